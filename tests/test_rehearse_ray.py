"""``k2fleet rehearse inventories/h800-pp.py``: vLLM TP8×PP2 across two sandbox hosts on a
REAL Ray cluster (the ``ray`` package from the control machine's engine-side wheelhouse
in each host's ``k2_venv``; only the vLLM engine is a test double, and it joins that
cluster with the venv's python).

Offline here: the plan's Ray gate, the engine-side packages and their check. The rehearsal
itself, and a worker that never joins, are in tests/test_rehearse_restart.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from k2fleet.planning.os_tables import OS_TABLES
from k2fleet.control.artifacts import read_control_artifacts
from k2fleet.planning.desired import ENGINE_SIDE_CHECK, desired_state, engine_side_check
from k2fleet.deploy.gate import check_hosts
from k2fleet.inventory.loader import inventory_host_data
from k2sandbox.harness import ROOT
from k2fleet.planning.host_archive import ARCHIVE
from k2fleet.planning.units import unit_file

INVENTORY = "inventories/h800-pp.py"

# ---------------------------------------------------------------- offline


def sandbox_plan():
    data = {"k2_engine_doubles": True, "k2_simulated_gpus": True}
    return check_hosts(INVENTORY, inventory_host_data(ROOT / INVENTORY, data))


def test_ray_gate_runs_before_vllm_serve_and_names_every_planned_node() -> None:
    dep, plan = sandbox_plan()
    vllm = next(s for s in plan.hosts["h800-0"].services if s.name == "k2-vllm")
    unit = unit_file(dep, vllm)
    gate = next(line for line in unit.splitlines() if f"{ARCHIVE} raygate" in line)
    assert gate.startswith("ExecStartPre=") and unit.index(gate) < unit.index("ExecStart=/")
    assert "--node h800-0=192.0.2.20:8 --node h800-1=192.0.2.21:8" in gate
    assert "--address 192.0.2.20:6379" in gate and "/opt/k2fleet/venv/vllm-0.33.0/bin/python3" in gate


def test_every_ray_process_authenticates_with_the_deployments_token() -> None:
    """#21: Ray's token authentication (ray 2.60, RAY_AUTH_MODE=token) on every process that
    talks to the cluster — both ``ray start`` units and the vLLM driver (its Ray gate runs in
    its unit) — with the token in a root-only file, never in argv or the environment."""
    from k2fleet.planning.desired import ControlArtifacts
    from k2fleet.planning.engines.vllm.render import RAY_TOKEN

    dep, plan = sandbox_plan()
    token = b"f" * 64 + b"\n"
    desired = desired_state(dep, plan, ControlArtifacts(relay_secret=b"s\n", ray_token=token))
    for host in plan.hosts.values():
        ray = [svc for svc in host.services if svc.name == "k2-ray" or "ray" in svc.argv]
        assert ray, host.name
        for svc in ray:
            assert svc.env["RAY_AUTH_MODE"] == "token" and svc.env["RAY_AUTH_TOKEN_PATH"] == RAY_TOKEN, svc.name
            assert not any(token.strip().decode() in w for w in [*svc.argv, *svc.env.values()])
        spec = desired[host.name].files["host"][RAY_TOKEN]
        assert spec.mode == "600" and spec.content == token


def test_every_ray_host_gets_the_engine_side_wheels_and_their_check() -> None:
    dep, plan = sandbox_plan()
    desired = desired_state(dep, plan, read_control_artifacts(dep, plan))
    for name in ("h800-0", "h800-1"):
        host = desired[name]
        venv = OS_TABLES[host.bootstrap.os].venv_packages  # python3-venv (ubuntu-22.04: python3.11-venv)
        assert set(venv) <= set(host.packages) and ENGINE_SIDE_CHECK in host.checks
        assert host.files["engine_side"], name
        assert "/opt/k2fleet/venv/vllm-0.33.0/bin/python" not in host.files["engine"]  # the venv's own python runs the double
        assert "'ray[cgraph]==2.60.0'" in host.engine_side_install[2]


def test_engine_side_check_names_what_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    dep, _ = sandbox_plan()
    pip = f"pip=={__import__('pip').__version__}"

    py = "%d.%d" % sys.version_info[:2]

    def check(requirements: list[str], python: str = py) -> subprocess.CompletedProcess:
        argv = engine_side_check(dep, requirements, python)
        return subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True)

    ok = check([pip])
    assert ok.returncode == 0, ok.stdout
    wrong = check(["pip==0.0.1", "no-such-dist==1.0"])
    assert wrong.returncode == 1
    assert f"no-such-dist missing (fleet: 1.0); pip {pip.split('==')[1]} (fleet: 0.0.1)" in wrong.stdout
    other = check([pip], "3.99")
    assert other.returncode == 1 and f"python {py} (fleet: 3.99)" in other.stdout


# ---------------------------------------------------------------- sandbox


# h800-pp rehearsed healthy on a real Ray cluster with token authentication, and a worker that
# never joins failing the deploy naming it: in tests/test_rehearse_restart.py (one rehearsal of
# this inventory in the suite)
