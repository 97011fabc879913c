"""Preflight role: refuse, before any change, a host that cannot run its part of the
plan (GPUs, driver, disk at ``k2_model_dir``, RAM, /dev/shm, ``k2_nic``, ``k2_ib_hcas``,
fleet address). Sandbox inventories declare simulated GPUs; production ones never can.

.. code:: python

    from roles import preflight
    preflight.check()
"""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import deploy

from k2fleet.preflight import check_host
from roles.context import fleet
from roles.state import CHECKPOINT_CHECK, report


class PreflightError(Exception):
    """A host cannot run its part of the plan."""


@deploy("k2fleet: preflight")
def check() -> None:
    ctx = fleet()
    entry = next(h for h in ctx.dep.fleet.hosts if h.name == host.name)
    rep = report()
    problems = check_host(ctx.dep, entry, rep, checkpoint_present=rep.passed(CHECKPOINT_CHECK))
    if problems:
        raise PreflightError(f"{host.name}: preflight failed: " + "; ".join(problems))
