"""The k2fleet deploy: bare hosts in an inventory → a serving, health-checked Kimi-K2.

    pyinfra inventories/h200.py deploys/kimi.py

    inventory ──gate (config.py, before any connection)──▶ Deployment + Plan
      ──control-machine step (k2fleet.control.artifacts; skipped under --dry)──▶ desired state
    per host: HostState fact (one read-only round trip), then k2fleet.deploy.pipeline.deploy_kimi:
      preflight → packages → bootstrap (driver, fabric, Docker; reboot) → firewall
      → privileged ports → mesh → engine → GPU exporter → Hub client → checkpoint
      → reach → services → health

pyinfra runs this file once per host; every host gets the same operation sequence, so
stages start in plan order across the fleet, and a rolling change's steps (one instance at a
time, ``k2_rollout``) run in their order: each step's operations are on every host, gated
to the step's hosts with ``_if``. ``k2fleet plan --json INVENTORY`` prints
the same desired state.
"""

from pyinfra import host, inventory, state

from k2fleet.deploy.fleet_run import fleet_run
from k2fleet.deploy.pipeline import deploy_kimi

run = fleet_run(state, inventory)
deploy_kimi(run, run.desired[host.name], run.fact_of(host), reboots=run.reboots(inventory),
            weights_wanted=run.weights_wanted(inventory), unsettled=run.unsettled(inventory),
            reboot_steps=run.reboot_steps(inventory), restart_steps=run.restart_steps(inventory),
            starting=run.starting(inventory))
