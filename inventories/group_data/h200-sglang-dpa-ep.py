"""Kimi-K2-Thinking, SGLang DP attention + EP over 4 nodes with RDMA (inventories/h200-sglang-dpa-ep.py)."""

k2_model = "moonshotai/Kimi-K2-Thinking"
k2_revision = "a51ccc050d73dab088bf7b0e2dd9b30ae85a4e55"
k2_engine = "sglang"
k2_gpu = "h200"
k2_runtime = "container"
k2_image = "lmsysorg/sglang:v0.5.23"
k2_tp = 32
k2_dp = 32
k2_ep = 32
k2_attn_dp = True
# SGLang's own mem_fraction_static is low under DP attention (its CUDA-graph reserve grows with the
# DP size): set it as Moonshot's deploy guidance does for TP32 DP32 (--mem-fraction-static 0.85, seed
# 001's 4-node prefill), and a context its KV cache holds under every profile
k2_gpu_memory_utilization = 0.85
k2_max_model_len = 32768
k2_dist_init_port = 50000
k2_nic = "ens10f0np0"
k2_ib_hcas = [f"mlx5_{i}" for i in range(8)]
k2_ib_link_layer = "InfiniBand"
k2_ib_rate_gbps = 400
