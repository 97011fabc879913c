"""Kimi-K2-Instruct, trtllm-serve TP16/EP8 over mpirun (inventories/h200-trtllm-mpi.py)."""

k2_model = "moonshotai/Kimi-K2-Instruct"
k2_revision = "fd1984e2b7a3350dbf7305fe73a4ede25c14de50"
k2_engine = "trtllm"
k2_gpu = "h200"
k2_tp = 16
k2_ep = 8
k2_attn_dp = True
k2_mesh_port = 2233
k2_nic = "ens10f0np0"
k2_engine_args = {
    "backend": "pytorch",
    "kv_cache_free_gpu_memory_fraction": 0.95,
    "trust_remote_code": True,
    "max_batch_size": 128,
    "max_num_tokens": 4096,
}
k2_trtllm_config = {
    "cuda_graph_config": {"padding_enabled": True, "batch_sizes": [1, 2, 4, 8, 16, 32, 64, 128]},
    "print_iter_log": True,
    "enable_attention_dp": True,
}
