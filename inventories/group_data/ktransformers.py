"""Kimi-K2-Instruct GGUF on the KTransformers legacy server with AMX rules."""

k2_model = "moonshotai/Kimi-K2-Instruct"
k2_revision = "fd1984e2b7a3350dbf7305fe73a4ede25c14de50"
k2_gguf_repo = "unsloth/Kimi-K2-Instruct-GGUF"
k2_gguf_revision = "dc35109e1b6ecf981f1d30d57c117b9a58c0b31b"
k2_gguf_pattern = "UD-Q3_K_XL/*"
k2_quantization = "gguf"
k2_engine = "ktransformers"
k2_engine_version = "0.3.2"
k2_gpu = "h20"
k2_gpus_per_node = 1
k2_tp = 1
k2_kt = {
    "cache_lens": 30000,
    "optimize_rules": "ktransformers/optimize/optimize_rules/DeepSeek-V3-Chat-fp8-linear-ggml-experts-serve-amx.yaml",
}
