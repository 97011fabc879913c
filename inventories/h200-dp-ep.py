"""2 × 8 H200, Kimi-K2-Instruct on vLLM: DP16 + expert parallel.

Seed: Moonshot's Kimi-K2 deploy guidance (vLLM "Data Parallelism + Expert
Parallelism"). h200-0 runs DP ranks 0-7 and the API server; h200-1 runs headless with
``--data-parallel-start-rank 8``. Fleet data: ``group_data/h200-dp-ep.py``.
"""

gpu_nodes = [
    ("h200-0", {"ssh_hostname": "192.0.2.30"}),
    ("h200-1", {"ssh_hostname": "192.0.2.31"}),
]
