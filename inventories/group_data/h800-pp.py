"""Kimi-K2-Instruct FP8, vLLM TP8 × PP2 on Ray (inventories/h800-pp.py)."""

k2_model = "moonshotai/Kimi-K2-Instruct"
k2_revision = "fd1984e2b7a3350dbf7305fe73a4ede25c14de50"
k2_engine = "vllm"
k2_gpu = "h800"
k2_tp = 8
k2_pp = 2
k2_dcp = 8
k2_multinode_backend = "ray"
k2_max_model_len = 2048
k2_nic = "ens10f0np0"
k2_ib_hcas = ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
k2_engine_args = {
    "tokenizer-mode": "auto",
    "dtype": "bfloat16",
    "quantization": "fp8",
    "max-num-seqs": 1,
    "max-num-batched-tokens": 1024,
    "enable-chunked-prefill": True,
    "disable-log-requests": True,
    "kv-cache-dtype": "fp8",
}
