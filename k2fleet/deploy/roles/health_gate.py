"""Health gate role: every serving endpoint must answer ``/health`` 200 AND a real chat
completion with a non-empty answer within ``k2_health_timeout``; otherwise the deploy
fails naming the host, the unit and its last log lines.

The gate runs after any change anywhere in the fleet, and whenever the quick check in
the HostState fact (the same program, short timeout) did not pass.
"""

from __future__ import annotations

from collections.abc import Callable

from pyinfra.api import deploy

from k2fleet.planning.desired import HEALTH_CHECK, HostDesired
from k2fleet.deploy.operations import command
from k2fleet.planning.host_fact import HostReport


@deploy("k2fleet: health gate")
def gate(desired: HostDesired, fact: HostReport, changed: Callable[[], bool]) -> None:
    """
    Prove this host's endpoint serves (a real completion), when anything changed.

    + desired: this host's desired state (``health_argv``: None on hosts without an endpoint)
    + fact: this host's HostState (whether the quick health check passed)
    + changed: called at execution time: did any tracked operation on any host change?

    **Example:**

    .. code:: python

        health.gate(run.desired[host.name], fact, changed=run.fleet_changed)
    """
    argv = desired.health_argv
    healthy_before = fact.passed(HEALTH_CHECK)
    command(name="health gate: /health 200 and a real chat completion",
            argv=argv or ["true"], _if=lambda: argv is not None and (changed() or not healthy_before))
