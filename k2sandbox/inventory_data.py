"""Fleet data every sandbox inventory shares (``inventories/group_data/sandbox*.py``
star-import it; ``__all__`` is exactly the keys they get).

Simulated GPUs and k2fleet's engine test doubles (both refused on any other inventory),
the synthetic checkpoint from a control-machine directory (``control:``, made by
``python -m k2sandbox.checkpoint_cache``), host packages from an offline bundle (the hosts have no
route out). Per-run variations are pyinfra's own ``--data``, never environment
variables, e.g.::

    pyinfra -y --data k2_nic=eth9 inventories/sandbox.py deploys/kimi.py
    pyinfra -y --data 'k2_engine_args={"max-num-seqs": 64}' inventories/sandbox.py deploys/kimi.py
    pyinfra -y --data k2_model_type_override=deepseek_v3 inventories/sandbox.py deploys/kimi.py
    pyinfra -y --data k2_checkpoint_source=hub --data k2_hub_endpoint=http://127.0.0.1:PORT \\
        --data k2_checkpoint_cache=/tmp/k2cache inventories/sandbox.py deploys/kimi.py
    pyinfra -y --data k2_shared_storage=true --data k2_model_dir=/mnt/k2shared/models \\
        inventories/sandbox.py deploys/kimi.py
"""

from k2sandbox.checkpoint_cache import SANDBOX_MODEL, SANDBOX_REVISION, sandbox_checkpoint_dir

__all__ = [
    "k2_model",
    "k2_revision",
    "k2_checkpoint_source",
    "k2_checkpoint_bytes",
    "k2_quantization",
    "k2_gpu",
    "k2_simulated_gpus",
    "k2_engine_doubles",
    "k2_package_source",
    "k2_health_timeout",
    "k2_os",
]

k2_model = SANDBOX_MODEL
k2_revision = SANDBOX_REVISION
k2_checkpoint_source = f"control:{sandbox_checkpoint_dir()}"
k2_checkpoint_bytes = 8_000_000
k2_quantization = "int4"
k2_gpu = "h200"
k2_simulated_gpus = True
k2_engine_doubles = True
k2_package_source = "bundle"
k2_health_timeout = 120
k2_os = "debian-12"  # sandbox hosts are Debian 12 (bookworm) nspawn containers
