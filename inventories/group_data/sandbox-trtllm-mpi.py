"""Sandbox TRT-LLM mpirun fleet data (inventories/sandbox-trtllm-mpi.py): the keys every
sandbox inventory shares (k2sandbox/inventory_data.py), served by trtllm-serve TP16 EP8 with
attention DP over 2 hosts (venv runtime: the engine test double)."""

from k2sandbox.inventory_data import *  # noqa: F403 - the shared sandbox keys (its __all__)

k2_engine = "trtllm"
k2_runtime = "venv"
k2_tp = 16
k2_ep = 8
k2_attn_dp = True
k2_trtllm_config = {"cuda_graph_config": {"enable_padding": True, "batch_sizes": [1, 2, 4, 8]}, "print_iter_log": True}
k2_engine_args = {"kv_cache_free_gpu_memory_fraction": 0.95, "max_batch_size": 128, "max_num_tokens": 4096}
