"""Kimi-K2.6, vLLM TP8 on one node (inventories/h200-k26.py)."""

k2_model = "moonshotai/Kimi-K2.6"
# Example pin: replace with the commit you vetted (`HfApi().model_info(repo).sha`).
k2_revision = "0000000000000000000000000000000000000026"
k2_engine = "vllm"
k2_gpu = "h200"
k2_tp = 8
k2_nic = "ens10f0np0"
