"""The sandbox fleet: local hosts made by ``k2fleet sandbox up 3`` (real systemd, real
sshd, own addresses on one bridge, no route out), like ``h200.py``: one vLLM TP8 replica
per host, on every sandbox host. Engines are k2fleet's TEST DOUBLES and GPUs are
simulated — declared in the fleet data; production inventories refuse both.

    k2fleet sandbox up 3 && python -m k2sandbox.checkpoint_cache
    pyinfra -y inventories/sandbox.py deploys/kimi.py

Hosts: the sandbox's ``hosts.json`` (fails with one line when no sandbox is up). Fleet
data: ``group_data/sandbox.py``. Variations are pyinfra's ``--data`` (see
``k2sandbox/inventory_data.py``); TRT-LLM over mpirun is ``sandbox-trtllm-mpi.py``.
"""

from k2sandbox.nspawn import sandbox_inventory_hosts

sandbox_hosts = sandbox_inventory_hosts()
