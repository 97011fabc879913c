"""The sandbox fleet as ``h200-trtllm-mpi.py``: trtllm-serve TP16 over the first 2
sandbox hosts through ``mpirun`` over k2fleet's SSH mesh (port 2233). Engines are
k2fleet's TEST DOUBLES and GPUs are simulated, as in ``sandbox.py``.

    k2fleet sandbox up 3 && python -m k2sandbox.checkpoint_cache
    pyinfra -y inventories/sandbox-trtllm-mpi.py deploys/kimi.py

Hosts: the first 2 of the sandbox's ``hosts.json``. Fleet data:
``group_data/sandbox-trtllm-mpi.py``.
"""

from k2sandbox.nspawn import sandbox_inventory_hosts

sandbox_hosts = sandbox_inventory_hosts(2)
