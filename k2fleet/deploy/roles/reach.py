"""Reach role: before the engines start, every serving host opens its peers' rendezvous
ports (:mod:`k2fleet.planning.reach_plan`): each host holds its own ports with a transient
listener, the others connect, and a port they cannot open fails that host's deploy with one
line naming it and the fix — before a model is loaded, not after.

Runs only when serving units are about to start somewhere in the fleet (``starting``); the
probe is on every host (pyinfra runs each operation across the fleet before the next: every
listener is up before any probe), with commands only where the plan has peers' ports.
"""

from __future__ import annotations

from typing import Any

from pyinfra.api import deploy

from k2fleet.deploy.operations import command, fleet_barrier
from k2fleet.planning.reach_plan import ReachCheck


@deploy("k2fleet: fleet reachability")
def check(reach: ReachCheck | None, starting: bool, probes: dict[str, Any], host_name: str) -> None:
    """
    Hold this host's rendezvous ports, open every peer's, stop holding them, and go on only
    if every host's probe passed (a fleet barrier: the hosts whose ports were reached would
    otherwise start engines that wait for the one that cannot reach them).

    The probe is a step of the fleet's order, on every host (commands only where there are
    peers' ports to open), so every host's listener is up before any probe runs.

    + reach: this host's part (``desired.reach``: None when it has nothing to check)
    + starting: serving units start somewhere in the fleet in this run (planning time)
    + probes: the run's host → probe operation (``FleetRun.reach_probes``), filled here
    + host_name: this host's name in the inventory (its key in ``probes``)

    **Example:**

    .. code:: python

        reach.check(run.desired[host.name].reach, starting=run.starting(inventory), probes=run.reach_probes,
                    host_name=host.name)
    """
    if not starting:
        return
    r = reach
    if r is not None and r.listen and r.start:
        command(name="reachability: hold this host's rendezvous ports on its fleet address", argv=r.start)
    probe = r.probe if r is not None else None
    probes[host_name] = command(name="reachability: open every peer's rendezvous ports", argv=probe or ["true"],
                                run=bool(probe))
    if r is not None and r.listen:
        command(name="reachability: stop holding the ports", argv=r.stop)

    def unreached() -> list[str]:  # a probe that failed, or never ran because its host failed before it
        return [name for name, op in probes.items() if not (op.is_complete() and op.did_succeed())]

    if r is not None:
        fleet_barrier(name="reachability: every host reached its peers", failed=unreached,
                      what="the reachability check")
