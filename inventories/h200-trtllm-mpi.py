"""2 × 8 H200, Kimi-K2-Instruct on TensorRT-LLM across both nodes with mpirun.

Seed: Moonshot's deploy guidance, TensorRT-LLM "Multi-node Serving" (``mpirun -np 16
-H HOST1:8,HOST2:8 -mca plm_rsh_args "-p 2233" ... trtllm-llmapi-launch trtllm-serve
serve``). Passwordless SSH is k2fleet's mesh: a per-deployment key, a dedicated sshd on
``k2_mesh_port`` (2233) and pinned known_hosts. The seed's
``cuda_graph_config.padding_enabled`` is written as 1.2's ``enable_padding``. Fleet
data: ``group_data/h200-trtllm-mpi.py``.
"""

gpu_nodes = [
    ("h200-0", {"ssh_hostname": "192.0.2.70"}),
    ("h200-1", {"ssh_hostname": "192.0.2.71"}),
]
