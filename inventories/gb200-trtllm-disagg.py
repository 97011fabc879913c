"""GB200 NVL72: Kimi-K2-Thinking-NVFP4 disaggregated serving with wide EP through
SLURM (TensorRT-LLM ``examples/disaggregated/slurm/benchmark/submit.py``).

Seed: TensorRT-LLM's Kimi K2 Thinking Blackwell guide, GB200 section. k2fleet renders
``config.yaml`` (slurm, benchmark, hardware, environment sections and the ctx/gen
worker configs) on the SLURM login node and submits it; SLURM places the workers.
Fleet data: ``group_data/gb200-trtllm-disagg.py``.
"""

slurm_login = [("gb200-login", {"ssh_hostname": "192.0.2.80", "k2_role": "slurm-submit"})]
