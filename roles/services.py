"""Services role: the plan's processes as systemd units, started stage by stage across
the fleet, restarted only when their unit, environment or config files changed.

Every host runs the same operation sequence (one slot per fleet-wide (stage, service)
pair; a host without that service gets no commands), so pyinfra's per-operation
ordering across hosts is the plan's start order.

.. code:: python

    from roles import services
    services.start()
"""

from __future__ import annotations

from pyinfra.api import deploy

from k2fleet.units import env_file, env_path, unit_file, unit_name, unit_path
from roles.context import FleetContext, fleet
from roles.ops import command, synced_files, unit_running
from roles.state import UNIT_GLOB, report, track

KEEP = {"k2-mesh-sshd.service"}


def unit_names(ctx: FleetContext) -> list[str]:
    return [unit_name(s) for s in ctx.host_plan().services]


def service_files(ctx: FleetContext, name: str) -> dict[str, tuple[bytes, str]]:
    svc = ctx.service(name)
    if svc is None:
        return {}
    files = {
        unit_path(svc): (unit_file(ctx.dep, svc).encode(), "644"),
        env_path(ctx.dep, svc): (env_file(svc).encode(), "600"),
    }
    for path, content in svc.files.items():
        files[path] = (content.encode(), "644")
    return files


def host_files(ctx: FleetContext) -> dict[str, tuple[bytes, str]]:
    return {path: (content.encode(), "644") for path, content in ctx.host_plan().files.items()}


def desired_files(ctx: FleetContext) -> dict[str, tuple[bytes, str]]:
    out: dict[str, tuple[bytes, str]] = host_files(ctx)
    for svc in ctx.host_plan().services:
        out |= service_files(ctx, svc.name)
    return out


@deploy("k2fleet: services")
def start() -> None:
    ctx = fleet()
    rep = report()
    planned = set(unit_names(ctx)) | KEEP
    stale = sorted(p for p in rep.globs.get(UNIT_GLOB, []) if p.rsplit("/", 1)[1] not in planned)
    stale_units = " ".join(p.rsplit("/", 1)[1] for p in stale)
    track(command(name="stop and remove k2fleet units the plan no longer has",
                  argv=f"systemctl disable --now {stale_units}; rm -f {' '.join(stale)}" if stale else "true",
                  _if=lambda: bool(stale)))
    track(synced_files(name="config files of ranks this host serves", files=host_files(ctx), current=rep.files))
    written = {}
    for stage, name in ctx.slots():
        written[name] = track(synced_files(name=f"unit, env and config of {name}", files=service_files(ctx, name), current=rep.files))
    command(name="reload systemd units", argv=["systemctl", "daemon-reload"],
            _if=lambda: any(op.did_change() for op in written.values()))
    for stage, name in ctx.slots():
        svc = ctx.service(name)
        unit = f"{name}.service"
        active = rep.unit_active(unit)
        track(unit_running(name=f"stage {stage}: start {name}", unit=unit, active=active or svc is None))
        command(name=f"stage {stage}: restart {name} (its files changed)", argv=["systemctl", "restart", unit],
                _if=lambda op=written[name], was=active and svc is not None: was and op.did_change())
