"""SSH mesh role: the deployment's own key pair and sshd on ``k2_mesh_port``.

The keys were made by the control-machine step (:mod:`k2fleet.control.artifacts`); their files,
the sshd/ssh configs and the unit are in the desired state (group ``mesh``).
"""

from __future__ import annotations

from pyinfra.api import deploy
from pyinfra.operations import systemd

from k2fleet.planning.mesh_config import UNIT
from k2fleet.deploy.operations import command, synced_files, unit_running
from k2fleet.planning.role_actions import MeshActions


@deploy("k2fleet: SSH mesh")
def configure(actions: MeshActions, tracked: list) -> None:
    """
    Remove mesh keys the host must no longer hold, write the mesh files and run the mesh
    sshd; restart it only when its files changed. While a unit that takes the mesh port runs
    (the TRT-LLM node container, whose sshd serves the mesh), the host's mesh sshd is left
    stopped (the record does not start it).

    + actions: this host's mesh record (``role_actions(...).mesh``: keys to remove, files to
      write, whether the sshd starts or restarts; none of it on a host off the mesh)
    + tracked: list the run's health gate watches; the file operation is appended

    **Example:**

    .. code:: python

        mesh.configure(role_actions(run.dep, mine, fact).mesh, run.tracked)
    """
    if actions.remove:
        command(name="remove the SSH keys of the mesh this host no longer holds", argv=["rm", "-f", "--", *actions.remove])
    if actions.files:
        tracked.append(synced_files(name="mesh keys, known_hosts and sshd config", files=actions.files))
        systemd.daemon_reload(name="reload systemd for the mesh unit")
    if actions.start:
        unit_running(name="start the mesh sshd", unit=UNIT)
    if actions.restart:
        command(name="restart the mesh sshd (config changed)", argv=["systemctl", "restart", UNIT])


@deploy("k2fleet: SSH mesh after the deploy")
def rest(actions: MeshActions) -> None:
    """
    ``k2_mesh_after_deploy: stop``: stop the mesh sshd once every health gate has passed (its
    unit has ``KillMode=process``: the running job's sessions stay); the next deploy that
    runs the roles starts it again for its duration. Nothing under ``keep`` or off the mesh.

    + actions: this host's mesh record (``stop_after``)

    **Example:**

    .. code:: python

        mesh.rest(role_actions(run.dep, mine, fact).mesh)
    """
    if actions.stop_after:
        command(name="stop the mesh sshd until the next deploy (k2_mesh_after_deploy: stop)",
                argv=["systemctl", "stop", UNIT])
