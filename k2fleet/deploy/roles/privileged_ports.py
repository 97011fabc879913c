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

from k2fleet.deploy.operations import command, synced_files
from k2fleet.planning import privileged_ports as plan_ports
from k2fleet.planning.desired import HostDesired
from k2fleet.planning.host_fact import HostReport


@deploy("k2fleet: privileged ports")
def configure(desired: HostDesired, fact: HostReport, tracked: list) -> None:
    """
    Write the drop-ins; raise the running kernel's value when the check fails; reload systemd
    when the node exporter's drop-in changed (it takes effect at that unit's next start).

    + desired: this host's desired state (files of group ``privileged_ports``, the check)
    + fact: this host's HostState (digests, checks)
    + tracked: list the run's health gate watches; the file operation is appended

    **Example:**

    .. code:: python

        privileged_ports.configure(run.desired[host.name], fact, run.tracked)
    """
    files = desired.files.get(plan_ports.GROUP, {})
    if not files:
        return
    written = synced_files(name="k2fleet's sysctl drop-in (ports only root binds)", files=files, current=fact.files)
    tracked.append(written)
    dropin = plan_ports.NODE_EXPORTER_DROPIN in files and fact.files.get(plan_ports.NODE_EXPORTER_DROPIN) != \
        files[plan_ports.NODE_EXPORTER_DROPIN].sha256
    command(name="reload systemd for the node exporter's drop-in", argv=["systemctl", "daemon-reload"],
            _if=lambda: dropin)
    value = desired.port_start
    command(name=f"make ports below {value} privileged ({plan_ports.SYSCTL})", argv=plan_ports.apply_argv(value),
            _if=lambda: not fact.passed(plan_ports.CHECK))
