"""Sandbox fleet data (inventories/sandbox.py): simulated GPUs, engine test doubles,
a synthetic checkpoint from the control machine (or the Hub test double), packages from an offline bundle."""

import json as _json
import os as _os

from k2fleet.synthetic import SANDBOX_MODEL, SANDBOX_REVISION, sandbox_checkpoint_dir

_SCENARIO = _os.environ.get("K2FLEET_SANDBOX_SCENARIO", "vllm")

k2_model = SANDBOX_MODEL
k2_revision = SANDBOX_REVISION
k2_checkpoint_source = f"control:{sandbox_checkpoint_dir()}"
# tests and benches switch to the Hub source served by tests/hub_double.py on loopback:
# K2FLEET_SANDBOX_CHECKPOINT=hub, K2FLEET_SANDBOX_HUB=http://127.0.0.1:PORT,
# K2FLEET_SANDBOX_CHECKPOINT_CACHE=DIR (the control-side cache)
if _os.environ.get("K2FLEET_SANDBOX_CHECKPOINT") == "hub":
    k2_checkpoint_source = "hub"
    k2_hub_endpoint = _os.environ.get("K2FLEET_SANDBOX_HUB") or None
    if _os.environ.get("K2FLEET_SANDBOX_CHECKPOINT_CACHE"):
        k2_checkpoint_cache = _os.environ["K2FLEET_SANDBOX_CHECKPOINT_CACHE"]
    # K2FLEET_SANDBOX_FETCHER=k2sb-2: that host downloads from the double (on the bridge address)
    k2_checkpoint_fetcher = _os.environ.get("K2FLEET_SANDBOX_FETCHER") or "control"
# tests put the model directory on the sandbox's shared storage through this: /mnt/k2shared
# is one control-machine directory bound into every host (as an NFS or Lustre mount would be)
if _os.environ.get("K2FLEET_SANDBOX_SHARED") == "1":
    k2_shared_storage = True
    k2_model_dir = "/mnt/k2shared/models"
k2_checkpoint_bytes = 8_000_000
k2_quantization = "int4"
k2_gpu = "h200"
k2_simulated_gpus = True
k2_engine_doubles = True
k2_package_source = "bundle"
k2_health_timeout = 120
if _SCENARIO == "trtllm-mpi":
    k2_engine = "trtllm"
    k2_runtime = "venv"
    k2_tp = 16
    k2_ep = 8
    k2_attn_dp = True
    k2_trtllm_config = {"cuda_graph_config": {"enable_padding": True, "batch_sizes": [1, 2, 4, 8]}, "print_iter_log": True}
    k2_engine_args = {"kv_cache_free_gpu_memory_fraction": 0.95, "max_batch_size": 128, "max_num_tokens": 4096}
else:
    k2_engine = "vllm"
    k2_tp = 8
    k2_engine_args = {}
# tests change one engine flag through this (JSON object of extra flags)
k2_engine_args = {**k2_engine_args, **_json.loads(_os.environ.get("K2FLEET_SANDBOX_ENGINE_ARGS", "{}"))}
# tests switch on the model_type fallback overlay through this (e.g. deepseek_v3)
k2_model_type_override = _os.environ.get("K2FLEET_SANDBOX_MODEL_TYPE") or None
