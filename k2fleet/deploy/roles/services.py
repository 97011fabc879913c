"""Services role: the plan's processes as systemd units, started stage by stage across
the fleet, restarted only when their unit, environment or config files changed.

Every host runs the same operation sequence (one slot per fleet-wide (stage, service)
pair; a host without that service gets no commands), so pyinfra's per-operation
ordering across hosts is the plan's start order.

Under ``k2_rollout: rolling`` the running instances whose units restart do so one instance
at a time (:mod:`k2fleet.planning.rollout`): per step, the same operations on every host,
each restricted to the step's hosts with ``_if`` — drain at the load balancer (on its host),
stop, start, the instance's health gate, back at the load balancer — so pyinfra's
operation-by-operation order across hosts is the steps' order. The load balancer itself
reloads when only its config changed (new backends: the streams in flight go on).
"""

from __future__ import annotations


from pyinfra.api import deploy

from k2fleet.planning.desired import UNIT_GLOB, HostDesired
from k2fleet.planning.firewall import UNIT as FIREWALL_UNIT
from k2fleet.deploy.operations import command, rolling_step, start_or_explain, synced_files, unit_running
from k2fleet.planning.host_fact import HostReport
from k2fleet.planning.quoting import shell_line
from k2fleet.planning.host_actions import rolled
from k2fleet.planning.rollout import Step


@deploy("k2fleet: services")
def start(desired: HostDesired, fact: HostReport, tracked: list, restart_all: bool = False,
          steps: list[Step] | None = None) -> None:
    """
    Remove stale k2fleet units, write each unit's files, start stage by stage; units
    whose own files changed are stopped in reverse stage order and started again in
    stage order (head before members), the others are left running; the restarts of a
    rolling change go instance by instance (``steps``).

    + desired: this host's desired state (``service_files``, ``units``, fleet-wide ``slots``,
      this host's ``own_slots``)
    + fact: this host's HostState (digests, unit states, the k2-*.service glob)
    + tracked: list the run's health gate watches; file and start operations are appended
    + restart_all: restart every running unit in stage order as if its files changed (the
      bootstrap rebooted hosts of the fleet: units that came back at boot started unordered)
    + steps: the run's restart steps, the same on every host
      (:func:`k2fleet.planning.host_actions.restart_steps` over every host's fact); the units of its
      rolling steps restart there, instance by instance, the others as above. None: every
      restart at once

    **Example:**

    .. code:: python

        services.start(run.desired[host.name], fact, run.tracked)
    """
    planned = desired.kept_units() | {FIREWALL_UNIT}  # the firewall role removes its own unit
    stale = sorted(p for p in fact.globs.get(UNIT_GLOB, []) if p.rsplit("/", 1)[1] not in planned)
    stale_units = [p.rsplit("/", 1)[1] for p in stale]
    remove = f"systemctl disable --now {shell_line(stale_units)}; rm -f {shell_line(stale)}" if stale else "true"
    removed = command(name="stop and remove k2fleet units the plan no longer has", argv=remove,
                      _if=lambda: bool(stale))
    tracked.append(removed)
    tracked.append(synced_files(name="config files of ranks this host serves",
                                files=desired.files.get("host", {}), current=fact.files))
    keyed = synced_files(name="the endpoints' API key (root-only files its units read)",
                         files=desired.files.get("api_key", {}), current=fact.files)
    tracked.append(keyed)
    written = {}
    for name in dict.fromkeys(name for _, name in desired.slots):
        written[name] = synced_files(name=f"unit, env and config of {name}",
                                     files=desired.service_files.get(name, {}), current=fact.files)
        tracked.append(written[name])
    command(name="reload systemd units", argv=["systemctl", "daemon-reload"],
            _if=lambda: removed.did_change() or any(op.did_change() for op in written.values()))
    steps = steps or []
    rolling = rolled(steps)
    reloads = desired.rollout.reloads
    reload_files = {name: {p: desired.service_files.get(name, {})[p] for p in paths
                           if p in desired.service_files.get(name, {})} for name, paths in reloads.items()}

    def differs(files: dict) -> bool:
        return any(spec.content is None or fact.files.get(path) != spec.sha256 for path, spec in files.items())

    def changed(stage: int, name: str):
        """Execute-time test: this host's (stage, name) was running and its files changed
        (or hosts rebooted), and no rolling step restarts it; a service that reloads (the
        load balancer) restarts only when a file other than its config changed."""
        was = fact.unit_active(f"{name}.service") and (stage, name) in desired.own_slots
        if (desired.name, stage, name) in rolling:
            return lambda: False
        if name in reloads:
            others = {p: f for p, f in desired.service_files.get(name, {}).items() if p not in reload_files[name]}
            return lambda: was and (restart_all or differs(others))
        reads_key = name in desired.api_key_services
        return lambda op=written[name]: was and (restart_all or op.did_change() or (reads_key and keyed.did_change()))

    # An instance whose files changed restarts as it starts: stop in reverse stage order
    # (members/launchers before the head or the nodes they joined), start stage by stage.
    for stage, name in reversed(desired.slots):
        command(name=f"stage {stage}: stop {name} (its files changed or hosts rebooted)", argv=["systemctl", "stop", f"{name}.service"],
                _if=changed(stage, name))
    for stage, name in desired.slots:
        mine = (stage, name) in desired.own_slots  # a name can start at one stage on the head, a later one on members
        unit = f"{name}.service"
        tracked.append(unit_running(name=f"stage {stage}: start {name}", unit=unit,
                                    active=(fact.unit_active(unit) and fact.unit_enabled(unit)) or not mine))
        tracked.append(command(name=f"stage {stage}: bring {name} back up (its files changed or hosts rebooted)",
                               argv=start_or_explain(unit), _if=changed(stage, name)))
    for name in reloads:  # the load balancer's new config: a reload (its streams in flight finish on the old workers)
        unit = f"{name}.service"
        was = fact.unit_active(unit) and name in {n for _, n in desired.own_slots}
        restart = any(changed(stage, n)() for stage, n in desired.own_slots if n == name)
        tracked.append(command(name=f"reload {name} (its config changed)", argv=["systemctl", "reload", unit],
                               _if=lambda was=was, restart=restart, files=reload_files.get(name, {}):
                               was and not restart and differs(files)))
    mine = [s for s in steps if s.instance is not None]
    for k, step in enumerate(mine, 1):
        rolling_step(desired, step, f"rolling {k}/{len(mine)} ({step.instance})", tracked)

