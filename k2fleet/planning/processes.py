"""The plan's data model: for each host, the processes it runs, in which order.

:func:`k2fleet.planning.planner.make_plan` fills it from a resolved Deployment (pure);
:mod:`k2fleet.planning.desired` turns it into everything each host must hold.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # types only: the engines' renderers import this module
    from k2fleet.planning.capacity import Capacity


@dataclass
class Health:
    """How the health gate proves a service serves: /health 200 and a real completion."""

    port: int
    path: str = "/health"
    chat: bool = True
    host: str = "127.0.0.1"  # where the gate calls it (the address it listens on under k2_bind_address: fleet)


@dataclass
class Service:
    """One long-running (or oneshot) process on one host.

    ``stage``: services start stage by stage across the whole fleet (0 first); a
    stage starts only after every service of the previous one is running.
    ``ports``: inventory key → port, used for the port clash check.
    ``pre_start``: commands that must succeed before the process starts (``ExecStartPre``,
    after the checkpoint gate), e.g. the Ray gate before vLLM drives the cluster.
    ``conflicts``: units this service stops while it runs (``Conflicts=``), e.g. the TRT-LLM
    node container whose sshd takes the mesh port from the host's mesh sshd.
    ``ssh_to``: the hosts this service's process logs into over the SSH mesh (mpirun's rank
    hosts); the mesh exists only for such services, with a key on this host alone.
    """

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    stage: int = 0
    rank: int = 0
    role: str = "serve"
    health: Health | None = None
    oneshot: bool = False
    workdir: str | None = None
    needs_checkpoint: bool = True
    description: str = ""
    pre_start: list[list[str]] = field(default_factory=list)
    conflicts: tuple[str, ...] = ()
    ssh_to: tuple[str, ...] = ()


@dataclass
class HostPlan:
    """``files``: config a host needs without running a service of its own (e.g. the
    TRT-LLM options YAML on every mpirun rank host)."""

    name: str
    address: str
    role: str
    services: list[Service] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)


@dataclass
class Plan:
    """Hosts in inventory order; ``to_json()`` is the ``k2fleet plan --json`` document.
    ``capacity``: per role (``disagg.ctx``/``disagg.gen`` for TRT-LLM SLURM sides) the KV cache
    prediction of one serving instance (:mod:`k2fleet.planning.capacity`)."""

    source: str
    engine: str
    engine_version: str
    runtime: str
    image: str | None
    checkpoint_path: str
    hosts: dict[str, HostPlan]
    capacity: dict[str, Capacity] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what could not be checked or predicted for the model

    def services(self) -> list[tuple[HostPlan, Service]]:
        return [(h, s) for h in self.hosts.values() for s in h.services]

    def stages(self) -> list[int]:
        return sorted({s.stage for _, s in self.services()})

    def endpoint(self) -> tuple[str, int] | None:
        """The address clients use: the replicas' load balancer if any (``k2_load_balancer``),
        else the router, else the first service in plan order that has a health check (planned,
        not observed: nothing is contacted)."""
        for host, svc in self.services():
            if "k2_load_balancer_port" in svc.ports:
                return host.address, svc.ports["k2_load_balancer_port"]
        for host, svc in self.services():
            if svc.role == "router" and svc.health:
                return host.address, svc.health.port
        for host, svc in self.services():
            if svc.health:
                return host.address, svc.health.port
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "engine": self.engine,
            "engine_version": self.engine_version,
            "runtime": self.runtime,
            "image": self.image,
            "checkpoint_path": self.checkpoint_path,
            "capacity": {role: cap.to_json() for role, cap in self.capacity.items()},
            "notes": list(self.notes),
            "hosts": {
                name: {"address": h.address, "role": h.role, "files": h.files, "services": [asdict(s) for s in h.services]}
                for name, h in self.hosts.items()
            },
        }
