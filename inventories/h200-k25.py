"""1 × 8 H200, Kimi-K2.5 (multimodal, native INT4, ~620 GB) on vLLM: TP8.

Seed: Moonshot's K2.5 vLLM deployment as the project notes summarise it (``vllm serve …
-tp 8 --mm-encoder-tp-mode data --trust-remote-code --tool-call-parser kimi_k2
--reasoning-parser kimi_k2``); ``--mm-encoder-tp-mode data`` comes from the catalog entry.
Fleet data: ``group_data/h200-k25.py``. Addresses are documentation addresses.
"""

gpu_nodes = [("h200-0", {"ssh_hostname": "192.0.2.120"})]
