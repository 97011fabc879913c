"""1 × 8 H200, Kimi-K2.6 (K2.5's architecture, ~640 GB) on vLLM: TP8.

Seed: the project notes — Moonshot's K2.6 guide reuses K2.5's deployment (``vllm serve …
-tp 8 --mm-encoder-tp-mode data --trust-remote-code --tool-call-parser kimi_k2
--reasoning-parser kimi_k2``). Fleet data: ``group_data/h200-k26.py``.
"""

gpu_nodes = [("h200-0", {"ssh_hostname": "192.0.2.130"})]
