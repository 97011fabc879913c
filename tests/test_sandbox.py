"""Real (no mocks) test of the nspawn sandbox fleet: boot 3 hosts, probe, tear down.

The hosts come from the one sandbox fixture (tests/conftest.py ``fleet``: the lock, a
bare boot, up again for each test even after ``test_down_removes_everything``)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from k2sandbox import nspawn as sandbox
from k2sandbox.harness import tool

ROOT = Path(__file__).resolve().parents[1]

N_HOSTS = 3


def _ssh(host: sandbox.SandboxHost, remote: str) -> subprocess.CompletedProcess[str]:
    return sandbox.ssh(host, remote, timeout=30)


def _sandbox_netns() -> list[str]:
    return sandbox._sandbox_netns()


def _sandbox_links() -> list[str]:
    return sandbox._sandbox_links()


def _live_nspawn_pids() -> list[str]:
    """This instance's systemd-nspawn processes that still run (zombies left to a non-reaping
    PID 1 excluded; another sandbox instance's hosts, e.g. the suite's other xdist worker's, not counted)."""
    out = subprocess.run(["ps", "-eo", "pid=,stat=,comm=,args="], capture_output=True, text=True).stdout
    rows = [line.split(None, 3) for line in out.splitlines()]
    return [row[0] for row in rows if len(row) == 4 and row[2] == "systemd-nspawn" and not row[1].startswith("Z")
            and f"--machine={sandbox.PREFIX}-" in row[3]]


@pytest.fixture
def state_dir() -> Path:
    return sandbox.DEFAULT_STATE_DIR.resolve()


@pytest.fixture
def hosts(fleet) -> list[sandbox.SandboxHost]:
    """The 3 sandbox hosts, up (booted by tests/conftest.py's fixture under the lock)."""
    return fleet.sandbox_hosts


def test_inventory(hosts: list[sandbox.SandboxHost], state_dir: Path) -> None:
    assert [h.name for h in hosts] == [sandbox.host_name(i) for i in range(1, N_HOSTS + 1)]
    entries = sandbox.sandbox_inventory_hosts(state_dir=state_dir)
    assert [(name, data["ssh_hostname"], data["k2_nic"]) for name, data in entries] == [
        (h.name, h.address, sandbox.HOST_NIC) for h in hosts]
    assert [name for name, _ in sandbox.sandbox_inventory_hosts(2, state_dir)] == [sandbox.host_name(1), sandbox.host_name(2)]
    with pytest.raises(SystemExit, match="has 3 hosts, this inventory needs 4"):
        sandbox.sandbox_inventory_hosts(4, state_dir)
    assert len({h.address for h in hosts}) == N_HOSTS
    assert sandbox.load_hosts(state_dir) == hosts
    for host in hosts:
        assert Path(host.ssh_key).is_absolute() and Path(host.ssh_key).exists()
        assert Path(host.ssh_known_hosts_file).is_absolute()
    known = Path(hosts[0].ssh_known_hosts_file).read_text()
    assert all(h.address in known for h in hosts)


def test_up_again_is_noop(hosts: list[sandbox.SandboxHost], state_dir: Path) -> None:
    pids = [row["pid"] for row in sandbox.status(state_dir)]
    assert sandbox.up(N_HOSTS, state_dir, hardware=sandbox.recorded_hardware(state_dir)[0]) == hosts
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


# --------------------------------------------------------------------------- the sandbox inventories (offline)


def _plan(inventory: str, state_dir: Path, *data: str, **env: str) -> subprocess.CompletedProcess[str]:
    argv = [tool("k2fleet"), "plan", inventory, "--json", *(a for d in data for a in ("--data", d))]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "K2FLEET_SANDBOX_DIR": str(state_dir), **env})


@pytest.fixture
def recorded_fleet(tmp_path: Path) -> Path:
    """A state dir whose hosts.json records 3 hosts (nothing booted: plans only)."""
    from k2sandbox.checkpoint_cache import ensure_sandbox_checkpoint

    ensure_sandbox_checkpoint()  # the sandbox inventories' control: source must exist to validate
    hosts = [sandbox.SandboxHost(sandbox.host_name(i), sandbox.host_address(i), "root", str(tmp_path / "id_ed25519"),
                                 str(tmp_path / "known_hosts")) for i in (1, 2, 3)]
    (tmp_path / "hosts.json").write_text(json.dumps([h.__dict__ for h in hosts]))
    return tmp_path


def test_sandbox_inventories_read_no_environment(recorded_fleet: Path) -> None:
    first = _plan("inventories/sandbox.py", recorded_fleet)
    assert first.returncode == 0, first.stderr
    noise = {"K2FLEET_SANDBOX_SCENARIO": "trtllm-mpi", "K2FLEET_SANDBOX_NIC": "eth9",
             "K2FLEET_SANDBOX_ENGINE_ARGS": '{"max-num-seqs": 1}', "K2FLEET_SANDBOX_SHARED": "1",
             "K2FLEET_SANDBOX_CHECKPOINT": "hub", "K2FLEET_SANDBOX_MODEL_TYPE": "deepseek_v3"}
    again = _plan("inventories/sandbox.py", recorded_fleet, **noise)
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr
    plan = json.loads(first.stdout)
    assert sorted(plan["hosts"]) == [sandbox.host_name(i) for i in (1, 2, 3)]
    trt = _plan("inventories/sandbox-trtllm-mpi.py", recorded_fleet)
    assert trt.returncode == 0, trt.stderr
    assert sorted(json.loads(trt.stdout)["hosts"]) == [sandbox.host_name(1), sandbox.host_name(2)]
    assert (plan["engine"], json.loads(trt.stdout)["engine"]) == ("vllm", "trtllm")


def test_sandbox_variations_are_pyinfra_data(recorded_fleet: Path) -> None:
    plan = _plan("inventories/sandbox.py", recorded_fleet, 'k2_engine_args={"max-num-seqs": 64}',
                 "k2_shared_storage=true", "k2_model_dir=/mnt/k2shared/models")
    assert plan.returncode == 0, plan.stderr
    argv = json.loads(plan.stdout)["hosts"][sandbox.host_name(1)]["services"][0]["argv"]
    assert "--max-num-seqs" in argv and argv[argv.index("--max-num-seqs") + 1] == "64"
    assert "/mnt/k2shared/models/" in " ".join(argv)


def test_sandbox_inventory_without_a_sandbox_is_one_line(tmp_path: Path) -> None:
    out = _plan("inventories/sandbox.py", tmp_path / "none")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        f"error: inventories/sandbox.py: inventory: could not be loaded: no sandbox fleet at {tmp_path / 'none'}: "
        "run `k2fleet sandbox up 3` first"]
