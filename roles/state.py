"""Everything a host should hold, and the one fact that says what it holds now.

``desired()`` collects the files, units and checks of every role for the current host;
``report()`` gathers :class:`~roles.facts.HostState` for exactly those (once per host
per run) so the roles decide every operation without another round trip.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pyinfra import host

from k2fleet.packages import required_packages
from k2fleet.preflight import HostReport
from roles.context import fleet
from roles.facts import HostState

CHECKPOINT_CHECK = "checkpoint-verified"
UNIT_GLOB = "/etc/systemd/system/k2-*.service"


@dataclass
class Desired:
    files: dict[str, dict[str, tuple[bytes, str]]] = field(default_factory=dict)  # role → path → (data, mode)
    units: list[str] = field(default_factory=list)
    checks: dict[str, list[str]] = field(default_factory=dict)
    exists: list[str] = field(default_factory=list)
    packages: list[str] = field(default_factory=list)

    def all_paths(self) -> list[str]:
        return sorted({p for files in self.files.values() for p in files})


_DESIRED: dict[str, Desired] = {}
_TRACKED: list = []


def track(op):
    """Remember an operation whose change must re-run the fleet's health gate."""
    _TRACKED.append(op)
    return op


def fleet_changed() -> bool:
    """Did any tracked operation on any host change something (execution time)?"""
    return any(op.is_complete() and op.did_change() for op in _TRACKED)
_REPORTS: dict[str, HostReport] = {}


def desired() -> Desired:
    if host.name not in _DESIRED:
        from roles import checkpoint, engine, health, hub_client, mesh, services

        ctx = fleet()
        d = Desired()
        d.files["mesh"] = mesh.desired_files(ctx)
        d.files["engine"] = engine.desired_files(ctx)
        d.files["services"] = services.desired_files(ctx)
        d.files["hub_client"] = hub_client.desired_files(ctx)
        d.units = ["k2-mesh-sshd.service"] + services.unit_names(ctx)
        d.checks = checkpoint.checks(ctx) | health.checks(ctx) | hub_client.checks(ctx)
        d.exists = engine.exists_paths(ctx)
        d.packages = required_packages(ctx.dep, ctx.host_plan(), mesh.enabled(ctx))
        _DESIRED[host.name] = d
    return _DESIRED[host.name]


def report() -> HostReport:
    """The HostState of the current host, gathered once per run."""
    if host.name not in _REPORTS:
        ctx, d = fleet(), desired()
        query = {
            "disk_path": ctx.dep.s.model_dir,
            "files": d.all_paths(),
            "units": d.units,
            "checks": d.checks,
            "exists": d.exists,
            "globs": [UNIT_GLOB],
            "packages": d.packages,
        }
        _REPORTS[host.name] = host.get_fact(HostState, query=query)
    return _REPORTS[host.name]
