"""Kimi-K2-Thinking-NVFP4, trtllm-serve TP8/EP8 with attention DP (inventories/b200-trtllm.py)."""

k2_model = "nvidia/Kimi-K2-Thinking-NVFP4"
# Example pin: replace with the commit you vetted (`HfApi().model_info(repo).sha`).
k2_revision = "0000000000000000000000000000000000000001"
k2_engine = "trtllm"
k2_gpu = "b200"
k2_tp = 8
k2_ep = 8
k2_attn_dp = True
k2_trtllm_config = {
    "max_batch_size": 128,
    "max_num_tokens": 8448,
    "max_seq_len": 8212,
    "tensor_parallel_size": 8,
    "moe_expert_parallel_size": 8,
    "enable_attention_dp": True,
    "pipeline_parallel_size": 1,
    "print_iter_log": True,
    "kv_cache_config": {"free_gpu_memory_fraction": 0.75, "dtype": "fp8"},
    "cache_transceiver_config": {"backend": "UCX", "max_tokens_in_buffer": 8448},
    "trust_remote_code": True,
}
