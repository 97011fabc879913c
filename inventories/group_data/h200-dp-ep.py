"""Kimi-K2-Instruct, vLLM DP16 + EP16 over two nodes (inventories/h200-dp-ep.py)."""

k2_model = "moonshotai/Kimi-K2-Instruct"
k2_revision = "fd1984e2b7a3350dbf7305fe73a4ede25c14de50"
k2_served_model_name = "kimi-k2"
k2_engine = "vllm"
k2_gpu = "h200"
k2_tp = 1
k2_dp = 16
k2_ep = 16
k2_dp_rpc_port = 13345
k2_gpu_memory_utilization = 0.85
k2_nic = "ens10f0np0"
k2_engine_args = {"max-num-batched-tokens": 8192, "max-num-seqs": 256}
