"""Kimi-K3, SGLang TP16 over two nodes (inventories/h200-k3-sglang.py)."""

k2_model = "moonshotai/Kimi-K3"
# Example pin: replace with the commit you vetted (`HfApi().model_info(repo).sha`).
k2_revision = "0000000000000000000000000000000000000003"
k2_engine = "sglang"
k2_gpu = "h200"
k2_tp = 16
k2_dist_init_port = 50000
k2_nic = "ens10f0np0"
# parsers: the catalog's kimi_k3 (tool and reasoning)
