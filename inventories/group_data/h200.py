"""Kimi-K2-Thinking, vLLM TP8, one replica per node (inventories/h200.py)."""

k2_model = "moonshotai/Kimi-K2-Thinking"
k2_revision = "a51ccc050d73dab088bf7b0e2dd9b30ae85a4e55"
k2_engine = "vllm"
k2_gpu = "h200"
k2_tp = 8
k2_nic = "ens10f0np0"
# tool + reasoning parsers default to kimi_k2 for a thinking model; auto tool choice on
