"""2 × 8 H200, Kimi-K2-Thinking on vLLM: TP8 + decode context parallel 8 per node.

Seed: the vLLM Kimi-K2-Thinking guide, high-throughput launch (TP8+DCP8 grows the KV
cache 8×). Fleet data: ``group_data/h200-dcp.py``.
"""

gpu_nodes = [
    ("h200-0", {"ssh_hostname": "192.0.2.10"}),
    ("h200-1", {"ssh_hostname": "192.0.2.11"}),
]
