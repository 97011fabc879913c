"""4 × 8 H200, Kimi-K2-Thinking on SGLang: DP attention + expert parallel over all four nodes, over RDMA.

The issue-34 user's fleet: one SGLang instance of 32 GPUs (``--tp-size 32 --attn-dp-size 32
--ep-size 32``), DeepEP as the all-to-all (SGLang's default with ``k2_ep`` > 1; across nodes it
needs ``k2_ib_hcas`` on every host), eight InfiniBand HCAs per node (mlx5_0..7, NDR 400 Gb/s),
``--dist-init-addr`` rendezvous on the first node. ``k2fleet plan`` shows the RDMA fabric: packages,
GPUDirect RDMA, the containers' devices, NCCL's and NVSHMEM's environment and the fabric gate the
preflight runs before any change. Fleet data: ``group_data/h200-sglang-dpa-ep.py``.
"""

gpu_nodes = [
    ("h200-0", {"ssh_hostname": "192.0.2.60"}),
    ("h200-1", {"ssh_hostname": "192.0.2.61"}),
    ("h200-2", {"ssh_hostname": "192.0.2.62"}),
    ("h200-3", {"ssh_hostname": "192.0.2.63"}),
]
