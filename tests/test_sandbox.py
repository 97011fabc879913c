"""Real (no mocks) test of the nspawn sandbox fleet: boot 3 hosts, probe, tear down."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="sandbox needs root (network namespaces, bridge, systemd-nspawn)"
)

from k2fleet import sandbox  # noqa: E402

N_HOSTS = 3


def _ssh(host: sandbox.SandboxHost, remote: str) -> subprocess.CompletedProcess[str]:
    return sandbox.ssh(host, remote, timeout=30)


def _sandbox_netns() -> list[str]:
    return sandbox._sandbox_netns()


def _sandbox_links() -> list[str]:
    return sandbox._sandbox_links()


def _live_nspawn_pids() -> list[str]:
    """systemd-nspawn processes that still run (zombies left to a non-reaping PID 1 excluded)."""
    out = subprocess.run(["ps", "-eo", "pid=,stat=,comm="], capture_output=True, text=True).stdout
    rows = [line.split(None, 2) for line in out.splitlines()]
    return [pid for pid, stat, comm in rows if comm == "systemd-nspawn" and not stat.startswith("Z")]


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("k2sb-state")


@pytest.fixture(scope="module")
def hosts(state_dir: Path) -> Iterator[list[sandbox.SandboxHost]]:
    from tests.sandbox_harness import hold_sandbox_lock

    lock = hold_sandbox_lock()  # the sandbox's names are global: one user at a time
    sandbox.down()  # a fleet left up by the demo or another state dir uses the same names
    try:
        yield sandbox.up(N_HOSTS, state_dir)
    finally:
        sandbox.down(state_dir)
        lock.close()


def test_inventory(hosts: list[sandbox.SandboxHost], state_dir: Path) -> None:
    assert [h.name for h in hosts] == [f"k2sb-{i}" for i in range(1, N_HOSTS + 1)]
    assert len({h.address for h in hosts}) == N_HOSTS
    assert sandbox.load_hosts(state_dir) == hosts
    for host in hosts:
        assert Path(host.ssh_key).is_absolute() and Path(host.ssh_key).exists()
        assert Path(host.ssh_known_hosts_file).is_absolute()
    known = Path(hosts[0].ssh_known_hosts_file).read_text()
    assert all(h.address in known for h in hosts)


def test_up_again_is_noop(hosts: list[sandbox.SandboxHost], state_dir: Path) -> None:
    pids = [row["pid"] for row in sandbox.status(state_dir)]
    assert sandbox.up(N_HOSTS, state_dir) == hosts
    assert [row["pid"] for row in sandbox.status(state_dir)] == pids
    assert all(row["running"] and row["ssh"] for row in sandbox.status(state_dir))


def test_systemd_is_pid1_and_running(hosts: list[sandbox.SandboxHost]) -> None:
    for host in hosts:
        state = _ssh(host, "systemctl is-system-running")
        assert state.stdout.strip() in ("running", "degraded"), (host.name, state)
        comm = _ssh(host, "ps -p 1 -o comm= 2>/dev/null || cat /proc/1/comm")
        assert comm.returncode == 0 and comm.stdout.strip() == "systemd", (host.name, comm)


def test_identity_distinct(hosts: list[sandbox.SandboxHost]) -> None:
    names, ids, addrs = set(), set(), set()
    for host in hosts:
        out = _ssh(host, "hostname; cat /etc/machine-id; ip -4 -o addr show dev eth0").stdout.split("\n")
        assert out[0] == host.name
        names.add(out[0])
        ids.add(out[1])
        assert f"{host.address}/24" in out[2]
        addrs.add(host.address)
    assert len(names) == len(ids) == len(addrs) == N_HOSTS


def test_hosts_reach_each_other(hosts: list[sandbox.SandboxHost]) -> None:
    first, others = hosts[0], hosts[1:]
    probe = ";".join(
        f"socket.create_connection(('{h.address}', 22), timeout=5).close()" for h in others
    )
    res = _ssh(first, f"python3 -c \"import socket; {probe}; print('ok')\"")
    assert res.returncode == 0 and res.stdout.strip() == "ok", res


def test_no_route_out(hosts: list[sandbox.SandboxHost]) -> None:
    for host in hosts:
        res = _ssh(host, "ip route get 8.8.8.8")
        assert res.returncode not in (0, 255), res  # 255 would be an ssh failure
        assert "unreachable" in res.stderr.lower(), res
        default = _ssh(host, "ip route show default")
        assert default.returncode == 0 and default.stdout.strip() == "", default


def test_down_removes_everything(hosts: list[sandbox.SandboxHost], state_dir: Path) -> None:
    sandbox.down(state_dir)
    sandbox.down(state_dir)  # idempotent
    assert _sandbox_netns() == []
    assert _sandbox_links() == []
    assert _live_nspawn_pids() == []
    assert not (state_dir / "hosts.json").exists()
    assert not (state_dir / "hosts").exists()
    assert sandbox.status(state_dir) == []
