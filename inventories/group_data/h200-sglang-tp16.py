"""Kimi-K2-Instruct, SGLang TP16 over two nodes (inventories/h200-sglang-tp16.py)."""

k2_model = "moonshotai/Kimi-K2-Instruct"
k2_revision = "fd1984e2b7a3350dbf7305fe73a4ede25c14de50"
k2_engine = "sglang"
k2_gpu = "h200"
k2_tp = 16
k2_dist_init_port = 50000
k2_nic = "ens10f0np0"
