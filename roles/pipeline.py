"""The Kimi-K2 pipeline: every role, in order, for one host.

Not a role itself (a plain function, so each role's operations keep their own names):
the one place that composes them (no role imports another).
``deploys/kimi.py`` gathers the host's fact and calls :func:`deploy_kimi`; the offline
role tests call it with a fact they construct.
"""

from __future__ import annotations

import os

from k2fleet.desired import HostDesired
from k2fleet.preflight import HostReport
from k2fleet.run import FleetRun
from roles import checkpoint, engine, health, hub_client, mesh, packages, preflight, services


def deploy_kimi(run: FleetRun, desired: HostDesired, fact: HostReport) -> None:
    """Carry out one host's desired state: preflight → packages → SSH mesh → engine →
    Hub client → checkpoint → services → health gate.

    + run: the run's :class:`~k2fleet.run.FleetRun` (deployment, artifacts, tracked operations)
    + desired: this host's desired state (``run.desired[host.name]``)
    + fact: this host's :class:`~k2fleet.facts.HostState`

    **Example:**

    .. code:: python

        run = fleet_run(state, inventory)
        mine = run.desired[host.name]
        deploy_kimi(run, mine, host.get_fact(HostState, query=mine.fact_query(run.dep.s.model_dir)))
    """
    dep = run.dep
    preflight.check(dep, desired, fact)
    packages.install_packages(desired.packages, dep.s.package_source, installed=list(fact.packages),
                              bundle=run.artifacts.bundle_for(desired.packages))
    mesh.configure(desired, fact, run.tracked)
    engine.install(desired, fact, run.tracked)
    hub_client.install(desired, fact, requirement=run.artifacts.hub_requirement)
    checkpoint.ensure(dep, desired, fact, run.tracked, log_file=str(run.state_dir / "checkpoint-transfers.jsonl"),
                      xet_disabled=bool(os.environ.get("HF_HUB_DISABLE_XET")))
    services.start(desired, fact, run.tracked)
    health.gate(desired, fact, changed=run.fleet_changed)
