"""Kimi-K2-Thinking, ROCm vLLM container TP8 (inventories/mi300x.py)."""

k2_model = "moonshotai/Kimi-K2-Thinking"
k2_revision = "a51ccc050d73dab088bf7b0e2dd9b30ae85a4e55"
k2_engine = "vllm"
k2_gpu = "mi300x"
k2_tp = 8
