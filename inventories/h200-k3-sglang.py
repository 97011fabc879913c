"""2 × 8 H200, Kimi-K3 (~1.56 TB, MXFP4 experts) on SGLang: TP16 across both nodes.

Seed: SGLang's Kimi-K3 cookbook node shape for H200 (2 × 8) and the kimi_k3 parsers, as the
project notes and issue #25 summarise them (SGLang >= 0.5.17; the 0.5.23 pin). k2fleet has no
KV cache prediction for K3 (its layer count, kv_lora_rank and KDA state size are not in its
sources): ``k2fleet plan`` says so. Fleet data: ``group_data/h200-k3-sglang.py``.
"""

gpu_nodes = [
    ("h200-0", {"ssh_hostname": "192.0.2.140"}),
    ("h200-1", {"ssh_hostname": "192.0.2.141"}),
]
