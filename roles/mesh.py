"""SSH mesh role: the deployment's own key pair and sshd on ``k2_mesh_port``.

Keys are generated once per deployment on the control machine (under
``$K2FLEET_STATE_DIR/<deployment id>/mesh``): a client key pair shared by the fleet and
one host key per host, so known_hosts is pinned before any host is contacted.

.. code:: python

    from roles import mesh
    mesh.configure()   # inside deploys/kimi.py, after preflight
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

from pyinfra import host
from pyinfra.api import deploy

from k2fleet import mesh as render
from roles.context import FleetContext, fleet
from roles.ops import command, synced_files, unit_running
from roles.state import report, track

UNIT_PATH = f"/etc/systemd/system/{render.UNIT}"


def _keypair(path: Path, comment: str) -> tuple[bytes, bytes]:
    """The key pair at ``path``, generated once; safe when hosts plan concurrently
    (a fresh pair is linked into place only if none exists: first writer wins)."""
    public = path.with_name(path.name + ".pub")
    if not public.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(tmp)], check=True)
        try:
            os.link(tmp, path)
            os.link(tmp.with_name(tmp.name + ".pub"), public)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
            tmp.with_name(tmp.name + ".pub").unlink()
    while not (path.exists() and public.exists()):  # another host's planning is linking it
        time.sleep(0.01)
    return path.read_bytes(), public.read_bytes()


def enabled(ctx: FleetContext) -> bool:
    """The mesh exists on fleets of more than one host (mpirun, checkpoint fan-out)."""
    return len(ctx.dep.fleet.hosts) > 1


def desired_files(ctx: FleetContext) -> dict[str, tuple[bytes, str]]:
    if not enabled(ctx):
        return {}
    dep, base = ctx.dep, ctx.state_dir / "mesh"
    private, public = _keypair(base / "id_ed25519", f"k2fleet-mesh-{ctx.deployment_id}")
    host_keys = {h.name: _keypair(base / "hosts" / h.name / "ssh_host_ed25519_key", h.name) for h in dep.fleet.hosts}
    entry = next(h for h in dep.fleet.hosts if h.name == host.name)
    d = render.mesh_dir(dep)
    host_private, host_public = host_keys[host.name]
    return {
        f"{d}/id_ed25519": (private, "600"),
        f"{d}/id_ed25519.pub": (public, "644"),
        f"{d}/authorized_keys": (render.authorized_keys(dep, public.decode()).encode(), "644"),
        f"{d}/known_hosts": (render.known_hosts(dep, {n: k[1].decode() for n, k in host_keys.items()}).encode(), "644"),
        f"{d}/ssh_config": (render.ssh_config(dep).encode(), "644"),
        f"{d}/sshd_config": (render.sshd_config(dep, entry).encode(), "644"),
        f"{d}/ssh_host_ed25519_key": (host_private, "600"),
        f"{d}/ssh_host_ed25519_key.pub": (host_public, "644"),
        UNIT_PATH: (render.unit_file(dep).encode(), "644"),
    }


@deploy("k2fleet: SSH mesh")
def configure() -> None:
    ctx = fleet()
    files = desired_files(ctx)
    rep = report()
    written = track(synced_files(name="mesh keys, known_hosts and sshd config", files=files, current=rep.files))
    was_active = rep.unit_active(render.UNIT)
    command(name="reload systemd for the mesh unit", argv=["systemctl", "daemon-reload"],
            _if=lambda: bool(files) and written.did_change())
    unit_running(name="start the mesh sshd", unit=render.UNIT, active=was_active or not files)
    command(name="restart the mesh sshd (config changed)", argv=["systemctl", "restart", render.UNIT],
            _if=lambda: bool(files) and was_active and written.did_change())
