"""#34: a rehearsal of an RDMA inventory keeps its HCAs. Every sandbox host that lists
``k2_ib_hcas`` boots with a TEST DOUBLE ``/sys/class/infiniband`` tree of them
(:mod:`k2sandbox.fabric_doubles`), the real host probe reads it and the real preflight's
fabric gate decides on it; ``--fabric-down HOST:HCA:PORT`` shows one port DOWN.

Two sandbox rehearsals of the 4 × 8 H200 SGLang DP-attention + EP inventory
(inventories/h200-sglang-dpa-ep.py, with ``--data k2_runtime=venv``: SGLang's containers across
hosts are not rehearsed yet, its venv is): one with h200-2's mlx5_3 port 1 DOWN stops before any
change in one line naming host, HCA and port, and no engine unit exists or runs on any
host (asked of each host's systemd); one with every port ACTIVE ends healthy, re-run 0 changes,
and the test itself calls the endpoint. Each test holds the sandbox lock from before the
rehearsal (which shares it) to after its own ``sandbox.down()``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import subprocess
import time
import urllib.request

import pytest

from k2fleet.cli import load_plan
from k2fleet.hostprogs import hoststate
from k2fleet.planning.host_fact import HostReport
from k2fleet.planning.preflight_checks import check_fabric
from k2sandbox import fabric_doubles as fd
from k2sandbox import nspawn as sandbox
from k2sandbox import rehearse as rh
from k2sandbox.harness import ROOT, tool
from tests.fleet_calls import served_model
from tests.test_rehearse import REHEARSAL_TIMEOUT_S, first_lines, needs_root

INVENTORY = "inventories/h200-sglang-dpa-ep.py"
VENV = ("--data", "k2_runtime=venv")  # SGLang containers across hosts: not rehearsed yet (rehearse.unsupported)
HOSTS = ["h200-0", "h200-1", "h200-2", "h200-3"]
HCAS = [f"mlx5_{i}" for i in range(8)]


@functools.cache
def dep_of():
    dep, _ = load_plan(str(ROOT / INVENTORY))
    return dep


def test_the_double_of_an_inventory_passes_its_gate_and_a_down_port_is_named(tmp_path) -> None:
    """The tree a rehearsal lays for a host is what its inventory declares: the real probe reads
    it, the real gate passes it; with one port DOWN the gate names that HCA and port."""
    dep = dep_of()
    entry = dep.fleet.hosts[2]
    down = rh.parse_fabric_down(dep, ["h200-2:mlx5_3:1"])
    (healthy, broken) = (rh.fabric_specs(dep, [entry.name], {})[0], rh.fabric_specs(dep, [entry.name], down)[0])
    for spec, root in ((healthy, tmp_path / "a"), (broken, tmp_path / "b")):
        fd.write_tree(root, fd.devices_of(spec))
    reports = []
    for root in (tmp_path / "a", tmp_path / "b"):
        names = hoststate.ib_hcas(str(root))
        assert names == HCAS
        reports.append(HostReport.from_json(json.loads(json.dumps({
            "gpus": {"vendor": None, "names": [], "memory_mib": [], "driver": None}, "disk_free": 0, "mem_total": 0,
            "shm_size": 0, "nics": {}, "ib_hcas": names, "ib_ports": hoststate.ib_ports(names, str(root)),
            "ib_simulated": True}))))
    assert check_fabric(entry, reports[0], sandbox=True) == []
    assert check_fabric(entry, reports[1], sandbox=True) == [
        "HCA mlx5_3 port 1 is DOWN (physical state 2: Polling), needs ACTIVE: check the cable, the switch port "
        "and the subnet manager (ibstat)"]


@pytest.mark.parametrize("item, words", [
    ("h200-2:mlx5_3", "wants HOST:HCA:PORT"),
    ("h200-9:mlx5_3:1", "no host 'h200-9'"),
    ("h200-2:mlx5_8:1", "h200-2 lists no HCA mlx5_8"),
    ("h200-2:mlx5_3:2", "the double of mlx5_3 has ports 1"),
])
def test_a_fabric_down_that_names_no_port_is_refused(item: str, words: str) -> None:
    with pytest.raises(rh.FabricDownError, match=re.escape(words)):
        rh.parse_fabric_down(dep_of(), [item])


def test_the_first_lines_say_the_hcas_are_kept_and_the_port_down(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Before anything boots: ``k2_ib_hcas`` is no longer among the changed values; the
    doubles laid and the port shown DOWN are named."""
    lines = first_lines(monkeypatch, tmp_path, INVENTORY, ["k2_runtime=venv"], fabric_down=["h200-2:mlx5_3:1"])
    assert not [line for line in lines if "changes k2_ib_hcas" in line], lines
    assert f"rehearse {INVENTORY}: keeps k2_ib_hcas {','.join(HCAS)} (InfiniBand, 400 Gb/s) on h200-0, h200-1, " \
           f"h200-2, h200-3: TEST DOUBLE /sys/class/infiniband trees at /etc/k2fleet-doubles/infiniband on the " \
           "sandbox hosts, every port ACTIVE" in lines, lines
    assert lines[-1] == (f"rehearse {INVENTORY}: fabric double: h200-2 mlx5_3 port 1 DOWN (--fabric-down; "
                         "state 1: DOWN, phys_state 2: Polling)")


# ---------------------------------------------------------------- sandbox


@contextlib.contextmanager
def sandbox_held():
    """The sandbox lock for the whole test — the rehearsal (a child sharing it), the test's own
    look at the kept hosts and ``sandbox.down()`` — so no other user boots in between; yields
    the environment that hands the lock to the child."""
    with sandbox.hold_sandbox_lock() as handle:
        try:
            yield handle, {**os.environ, **sandbox.lock_env(handle)}
        finally:
            sandbox.down()
        assert not sandbox.status() and not sandbox._sandbox_netns()  # left down (still under the lock)


def rehearse_holding(handle, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    started = time.monotonic()
    proc = subprocess.run([tool("k2fleet"), "rehearse", INVENTORY, "--keep", *VENV, *args], cwd=ROOT,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=REHEARSAL_TIMEOUT_S,
                          env=env, pass_fds=(handle.fileno(),))
    print(f"rehearse {INVENTORY} {' '.join(args)}: {time.monotonic() - started:.0f}s, exit {proc.returncode}")
    print("\n".join(proc.stdout.splitlines()[:12] + ["..."] + proc.stdout.splitlines()[-6:]))
    return proc


def engine_units(host: sandbox.SandboxHost) -> str:
    """Every k2-sglang unit systemd on ``host`` knows (loaded or not, its unit file) and whether
    k2-sglang.service is active."""
    shown = sandbox.ssh(host, "systemctl list-units --all --no-legend --plain 'k2-sglang*'; "
                              "systemctl list-unit-files --no-legend 'k2-sglang*'; "
                              "systemctl is-active k2-sglang.service; true")
    assert shown.returncode == 0, shown.stderr
    return shown.stdout


@pytest.mark.sandbox
@needs_root
def test_a_down_port_stops_the_rehearsal_before_any_engine_starts() -> None:
    with sandbox_held() as (handle, env):
        proc = rehearse_holding(handle, env, "--fabric-down", "h200-2:mlx5_3:1")
        assert proc.returncode != 0, proc.stdout
        failed = [line.strip() for line in proc.stdout.splitlines() if "preflight failed" in line]
        want = ("h200-2: preflight failed: HCA mlx5_3 port 1 is DOWN (physical state 2: Polling), needs ACTIVE: "
                "check the cable, the switch port and the subnet manager (ibstat)")
        assert any(line.endswith(want) for line in failed), proc.stdout[-3000:]  # one line: host, HCA, port
        assert not [line for line in failed if re.search(r"h200-[013]: preflight failed", line)], failed
        # no engine unit on any host: asked of each host's systemd, not taken from the tool's verdict
        hosts = sandbox.load_hosts()
        assert len(hosts) == 4 and sandbox.recorded_fabric()[2]["down"] == [["mlx5_3", 1]]
        for host in hosts:
            units = engine_units(host)
            assert units.split() == ["inactive"], f"{host.name}: {units}"


@pytest.mark.sandbox
@needs_root
def test_every_port_active_ends_healthy() -> None:
    with sandbox_held() as (handle, env):
        proc = rehearse_holding(handle, env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
        assert f"rehearse {INVENTORY}: keeps k2_ib_hcas {','.join(HCAS)}" in proc.stdout
        assert proc.stdout.strip().splitlines()[-1] == f"rehearsal {INVENTORY}: 1/1 endpoints healthy, re-run 0 changes"
        # the test calls the endpoint itself: a chat completion with a non-empty answer
        main = re.search(r"^endpoint: (http://\S+/v1)$", proc.stdout, re.M)
        assert main, proc.stdout
        assert served_model(main.group(1)) == "moonshotai/Kimi-K2-Thinking"
        body = json.dumps({"model": "moonshotai/Kimi-K2-Thinking", "max_tokens": 32,
                           "messages": [{"role": "user", "content": "Say hi"}]}).encode()
        request = urllib.request.Request(f"{main.group(1)}/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as answer:
            message = json.load(answer)["choices"][0]["message"]
        assert (message.get("content") or message.get("reasoning_content") or message.get("reasoning") or "").strip()
        for host in sandbox.load_hosts():  # the engine runs on every node of the instance
            assert engine_units(host).split()[-1] == "active", host.name
