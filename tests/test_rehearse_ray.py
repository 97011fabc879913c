"""``k2fleet rehearse inventories/h800-pp.py``: vLLM TP8×PP2 across two sandbox hosts on a
REAL Ray cluster (the ``ray`` package from the control machine's engine-side wheelhouse
in each host's ``k2_venv``; only the vLLM engine is a test double, and it joins that
cluster with the venv's python).

The rehearse command takes the sandbox lock itself; the fault test touches only the
host the rehearsal booted (after it printed its name), never another user's fleet.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from k2fleet.planning.os_tables import OS_TABLES
from k2sandbox import nspawn as sandbox
from k2fleet.control.artifacts import read_control_artifacts
from k2fleet.planning.desired import ENGINE_SIDE_CHECK, desired_state, engine_side_check
from k2fleet.deploy.gate import check_hosts
from k2fleet.inventory.loader import inventory_host_data
from k2sandbox.harness import ROOT, tool
from k2fleet.planning.host_archive import ARCHIVE
from k2fleet.planning.units import unit_file

INVENTORY = "inventories/h800-pp.py"
REHEARSAL_TIMEOUT_S = 600

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox fleet needs root")

# Makes the worker's k2-ray unit run but never join the cluster (as a Ray worker blocked
# by a firewall or hung would): a systemd drop-in written before the deploy starts units.
NEVER_JOINS = "[Service]\nExecStart=\nExecStart=/bin/sleep infinity\n"


def run_rehearsal(*args: str, on_line=None) -> tuple[int, list[str], str, float]:
    """Run ``k2fleet rehearse`` (stdout line by line to ``on_line``); (rc, lines, stderr, seconds)."""
    started = time.monotonic()
    proc = subprocess.Popen([tool("k2fleet"), "rehearse", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    timer = threading.Timer(REHEARSAL_TIMEOUT_S, proc.kill)
    timer.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if on_line:
                on_line(lines[-1])
        stderr = proc.stderr.read()
        proc.wait()
    finally:
        timer.cancel()
    return proc.returncode, lines, stderr, time.monotonic() - started


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


# h800-pp rehearsed healthy on a real Ray cluster with token authentication: in
# tests/test_rehearse_restart.py (one rehearsal of this inventory in the suite)


@pytest.mark.sandbox
@needs_root
def test_worker_that_never_joins_fails_the_deploy_naming_it() -> None:
    injected: list[str] = []

    def break_worker(line: str) -> None:
        # "  h800-1 -> k2sb-2 10.213.0.12": the rehearsal booted our worker host; make its
        # Ray unit never join before the deploy reaches the units.
        parts = line.split()
        if parts[:2] != ["h800-1", "->"]:
            return
        host = next(h for h in sandbox.load_hosts(sandbox.DEFAULT_STATE_DIR) if h.name == parts[2])
        remote = ("mkdir -p /etc/systemd/system/k2-ray.service.d && "
                  f"printf '%s' '{NEVER_JOINS}' > /etc/systemd/system/k2-ray.service.d/never-joins.conf")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if sandbox.ssh(host, remote).returncode == 0:
                injected.append(host.name)
                return
            time.sleep(1)

    rc, lines, stderr, seconds = run_rehearsal(INVENTORY, "--data", "k2_health_timeout=20", on_line=break_worker)
    out = "\n".join(lines)
    assert injected, out + stderr
    assert rc == 1, out + stderr
    assert lines[-1].startswith(f"rehearsal {INVENTORY}: failed: h800-0 k2-vllm: Ray node h800-1 (10.213.0.12) "
                                "has not joined within 20s"), out
    print(f"failed rehearsal of {INVENTORY}: {seconds:.0f}s")
