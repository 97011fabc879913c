"""Health gate role: every serving endpoint must answer ``/health`` 200 AND a real chat
completion with a non-empty answer within ``k2_health_timeout``; otherwise the deploy
fails naming the host, the unit and its last log lines.

The gate runs after any change anywhere in the fleet, and whenever the quick check in
the HostState fact (the same script, short timeout) did not pass.

.. code:: python

    from roles import health
    health.gate(changed=lambda: True)
"""

from __future__ import annotations

from collections.abc import Callable

from pyinfra.api import deploy

from k2fleet.units import LIB_DIR
from roles.context import FleetContext, fleet
from roles.ops import command
from roles.state import report

SCRIPT = f"{LIB_DIR}/k2fleet-health.py"


def _gate_argv(ctx: FleetContext, timeout: int) -> list[str] | None:
    for svc in ctx.host_plan().services:
        if svc.health and svc.health.chat:
            return ["/usr/bin/python3", SCRIPT, "--base", f"http://127.0.0.1:{svc.health.port}",
                    "--model", ctx.dep.api_model_name, "--unit", f"{svc.name}.service", "--timeout", str(timeout)]
    return None


def checks(ctx: FleetContext) -> dict[str, list[str]]:
    argv = _gate_argv(ctx, timeout=5)
    return {"healthy": argv} if argv else {}


@deploy("k2fleet: health gate")
def gate(changed: Callable[[], bool]) -> None:
    ctx = fleet()
    argv = _gate_argv(ctx, ctx.dep.s.health_timeout)
    healthy_before = report().passed("healthy")
    command(name="health gate: /health 200 and a real chat completion",
            argv=argv or ["true"], _if=lambda: argv is not None and (changed() or not healthy_before))
