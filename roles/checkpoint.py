"""Checkpoint role: the pinned checkpoint is on every host and verified before any
engine may start (the units' ``ExecStartPre`` re-checks the verified marker).

Sources (``k2_checkpoint_source``):

- ``control:/path`` — a directory on the control machine with the files and
  ``.k2fleet/manifest.json`` (air-gapped fleets): rsync over SSH to each host that
  lacks a verified copy, then ``verify.py`` on the host (sha256 of every file against
  the manifest, index completeness, safetensors headers) writes the marker.

.. code:: python

    from roles import checkpoint
    checkpoint.ensure()
"""

from __future__ import annotations

import shlex
import subprocess

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import python

from k2fleet.spec import SpecError
from k2fleet.units import gate_argv
from roles.context import FleetContext, fleet
from roles.ops import command
from roles.state import CHECKPOINT_CHECK, report, track


def checks(ctx: FleetContext) -> dict[str, list[str]]:
    return {CHECKPOINT_CHECK: gate_argv(ctx.dep)}


def needs_checkpoint(ctx: FleetContext) -> bool:
    """Every GPU host loads weights (mpirun ranks too, with no service of their own)."""
    hp = ctx.host_plan()
    return hp.role not in ("router", "slurm-submit") or any(s.needs_checkpoint for s in hp.services)


def _ssh_command() -> list[str]:
    data = host.data
    ssh = ["ssh", "-o", "BatchMode=yes", "-p", str(data.get("ssh_port") or 22)]
    if data.get("ssh_key"):
        ssh += ["-i", str(data.get("ssh_key")), "-o", "IdentitiesOnly=yes"]
    if data.get("ssh_known_hosts_file"):
        ssh += ["-o", f"UserKnownHostsFile={data.get('ssh_known_hosts_file')}", "-o", "StrictHostKeyChecking=yes"]
    return ssh


def push_from_control(source: str, dest: str, target: str, ssh: list[str]) -> None:
    """rsync ``source/`` to ``target:dest/`` (resumable: partial files are kept)."""
    argv = ["rsync", "-a", "--partial", "--mkpath", "--delete", "-e", shlex.join(ssh), f"{source.rstrip('/')}/", f"{target}:{dest}/"]
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"rsync to {target} failed: {result.stderr.strip()[-2000:]}")


@deploy("k2fleet: checkpoint")
def ensure() -> None:
    ctx = fleet()
    dep = ctx.dep
    verified = report().passed(CHECKPOINT_CHECK)
    wanted = needs_checkpoint(ctx) and not verified
    source = dep.s.checkpoint_source
    if wanted and not source.startswith("control:"):
        raise SpecError("k2_checkpoint_source", f"source {source!r} is not available in this version; use control:/path")
    user = host.data.get("ssh_user") or "root"
    target = f"{user}@{host.data.get('ssh_hostname') or host.name}"
    python.call(
        name="copy the checkpoint from the control machine",
        function=push_from_control,
        source=source.removeprefix("control:"),
        dest=dep.checkpoint_path,
        target=target,
        ssh=_ssh_command(),
        _if=lambda: wanted,
    )
    track(command(name="verify every checkpoint file (sha256, index, headers)",
            argv=["/usr/bin/python3", "/opt/k2fleet/lib/verify.py", "--full", dep.checkpoint_path],
            _if=lambda: wanted))
