"""Privileged-ports role: no local user can bind a port k2fleet serves on
(:mod:`k2fleet.planning.privileged_ports`).

The sysctl drop-in (and, for the node exporter, a systemd drop-in granting
``CAP_NET_BIND_SERVICE``) are in the desired state (group ``privileged_ports``); the running
kernel's ``net.ipv4.ip_unprivileged_port_start`` is raised to the plan's value when the fact's
check finds it lower. A settled host (files in place, value at least the plan's) gets no
operation.
"""

from __future__ import annotations

from pyinfra.api import deploy
from pyinfra.operations import systemd

from k2fleet.deploy.operations import command, synced_files
from k2fleet.planning import privileged_ports as plan_ports
from k2fleet.planning.role_actions import PortsActions


@deploy("k2fleet: privileged ports")
def configure(actions: PortsActions, tracked: list) -> None:
    """
    Write the drop-ins; raise the running kernel's value when the check fails; reload systemd
    when the node exporter's drop-in changed (it takes effect at that unit's next start).

    + actions: this host's record (``role_actions(...).ports``: the drop-ins to write, whether
      the node exporter's is one, the value to raise the running kernel's to)
    + tracked: list the run's health gate watches; the file operation is appended

    **Example:**

    .. code:: python

        privileged_ports.configure(role_actions(run.dep, mine, fact).ports, run.tracked)
    """
    if actions.files:
        tracked.append(synced_files(name="k2fleet's sysctl drop-in (ports only root binds)", files=actions.files))
    if actions.dropin:
        systemd.daemon_reload(name="reload systemd for the node exporter's drop-in")
    if actions.raise_to is not None:
        command(name=f"make ports below {actions.raise_to} privileged ({plan_ports.SYSCTL})",
                argv=plan_ports.apply_argv(actions.raise_to))
