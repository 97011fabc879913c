"""Kimi-K2-Instruct-0905 FP8, vLLM TP8 × PP2 over two nodes (inventories/h200-k2-0905.py)."""

k2_model = "moonshotai/Kimi-K2-Instruct-0905"
# Example pin: replace with the commit you vetted (`HfApi().model_info(repo).sha`).
k2_revision = "0000000000000000000000000000000000000905"
k2_engine = "vllm"
k2_gpu = "h200"
k2_tp = 8
k2_pp = 2
k2_multinode_backend = "mp"  # --nnodes/--node-rank/--master-addr, no Ray
k2_max_model_len = 131072
k2_nic = "ens10f0np0"
# not a thinking model: the tool parser defaults to kimi_k2, no reasoning parser
