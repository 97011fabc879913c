"""2 × 8 H200, Kimi-K2-Instruct-0905 (block FP8, ~1 TB) on vLLM: TP8 × PP2 over ``--nnodes``.

Seed: the project notes ("Kimi models after K2-Thinking": K2-Instruct-0905 is the K2
architecture in FP8, deployed like Kimi-K2-Instruct) and the vLLM Kimi-K2 usage guide's
FP8 launch; 1 TB does not leave a KV cache on one 8 × H200 node. Fleet data:
``group_data/h200-k2-0905.py``. Addresses are documentation addresses: set your own.
"""

gpu_nodes = [
    ("h200-0", {"ssh_hostname": "192.0.2.110"}),
    ("h200-1", {"ssh_hostname": "192.0.2.111"}),
]
