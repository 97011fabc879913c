"""A multi-host instance fails as one: the watchdog units beside its engine units (pure).

For every instance that spans hosts, each member host (a rank: vLLM ``--headless`` node or DP
ranks, a Ray worker, SGLang ``--node-rank`` > 0) gets ``<unit>-watch``: the host program
:mod:`k2fleet.hostprogs.groupwatch` in ``member`` mode, which stops the rank when its head is
gone and starts it once the head is back. Where the engine's members hold a connection to the
head's rendezvous port while they run (:data:`HELD_PORT`), the head's host gets
``<unit>-watch`` in ``head`` mode too: a rank host whose connection is gone stops the head,
holds it down long enough for every member watchdog to stop its rank, and starts it again —
the whole instance restarts, head first. Where the engine's head already exits when a rank
dies (vLLM DP: the API server shuts down on engine death; vLLM on Ray: a dead actor is an
engine death), ``Restart=on-failure`` of the head's unit and the member watchdogs do it.

The engine-specific part is the two tables below (which port of the head's service).
"""

from __future__ import annotations

from k2fleet.planning.deployment import Deployment
from k2fleet.planning.host_archive import host_argv
from k2fleet.planning.processes import HostPlan, Plan, Service

# engine → the head service's port keys a member watches, first present wins: one the head
# listens on from its start for its whole life (Ray's GCS; torch's TCPStore at vLLM's
# --master-port and SGLang's --dist-init-addr; vLLM DP: the API port, whose socket vLLM binds
# before it builds the engine). Not vLLM's DP RPC port: vLLM closes that handshake socket
# once the engines started. The fleet's firewall lets fleet hosts reach every port.
HEAD_PORT = {"vllm": ("k2_ray_port", "k2_master_port", "k2_port"), "sglang": ("k2_dist_init_port",)}
# engine → the head service's port members stay connected to while they run (torch's
# TCPStore at vLLM's --master-port and SGLang's --dist-init-addr: every rank's process group
# keeps its store client); engines not named here get no head-side watchdog.
HELD_PORT = {"vllm": "k2_master_port", "sglang": "k2_dist_init_port"}
SUFFIX = "-watch"
INTERVAL_S = 1
GRACE = 3  # failed probes in a row (members: connects to the head; head: reads without a member's connection)
HOLD_S = INTERVAL_S * (GRACE + 3)  # the head stays down longer than a member's grace: every member sees it gone
STATE_DIR = "/run/k2fleet-watch"  # the member's "stopped by the watchdog" marks (systemd's RuntimeDirectory, 0700)


def watched(svc: Service) -> bool:
    """Whether ``svc`` is an instance watchdog.

    >>> watched(Service("k2-vllm-watch", [])), watched(Service("k2-vllm", []))
    (True, False)
    """
    return svc.name.endswith(SUFFIX)


def state_dir(name: str) -> str:
    return f"{STATE_DIR}/{name}"


def unit_lines(svc: Service) -> list[str]:
    """``[Service]`` lines of a watchdog's unit: its state directory, root-only, kept across its
    own restarts (a mark there says the watchdog stopped the rank and must start it again)."""
    rel = state_dir(svc.name).removeprefix("/run/")
    return [f"RuntimeDirectory={rel}", "RuntimeDirectoryMode=0700", "RuntimeDirectoryPreserve=yes"]


def _watch_service(svc: Service, argv: list[str], what: str) -> Service:
    return Service(
        name=f"{svc.name}{SUFFIX}", argv=argv, stage=svc.stage, rank=svc.rank, role=svc.role,
        needs_checkpoint=False, description=f"instance watchdog of {svc.name}: {what}",
    )


def _port(head: Service, keys: tuple[str, ...]) -> int | None:
    return next((head.ports[k] for k in keys if k in head.ports), None)


def _host_port(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def add_watchdogs(dep: Deployment, plan: Plan) -> None:
    """Add the watchdog services of every multi-host instance of ``plan``."""
    head_keys = HEAD_PORT.get(dep.engine)
    if not head_keys:
        return
    for pool in dep.pools.values():
        for nodes in pool.instances:
            if len(nodes) < 2:
                continue
            head_host: HostPlan = plan.hosts[nodes[0].name]
            heads = {s.name: s for s in head_host.services if s.rank == 0 and s.role == pool.role and not watched(s)}
            members: dict[str, list[tuple[HostPlan, Service]]] = {}
            for node in nodes[1:]:
                host = plan.hosts[node.name]
                for svc in list(host.services):
                    head = heads.get(svc.name)
                    port = _port(head, head_keys) if head and svc.rank > 0 else None
                    if head is None or port is None:
                        continue
                    unit = f"{svc.name}.service"
                    argv = host_argv("groupwatch", "member", "--unit", unit, "--head", _host_port(head_host.address, port),
                                     "--state", state_dir(f"{svc.name}{SUFFIX}"),
                                     "--interval", str(INTERVAL_S), "--grace", str(GRACE))
                    host.services.append(_watch_service(svc, argv, f"stops it when the head on {head_host.name} is gone"))
                    members.setdefault(svc.name, []).append((host, svc))
            held = HELD_PORT.get(dep.engine)
            for name, ranks in members.items():
                head = heads[name]
                if held not in head.ports:
                    continue
                argv = host_argv("groupwatch", "head", "--unit", f"{name}.service", "--port", str(head.ports[held]),
                                 *(w for host, _ in ranks for w in ("--member", host.address)),
                                 "--interval", str(INTERVAL_S), "--grace", str(GRACE), "--hold", str(HOLD_S))
                head_host.services.append(_watch_service(head, argv, "restarts the instance when a rank host leaves"))


def rendezvous(dep: Deployment, hp: HostPlan, svc: Service) -> tuple[int, tuple[str, ...]] | None:
    """When ``svc`` on ``hp`` heads an instance spanning hosts whose ranks stay connected to
    its rendezvous port (:data:`HELD_PORT`): (that port, each rank host as ``NAME=ADDRESS``),
    which its health gate names on failure; else None."""
    held = HELD_PORT.get(dep.engine)
    if held is None or svc.rank != 0 or watched(svc) or held not in svc.ports:
        return None
    for pool in dep.pools.values():
        for nodes in pool.instances:
            if len(nodes) > 1 and nodes[0].name == hp.name and pool.role == svc.role:
                return svc.ports[held], tuple(f"{n.name}={n.address}" for n in nodes[1:])
    return None
