"""The sandbox fleet: local hosts made by ``k2fleet sandbox up 3`` (real systemd, real
sshd, own addresses on one bridge, no route out). Engines are k2fleet's TEST DOUBLES
and GPUs are simulated — declared explicitly here; production inventories refuse both.

Scenario (``K2FLEET_SANDBOX_SCENARIO``):

- ``vllm`` (default): like ``h200.py``, one vLLM TP8 replica per host, 3 hosts;
- ``trtllm-mpi``: like ``h200-trtllm-mpi.py``, trtllm-serve TP16 over the first 2
  hosts through ``mpirun`` over the SSH mesh (port 2233).

Fleet data: ``group_data/sandbox.py``.
"""

import json as _json
import os as _os
from pathlib import Path as _Path

_STATE = _Path(_os.environ.get("K2FLEET_SANDBOX_DIR", "/var/lib/k2fleet-sandbox"))
_HOSTS = _STATE / "hosts.json"
if not _HOSTS.exists():
    raise SystemExit(f"no sandbox fleet at {_STATE}: run `k2fleet sandbox up 3` first")
_SCENARIO = _os.environ.get("K2FLEET_SANDBOX_SCENARIO", "vllm")
_ENTRIES = _json.loads(_HOSTS.read_text())
if _SCENARIO == "trtllm-mpi":
    _ENTRIES = _ENTRIES[:2]

sandbox_hosts = [
    (
        e["name"],
        {
            "ssh_hostname": e["address"],
            "ssh_user": e["ssh_user"],
            "ssh_key": e["ssh_key"],
            "ssh_known_hosts_file": e["ssh_known_hosts_file"],
            "ssh_strict_host_key_checking": "yes",
            "k2_nic": _os.environ.get("K2FLEET_SANDBOX_NIC", "eth0"),  # tests break it to prove preflight
        },
    )
    for e in _ENTRIES
]
