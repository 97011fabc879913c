"""The k2fleet deploy: bare hosts in an inventory → a serving, health-checked Kimi-K2.

    pyinfra inventories/h200.py deploys/kimi.py

Stages, each a role in ``roles/`` driven by the plan ``k2fleet plan INVENTORY`` prints:
preflight facts → host packages → SSH mesh → engine runtime → Hub client (only on a
``k2_checkpoint_fetcher`` host) → checkpoint → services
(stage by stage across hosts) → health gate. A bad inventory stops here with the
validator's message before the first operation.
"""

from roles import checkpoint, engine, health, hub_client, mesh, packages, preflight, services
from roles.context import fleet
from roles.state import desired, fleet_changed, report

ctx = fleet()
preflight.check()
packages.install_packages(desired().packages, ctx.dep.s.package_source, installed=list(report().packages))
mesh.configure()
engine.install()
hub_client.install()
checkpoint.ensure()
services.start()
health.gate(changed=fleet_changed)
