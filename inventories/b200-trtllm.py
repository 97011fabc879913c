"""1 × 8 B200, Kimi-K2-Thinking-NVFP4 on TensorRT-LLM (trtllm-serve in the release
container) with the seed's extra LLM API options YAML.

Seed: TensorRT-LLM's "Deployment Guide for Kimi K2 Thinking on TensorRT LLM -
Blackwell" (DGX B200 through Docker). Fleet data: ``group_data/b200-trtllm.py``.
"""

gpu_nodes = [("b200-0", {"ssh_hostname": "192.0.2.60"})]
