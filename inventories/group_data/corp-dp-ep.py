"""Kimi-K2-Instruct, vLLM DP16 + EP16 over two nodes behind a bastion (inventories/corp-dp-ep.py)."""

# how the hosts are reached: pyinfra's own keys, k2fleet's side channels use the same
ssh_user = "ops"
ssh_port = 2222
_sudo = True
ssh_config_file = "inventories/corp.ssh_config"  # relative to where pyinfra runs (the checkout)

k2_model = "moonshotai/Kimi-K2-Instruct"
k2_revision = "fd1984e2b7a3350dbf7305fe73a4ede25c14de50"
k2_served_model_name = "kimi-k2"
k2_engine = "vllm"
k2_gpu = "h200"
k2_tp = 1
k2_dp = 16
k2_ep = 16
k2_dp_rpc_port = 13345
k2_gpu_memory_utilization = 0.85
k2_nic = "ens10f0np0"
k2_bind_address = "fleet"
k2_engine_args = {"max-num-batched-tokens": 8192, "max-num-seqs": 256}
