"""Health gate role: every serving endpoint must answer ``/health`` 200 AND a real chat
completion with a non-empty answer within ``k2_health_timeout``; otherwise the deploy
fails naming the host, the unit and its last log lines.

The gate runs after any change anywhere in the fleet, and whenever the quick check in
the HostState fact (the same program, short timeout) did not pass.
"""

from __future__ import annotations

from collections.abc import Callable

from pyinfra.api import deploy

from k2fleet.deploy.operations import command
from k2fleet.planning.role_actions import HealthActions


@deploy("k2fleet: health gate")
def gate(actions: HealthActions, changed: Callable[[], bool]) -> None:
    """
    Prove this host's endpoint serves (a real completion), when anything changed.

    The operation is on every host, after every other (a fleet-wide step: ``changed`` looks at
    every host's operations), with commands only where there is an endpoint; when the fact's
    quick check passed, ``_if=`` asks at execution time whether any host changed anything.

    + actions: this host's record (``role_actions(...).health``: the gate's argv, None on hosts
      without an endpoint; whether the quick health check passed)
    + changed: called at execution time: did any tracked operation on any host change?

    **Example:**

    .. code:: python

        health_gate.gate(role_actions(run.dep, mine, fact).health, changed=run.fleet_changed)
    """
    argv = actions.argv
    command(name="health gate: /health 200 and a real chat completion", argv=list(argv or ["true"]),
            run=argv is not None, _if=[changed] if actions.healthy else [])
