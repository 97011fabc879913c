"""Kimi-K2-Instruct, SGLang PD disaggregation (inventories/h200-sglang-pd.py)."""

k2_model = "moonshotai/Kimi-K2-Instruct"
k2_revision = "fd1984e2b7a3350dbf7305fe73a4ede25c14de50"
k2_engine = "sglang"
k2_gpu = "h200"
k2_dist_init_port = 5757
k2_bootstrap_port = 8998
k2_router_port = 8000
k2_nic = "ens10f0np0"
k2_ib_hcas = ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
