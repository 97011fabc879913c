"""Real reboots of sandbox hosts (no mocks): the container's systemd reboots, its
systemd-nspawn exits 133 and the host's supervisor boots it again; a host whose init is
killed (the fault drill of ../shared/NOTES.md) stays down; the simulated GPU file the
NVIDIA/AMD TEST DOUBLE packages read is in every host.

The hosts come from tests/conftest.py's ``fleet`` fixture (the lock, 2 hosts with
simulated H200s, up again for each test after one took a host down).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid

import pytest

from k2sandbox import nspawn as sandbox

SANDBOX_HOSTS = 2
SANDBOX_GPUS = "h200:8"
REBOOT_DEADLINE_S = 60.0

H200_HGX = {"vendor": "nvidia", "name": "NVIDIA H200", "count": 8, "memory_mib": 141 * 1024, "nvswitch": True}


def _ssh(host: sandbox.SandboxHost, remote: str, timeout: float = 15) -> subprocess.CompletedProcess[str]:
    return sandbox.ssh(host, remote, timeout=timeout)


def _row(name: str) -> dict[str, object]:
    return next(row for row in sandbox.status() if row["name"] == name)


def _uptime(host: sandbox.SandboxHost) -> float:
    """What pyinfra's Uptime fact reads (``/proc/uptime``), in seconds."""
    out = _ssh(host, "cat /proc/uptime")
    assert out.returncode == 0, out
    return float(out.stdout.split()[0])


def _container_init(name: str) -> int:
    """The host's init as the control machine sees it: the process of its netns that is
    PID 1 of its own PID namespace (what the fault drill kills)."""
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, check=True).stdout.split()
    for pid in pids:
        try:
            status = open(f"/proc/{pid}/status").read()
        except FileNotFoundError:
            continue
        nspids = next(line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:"))
        if len(nspids) > 1 and nspids[-1] == "1":
            return int(pid)
    raise AssertionError(f"no init found among {name}'s netns pids {pids}")


def _live_processes(*needles: str) -> list[str]:
    """``pid args`` of live (non-zombie) processes whose command line holds every needle."""
    out = subprocess.run(["ps", "-eo", "pid=,stat=,args="], capture_output=True, text=True).stdout
    rows = [line.split(None, 2) for line in out.splitlines() if len(line.split(None, 2)) == 3]
    return [f"{pid} {args}" for pid, stat, args in rows
            if not stat.startswith("Z") and all(n in args for n in needles)]


def test_hardware_file_is_in_every_host(fleet) -> None:
    assert sandbox.simulated_hardware("h200", 8) == H200_HGX
    assert sandbox.recorded_hardware() == [H200_HGX] * SANDBOX_HOSTS
    for host in fleet.sandbox_hosts:
        out = _ssh(host, f"cat {sandbox.HARDWARE_FILE}")
        assert out.returncode == 0, (host.name, out)
        assert json.loads(out.stdout) == H200_HGX, host.name
    # the same hardware reuses the running hosts; other hardware boots them again
    pids = [row["pid"] for row in sandbox.status()]
    assert sandbox.up(SANDBOX_HOSTS, hardware=dict(H200_HGX)) == fleet.sandbox_hosts
    assert [row["pid"] for row in sandbox.status()] == pids
    mi300x = sandbox.simulated_hardware("mi300x", 8)
    try:
        hosts = sandbox.up(SANDBOX_HOSTS, hardware=mi300x)
        assert not set(pids) & {row["pid"] for row in sandbox.status()}
        out = _ssh(hosts[0], f"cat {sandbox.HARDWARE_FILE}")
        assert json.loads(out.stdout) == {"vendor": "amd", "name": "AMD Instinct MI300X", "count": 8,
                                          "memory_mib": 192 * 1024}
    finally:
        fleet.boot_bare()  # back to the module's H200 hosts


def test_reboot_brings_the_host_back_and_leaves_the_others(fleet) -> None:
    first, second = fleet.sandbox_hosts
    before = {row["name"]: row for row in sandbox.status()}
    assert all(row["running"] and row["supervised"] and row["boots"] == 1 for row in before.values()), before
    token = uuid.uuid4().hex
    seeded = _ssh(second, f"echo {token} > /run/k2-boot-marker && echo {token} > /root/k2-survives-reboot")
    assert seeded.returncode == 0, seeded
    uptime_before = _uptime(second)

    started = time.monotonic()
    _ssh(second, "systemctl reboot")  # ssh may lose its connection as the host goes down
    answer = None
    while time.monotonic() - started < REBOOT_DEADLINE_S:
        row = _row(second.name)
        if row["boots"] == 2 and row["running"]:
            answer = _ssh(second, "systemctl is-system-running", timeout=5)
            if answer.stdout.strip() in ("running", "degraded"):
                break
        time.sleep(0.1)
    took = time.monotonic() - started
    print(f"\n{second.name} rebooted: systemd running again after {took:.1f}s")
    assert answer is not None and answer.stdout.strip() in ("running", "degraded"), (took, answer)

    after = {row["name"]: row for row in sandbox.status()}
    assert after[second.name]["pid"] != before[second.name]["pid"] and after[second.name]["supervised"]
    assert after[first.name] == before[first.name]  # same nspawn, never rebooted
    state = _ssh(second, "cat /run/k2-boot-marker; cat /root/k2-survives-reboot; hostname")
    assert state.stdout.split() == [token, second.name], state  # /run is new, /root kept
    assert "No such file" in state.stderr
    # the new boot's uptime starts again: pyinfra's server.reboot confirms a reboot by an
    # uptime below the old one plus its delay; without a reset it would be past both
    uptime_after = _uptime(second)
    since_reboot = time.monotonic() - started  # the checks above took time too
    assert uptime_after < since_reboot and uptime_after < uptime_before + took, (uptime_before, took, uptime_after)
    assert _uptime(first) > took
    assert _ssh(first, "systemctl is-system-running").stdout.strip() in ("running", "degraded")


def test_a_killed_host_stays_down_and_down_removes_everything(fleet) -> None:
    first, second = fleet.sandbox_hosts
    fleet.forget()  # the test takes a host down by hand
    supervisor = sandbox._read_pid(sandbox.DEFAULT_STATE_DIR / "run" / f"{second.name}.supervisor")
    assert supervisor and sandbox._alive(supervisor)
    boots = _row(second.name)["boots"]

    os.kill(_container_init(second.name), signal.SIGKILL)  # the fault drill: the host crashes
    deadline = time.monotonic() + 15
    while sandbox._alive(supervisor) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not sandbox._alive(supervisor)
    time.sleep(2)  # nothing starts it again
    row = _row(second.name)
    assert (row["running"], row["supervised"], row["ssh"], row["boots"]) == (False, False, False, boots), row
    assert _ssh(second, "true", timeout=10).returncode == 255
    assert _row(first.name)["running"] and _ssh(first, "true").returncode == 0
    log = (sandbox.DEFAULT_STATE_DIR / "logs" / f"{second.name}.log").read_text(errors="replace")
    assert "supervisor exits" in log.splitlines()[-1], log[-500:]

    sandbox.down()
    assert _live_processes("systemd-nspawn", f"--machine={sandbox.PREFIX}-") == []
    assert _live_processes(f"nspawn.py supervise {sandbox.DEFAULT_STATE_DIR.resolve() / 'run'} ") == []
    assert sandbox._sandbox_netns() == [] and sandbox._sandbox_links() == []  # netns, veths, the bridge
    assert sandbox.status() == []


def test_stopping_a_rebooting_host_starts_nothing_again(fleet) -> None:
    _, second = fleet.sandbox_hosts
    fleet.forget()
    _ssh(second, "systemctl reboot")  # returns once systemd queued the reboot
    sandbox.stop_hosts(sandbox.DEFAULT_STATE_DIR)  # meets the host on its way down to reboot
    last = (sandbox.DEFAULT_STATE_DIR / "logs" / f"{second.name}.log").read_text(errors="replace").splitlines()[-1]
    print(f"\n{last}")
    assert last.endswith("(stopped); supervisor exits"), last
    time.sleep(2)  # nothing starts it again
    assert _live_processes("systemd-nspawn", f"--machine={sandbox.PREFIX}-") == []
    assert _live_processes(f"nspawn.py supervise {sandbox.DEFAULT_STATE_DIR.resolve() / 'run'} ") == []
    sandbox.down()
    assert sandbox._sandbox_netns() == [] and sandbox._sandbox_links() == []


@pytest.mark.parametrize(("gpu", "expected"), [
    ("b200:8", {"vendor": "nvidia", "name": "NVIDIA B200", "count": 8, "memory_mib": 180 * 1024, "nvswitch": True}),
    ("h100:4", {"vendor": "nvidia", "name": "NVIDIA H100", "count": 4, "memory_mib": 80 * 1024, "nvswitch": False}),
    ("gb300", {"vendor": "nvidia", "name": "NVIDIA GB300", "count": 4, "memory_mib": 279 * 1024, "nvswitch": False,
               "imex": True}),
    ("mi355x:8", {"vendor": "amd", "name": "AMD Instinct MI355X", "count": 8, "memory_mib": 288 * 1024}),
])
def test_simulated_hardware_from_the_tables(gpu: str, expected: dict) -> None:
    assert sandbox.parse_gpus(gpu) == expected


@pytest.mark.parametrize("bad", ["h201", "h200:9", "gb200:8", "h200:x"])
def test_simulated_hardware_refuses_what_no_node_has(bad: str) -> None:
    with pytest.raises(sandbox.SandboxError):
        sandbox.parse_gpus(bad)
