"""Rolling changes: the fleet's instances, its load balancer, and a change's steps (pure data).

A change that restarts serving units (a flag, a file, the API key; a driver reboot) takes
every instance it touches down at once under ``k2_rollout: all-at-once``. Under ``rolling``
(the default) :func:`restart_steps` orders them instance by instance: per step, one
instance (``serve``, ``prefill`` or ``decode``: the hosts one engine instance spans) is
drained at the load balancer (``k2_load_balancer``, when one runs and the instance is behind
it: :mod:`k2fleet.hostprogs.lbctl` waits until its requests in flight finish, at most
``k2_drain_timeout``), its changed units stop (members before the head) and start again
(head before members), its health gate passes (the existing host program,
``k2fleet-host.pyz health``: a real completion), and it is put back (``state ready``, waiting
until the load balancer's own checks see it UP) before the next instance is touched.
Instances whose units do not restart get no operation; units that were not running (a
first deploy) simply start, as before; units outside any instance (the PD router, the load
balancer itself, which reloads) restart as before.

:func:`k2fleet.planning.host_actions.reboot_steps` does the same for ``k2_reboot: rolling`` under ``k2_rollout: rolling``:
the hosts of one instance reboot together, instance after instance, each drained before and
health-gated and put back after (the load balancer's own host last: its reboot interrupts
the load balancer).

Everything here is decided from the desired state and the one HostState fact per host, so
every host of the run plans the same steps (pyinfra runs one operation sequence on all
hosts; a step's operations are restricted to its hosts with ``_if``).

>>> Step("serve-0", {"n0": ((0, "k2-vllm"),)}, "n0", ("n0",)).hosts
('n0',)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k2fleet.planning.host_archive import host_argv

INSTANCE_ROLES = ("serve", "prefill", "decode")


@dataclass(frozen=True)
class Instance:
    """One engine instance: its name (``ROLE-INDEX``), its hosts (head first) and its server
    name at the load balancer (None: not behind one)."""

    name: str
    hosts: tuple[str, ...]
    server: str | None = None


@dataclass(frozen=True)
class Balancer:
    """Where the load balancer runs and how it is driven (:mod:`k2fleet.hostprogs.lbctl`)."""

    host: str
    unit: str
    socket: str
    backend: str
    drain_timeout: int
    ready_timeout: int

    def argv(self, action: str, server: str) -> list[str]:
        """``lbctl drain|ready BACKEND/SERVER`` on the load balancer's host, capped."""
        timeout = self.drain_timeout if action == "drain" else self.ready_timeout
        return host_argv("lbctl", "--socket", self.socket, action, f"{self.backend}/{server}", "--timeout", str(timeout))


@dataclass(frozen=True)
class Rollout:
    """The fleet's rollout settings, the same on every host's desired state."""

    mode: str = "all-at-once"  # k2_rollout
    instances: tuple[Instance, ...] = ()
    balancer: Balancer | None = None
    reloads: dict[str, tuple[str, ...]] = field(default_factory=dict)  # service → files whose change only reloads it

    def instance_of(self, host: str) -> Instance | None:
        return next((i for i in self.instances if host in i.hosts), None)


@dataclass(frozen=True)
class Step:
    """One step of a change: the (stage, service) slots that restart on each host, the
    load-balancer server drained before and put back after (None: none), the hosts whose
    health gate runs after the restart; ``instance`` None: every instance at once;
    ``reboot``: hosts that reboot in this step (:func:`reboot_steps`)."""

    instance: str | None
    units: dict[str, tuple[tuple[int, str], ...]]
    server: str | None = None
    gate: tuple[str, ...] = ()
    reboot: tuple[str, ...] = ()

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys([*self.units, *self.reboot]))
