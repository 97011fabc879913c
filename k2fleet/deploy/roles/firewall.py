"""Firewall role: k2fleet's nftables table ``inet k2fleet`` (:mod:`k2fleet.planning.firewall`).

The rules file and ``k2-firewall.service`` are in the desired state (group ``firewall``);
the unit loads the file with ``nft -f`` (one transaction) at boot and on reload. With
``k2_firewall`` off the group is empty and a table k2fleet loaded before is removed with
its unit and file. Nothing outside k2fleet's own table is read or changed.
"""

from __future__ import annotations

from pyinfra.api import deploy

from k2fleet.planning import firewall as plan_firewall
from k2fleet.planning.desired import UNIT_GLOB, HostDesired
from k2fleet.deploy.operations import command, start_or_explain, synced_files, unit_running
from k2fleet.planning.host_fact import HostReport
from k2fleet.planning.quoting import shell_line


@deploy("k2fleet: firewall")
def configure(desired: HostDesired, fact: HostReport, tracked: list, rules_path: str) -> None:
    """
    Write the rules and their unit; load the table (start the unit) when it is not loaded,
    reload it atomically when the rules changed or the kernel no longer holds them (e.g.
    an ``nft flush ruleset``); with no rules planned, remove a table k2fleet loaded before.

    + desired: this host's desired state (files of group ``firewall``, the ``firewall`` check)
    + fact: this host's HostState (digests, unit states, the k2-*.service glob, checks)
    + tracked: list the run's health gate watches; the file operation is appended
    + rules_path: where the rules file is (or was) on the host

    **Example:**

    .. code:: python

        firewall.configure(run.desired[host.name], fact, run.tracked, rules_path=plan_firewall.rules_path(dep))
    """
    unit = plan_firewall.UNIT
    files = desired.files.get("firewall", {})
    if not files:
        present = any(p.rsplit("/", 1)[1] == unit for p in fact.globs.get(UNIT_GLOB, []))
        table = plan_firewall.TABLE.split()
        command(name="remove k2fleet's nftables table and its unit (k2_firewall is off)",
                argv=f"systemctl disable --now {unit}; {shell_line([plan_firewall.NFT, 'delete', 'table', *table])} "
                     f"2>/dev/null; rm -f {shell_line([plan_firewall.UNIT_PATH, rules_path])}; systemctl daemon-reload",
                _if=lambda: present)
        return
    written = synced_files(name="nftables rules of table inet k2fleet and their unit", files=files, current=fact.files)
    tracked.append(written)
    active = fact.unit_active(unit)
    loaded = fact.passed(plan_firewall.CHECK)
    command(name="reload systemd for the firewall unit", argv=["systemctl", "daemon-reload"], _if=written.did_change)
    unit_running(name="load k2fleet's nftables table (k2-firewall.service)", unit=unit,
                 active=active and fact.unit_enabled(unit))
    command(name="reload k2fleet's nftables table (rules changed or not loaded)",
            argv=start_or_explain(unit, "reload"), _if=lambda: active and (written.did_change() or not loaded))
