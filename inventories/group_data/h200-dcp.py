"""Kimi-K2-Thinking, vLLM TP8 × DCP8 (inventories/h200-dcp.py)."""

k2_model = "moonshotai/Kimi-K2-Thinking"
k2_revision = "a51ccc050d73dab088bf7b0e2dd9b30ae85a4e55"
k2_engine = "vllm"
k2_gpu = "h200"
k2_tp = 8
k2_dcp = 8
k2_nic = "ens10f0np0"
