"""The planner: a resolved Deployment → a :class:`~k2fleet.planning.processes.Plan` (pure).

Each engine's renderer (``k2fleet/planning/engines/<name>/render.py``, asked through the engine) yields ``(host name, Service)`` pairs
(or ``(host name, {path: content})`` for files a host needs without a service of its
own); the planner collects them per host and checks that no two processes of one host
share a port. Nothing here connects to a host or writes a file.
"""

from __future__ import annotations

from k2fleet.planning.os_tables import provided_note, reserved_ports
from k2fleet.planning.deployment import Deployment
from k2fleet.planning.processes import HostPlan, Plan, Service
from k2fleet.planning import api_front, engine_cache, engine_flags, instance_watch, load_balancer
from k2fleet.inventory.spec import SpecError


def _check_ports(plan: Plan, host_ports: dict[str, int]) -> None:
    for host in plan.hosts.values():
        seen: dict[int, str] = {}
        for key, port in [*host_ports.items(), *((k, p) for svc in host.services for k, p in svc.ports.items())]:
            other = seen.get(port)
            if other is not None and other != key:
                raise SpecError(
                    key,
                    f"port {port} on host {host.name} is also used by {other}; give them different ports",
                    plan.source,
                )
            seen[port] = key


def _bind_to_fleet_address(plan: Plan) -> None:
    """``k2_bind_address: fleet``: every listener the renderers put on all interfaces
    (``--host 0.0.0.0``) listens on its host's fleet address instead, and its health gate
    calls that address (the one owner of this rule; renderers keep emitting 0.0.0.0)."""
    for host in plan.hosts.values():
        for svc in host.services:
            svc.argv = [host.address if word == "0.0.0.0" and i and svc.argv[i - 1] == "--host" else word
                        for i, word in enumerate(svc.argv)]
            if svc.health is not None:
                svc.health.host = host.address


def make_plan(dep: Deployment) -> Plan:
    """Check ``k2_engine_args`` and the LLM API options against the engine's flag tables,
    then render every host's services for ``dep``; raises SpecError (a flag, a port clash)."""
    engine_flags.check_deployment(dep)
    hosts = {
        h.name: HostPlan(name=h.name, address=h.address, role=h.settings.role) for h in dep.fleet.hosts
    }
    for host_name, item in dep.engine_impl.render(dep):
        if isinstance(item, Service):
            hosts[host_name].services.append(item)
        else:
            hosts[host_name].files.update(item)
    plan = Plan(
        source=dep.fleet.source,
        engine=dep.engine,
        engine_version=dep.version,
        runtime=dep.runtime,
        image=dep.image,
        checkpoint_path=dep.serve_path,
        hosts=hosts,
        capacity=dict(dep.capacity),
        notes=list(dep.notes) + ([provided_note(dep.driver, dep.gpu.name)]  # k2_gpu_stack: provided
                                 if dep.s.gpu_stack == "provided" and dep.gpu else []),
    )
    reserved = reserved_ports(dep.gpu.name) if dep.gpu else {}
    engine_cache.add_cache_dirs(plan)
    if dep.s.bind_address == "fleet":
        _bind_to_fleet_address(plan)
    api_front.add_fronts(dep, plan)  # after the bind address: the front takes the endpoint's address
    load_balancer.add_load_balancer(dep, plan)  # after the fronts: its backends are the endpoints clients call
    instance_watch.add_watchdogs(dep, plan)  # multi-host instances fail as one
    _check_ports(plan, {"k2_mesh_port": dep.s.mesh_port, "k2_relay_port": dep.s.relay_port} | reserved)
    return plan
