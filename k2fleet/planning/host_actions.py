"""What one host needs this run, decided from (its desired state, its fact) alone (pure).

:func:`host_actions` lists every difference between what the host must hold
(:class:`~k2fleet.planning.desired.HostDesired`) and what the one HostState fact saw
(:class:`~k2fleet.planning.host_fact.HostReport`): files to write, packages to install,
the bootstrap's pending and obsolete packages (and missing kernel headers) and its reboot, stale units to remove,
units to start or enable, packages to hold, checks that fail (GPU gate, checkpoint, image pin, Hub client, engine-side
wheels, health), paths that must exist and an install dpkg did not finish. A host with none is *settled*.

Over the whole fleet's facts, :func:`restart_steps` and :func:`reboot_steps` decide which
running instances restart (or reboot) in this run and in what order: instance by instance
under ``k2_rollout: rolling`` (:mod:`k2fleet.planning.rollout`).

The roles carry out the differences, each from its own record of them
(:func:`k2fleet.planning.role_actions.role_actions`, decided by the same functions); when every host of the fleet is settled the deploy
plans no operation at all (``deploys/kimi.py``), so a no-op re-run costs the fact and
nothing else. The decision is conservative: anything the fact cannot prove (a control
artifact not made yet, a unit not active, a check that did not pass) is a difference.

>>> from k2fleet.planning.desired import FileSpec, HostDesired
>>> from k2fleet.planning.host_fact import Gpus, HostReport
>>> d = HostDesired("h", "10.0.0.1", files={"engine": {"/x": FileSpec(b"x", "644")}}, units=["k2-vllm.service"],
...                 checks={"healthy": ["true"]})
>>> seen = HostReport(Gpus(None, (), (), None), 0, 0, 0, {}, (), files={"/x": FileSpec(b"x", "644").sha256},
...                   units={"k2-vllm.service": {"ActiveState": "active"}}, checks={"healthy": 0})
>>> host_actions(d, seen).settled
True
>>> host_actions(d, HostReport(Gpus(None, (), (), None), 0, 0, 0, {}, ())).describe()
'files: /x; start: k2-vllm.service; failing checks: healthy'
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k2fleet.planning import host_bootstrap as bootstrap
from k2fleet.planning.desired import DPKG_JOURNAL_GLOB, UNIT_GLOB, HostDesired
from k2fleet.planning.host_fact import HostReport
from k2fleet.planning.mesh_config import UNIT as MESH_UNIT
from k2fleet.planning.rollout import Instance, Step


@dataclass(frozen=True)
class HostActions:
    """The differences one host has from its desired state (empty everywhere: settled)."""

    files: tuple[str, ...] = ()  # paths whose content differs, is missing, or is not made yet
    packages: tuple[str, ...] = ()  # host packages not installed
    bootstrap_packages: tuple[str, ...] = ()  # driver/fabric/runtime packages pending or obsolete, kernel headers missing
    reboot: str | None = None  # why the bootstrap reboots the host
    stale_units: tuple[str, ...] = ()  # k2fleet units the plan no longer has
    start: tuple[str, ...] = ()  # planned units not active
    enable: tuple[str, ...] = ()  # planned units active but disabled (or masked): they would not start at boot
    holds: tuple[str, ...] = ()  # packages the bootstrap holds that are not held (or that this run changes)
    failing_checks: tuple[str, ...] = ()  # the fact's checks that did not pass
    missing: tuple[str, ...] = ()  # paths that must exist and do not
    remove: tuple[str, ...] = ()  # paths that must not exist and do (e.g. a mesh key this host no longer holds)
    finish_dpkg: bool = False  # dpkg's journal holds an install a reboot or crash interrupted
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def settled(self) -> bool:
        return not (self.files or self.packages or self.bootstrap_packages or self.reboot or self.stale_units
                    or self.start or self.enable or self.holds or self.failing_checks or self.missing or self.remove
                    or self.finish_dpkg)

    def describe(self) -> str:
        """One line: what differs (empty when settled)."""
        parts = [("files", self.files), ("packages", self.packages), ("bootstrap packages", self.bootstrap_packages),
                 ("reboot", (self.reboot,) if self.reboot else ()), ("stale units", self.stale_units),
                 ("start", self.start), ("enable", self.enable), ("hold", self.holds), ("failing checks", self.failing_checks), ("missing", self.missing),
                 ("remove", self.remove), ("interrupted install", ("dpkg --configure -a",) if self.finish_dpkg else ())]
        return "; ".join(f"{what}: {', '.join(items)}" for what, items in parts if items)


def host_actions(desired: HostDesired, fact: HostReport) -> HostActions:
    """Every difference between ``desired`` and what ``fact`` saw (see the module doc)."""
    files = tuple(sorted(path for group in (*desired.files.values(), *desired.service_files.values())
                         for path, spec in group.items()
                         if spec.content is None or fact.files.get(path) != spec.sha256))
    planned = desired.kept_units()
    # the mesh sshd is stopped while a unit that takes its port runs (the TRT-LLM node container)
    yielded = {MESH_UNIT} if any(fact.unit_active(u) for u in desired.mesh_yields_to) else set()
    stale = tuple(sorted(p.rsplit("/", 1)[1] for p in fact.globs.get(UNIT_GLOB, [])
                         if p.rsplit("/", 1)[1] not in planned))
    boot = desired.bootstrap
    bootstrap_packages: tuple[str, ...] = ()
    holds: tuple[str, ...] = ()
    reboot = None
    if boot is not None:
        bootstrap_packages = tuple(sorted({p.name for p in bootstrap.pending_packages(boot, fact.boot)}
                                          | set(bootstrap.obsolete_packages(boot, fact.boot))
                                          | set(bootstrap.missing_headers(boot, fact.boot))))
        holds = tuple(bootstrap.missing_holds(boot, fact.boot))
        reboot = bootstrap.reboot_reason(boot, fact.boot)
    start = tuple(u for u in desired.units if not fact.unit_active(u) and u not in yielded)
    return HostActions(
        files=files,
        packages=tuple(p for p in desired.packages if p not in fact.packages),
        bootstrap_packages=bootstrap_packages,
        reboot=reboot,
        stale_units=stale,
        start=start,
        enable=tuple(u for u in desired.units if u not in start and u not in yielded and not fact.unit_enabled(u)),
        holds=holds,
        failing_checks=tuple(sorted(name for name in desired.checks if not fact.passed(name))),
        missing=tuple(p for p in desired.exists if not fact.exists.get(p)),
        remove=tuple(p for p in desired.absent if fact.exists.get(p)),
        finish_dpkg=bool(fact.globs.get(DPKG_JOURNAL_GLOB)),
    )


# --------------------------------------------------------------------------- rolling changes


def _differs(files: dict, fact: HostReport) -> bool:
    return any(spec.content is None or fact.files.get(path) != spec.sha256 for path, spec in files.items())


def restarting(d: HostDesired, fact: HostReport, restart_all: bool = False) -> tuple[tuple[int, str], ...]:
    """This host's running (stage, service) slots whose files changed (its unit, environment
    or config files; the API key for the services that read it), every running one under
    ``restart_all``; never a service that only reloads (the load balancer's config)."""
    key_changed = _differs(d.files.get("api_key", {}), fact)
    out = []
    for stage, name in d.own_slots:
        if not fact.unit_active(f"{name}.service"):
            continue
        files = d.service_files.get(name, {})
        reload_only = set(d.rollout.reloads.get(name, ()))
        own = _differs({p: s for p, s in files.items() if p not in reload_only}, fact)
        if restart_all or own or (name in d.api_key_services and key_changed):
            out.append((stage, name))
    return tuple(out)


def _server(d: HostDesired, facts: dict[str, HostReport], instance: Instance) -> str | None:
    """The instance's server at the load balancer, when one runs there (the fact saw its unit
    active: a load balancer this run starts has no traffic to keep)."""
    lb = d.rollout.balancer
    if lb is None or instance.server is None or lb.host not in facts or not facts[lb.host].unit_active(lb.unit):
        return None
    return instance.server


def restart_steps(desired: dict[str, HostDesired], facts: dict[str, HostReport],
                  restart_all: bool = False) -> list[Step]:
    """The restarts of this run as steps (see the module doc): under ``rolling``, one per
    instance with a restarting unit, in instance order; under ``all-at-once``, one step with
    every restarting unit of the fleet (today's behaviour), or none."""
    some = next(iter(desired.values()), None)
    if some is None:
        return []
    units = {h: r for h, d in desired.items() if (r := restarting(d, facts[h], restart_all))}
    if not units:
        return []
    if some.rollout.mode != "rolling":
        return [Step(None, units)]
    steps = []
    for instance in some.rollout.instances:
        mine = {h: units[h] for h in instance.hosts if h in units}
        if mine:
            gate = tuple(h for h in instance.hosts if desired[h].health_argv is not None)
            steps.append(Step(instance.name, mine, _server(some, facts, instance), gate))
    return steps


def rolled(steps: list[Step]) -> set[tuple[str, int, str]]:
    """(host, stage, service) of every unit a rolling step restarts (the others restart at once)."""
    return {(h, *slot) for s in steps if s.instance is not None for h, slots in s.units.items() for slot in slots}


def reboot_steps(desired: dict[str, HostDesired], facts: dict[str, HostReport], reboots: dict[str, str]) -> list[Step]:
    """``k2_reboot: rolling`` under ``k2_rollout: rolling``: the hosts to reboot, instance by
    instance (all hosts of one instance at once), each instance that was serving drained
    before and health-gated after (its running units restarted in stage order first when it
    spans several hosts: they came back at boot in no order); hosts outside any instance one
    by one after them; the load balancer's own host's instance last. Empty otherwise (the
    bootstrap reboots as before: all at once, or host by host under ``rolling``)."""
    some = next(iter(desired.values()), None)
    if some is None or not reboots or some.rollout.mode != "rolling" or some.bootstrap is None \
            or some.bootstrap.reboot != "rolling":
        return []
    lb = some.rollout.balancer
    order = sorted(some.rollout.instances, key=lambda i: bool(lb and lb.host in i.hosts))
    steps = []
    covered: set[str] = set()
    for instance in order:
        covered |= set(instance.hosts)
        hosts = tuple(h for h in instance.hosts if h in reboots)
        if not hosts:
            continue
        running = {h: tuple(s for s in desired[h].own_slots if facts[h].unit_active(f"{s[1]}.service")
                            and s[1] not in some.rollout.reloads) for h in instance.hosts}
        running = {h: r for h, r in running.items() if r}
        serving = bool(running)
        restart = running if serving and len(instance.hosts) > 1 else {}
        gate = tuple(h for h in instance.hosts if desired[h].health_argv is not None) if serving else ()
        steps.append(Step(instance.name, restart, _server(some, facts, instance) if serving else None, gate, hosts))
    for host in desired:
        if host in reboots and host not in covered:
            steps.append(Step(host, {}, None, (), (host,)))
    return steps
