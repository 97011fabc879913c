"""The fleet plan as seen from inside a pyinfra deploy.

``fleet()`` builds (once per run) the validated :class:`~k2fleet.deployment.Deployment`
and :class:`~k2fleet.plan.Plan` from the inventory pyinfra loaded, so the deploy reads
exactly what ``k2fleet plan INVENTORY`` prints. A bad inventory raises
:class:`~k2fleet.spec.SpecError` here, before the first operation.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from pyinfra import host, inventory

from k2fleet.deployment import Deployment, resolve
from k2fleet.inventory import fleet_from_hosts
from k2fleet.plan import HostPlan, Plan, Service, make_plan

REPO = Path(__file__).resolve().parents[1]
FILES = REPO / "files"


@dataclass
class FleetContext:
    dep: Deployment
    plan: Plan
    deployment_id: str

    @property
    def state_dir(self) -> Path:
        """Control-machine directory for this deployment's generated secrets (mesh keys)."""
        base = Path(os.environ.get("K2FLEET_STATE_DIR", Path.home() / ".local/state/k2fleet"))
        path = base / self.deployment_id
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        return path

    def host_plan(self) -> HostPlan:
        return self.plan.hosts[host.name]

    def slots(self) -> list[tuple[int, str]]:
        """Every (stage, service name) in the fleet, in start order: one op sequence for all hosts."""
        return sorted({(svc.stage, svc.name) for _, svc in self.plan.services()})

    def service(self, name: str) -> Service | None:
        return next((s for s in self.host_plan().services if s.name == name), None)


_CACHE: dict[int, FleetContext] = {}


def fleet() -> FleetContext:
    key = id(inventory._get_module())
    if key not in _CACHE:
        hosts = [(h.name, h.data.dict(), tuple(h.groups)) for h in inventory]
        dep = resolve(fleet_from_hosts("inventory", hosts))
        ident = hashlib.sha256(
            "|".join([dep.s.model, dep.s.revision, *sorted(h.address for h in dep.fleet.hosts)]).encode()
        ).hexdigest()[:12]
        _CACHE[key] = FleetContext(dep=dep, plan=make_plan(dep), deployment_id=ident)
    return _CACHE[key]
