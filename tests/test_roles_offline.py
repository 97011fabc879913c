"""Offline role tier: the real roles, run in-process against pyinfra's ``@fake`` connector.

Each test plans a real inventory with the real planner (:func:`k2fleet.cli.load_plan` +
:func:`k2fleet.planning.desired.desired_state`, no side effects), runs the deploy's own pipeline
(:func:`k2fleet.deploy.pipeline.deploy_kimi`, what ``deploys/kimi.py`` calls) with a
:class:`~k2fleet.planning.host_fact.HostReport` built here instead of the HostState fact, and runs the operations with
``pyinfra.api.run_ops`` against ``@fake/<host>`` hosts: nothing is contacted, every
command "succeeds" with no output.

How planned commands are read (pyinfra 3.10): at prepare time an operation's
``command_generator`` yields its commands *ignoring* ``_if`` (``_if`` is only evaluated
when ``state.is_executing``), and most ``_if`` callables ask earlier operations
``did_change()``, which raises before execution. So the authoritative answer is the
execution against ``@fake``: ``OperationMeta.did_change()`` per operation, and the
commands each operation sent, sliced out of the fake connector's ``executed_commands``
between ``operation_host_start`` callbacks (uploads are recorded by wrapping the
connector's ``put_file``). Control-machine functions (``python.call``) are replaced by
recorders so no test can fetch or push a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
from pyinfra.api import BaseStateCallback, Config, Inventory, State
import pyinfra
from pyinfra.api.connect import connect_all
from pyinfra.api.operations import run_ops
from pyinfra.api.state import StateStage
from pyinfra.context import ctx_host, ctx_state

from k2fleet.deploy.operations import START_CLOCK
from k2fleet.planning.host_bootstrap import reboot_reason
from k2fleet.control import checkpoint_copy as fanout
from k2fleet.planning import relay_plan
from k2fleet.cli import load_plan
from k2fleet.planning.deployment import Deployment
from k2fleet.planning.desired import CHECKPOINT_CHECK, DPKG_JOURNAL_GLOB, UNIT_GLOB, ControlArtifacts, HostDesired, desired_state
from k2fleet.planning.host_actions import host_actions
from k2fleet.planning.host_actions import reboot_steps, restart_steps
from k2fleet.planning.host_archive import host_argv
from k2fleet.planning.processes import Plan
from k2fleet.planning.host_fact import HostReport
from k2fleet.deploy.fleet_run import FleetRun
from k2fleet.deploy.roles import checkpoint
from k2fleet.deploy.pipeline import deploy_kimi
from k2fleet.planning import mesh_config
from tests.inventory_factory import write_inventory

REPO = Path(__file__).resolve().parents[1]
H200 = REPO / "inventories" / "h200.py"
TRTLLM_MPI = REPO / "inventories" / "h200-trtllm-mpi.py"
DP_EP = REPO / "inventories" / "h200-dp-ep.py"
ENGINE_FLAG = 'k2_engine_args={"max-num-seqs": 64}'

# --------------------------------------------------------------------------- desired state + fact
ACTIVE_PORT = {"state": "4: ACTIVE", "phys_state": "5: LinkUp", "link_layer": "InfiniBand", "rate": "400 Gb/sec (4X NDR)"}


def artifacts(dep: Deployment, plan: Plan) -> ControlArtifacts:
    return ControlArtifacts(mesh_clients={n: (b"priv", b"ssh-ed25519 AAAA k") for n in mesh_config.mesh_links(plan)},
                            mesh_hosts={h.name: (b"hp", b"ssh-ed25519 BBBB " + h.name.encode()) for h in dep.fleet.hosts},
                            relay_secret=b"0123456789abcdef" * 4 + b"\n")


@lru_cache(maxsize=None)
def planned(inventory: str, data: tuple[str, ...] = ()) -> tuple[Deployment, Plan, dict[str, HostDesired]]:
    dep, plan = load_plan(inventory, data=list(data))
    return dep, plan, desired_state(dep, plan, artifacts(dep, plan))


def digests(d: HostDesired) -> dict[str, str | None]:
    return {p: spec.sha256 for files in (*d.files.values(), *d.service_files.values()) for p, spec in files.items()}


DRIVER = "580.95.05"
KERNEL = "6.8.0-60-generic"


def settled_boot(d: HostDesired, driver: str = DRIVER) -> dict[str, Any]:
    """The bootstrap part of a settled host's HostState: every planned package at the
    driver's version, held, the module of that version loaded (hoststate.py's shape)."""
    b = d.bootstrap
    assert b is not None
    versions = {p.name: f"{driver}-1" for p in b.packages} | {k: "1.0" for k in b.holds if b.package(k) is None}
    versions[b.kernel_headers.format(kernel=KERNEL)] = "6.8.0-60.63"
    return {"os": {"id": "ubuntu", "version_id": "22.04"}, "kernel": KERNEL, "secure_boot": False,
            "hardware": {"vendor": b.vendor, "count": 8, "name": None, "simulated": False},
            "modules": {"nvidia": driver if b.vendor == "nvidia" else None, "amdgpu": None},
            "nouveau": False, "package_versions": versions, "holds": sorted(b.holds), "reboot_required": []}


def settled(dep: Deployment, d: HostDesired) -> HostReport:
    """The HostState of a host that already holds exactly ``d`` (JSON shape of hoststate.py)."""
    entry = next(h for h in dep.fleet.hosts if h.name == d.name)
    nic = entry.settings.nic or "eth0"
    units = d.fact_query("/")["units"]
    report = {
        "gpus": {"vendor": "nvidia", "names": ["NVIDIA H200"] * dep.gpus_per_node,
                 "memory_mib": [143771] * dep.gpus_per_node, "driver": "570.86.15"},
        "disk_free": 4 * 10**12, "mem_total": 2 * 2**40, "shm_size": 64 * 2**30,
        "nics": {"lo": ["127.0.0.1"], nic: [d.address]}, "ib_hcas": sorted({h.partition(":")[0] for h in entry.settings.ib_hcas}),
        "ib_ports": {h.partition(":")[0]: {"1": ACTIVE_PORT} for h in entry.settings.ib_hcas},
        "files": digests(d),
        "exists": {p: True for p in d.exists},
        "globs": {UNIT_GLOB: sorted(f"/etc/systemd/system/{u}" for u in d.units)},
        "units": {u: {"Id": u, "ActiveState": "active", "UnitFileState": "enabled", "LoadState": "loaded"}
                  for u in units},
        "packages": sorted(d.packages),
        "checks": {name: 0 for name in d.checks},
        "bootstrap": settled_boot(d),
    }
    return HostReport.from_json(json.loads(json.dumps(report)))


def settled_fleet(dep: Deployment, desired: dict[str, HostDesired]) -> dict[str, HostReport]:
    return {name: settled(dep, d) for name, d in desired.items()}


# --------------------------------------------------------------------------- running the roles


@dataclass
class Op:
    name: str
    changed: bool
    commands: list[str]


@dataclass
class Outcome:
    ops: dict[str, dict[str, Op]]  # host → operation name (without the deploy prefix) → Op
    planned_unconditional: dict[str, list[str]]  # host → ops with prepare-time commands and no _if
    control_calls: list[str] = field(default_factory=list)
    timeline: list[tuple[str, str]] = field(default_factory=list)  # (host, operation) as they started, fleet-wide

    def changed(self, host: str) -> list[str]:
        return [name for name, op in self.ops[host].items() if op.changed]

    def op(self, host: str, fragment: str) -> Op:
        hits = [op for name, op in self.ops[host].items() if fragment in name]
        assert len(hits) == 1, f"{fragment!r} names {len(hits)} operations on {host}: {list(self.ops[host])}"
        return hits[0]

    def commands(self, host: str) -> list[str]:
        return [c for op in self.ops[host].values() for c in op.commands]

    def ran(self, host: str, fragment: str) -> bool:
        """An operation named with ``fragment`` is planned on ``host`` and changed it."""
        return any(fragment in name and op.changed for name, op in self.ops[host].items())

    def absent(self, host: str, fragment: str) -> bool:
        """No operation named with ``fragment`` is planned on ``host`` (its record needs none)."""
        return not any(fragment in name for name in self.ops[host])


class _Trace(BaseStateCallback):
    """Per host: (op hash, index into the fake connector's executed_commands) at each op start."""

    def __init__(self) -> None:
        self.starts: dict[Any, list[tuple[str, int]]] = {}
        self.timeline: list[tuple[Any, str]] = []

    def operation_host_start(self, state: State, host: Any, op_hash: str) -> None:  # type: ignore[override]
        self.starts.setdefault(host, []).append((op_hash, len(host.connector.executed_commands)))
        self.timeline.append((host, op_hash))


def _record_uploads(connector: Any) -> None:
    put_file = connector.put_file

    def recording_put_file(filename_or_io: Any, remote_filename: str, *args: Any, **kwargs: Any) -> bool:
        connector.executed_commands.append(f"<upload> {remote_filename}")
        return put_file(filename_or_io, remote_filename, *args, **kwargs)

    connector.put_file = recording_put_file


@pytest.fixture
def control_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace the control-machine functions of the checkpoint role by recorders."""
    calls = ControlCalls()
    for module, name in ((fanout, "prepare_control_copy"), (fanout, "relay_to_host"), (checkpoint, "send_token")):
        monkeypatch.setattr(module, name, lambda *a, _n=name, **k: calls.record(_n, k))
    return calls


class ControlCalls(list):
    """Names of the control-machine functions called, in order; ``kwargs`` beside them."""

    def __init__(self) -> None:
        super().__init__()
        self.kwargs: list[dict[str, Any]] = []

    def record(self, name: str, kwargs: dict[str, Any]) -> None:
        self.append(name)
        self.kwargs.append(kwargs)


def run_roles(dep: Deployment, plan: Plan, desired: dict[str, HostDesired], facts: dict[str, HostReport],
              tmp_path: Path, control_calls: list[str], every_role: bool = False) -> Outcome:
    """Plan the deploy's pipeline on one @fake host per inventory host, then execute.
    ``every_role``: plan every role even on a settled fleet (how each role behaves on its own)."""
    run = FleetRun(dep=dep, plan=plan, artifacts=artifacts(dep, plan), desired=desired, dry=False, state_dir=tmp_path)
    reboots = {name: why for name, d in desired.items()
               if d.bootstrap and (why := reboot_reason(d.bootstrap, facts[name].boot))}
    weights_wanted: dict[str, list[str]] = {}
    for name, d in desired.items():
        for ws in dep.weight_sets:
            if d.fanout and d.fanout.loads_weights and not facts[name].passed(ws.check):
                weights_wanted.setdefault(ws.check, []).append(name)
    rolling_reboots = reboot_steps(desired, facts, reboots)
    restarts = restart_steps(desired, facts, bool(reboots) and not rolling_reboots)
    unsettled = None if every_role else {name: a.describe() for name, d in desired.items()
                                         if not (a := host_actions(d, facts[name])).settled}
    starting = bool(restarts) or any(not facts[name].unit_active(f"{unit}.service") for name, d in desired.items()
                                     for _, unit in d.own_slots)  # FleetRun.starting
    hosts = [(f"@fake/{name}", {"ssh_hostname": d.address, "fake_delay": 0, "fake_delay_jitter": 0})
             for name, d in desired.items()]
    state = State(Inventory((hosts, {})), Config())
    trace = _Trace()
    state.add_callback_handler(trace)
    connect_all(state)
    for h in state.inventory:
        _record_uploads(h.connector)

    def pipeline() -> None:  # deploys/kimi.py, with the fact given instead of gathered
        from pyinfra import host

        mine = run.desired[host.name.removeprefix("@fake/")]
        deploy_kimi(run, mine, facts[mine.name], reboots=reboots, weights_wanted=weights_wanted, unsettled=unsettled,
                    reboot_steps=rolling_reboots, restart_steps=restarts, starting=starting)

    plan_as_the_cli(state, pipeline)

    # Prepare-time view: commands each op yields with _if ignored; which of them have no _if.
    unconditional: dict[str, list[str]] = {}
    for h in state.inventory:
        with ctx_state.use(state), ctx_host.use(h):
            for op_hash in h.op_hash_order:
                data = state.get_op_data_for_host(h, op_hash)
                if not data.global_arguments.get("_if") and list(data.command_generator()):
                    unconditional.setdefault(h.name.removeprefix("@fake/"), []).append(_name(state, op_hash))

    run_ops(state)

    ops: dict[str, dict[str, Op]] = {}
    for h in state.inventory:
        name = h.name.removeprefix("@fake/")
        executed = h.connector.executed_commands
        starts = trace.starts.get(h, [])
        bounds = [i for _, i in starts[1:]] + [len(executed)]
        sliced = {op_hash: executed[i:end] for (op_hash, i), end in zip(starts, bounds)}
        ops[name] = {}
        for op_hash in h.op_hash_order:
            meta = state.get_op_data_for_host(h, op_hash).operation_meta
            assert meta.did_succeed(), f"{name}: {_name(state, op_hash)} failed"
            op_name = _name(state, op_hash)
            assert op_name not in ops[name], f"two operations named {op_name!r} on {name}"
            # start_or_explain's clock left out: the tests read which units start, stop and restart
            commands = [c.replace(START_CLOCK, "") for c in sliced.get(op_hash, [])]
            ops[name][op_name] = Op(op_name, meta.did_change(), commands)
    timeline = [(h.name.removeprefix("@fake/"), _name(state, op_hash)) for h, op_hash in trace.timeline]
    return Outcome(ops=ops, planned_unconditional=unconditional, control_calls=list(control_calls), timeline=timeline)


def plan_as_the_cli(state: State, pipeline: Any) -> None:
    """Plan ``pipeline`` on every host as ``pyinfra deploys/kimi.py`` does: in CLI mode an
    operation is identified by its call site (the stack's line numbers, ``host.loop``'s
    position), so a host that skips an operation (a plain ``if``) keeps the others aligned
    with the fleet's; pyinfra's API mode (``add_deploy``) would number them by position."""
    was = pyinfra.is_cli
    pyinfra.is_cli = True
    try:
        state.set_stage(StateStage.Prepare)
        with ctx_state.use(state):
            for h in state.inventory:
                with ctx_host.use(h):
                    pipeline()
    finally:
        pyinfra.is_cli = was


def _name(state: State, op_hash: str) -> str:
    names = state.get_op_meta(op_hash).names
    assert len(names) == 1, names
    (name,) = names
    return name.split(" | ", 1)[1] if " | " in name else name


# --------------------------------------------------------------------------- the tests


def test_settled_fleet_plans_zero_operations(tmp_path: Path, control_calls: list[str]) -> None:
    """The composition: every host holds its desired state, so no host gets an operation."""
    dep, plan, desired = planned(str(H200))
    facts = settled_fleet(dep, desired)
    assert all(host_actions(d, facts[name]).settled for name, d in desired.items())
    out = run_roles(dep, plan, desired, facts, tmp_path, control_calls)
    assert out.ops == {"h200-0": {}, "h200-1": {}}
    assert out.control_calls == []


def test_one_unsettled_host_plans_the_fleet_and_the_settled_one_changes_nothing(tmp_path: Path,
                                                                               control_calls: list[str]) -> None:
    dep, plan, desired = planned(str(H200))
    facts = settled_fleet(dep, desired)
    facts["h200-1"] = dataclasses.replace(facts["h200-1"], units={**facts["h200-1"].units,
                                                                  "k2-vllm.service": {"ActiveState": "failed"}})
    assert host_actions(desired["h200-1"], facts["h200-1"]).describe() == "start: k2-vllm.service"
    out = run_roles(dep, plan, desired, facts, tmp_path, control_calls)
    assert [c for c in out.commands("h200-1") if c.startswith("systemctl enable --now k2-vllm.service")]
    assert [n for n in out.changed("h200-0") if "health gate" not in n] == []  # its gate re-runs: the fleet changed
    assert not [c for c in out.commands("h200-0") if c.startswith("systemctl")]


def test_every_role_on_a_settled_fleet_changes_nothing(tmp_path: Path, control_calls: list[str]) -> None:
    """Every role planned on a settled fleet (not only the composition's early return): the
    records say nothing differs, so the only operations are the steps of the fleet's order
    that are on every host (a stage's stop and starts, the checkpoint check, the health gate),
    and none of them yields a command."""
    dep, plan, desired = planned(str(H200))
    out = run_roles(dep, plan, desired, settled_fleet(dep, desired), tmp_path, control_calls, every_role=True)
    assert set(out.ops) == {"h200-0", "h200-1"}
    fleet_steps = ["checkpoint: check every file (index, headers; hashed by the relay as it arrived)",
                   "stage 0: stop k2-vllm (its files changed or hosts rebooted)", "stage 0: start k2-vllm",
                   "stage 0: bring k2-vllm back up (its files changed or hosts rebooted)",
                   "health gate: /health 200 and a real chat completion"]
    for host, ops in out.ops.items():
        assert list(ops) == fleet_steps, list(ops)  # no file, package, unit or relay operation: nothing differs
        assert out.changed(host) == [], f"{host} would change: {out.changed(host)}"
        assert out.commands(host) == [], f"{host} would run: {out.commands(host)}"
        # the prepare-time view (what --dry shows) agrees: no operation yields a command before execution
        assert out.planned_unconditional.get(host, []) == []
    assert out.control_calls == []
    # not vacuous: the same roles on a host whose files all differ plan their operations there
    facts = settled_fleet(dep, desired)
    facts["h200-1"] = dataclasses.replace(facts["h200-1"], files={})
    out = run_roles(dep, plan, desired, facts, tmp_path, control_calls, every_role=True)
    for role_op in ("bootstrap files", "GPU gate", "nftables rules", "sysctl drop-in", "host programs",
                    "unit, env and config of k2-vllm", "reload systemd units"):
        assert out.ran("h200-1", role_op) and out.absent("h200-0", role_op), role_op


def test_harness_sees_one_stale_digest(tmp_path: Path, control_calls: list[str]) -> None:
    """Control for the settled case: one wrong mesh digest on one host is seen and acted on
    (the TRT-LLM mpirun fleet: the only kind with a mesh)."""
    dep, plan, desired = planned(str(TRTLLM_MPI))
    facts = settled_fleet(dep, desired)
    path = "/etc/k2fleet/mesh/sshd_config"
    assert path in facts["h200-1"].files
    facts["h200-1"] = dataclasses.replace(facts["h200-1"], files={**facts["h200-1"].files, path: "0" * 64})
    out = run_roles(dep, plan, desired, facts, tmp_path, control_calls)
    written = out.op("h200-1", "mesh keys")
    assert written.changed and f"<upload> {path}" in written.commands
    assert [c for c in written.commands if c.startswith("<upload>")] == [f"<upload> {path}"]
    assert out.op("h200-1", "restart the mesh sshd").commands == ["systemctl restart k2-mesh-sshd.service"]
    assert out.absent("h200-0", "restart the mesh sshd") and out.absent("h200-0", "mesh keys")
    assert out.op("h200-0", "health gate").changed  # any change in the fleet re-runs every gate


@pytest.mark.parametrize("rollout", ["all-at-once", "rolling"])
def test_changed_engine_flag_restarts_only_the_engine(tmp_path: Path, control_calls: list[str], rollout: str) -> None:
    """Both replicas restart: together under all-at-once; under rolling (the default), one
    instance per step, each step's health gate before the next (tests/test_rollout.py: the order)."""
    mode = (f"k2_rollout={rollout}",)
    dep0, _, before = planned(str(H200), mode)
    dep, plan, desired = planned(str(H200), (ENGINE_FLAG, *mode))
    facts = settled_fleet(dep0, before)  # the hosts hold the plan without the flag
    out = run_roles(dep, plan, desired, facts, tmp_path, control_calls)
    for i, host in enumerate(("h200-0", "h200-1")):
        old, new = digests(before[host]), digests(desired[host])
        differ = sorted(p for p in new if old.get(p) != new[p])
        assert differ == ["/etc/systemd/system/k2-vllm.service"]
        assert "--max-num-seqs 64" in desired[host].service_files["k2-vllm"][differ[0]].content.decode()
        if rollout == "all-at-once":
            restart = ["stage 0: stop k2-vllm (its files changed or hosts rebooted)",
                       "stage 0: bring k2-vllm back up (its files changed or hosts rebooted)"]
        else:
            tag = f"rolling {i + 1}/2 (serve-{i})"
            restart = [f"{tag}: stop k2-vllm (stage 0)", f"{tag}: start k2-vllm (stage 0)",
                       f"{tag}: health gate of serve-{i}: /health 200 and a real chat completion"]
        assert out.changed(host) == ["unit, env and config of k2-vllm", "reload systemd units", *restart,
                                     "health gate: /health 200 and a real chat completion"], out.changed(host)
        uploads = [c for c in out.op(host, "unit, env and config of k2-vllm").commands if c.startswith("<upload>")]
        assert uploads == ["<upload> /etc/systemd/system/k2-vllm.service"]
        restarts = [c for c in out.commands(host) if c.startswith(("systemctl stop", "systemctl start"))]
        assert [c.split(" || ")[0] for c in restarts] == ["systemctl stop k2-vllm.service", "systemctl start k2-vllm.service"]
        assert out.absent(host, "restart the mesh sshd")
        assert not out.op(host, "stage 0: start k2-vllm").changed  # already active: stop + start, not enable --now
    assert out.control_calls == []


def test_stale_unit_is_removed(tmp_path: Path, control_calls: list[str]) -> None:
    dep, plan, desired = planned(str(H200))
    facts = settled_fleet(dep, desired)
    stale = "/etc/systemd/system/k2-old.service"
    facts["h200-1"] = dataclasses.replace(
        facts["h200-1"], globs={UNIT_GLOB: sorted([*facts["h200-1"].globs[UNIT_GLOB], stale])})
    out = run_roles(dep, plan, desired, facts, tmp_path, control_calls)
    removal = out.op("h200-1", "stop and remove k2fleet units")
    assert removal.changed
    assert removal.commands == [f"systemctl disable --now k2-old.service; rm -f {stale}"]
    assert "k2-vllm" not in removal.commands[0] and "k2-mesh-sshd" not in removal.commands[0]
    assert out.changed("h200-1") == ["stop and remove k2fleet units the plan no longer has",
                                     "reload systemd units",
                                     "health gate: /health 200 and a real chat completion"]
    assert out.absent("h200-0", "stop and remove k2fleet units")


def test_an_interrupted_dpkg_run_is_finished_before_any_install_and_nothing_else_changes(
        tmp_path: Path, control_calls: list[str]) -> None:
    """dpkg's journal holds files (a reboot or a crash mid-install): apt refuses every install
    until ``dpkg --configure -a`` ran, so the packages role runs it first, on that host only;
    the host is not settled until then (tests/test_fault_drills_sandbox.py: the power cut)."""
    dep, plan, desired = planned(str(H200))
    facts = settled_fleet(dep, desired)
    facts["h200-1"] = dataclasses.replace(facts["h200-1"], globs={**facts["h200-1"].globs,
                                                                  DPKG_JOURNAL_GLOB: ["/var/lib/dpkg/updates/0000"]})
    actions = host_actions(desired["h200-1"], facts["h200-1"])
    assert not actions.settled and actions.describe() == "interrupted install: dpkg --configure -a"
    out = run_roles(dep, plan, desired, facts, tmp_path, control_calls)
    finish = out.op("h200-1", "finish the install a reboot or crash interrupted (dpkg --configure -a)")
    assert finish.changed and finish.commands == ["DEBIAN_FRONTEND=noninteractive dpkg --force-confold --configure -a"]
    assert out.absent("h200-0", "finish the install")
    assert not [c for c in out.commands("h200-1") if "apt-get" in c or "systemctl" in c], out.commands("h200-1")


RELAY_OPS = ["checkpoint: start this host's relay of its verified files (while the fleet receives)",
             "checkpoint: receive shard by shard, each verified before it is passed on "
             "(the fetcher host: its Hub download, feeding its relay file by file)",
             "checkpoint: check every file (index, headers; hashed by the relay as it arrived)",
             "checkpoint: stop this host's relay"]


def test_failed_gate_receives_through_the_relay_from_its_peers(tmp_path: Path, control_calls: list[str]) -> None:
    dep, plan, desired = planned(str(H200))
    root, child = desired["h200-0"], desired["h200-1"]
    assert root.fanout and root.fanout.is_root and child.fanout and child.fanout.position == 1
    facts = settled_fleet(dep, desired)
    facts["h200-1"] = dataclasses.replace(facts["h200-1"], checks={**facts["h200-1"].checks, CHECKPOINT_CHECK: 1})
    out = run_roles(dep, plan, desired, facts, tmp_path, control_calls)
    path = dep.checkpoint_path
    relays = [f"http://{root.address}:{dep.s.relay_port}", f"http://{child.address}:{dep.s.relay_port}"]

    assert out.changed("h200-1") == [*RELAY_OPS, "health gate: /health 200 and a real chat completion"]
    serve = out.op("h200-1", RELAY_OPS[0]).commands
    assert len(serve) == 1 and f"k2fleet-host.pyz relay serve {path} --bind {child.address} --port {dep.s.relay_port}" in serve[0]
    assert out.op("h200-1", RELAY_OPS[2]).commands == [shlex.join(host_argv("verify", "--repo", dep.s.model, "--revision", dep.s.revision, path))]
    # the root's gate passed: it serves its verified copy and stops afterwards, receives nothing
    assert out.changed("h200-0") == ["fetch + verify the checkpoint on the control machine (once per fleet)",
                                     RELAY_OPS[0], RELAY_OPS[3], "checkpoint: stop the control machine's relay",
                                     "health gate: /health 200 and a real chat completion"]
    assert out.control_calls == ["prepare_control_copy", "relay_to_host"]  # the one receiving host
    call = control_calls.kwargs[1]
    assert call["target"].endswith(child.address) and call["source"] is not None
    assert call["fetch_argv"] == [*host_argv("relay"), "fetch", "--fleet", ",".join(relays),
                                  "--position", "1", "--fanout", "1", "--repo", dep.s.model, "--revision",
                                  dep.s.revision, "--secret-file", relay_plan.RELAY_SECRET, "--log", relay_plan.HOST_LOG,
                                  "--source",
                                  f"http://127.0.0.1:{dep.s.relay_port}", path]


def test_settled_fleet_runs_no_relay(tmp_path: Path, control_calls: list[str]) -> None:
    """Three hosts, every gate passed: no relay starts anywhere, nothing is asked of the control
    machine (the checkpoint role itself, planned even though the fleet is settled)."""
    inv = write_inventory(tmp_path / "inv", hosts=3, k2_tp=8)
    dep, plan, desired = planned(str(inv))
    out = run_roles(dep, plan, desired, settled_fleet(dep, desired), tmp_path, control_calls, every_role=True)
    for name in desired:
        assert not any(out.ran(name, op) for op in RELAY_OPS)
        assert not out.op(name, RELAY_OPS[2]).commands  # the role was planned: its fleet-wide check, empty here
    assert [desired[n].fanout.position for n in ("node-0", "node-1", "node-2")] == [0, 1, 2]
    assert out.control_calls == []



def test_a_private_file_has_its_final_mode_before_any_byte_lands(tmp_path: Path, control_calls: list[str]) -> None:
    """The relay secret (mode 600) on a host that lacks it: the file is created root-only
    (umask 077, chmod 600) before the upload writes into it — never readable by others."""
    dep, plan, desired = planned(str(H200))
    facts = settled_fleet(dep, desired)
    secret = relay_plan.RELAY_SECRET
    facts["h200-0"] = dataclasses.replace(facts["h200-0"], files={**facts["h200-0"].files, secret: None})
    commands = run_roles(dep, plan, desired, facts, tmp_path, control_calls).op("h200-0", "host programs").commands
    prepared = next(i for i, c in enumerate(commands) if "umask 077" in c and secret in c)
    uploaded = commands.index(f"<upload> {secret}")
    assert prepared < uploaded and "chmod 600" in commands[prepared], commands
    assert [c for c in commands if c.startswith("<upload>")] == [f"<upload> {secret}"]


def test_the_control_machine_makes_the_relay_secret_once_with_its_final_mode(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from k2fleet.control import artifacts as control

    monkeypatch.setenv("K2FLEET_STATE_DIR", str(tmp_path / "state"))
    dep, _, _ = planned(str(H200))
    path = control.relay_secret_path(dep)
    first = control._make_secret(path)
    assert len(first.strip()) == 64 and (path.stat().st_mode & 0o777) == 0o600
    assert control._make_secret(path) == first  # made once


def test_the_mesh_exists_only_where_mpirun_logs_in_with_a_key_on_its_head_alone() -> None:
    """#21: vLLM's two hosts (Ray/torch rendezvous, no SSH) get no mesh at all; on the
    TRT-LLM mpirun fleet only the head holds a client key (its own), and the rank host's
    mesh sshd takes that key only from the head's address; the head's sshd lets nobody in."""
    _, _, vllm = planned(str(H200))
    for d in vllm.values():
        assert not d.files["mesh"] and "openssh-server" not in d.packages and "k2-mesh-sshd.service" not in " ".join(
            p for files in d.files.values() for p in files)
    dep, plan, desired = planned(str(TRTLLM_MPI))
    head, rank = desired["h200-0"].files["mesh"], desired["h200-1"].files["mesh"]
    key = "/etc/k2fleet/mesh/id_ed25519"
    assert head[key].mode == "600" and key not in rank and f"{key}.pub" not in rank
    authorized = rank["/etc/k2fleet/mesh/authorized_keys"].content.decode().splitlines()
    assert len(authorized) == 1 and authorized[0].startswith('from="192.0.2.70",no-agent-forwarding')
    assert head["/etc/k2fleet/mesh/authorized_keys"].content == b""
    assert f"AllowUsers {dep.s.mesh_user}@192.0.2.70\n" in rank["/etc/k2fleet/mesh/sshd_config"].content.decode()
    assert "DenyUsers *\n" in head["/etc/k2fleet/mesh/sshd_config"].content.decode()
    mpirun = next(s.argv for h in plan.hosts.values() for s in h.services if "mpirun" in s.argv)
    assert mpirun[mpirun.index("plm_rsh_no_tree_spawn") + 1] == "1"  # ranks never log into each other
    assert mesh_config.mesh_links(plan) == {"h200-0": ("h200-1",)}


def test_mesh_after_deploy_stop_leaves_no_listener_and_a_settled_fleet_untouched(tmp_path: Path,
                                                                                   control_calls: list[str]) -> None:
    """``k2_mesh_after_deploy: stop``: a deploy that runs the roles starts the mesh for its
    duration and stops it after the health gates; with the mesh stopped the fleet is still
    settled (zero operations), and the stopped unit is kept, not removed as stale."""
    dep, plan, desired = planned(str(TRTLLM_MPI), ("k2_mesh_after_deploy=stop",))
    assert not desired["h200-1"].mesh_between_deploys and "k2-mesh-sshd.service" not in desired["h200-1"].units
    assert "k2-mesh-sshd.service" in desired["h200-1"].kept_units()
    facts = settled_fleet(dep, desired)
    out = run_roles(dep, plan, desired, facts, tmp_path, control_calls)
    assert all(not out.changed(h) for h in desired), {h: out.changed(h) for h in desired}
    stale = dataclasses.replace(facts["h200-1"], files={**facts["h200-1"].files, "/etc/k2fleet/mesh/sshd_config": "0" * 64})
    out = run_roles(dep, plan, desired, {**facts, "h200-1": stale}, tmp_path, control_calls)
    assert out.op("h200-1", "stop the mesh sshd until the next deploy").commands == ["systemctl stop k2-mesh-sshd.service"]
    assert "stop and remove k2fleet units the plan no longer has" not in out.changed("h200-1")


def test_a_mesh_key_the_host_no_longer_holds_is_removed(tmp_path: Path, control_calls: list[str]) -> None:
    """A rank host still holding the fleet's old shared client key (as every host did before
    the mesh became mpirun's head's alone), or a vLLM host holding any mesh key, is not
    settled, and the mesh role removes exactly those keys."""
    dep, plan, desired = planned(str(TRTLLM_MPI))
    assert "/etc/k2fleet/mesh/id_ed25519" in desired["h200-1"].absent
    assert "/etc/k2fleet/mesh/id_ed25519" not in desired["h200-0"].absent
    facts = settled_fleet(dep, desired)
    stale = dataclasses.replace(facts["h200-1"], exists={**facts["h200-1"].exists, "/etc/k2fleet/mesh/id_ed25519": True})
    assert host_actions(desired["h200-1"], stale).remove == ("/etc/k2fleet/mesh/id_ed25519",)
    out = run_roles(dep, plan, desired, {**facts, "h200-1": stale}, tmp_path, control_calls)
    assert out.op("h200-1", "remove the SSH keys of the mesh this host no longer holds").commands == ["rm -f -- /etc/k2fleet/mesh/id_ed25519"]
    assert out.absent("h200-0", "remove the SSH keys of the mesh this host no longer holds")
    _, _, vllm = planned(str(H200))
    assert "/etc/k2fleet/mesh/ssh_host_ed25519_key" in vllm["h200-1"].absent


def test_a_bring_up_checks_the_peers_rendezvous_ports_before_the_engines_start(tmp_path: Path,
                                                                                 control_calls: list[str]) -> None:
    """DP+EP over two hosts, engines not running: the head holds its DP RPC port on its fleet
    address, the other host opens it, then the listener stops — every listener before any
    probe, every probe before an engine starts. A settled fleet plans none of it."""
    dep, plan, desired = planned(str(DP_EP))
    head, worker = desired["h200-0"], desired["h200-1"]
    facts = settled_fleet(dep, desired)
    assert run_roles(dep, plan, desired, facts, tmp_path, control_calls).ops == {"h200-0": {}, "h200-1": {}}
    for name in facts:
        facts[name] = dataclasses.replace(facts[name], units={**facts[name].units,
                                                              "k2-vllm.service": {"ActiveState": "inactive"}})
    out = run_roles(dep, plan, desired, facts, tmp_path, control_calls)
    hold = out.op("h200-0", "reachability: hold this host's rendezvous ports")
    assert hold.changed and any("systemd-run --unit=k2-reach" in c and f"--bind {head.address} --ports 13345" in c
                                for c in hold.commands), hold.commands
    probe = out.op("h200-1", "reachability: open every peer's rendezvous ports")
    assert probe.changed and any(f"reach probe --host h200-1 --targets {head.address}:13345" in c
                                 for c in probe.commands), probe.commands
    assert out.absent("h200-1", "reachability: hold this host's rendezvous ports")  # nothing to hold
    assert not out.op("h200-0", "reachability: open every peer's rendezvous ports").commands  # no peer port
    order = [op for _, op in out.timeline]
    last_hold = max(i for i, op in enumerate(order) if op.startswith("reachability: hold"))
    first_probe = min(i for i, op in enumerate(order) if op.startswith("reachability: open"))
    first_start = min(i for i, op in enumerate(order) if "k2-vllm" in op and ("bring" in op or "start" in op))
    assert last_hold < first_probe < first_start, order


def test_fetcher_download_and_the_receivers_fetches_are_one_operation(
        tmp_path: Path, control_calls: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``k2_checkpoint_fetcher: h200-1``, nothing verified anywhere: the fetcher's Hub download
    (``--publish``: it feeds its relay file by file) is the same operation as the other
    host's relay fetch — pyinfra runs one operation on every host at once, so receivers
    take each file while the download runs — and every relay starts before it."""
    dep, plan, desired = planned(str(H200), ("k2_checkpoint_fetcher=h200-1",))
    assert desired["h200-1"].fanout.is_root and desired["h200-0"].fanout.position == 1
    facts = settled_fleet(dep, desired)
    for name in facts:
        facts[name] = dataclasses.replace(facts[name], checks={**facts[name].checks, CHECKPOINT_CHECK: 1})
    ran: list[list[str]] = []

    def fake_run(argv: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        ran.append(argv)
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(checkpoint.subprocess, "run", fake_run)
    out = run_roles(dep, plan, desired, facts, tmp_path, control_calls)
    assert out.op("h200-1", RELAY_OPS[1]).changed and out.op("h200-0", RELAY_OPS[1]).changed
    assert not any("from the Hub on this host" in name for host in out.ops for name in out.ops[host])  # no op of its own
    assert out.control_calls == ["send_token", "relay_to_host"]  # h200-0 receives; h200-1 downloads
    (download,) = ran
    assert download[-2].endswith(desired["h200-1"].address) or "h200-1" in download[-2]
    assert "download moonshotai/Kimi-K2-Thinking" in download[-1] and "--publish" in download[-1]
    assert "--max-workers 2" in download[-1] and f"rm -f {checkpoint.TOKEN_PATH}" in download[-1]
    relay_fetch = control_calls.kwargs[1]
    assert relay_fetch["source"] is None and relay_fetch["fetch_argv"][-1] == dep.checkpoint_path
    for host in ("h200-0", "h200-1"):  # its relay serves before the transfer starts
        names = list(out.ops[host])
        assert names.index(RELAY_OPS[0]) < names.index(RELAY_OPS[1])
