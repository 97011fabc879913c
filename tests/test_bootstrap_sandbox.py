"""The bootstrap on sandbox hosts, for real: bare Debian 12 hosts (no driver, no Docker)
→ GPU-ready → serving, through real apt from the offline bundle, real systemd and real
reboots. NVIDIA's packages are k2fleet's TEST DOUBLE .debs (k2sandbox/driver_doubles.py:
same names and versions scheme, a fake ``nvidia-smi`` reporting the sandbox's simulated
GPUs, a "module" that loads at boot from /run, a fabric manager that refuses a driver of
another version), because GPUs and the drivers' kernel side cannot exist here.

One module-scoped fleet of 2 hosts (inventories/sandbox.py). Each test makes the state it
starts from itself (:func:`on_branch_580`, ``fleet.ensure_deployed``), so any one of them runs
alone or in any order; run in file order, each finds the state the one before left and the
fleet deploys nothing twice: bare → healthy (holds listed by apt-mark); a branch change under
``never`` stops before any change naming both hosts; under ``rolling`` it reboots them one at
a time and ends healthy in the same run; the re-run changes nothing; a dead fabric manager
fails the gate and the deploy brings it back.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from k2sandbox import nspawn as sandbox
from k2sandbox.driver_doubles import DRIVER_VERSIONS
from k2sandbox.harness import ssh

pytestmark = pytest.mark.sandbox
SANDBOX_HOSTS = 2
NAMES = (sandbox.host_name(1), sandbox.host_name(2))
BRANCH_590 = {"k2_driver_branch": 590}
ROLLING_590 = {**BRANCH_590, "k2_reboot": "rolling"}


def on_all(fleet, command: str) -> list[str]:
    return [ssh(h, command).stdout.strip() for h in fleet.hosts]


def boots() -> dict[str, int]:
    return {row["name"]: row["boots"] for row in sandbox.status()}


def nspawn_started_at(name: str) -> float:
    """When the host's current systemd-nspawn started (seconds since this machine booted)."""
    pid = int((sandbox.DEFAULT_STATE_DIR / "run" / f"{name}.pid").read_text())
    ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    return ticks / os.sysconf("SC_CLK_TCK")


def on_branch_580(fleet) -> None:
    """The fleet as the inventory's own deploy leaves bare hosts: driver branch 580, nothing
    rebooted since. A fleet deployed otherwise (e.g. moved to 590) is booted bare again first:
    a deploy back to 580 is not that state."""
    if fleet.is_deployed():
        return
    fleet.boot_bare()
    fleet.ensure_deployed()


def test_bare_hosts_come_up_gpu_ready_with_the_driver_and_fabric_held(fleet) -> None:
    fleet.boot_bare()
    assert on_all(fleet, "command -v nvidia-smi docker || echo none") == ["none", "none"]  # bare
    result = fleet.deploy()
    assert result.returncode == 0, result.tail()
    for held in on_all(fleet, "apt-mark showhold"):
        assert {"nvidia-open-580", "nvidia-open", "nvidia-fabricmanager", "libnvidia-nscq"} <= set(held.split())
    driver = DRIVER_VERSIONS[580]
    assert on_all(fleet, "nvidia-smi --query-gpu=driver_version --format=csv,noheader | sort -u") == [driver] * 2
    assert on_all(fleet, "nvidia-smi --query-gpu=name --format=csv,noheader | wc -l") == ["8", "8"]
    fabric = on_all(fleet, "nvidia-smi -q | grep -A2 '^    Fabric' | grep -c 'State.*Completed'")
    assert fabric == ["8", "8"]
    assert on_all(fleet, "systemctl is-active nvidia-persistenced nvidia-fabricmanager | sort -u") == ["active"] * 2
    assert on_all(fleet, "grep -c nvidia- /etc/apt/apt.conf.d/51k2fleet-hold-drivers") == ["2", "2"]
    again = fleet.deploy()
    assert again.returncode == 0 and again.changed == 0, again.changed_operations


def test_branch_change_under_never_stops_before_any_change_naming_every_host(fleet) -> None:
    on_branch_580(fleet)
    before = boots()
    held = on_all(fleet, "apt-mark showhold")
    result = fleet.deploy({**BRANCH_590, "k2_reboot": "never"})
    assert result.returncode != 0
    text = result.output
    assert "k2_reboot is never and these hosts need a reboot" in text, result.tail()
    for name in NAMES:
        assert f"{name} (driver {DRIVER_VERSIONS[580]} is loaded and the newest of branch 590" in text, result.tail()
    assert not result.ran_operations
    assert boots() == before and on_all(fleet, "apt-mark showhold") == held
    assert on_all(fleet, "dpkg-query -W -f='${Version}' nvidia-open") == [f"{DRIVER_VERSIONS[580]}-1"] * 2


def test_branch_change_reboots_one_host_at_a_time_and_ends_healthy_in_the_same_run(fleet) -> None:
    on_branch_580(fleet)
    before = boots()
    started = time.monotonic()
    result = fleet.deploy(ROLLING_590)
    took = time.monotonic() - started
    assert result.returncode == 0, result.tail()  # the health gate passed after the reboots
    assert boots() == {name: before[name] + 1 for name in NAMES}
    first, second = sorted(nspawn_started_at(n) for n in NAMES)
    # rolling: the second host is told to reboot only after the first is back (a 2 s
    # wait, the reconnect, its boot finished), so its new boot starts 2-3 s later; hosts
    # rebooted together (if-needed) start theirs within a fraction of a second
    assert second - first >= 1.5, (first, second)
    print(f"rolling driver change 580 -> 590 on 2 hosts: {took:.0f}s, boots {second - first:.1f}s apart")
    driver = DRIVER_VERSIONS[590]
    assert on_all(fleet, "nvidia-smi --query-gpu=driver_version --format=csv,noheader | sort -u") == [driver] * 2
    for held in on_all(fleet, "apt-mark showhold"):
        names = set(held.split())
        assert {"nvidia-driver-pinning-590", "nvidia-open", "nvidia-fabricmanager"} <= names
        assert "nvidia-open-580" not in names  # the old branch's package is gone
    assert on_all(fleet, "dpkg-query -W -f='${Version}' nvidia-fabricmanager") == [f"{driver}-1"] * 2
    again = fleet.deploy(ROLLING_590)
    assert again.returncode == 0 and again.changed == 0, again.changed_operations
    assert boots() == {name: before[name] + 1 for name in NAMES}  # no second reboot


def test_a_dead_fabric_manager_fails_the_gate_as_cuda_802_and_the_deploy_brings_it_back(fleet) -> None:
    from k2fleet.planning.host_bootstrap import gate_argv
    from k2fleet.cli import load_plan
    from k2fleet.planning.desired import ControlArtifacts, desired_state
    from k2fleet.planning.quoting import shell_line
    from k2sandbox.harness import INVENTORY, ROOT

    data = ROLLING_590
    fleet.ensure_deployed(data)  # branch 590 deployed (from bare hosts if this test runs alone)
    dep, plan = load_plan(ROOT / INVENTORY, data=[f"{k}={v}" for k, v in data.items()])
    boot = desired_state(dep, plan, ControlArtifacts())[NAMES[0]].bootstrap
    host = fleet.hosts[0]
    ssh(host, "systemctl stop nvidia-fabricmanager")
    gate = ssh(host, shell_line(gate_argv(boot, timeout=0)), check=False)
    assert gate.returncode == 1
    assert "NVLink fabric not ready on 8 GPU(s) (('In Progress', 'N/A'))" in gate.stdout, gate.stdout
    assert "CUDA would fail with error 802" in gate.stdout and "nvidia-fabricmanager is inactive" in gate.stdout
    result = fleet.deploy(data)
    assert result.returncode == 0, result.tail()
    started = [hosts for name, hosts in result.changed_operations.items() if "enable and start the GPU services" in name]
    assert started == [[NAMES[0]]], result.changed_operations
    assert ssh(host, shell_line(gate_argv(boot, timeout=0)), check=False).returncode == 0
