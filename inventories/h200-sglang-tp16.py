"""2 × 8 H200, Kimi-K2-Instruct on SGLang: TP16 across both nodes.

Seed: Moonshot's deploy guidance, SGLang "Tensor Parallelism" (``--tp 16
--dist-init-addr MASTER:50000 --nnodes 2 --node-rank R``), written with SGLang 0.5.23's
``--tp-size``. Fleet data: ``group_data/h200-sglang-tp16.py``.
"""

gpu_nodes = [
    ("h200-0", {"ssh_hostname": "192.0.2.40"}),
    ("h200-1", {"ssh_hostname": "192.0.2.41"}),
]
