"""1 × 8 MI300X, Kimi-K2-Thinking on vLLM's ROCm container, TP8.

Seed: the vLLM Kimi-K2-Thinking guide, "AMD GPU Support" (Option B, Docker). The
seed's ``VLLM_USE_V1``/``VLLM_USE_TRITON_FLASH_ATTN`` are gone from vLLM 0.33 and are
not set; ``VLLM_ROCM_USE_AITER=1`` and ``SAFETENSORS_FAST_GPU=1`` are. Fleet data:
``group_data/mi300x.py``.
"""

gpu_nodes = [("mi300x-0", {"ssh_hostname": "192.0.2.100"})]
