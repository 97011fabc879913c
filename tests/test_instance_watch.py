"""A multi-host instance fails as one (offline): the plan gives every multi-host instance its
watchdog units (:mod:`k2fleet.planning.instance_watch`), and the host program's decisions
(:mod:`k2fleet.hostprogs.groupwatch`) stop a rank whose head is gone, start it when the head
is back, and restart the head (stop, hold, start) when a rank host's connection is gone.
Warm restarts: every engine process's compile and JIT caches point at the host's persistent
engine cache, made root-only before the engine starts and bound into containers.
The sandbox proof is tests/test_instance_watch_sandbox.py."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from k2fleet.cli import load_plan
from k2fleet.hostprogs import groupwatch
from k2fleet.planning import engine_cache, instance_watch
from k2fleet.planning.units import unit_file

REPO = Path(__file__).resolve().parents[1]


def plan_of(inventory: str, *data: str):
    return load_plan(REPO / "inventories" / inventory, list(data))


def services(plan) -> dict[tuple[str, str], object]:
    return {(h.name, s.name): s for h in plan.hosts.values() for s in h.services}


def args_of(svc) -> list[str]:
    assert svc.argv[2] == "groupwatch", svc.argv
    return svc.argv[3:]


def test_vllm_nnodes_instance_has_a_member_and_a_head_watchdog() -> None:
    dep, plan = plan_of("h200-k2-0905.py")
    found = services(plan)
    head, member = plan.hosts["h200-0"], plan.hosts["h200-1"]
    m = args_of(found[("h200-1", "k2-vllm-watch")])
    assert m[:5] == ["member", "--unit", "k2-vllm.service", "--head", f"{head.address}:{dep.s.master_port}"], m
    h = args_of(found[("h200-0", "k2-vllm-watch")])
    assert h[:5] == ["head", "--unit", "k2-vllm.service", "--port", str(dep.s.master_port)], h
    assert h[h.index("--member") + 1] == member.address
    # the head stays down longer than a member needs to see it gone
    hold = float(h[h.index("--hold") + 1])
    assert hold > float(m[m.index("--interval") + 1]) * int(m[m.index("--grace") + 1])
    unit = unit_file(dep, found[("h200-1", "k2-vllm-watch")])
    assert "RuntimeDirectory=k2fleet-watch/k2-vllm-watch" in unit and "RuntimeDirectoryMode=0700" in unit
    assert "RuntimeDirectoryPreserve=yes" in unit
    assert f"--state /run/k2fleet-watch/k2-vllm-watch" in unit
    assert not found[("h200-1", "k2-vllm-watch")].needs_checkpoint


def test_the_heads_health_gate_names_the_rank_hosts_that_never_joined_its_rendezvous() -> None:
    """The head's gate carries the rendezvous port and its rank hosts; on failure it names each
    rank host with no connection there, and whether the network reaches it (a real loopback
    socket: connected, refused — packets flow — and a timeout are told apart)."""
    from k2fleet.hostprogs import health
    from k2fleet.planning.desired import health_argv

    dep, plan = plan_of("h200-k2-0905.py")
    head, member = plan.hosts["h200-0"], plan.hosts["h200-1"]
    argv = health_argv(dep, head, 60)
    assert argv[argv.index("--rendezvous-port") + 1] == str(dep.s.master_port)
    assert argv[argv.index("--member") + 1] == f"h200-1={member.address}"
    assert "--rendezvous-port" not in (health_argv(dep, member, 60) or [])
    single, single_plan = plan_of("h200.py")
    assert "--rendezvous-port" not in health_argv(single, single_plan.hosts["h200-0"], 60)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)), server.accept()[0]:
            assert health.rendezvous_problems(port, ["h1=127.0.0.1"]) == []  # connected: nothing to say
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        refused = closed.getsockname()[1]
        closed.close()
        said = health.rendezvous_problems(port, ["h1=127.0.0.1"], probe=lambda a: health.answers(a, refused))
        assert said == [f"rank host h1 (127.0.0.1) never connected to the rendezvous port {port} (it answers from "
                        "here: is its rank running?)"]


def test_vllm_dp_members_watch_the_api_port_and_the_head_has_no_connection_watchdog() -> None:
    dep, plan = plan_of("h200-dp-ep.py")
    found = services(plan)
    head = plan.hosts["h200-0"]
    m = args_of(found[("h200-1", "k2-vllm-watch")])
    assert m[m.index("--head") + 1] == f"{head.address}:{dep.s.port}"  # not the DP RPC port vLLM closes after start
    assert ("h200-0", "k2-vllm-watch") not in found  # vLLM's API server exits when a DP rank dies


def test_ray_workers_watch_the_ray_head() -> None:
    dep, plan = plan_of("h800-pp.py")
    found = services(plan)
    m = args_of(found[("h800-1", "k2-ray-watch")])
    assert m[m.index("--head") + 1] == f"{plan.hosts['h800-0'].address}:{dep.s.ray_port}"
    assert {k for k in found if k[1].endswith("-watch")} == {("h800-1", "k2-ray-watch")}


def test_sglang_multinode_has_both_watchdogs_on_the_dist_init_port() -> None:
    dep, plan = plan_of("h200-sglang-tp16.py")
    found = services(plan)
    watches = sorted(k for k in found if k[1].endswith("-watch"))
    assert len(watches) == 2, watches
    head_host = next(iter(plan.hosts))
    h = args_of(found[(head_host, watches[0][1])])
    assert h[0] == "head" and h[h.index("--port") + 1] == str(dep.s.dist_init_port)


def test_single_host_instances_have_no_watchdog() -> None:
    _, plan = plan_of("h200.py")
    assert not [k for k in services(plan) if k[1].endswith("-watch")]


# ---------------------------------------------------------------- the host program's decisions


class Units:
    def __init__(self, state: str = "active") -> None:
        self.state, self.calls = state, []

    def act(self, verb: str) -> None:
        self.calls.append(verb)
        self.state = {"stop": "inactive", "start": "active"}[verb]


def test_member_stops_its_rank_when_the_head_is_gone_and_starts_it_when_it_is_back(tmp_path: Path) -> None:
    units = Units()
    watch = groupwatch.Member("k2-vllm.service", 3, str(tmp_path / "stopped"), lambda: units.state, units.act)
    assert watch.step(False, "h:1") is None  # never seen: a head still starting is not "gone"
    assert watch.step(True, "h:1") is None
    assert [watch.step(False, "h:1") for _ in range(2)] == [None, None] and units.calls == []
    assert "gone" in watch.step(False, "h:1") and units.calls == ["stop"]
    assert (tmp_path / "stopped").exists()
    assert watch.step(False, "h:1") is None and units.calls == ["stop"]
    # a restarted watchdog still knows it stopped the rank
    again = groupwatch.Member("k2-vllm.service", 3, str(tmp_path / "stopped"), lambda: units.state, units.act)
    assert "back" in again.step(True, "h:1") and units.calls == ["stop", "start"]
    assert not (tmp_path / "stopped").exists()


def test_member_never_starts_a_rank_an_operator_stopped(tmp_path: Path) -> None:
    units = Units("inactive")
    watch = groupwatch.Member("k2-vllm.service", 1, str(tmp_path / "stopped"), lambda: units.state, units.act)
    watch.step(True, "h:1")
    assert watch.step(False, "h:1") is None and watch.step(True, "h:1") is None and units.calls == []


def test_head_restarts_the_instance_when_a_rank_host_leaves() -> None:
    units, holds = Units(), []
    watch = groupwatch.Head("k2-vllm.service", ["10.0.0.2", "10.0.0.3"], 2, lambda: units.state, units.act,
                            lambda: holds.append(1))
    assert watch.step({"10.0.0.2"}) is None  # not armed until every member held a connection
    assert watch.step({"10.0.0.2"}) is None and units.calls == []
    assert watch.step({"10.0.0.2", "10.0.0.3"}) is None  # armed
    assert watch.step({"10.0.0.2"}) is None
    assert "10.0.0.3" in watch.step({"10.0.0.2"}) and units.calls == ["stop", "start"] and holds == [1]
    assert watch.step(set()) is None  # disarmed until the members are back


def test_head_leaves_a_unit_systemd_is_restarting_alone() -> None:
    units = Units("activating")
    watch = groupwatch.Head("k2-vllm.service", ["10.0.0.2"], 1, lambda: units.state, units.act, lambda: None)
    watch.armed = True
    assert watch.step(set()) is None and units.calls == []


def test_held_peers_reads_the_kernels_tcp_table() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            conn, _ = server.accept()
            with conn:
                assert groupwatch.held_peers(port) == {"127.0.0.1"}


def test_held_peers_parses_ipv4_and_ipv6_rows(tmp_path: Path) -> None:
    table = tmp_path / "tcp"
    table.write_text("  sl  local_address rem_address   st\n"
                     "   0: 0100000A:7325 0200000A:C350 01 0\n"       # 10.0.0.1:29477 <- 10.0.0.2, ESTABLISHED
                     "   1: 0100000A:7325 0300000A:C351 0A 0\n"       # LISTEN-ish state: not counted
                     "   2: 0100000A:1F90 0400000A:C352 01 0\n")      # another port
    assert groupwatch.held_peers(0x7325, [str(table)]) == {"10.0.0.2"}


# ---------------------------------------------------------------- warm restarts


def test_engine_units_keep_their_caches_in_the_hosts_engine_cache() -> None:
    dep, plan = plan_of("h200-k2-0905.py")
    svc = services(plan)[("h200-1", "k2-vllm")]
    root = engine_cache.cache_dir("vllm")
    assert svc.env["VLLM_CACHE_ROOT"] == f"{root}/vllm"
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE"):
        assert svc.env[var].startswith(root + "/"), var
    assert svc.pre_start[0] == ["/usr/bin/install", "-d", "-m", "0700", "-o", "root", "-g", "root",
                                engine_cache.CACHE_ROOT, root]
    unit = unit_file(dep, svc)
    assert unit.index(f"ExecStartPre=/usr/bin/install -d -m 0700 -o root -g root {engine_cache.CACHE_ROOT} {root}") \
        < unit.index("ExecStart=")
    watch = services(plan)[("h200-1", "k2-vllm-watch")]
    assert "VLLM_CACHE_ROOT" not in watch.env and watch.pre_start == []


def test_containers_bind_the_engine_cache_read_write() -> None:
    _, plan = plan_of("h200-sglang-dpa-ep.py")
    svc = next(s for h in plan.hosts.values() for s in h.services if s.argv[:2] == ["/usr/bin/docker", "run"])
    root = engine_cache.cache_dir("sglang")
    assert f"{root}:{root}" in svc.argv and f"{root}:{root}:ro" not in svc.argv
    assert svc.env["SGLANG_DG_CACHE_DIR"] == f"{root}/deep_gemm"
    assert svc.argv.index(f"{root}:{root}") < svc.argv.index(svc.argv[-1])


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm", "ktransformers"])
def test_every_engine_points_inductor_triton_and_flashinfer_at_its_cache(engine: str) -> None:
    env = engine_cache.cache_env(engine)
    assert engine_cache.cache_dir_of(env) == engine_cache.cache_dir(engine)
    assert {"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE"} <= set(env)
