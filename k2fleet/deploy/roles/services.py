"""Services role: the plan's processes as systemd units, started stage by stage across
the fleet, restarted only when their unit, environment or config files changed.

Every host runs the same stop/start/reload sequence (one slot per fleet-wide (stage, service)
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


from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import systemd

from k2fleet.planning.desired import HostDesired
from k2fleet.deploy.operations import command, rolling_step, start_or_explain, synced_files, unit_running
from k2fleet.planning.quoting import shell_line
from k2fleet.planning.host_actions import rolled
from k2fleet.planning.role_actions import ServicesActions
from k2fleet.planning.rollout import Step


@deploy("k2fleet: services")
def start(actions: ServicesActions, desired: HostDesired, tracked: list, steps: list[Step] | None = None) -> None:
    """
    Remove stale k2fleet units, write each unit's files, start stage by stage; units
    whose own files changed are stopped in reverse stage order and started again in
    stage order (head before members), the others are left running; the restarts of a
    rolling change go instance by instance (``steps``).

    What only this host needs (stale units, files, systemd's reload) is planned only where
    the record says so; the stops, starts and reloads are steps of the fleet's order, on every
    host, with commands only where the record has them (``run=``).

    + actions: this host's services record (``role_actions(...).services``: stale unit files,
      files to write, own slots to start, running slots that restart — every running one when
      hosts rebooted — and reloading services whose config changed)
    + desired: this host's plan (its name, fleet-wide ``slots``, its rollout: load balancer, reloads)
    + tracked: list the run's health gate watches; file and start operations are appended
    + steps: the run's restart steps, the same on every host
      (:func:`k2fleet.planning.host_actions.restart_steps` over every host's fact); the units of its
      rolling steps restart there, instance by instance, the others as above. None: every
      restart at once

    **Example:**

    .. code:: python

        services.start(role_actions(run.dep, mine, fact).services, mine, run.tracked)
    """
    a = actions
    if a.stale:
        tracked.append(command(name="stop and remove k2fleet units the plan no longer has",
                               argv=f"systemctl disable --now {shell_line(list(a.stale_units))}; "
                                    f"rm -f {shell_line(list(a.stale))}"))
    if a.host_files:
        tracked.append(synced_files(name="config files of ranks this host serves", files=a.host_files))
    if a.key_files:
        tracked.append(synced_files(name="the endpoints' API key (root-only files its units read)", files=a.key_files))
    for name in host.loop(list(dict.fromkeys(name for _, name in desired.slots))):  # one call site per fleet name
        if a.unit_files.get(name):
            tracked.append(synced_files(name=f"unit, env and config of {name}", files=a.unit_files[name]))
    if a.stale or any(a.unit_files.values()):
        systemd.daemon_reload(name="reload systemd units")
    steps = steps or []
    rolling = rolled(steps)
    restart = {s for s in a.changed if (desired.name, *s) not in rolling}

    # An instance whose files changed restarts as it starts: stop in reverse stage order
    # (members/launchers before the head or the nodes they joined), start stage by stage.
    for stage, name in reversed(desired.slots):
        command(name=f"stage {stage}: stop {name} (its files changed or hosts rebooted)",
                argv=["systemctl", "stop", f"{name}.service"], run=(stage, name) in restart)
    for stage, name in desired.slots:
        unit = f"{name}.service"
        tracked.append(unit_running(name=f"stage {stage}: start {name}", unit=unit, active=(stage, name) not in a.start))
        tracked.append(command(name=f"stage {stage}: bring {name} back up (its files changed or hosts rebooted)",
                               argv=start_or_explain(unit), run=(stage, name) in restart))
    restarted = {name for _, name in restart}
    for name in desired.rollout.reloads:  # the load balancer's new config: a reload (its streams in flight finish on the old workers)
        tracked.append(command(name=f"reload {name} (its config changed)", argv=["systemctl", "reload", f"{name}.service"],
                               run=name in a.reload and name not in restarted))
    mine = [s for s in steps if s.instance is not None]
    for k, step in enumerate(mine, 1):
        rolling_step(desired, step, f"rolling {k}/{len(mine)} ({step.instance})", tracked)
