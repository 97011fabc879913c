"""2 × 8 H200, Kimi-K2-Thinking on vLLM: one TP8 replica per node.

Seed: the vLLM Kimi-K2-Thinking usage guide, low-latency launch. Fleet data:
``group_data/h200.py``. Addresses are documentation addresses: set your own.
"""

gpu_nodes = [
    ("h200-0", {"ssh_hostname": "192.0.2.10"}),
    ("h200-1", {"ssh_hostname": "192.0.2.11"}),
]
