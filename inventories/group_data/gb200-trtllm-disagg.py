"""GB200 wide-EP disaggregated SLURM config (inventories/gb200-trtllm-disagg.py)."""

k2_model = "nvidia/Kimi-K2-Thinking-NVFP4"
# Example pin: replace with the commit you vetted (`HfApi().model_info(repo).sha`).
k2_revision = "0000000000000000000000000000000000000001"
k2_engine = "trtllm"
k2_gpu = "gb200"
k2_gpus_per_node = 4
k2_model_dir = "/lustre/models"

k2_slurm = {
    "slurm": {
        "script_file": "disaggr_torch.slurm",
        "partition": "<partition>",
        "account": "<account>",
        "job_time": "02:00:00",
        "job_name": "kimi-k2-thinking-disagg",
        "extra_args": "",
        "numa_bind": True,
    },
    "benchmark": {
        "mode": "e2e",
        "use_nv_sa_benchmark": False,
        "multi_round": 8,
        "benchmark_ratio": 0.8,
        "streaming": True,
        "concurrency_list": "16",
        "input_length": 1024,
        "output_length": 1024,
        "dataset_file": "<dataset_file>",
    },
    "hardware": {"gpus_per_node": 4, "num_ctx_servers": 4, "num_gen_servers": 1},
    "environment": {
        "container_mount": "/lustre/models:/lustre/models",
        "trtllm_repo": "/lustre/src/TensorRT-LLM",
        "build_wheel": False,
        "trtllm_wheel_path": "",
        "work_dir": "/lustre/work/kimi-k2-disagg",
        "worker_env_var": "TLLM_LOG_LEVEL=INFO TRTLLM_SERVER_DISABLE_GC=1 TRTLLM_WORKER_DISABLE_GC=1 TRTLLM_ENABLE_PDL=1 ENROOT_ALLOW_DEV=yes",
        "server_env_var": "TRTLLM_SERVER_DISABLE_GC=1",
    },
}

k2_disagg = {
    "gen": {
        "tensor_parallel_size": 32,
        "moe_expert_parallel_size": 32,
        "enable_attention_dp": True,
        "enable_lm_head_tp_in_adp": True,
        "pipeline_parallel_size": 1,
        "max_batch_size": 128,
        "max_num_tokens": 128,
        "max_seq_len": 9236,
        "cuda_graph_config": {
            "enable_padding": True,
            "batch_sizes": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 768, 1024, 2048],
        },
        "print_iter_log": True,
        "kv_cache_config": {"enable_block_reuse": False, "free_gpu_memory_fraction": 0.6, "dtype": "fp8"},
        "moe_config": {
            "backend": "WIDEEP",
            "use_low_precision_moe_combine": True,
            "load_balancer": {"num_slots": 416, "layer_updates_per_iter": 1},
        },
        "cache_transceiver_config": {"backend": "UCX", "max_tokens_in_buffer": 8448},
        "stream_interval": 20,
        "num_postprocess_workers": 4,
        "trust_remote_code": True,
    },
    "ctx": {
        "max_batch_size": 1,
        "max_num_tokens": 8448,
        "max_seq_len": 8212,
        "tensor_parallel_size": 4,
        "moe_expert_parallel_size": 4,
        "enable_attention_dp": True,
        "pipeline_parallel_size": 1,
        "print_iter_log": True,
        "cuda_graph_config": None,
        "disable_overlap_scheduler": True,
        "kv_cache_config": {"enable_block_reuse": False, "free_gpu_memory_fraction": 0.75, "dtype": "fp8"},
        "cache_transceiver_config": {"backend": "UCX", "max_tokens_in_buffer": 8448},
        "trust_remote_code": True,
    },
}
