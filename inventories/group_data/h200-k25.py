"""Kimi-K2.5, vLLM TP8 on one node (inventories/h200-k25.py)."""

k2_model = "moonshotai/Kimi-K2.5"
# Example pin: replace with the commit you vetted (`HfApi().model_info(repo).sha`).
k2_revision = "0000000000000000000000000000000000000025"
k2_engine = "vllm"
k2_gpu = "h200"
k2_tp = 8
k2_nic = "ens10f0np0"
# parsers: kimi_k2 (tool and reasoning); --mm-encoder-tp-mode data from the catalog
