"""2 × 8 H800, Kimi-K2-Instruct FP8 on vLLM: TP8 × PP2 across the nodes on Ray.

Seed: the vLLM Kimi-K2 usage guide ("Running Kimi-K2 with FP8 on 16xH800"). h800-0 is
the Ray head and runs the API server; h800-1 joins as a Ray worker. The seed's
``--disable-log-requests`` is gone from vLLM 0.33 (request logging is off by default)
and is dropped for that pin. Fleet data: ``group_data/h800-pp.py``.
"""

gpu_nodes = [
    ("h800-0", {"ssh_hostname": "192.0.2.20"}),
    ("h800-1", {"ssh_hostname": "192.0.2.21"}),
]
