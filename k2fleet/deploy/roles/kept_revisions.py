"""Kept revisions role: after the health gate passed on what is pinned, each host keeps
``k2_keep_revisions`` checkpoint revisions and engine venvs — the pinned one, then the ones
served last — and removes the others (:mod:`k2fleet.planning.kept_revisions`,
:mod:`k2fleet.hostprogs.revisions`). It runs only where the HostState fact's check of that
directory failed (the pinned one not yet recorded as served last, or more than the count).
"""

from __future__ import annotations

from pyinfra.api import deploy

from k2fleet.deploy.operations import command
from k2fleet.planning.desired import HostDesired
from k2fleet.planning.host_fact import HostReport


@deploy("k2fleet: kept revisions")
def prune(desired: HostDesired, fact: HostReport) -> None:
    """
    Record the pinned revision as served last and remove the revisions beyond the count.

    + desired: this host's desired state (``kept``: its directories of revisions)
    + fact: this host's HostState (each directory's read-only check)

    **Example:**

    .. code:: python

        kept_revisions.prune(run.desired[host.name], fact)
    """
    for kept in desired.kept:
        command(name=f"keep {kept.keep} {kept.kind} revision(s) in {kept.root} (the pinned one first), remove older ones",
                argv=kept.argv(), _if=lambda kept=kept: not fact.passed(kept.check))
