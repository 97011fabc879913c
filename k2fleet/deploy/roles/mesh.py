"""SSH mesh role: the deployment's own key pair and sshd on ``k2_mesh_port``.

The keys were made by the control-machine step (:mod:`k2fleet.control.artifacts`); their files,
the sshd/ssh configs and the unit are in the desired state (group ``mesh``).
"""

from __future__ import annotations

from pyinfra.api import deploy

from k2fleet.planning.desired import HostDesired
from k2fleet.planning.mesh_config import UNIT
from k2fleet.deploy.operations import command, synced_files, unit_running
from k2fleet.planning.host_fact import HostReport


@deploy("k2fleet: SSH mesh")
def configure(desired: HostDesired, fact: HostReport, tracked: list) -> None:
    """
    Remove mesh keys the host must no longer hold (``desired.absent``), write the mesh files
    and run the mesh sshd; restart it only when its files changed.
    While a unit that takes the mesh port runs (``desired.mesh_yields_to``: the TRT-LLM
    node container, whose sshd serves the mesh), the host's mesh sshd is left stopped.

    + desired: this host's desired state (files of group ``mesh``; none on a one-host fleet)
    + fact: this host's HostState
    + tracked: list the run's health gate watches; the file operation is appended

    **Example:**

    .. code:: python

        mesh.configure(run.desired[host.name], fact, run.tracked)
    """
    files = desired.files.get("mesh", {})
    held = [path for path in desired.absent if fact.exists.get(path)]
    command(name="remove the SSH keys of the mesh this host no longer holds", argv=["rm", "-f", "--", *held] if held else ["true"],
            _if=lambda: bool(held))
    written = synced_files(name="mesh keys, known_hosts and sshd config", files=files, current=fact.files)
    tracked.append(written)
    was_active = fact.unit_active(UNIT)
    yielded = any(fact.unit_active(unit) for unit in desired.mesh_yields_to)
    command(name="reload systemd for the mesh unit", argv=["systemctl", "daemon-reload"],
            _if=lambda: bool(files) and written.did_change())
    unit_running(name="start the mesh sshd", unit=UNIT,
                 active=(was_active and fact.unit_enabled(UNIT)) or not files or yielded)
    command(name="restart the mesh sshd (config changed)", argv=["systemctl", "restart", UNIT],
            _if=lambda: bool(files) and was_active and written.did_change())


@deploy("k2fleet: SSH mesh after the deploy")
def rest(desired: HostDesired, fact: HostReport) -> None:
    """
    ``k2_mesh_after_deploy: stop``: stop the mesh sshd once every health gate has passed (its
    unit has ``KillMode=process``: the running job's sessions stay); the next deploy that
    runs the roles starts it again for its duration. Nothing under ``keep`` or off the mesh.

    + desired: this host's desired state (``mesh_between_deploys``, the mesh's files)
    + fact: this host's HostState

    **Example:**

    .. code:: python

        mesh.rest(run.desired[host.name], fact)
    """
    if desired.files.get("mesh") and not desired.mesh_between_deploys:
        command(name="stop the mesh sshd until the next deploy (k2_mesh_after_deploy: stop)",
                argv=["systemctl", "stop", UNIT])
