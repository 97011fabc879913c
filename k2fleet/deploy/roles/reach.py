"""Reach role: before the engines start, every serving host opens its peers' rendezvous
ports (:mod:`k2fleet.planning.reach_plan`): each host holds its own ports with a transient
listener, the others connect, and a port they cannot open fails that host's deploy with one
line naming it and the fix — before a model is loaded, not after.

Runs only when serving units are about to start somewhere in the fleet (``starting``); the
operations are the same on every host (pyinfra runs each across the fleet before the next:
every listener is up before any probe), gated per host.
"""

from __future__ import annotations

from pyinfra.api import deploy

from k2fleet.deploy.operations import command
from k2fleet.planning.desired import HostDesired


@deploy("k2fleet: fleet reachability")
def check(desired: HostDesired, starting: bool) -> None:
    """
    Hold this host's rendezvous ports, open every peer's, then stop holding them.

    + desired: this host's desired state (``reach``: None when it has nothing to check)
    + starting: serving units start somewhere in the fleet in this run (planning time)

    **Example:**

    .. code:: python

        reach.check(run.desired[host.name], starting=run.starting(inventory))
    """
    r = desired.reach
    listen = bool(starting and r is not None and r.listen)
    probe = bool(starting and r is not None and r.probe)
    command(name="reachability: hold this host's rendezvous ports on its fleet address",
            argv=r.listen if listen and r is not None and r.listen else ["true"], _if=lambda: listen)
    command(name="reachability: open every peer's rendezvous ports",
            argv=r.probe if probe and r is not None and r.probe else ["true"], _if=lambda: probe)
    command(name="reachability: stop holding the ports", argv=r.stop if listen and r is not None else ["true"],
            _if=lambda: listen)
