"""Firewall role: k2fleet's nftables table ``inet k2fleet`` (:mod:`k2fleet.planning.firewall`).

The rules file and ``k2-firewall.service`` are in the desired state (group ``firewall``);
the unit loads the file with ``nft -f`` (one transaction) at boot and on reload. With
``k2_firewall`` off the group is empty and a table k2fleet loaded before is removed with
its unit and file. Nothing outside k2fleet's own table is read or changed.
"""

from __future__ import annotations

from pyinfra.api import deploy
from pyinfra.operations import systemd

from k2fleet.planning import firewall as plan_firewall
from k2fleet.deploy.operations import command, start_or_explain, synced_files, unit_running
from k2fleet.planning.quoting import shell_line
from k2fleet.planning.role_actions import FirewallActions


@deploy("k2fleet: firewall")
def configure(actions: FirewallActions, tracked: list) -> None:
    """
    Write the rules and their unit; load the table (start the unit) when it is not loaded,
    reload it atomically when the rules changed or the kernel no longer holds them (e.g.
    an ``nft flush ruleset``); with no rules planned, remove a table k2fleet loaded before.

    + actions: this host's firewall record (``role_actions(...).firewall``: the files to write,
      whether the unit starts, reloads or, with ``k2_firewall`` off, is removed; where the
      rules file is or was)
    + tracked: list the run's health gate watches; the file operation is appended

    **Example:**

    .. code:: python

        firewall.configure(role_actions(run.dep, mine, fact).firewall, run.tracked)
    """
    unit = plan_firewall.UNIT
    if actions.remove:
        table = plan_firewall.TABLE.split()
        command(name="remove k2fleet's nftables table and its unit (k2_firewall is off)",
                argv=f"systemctl disable --now {unit}; {shell_line([plan_firewall.NFT, 'delete', 'table', *table])} "
                     f"2>/dev/null; rm -f {shell_line([plan_firewall.UNIT_PATH, actions.rules_path])}; "
                     "systemctl daemon-reload")
    if actions.files:
        tracked.append(synced_files(name="nftables rules of table inet k2fleet and their unit", files=actions.files))
        systemd.daemon_reload(name="reload systemd for the firewall unit")
    if actions.start:
        unit_running(name="load k2fleet's nftables table (k2-firewall.service)", unit=unit)
    if actions.reload:
        command(name="reload k2fleet's nftables table (rules changed or not loaded)", argv=start_or_explain(unit, "reload"))
