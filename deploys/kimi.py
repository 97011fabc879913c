"""The k2fleet deploy: bare hosts in an inventory → a serving, health-checked Kimi-K2.

    pyinfra inventories/h200.py deploys/kimi.py

The pipeline, for each host (pyinfra runs this file once per host; every host gets the
same operation sequence, so stages start in plan order across the fleet):

    inventory ──gate (config.py)──▶ Deployment + Plan ──control step──▶ desired state
    HostState fact (one read-only round trip) ─┐                          │
                                               ▼                          ▼
    preflight → packages → mesh → engine → Hub client → checkpoint → services → health

``k2fleet plan --json INVENTORY`` prints the same desired state.
"""

import os

from pyinfra import host, inventory, state

from k2fleet.facts import HostState
from k2fleet.run import fleet_run
from roles import checkpoint, engine, health, hub_client, mesh, packages, preflight, services

run = fleet_run(state, inventory)
mine = run.desired[host.name]
fact = host.get_fact(HostState, query=mine.fact_query(run.dep.s.model_dir))

preflight.check(run.dep, mine, fact)
packages.install_packages(mine.packages, run.dep.s.package_source, installed=list(fact.packages),
                          bundle=run.artifacts.bundles.get(tuple(sorted(set(mine.packages)))))
mesh.configure(mine, fact, run.tracked)
engine.install(mine, fact, run.tracked)
hub_client.install(mine, fact, requirement=run.hub_requirement)
checkpoint.ensure(run.dep, mine, fact, run.tracked, log_file=str(run.state_dir / "checkpoint-transfers.jsonl"),
                  xet_disabled=bool(os.environ.get("HF_HUB_DISABLE_XET")))
services.start(mine, fact, run.tracked)
health.gate(mine, fact, changed=run.fleet_changed)
