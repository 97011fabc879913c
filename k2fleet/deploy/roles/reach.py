"""Reach role: before the engines start, every serving host opens its peers' rendezvous
ports (:mod:`k2fleet.planning.reach_plan`): each host holds its own ports with a transient
listener, the others connect, and a port they cannot open fails that host's deploy with one
line naming it and the fix — before a model is loaded, not after.

Runs only when serving units are about to start somewhere in the fleet (``starting``); the
operations are the same on every host (pyinfra runs each across the fleet before the next:
every listener is up before any probe), gated per host.
"""

from __future__ import annotations

from typing import Any

from pyinfra.api import deploy

from k2fleet.deploy.operations import command, fleet_barrier
from k2fleet.planning.desired import HostDesired


@deploy("k2fleet: fleet reachability")
def check(desired: HostDesired, starting: bool, probes: dict[str, Any]) -> None:
    """
    Hold this host's rendezvous ports, open every peer's, stop holding them, and go on only
    if every host's probe passed (a fleet barrier: the hosts whose ports were reached would
    otherwise start engines that wait for the one that cannot reach them).

    + desired: this host's desired state (``reach``: None when it has nothing to check)
    + starting: serving units start somewhere in the fleet in this run (planning time)
    + probes: the run's host → probe operation (``FleetRun.reach_probes``), filled here

    **Example:**

    .. code:: python

        reach.check(run.desired[host.name], starting=run.starting(inventory), probes=run.reach_probes)
    """
    r = desired.reach
    listen = bool(starting and r is not None and r.listen)
    probe = bool(starting and r is not None and r.probe)
    command(name="reachability: hold this host's rendezvous ports on its fleet address",
            argv=r.start if listen and r is not None and r.start else ["true"], _if=lambda: listen)
    probes[desired.name] = command(name="reachability: open every peer's rendezvous ports",
                                   argv=r.probe if probe and r is not None and r.probe else ["true"], _if=lambda: probe)
    command(name="reachability: stop holding the ports", argv=r.stop if listen and r is not None else ["true"],
            _if=lambda: listen)

    def unreached() -> list[str]:  # a probe that failed, or never ran because its host failed before it
        return [name for name, op in probes.items() if not (op.is_complete() and op.did_succeed())]

    fleet_barrier(name="reachability: every host reached its peers", failed=unreached,
                  what="the reachability check", _if=lambda: starting and r is not None)
