"""Kept revisions role: after the health gate passed on what is pinned, each host keeps
``k2_keep_revisions`` checkpoint revisions and engine venvs — the pinned one, then the ones
served last — and removes the others (:mod:`k2fleet.planning.kept_revisions`,
:mod:`k2fleet.hostprogs.revisions`). Its record lists only the directories whose HostState
check failed (the pinned one not yet recorded as served last, or more than the count).
"""

from __future__ import annotations

from pyinfra.api import deploy

from k2fleet.deploy.operations import command


@deploy("k2fleet: kept revisions")
def prune(kept: tuple[tuple[str, tuple[str, ...]], ...]) -> None:
    """
    Record the pinned revision as served last and remove the revisions beyond the count.

    + kept: this host's record (``role_actions(...).kept_revisions``): (operation name, argv)
      per directory of revisions to prune

    **Example:**

    .. code:: python

        kept_revisions.prune(role_actions(run.dep, mine, fact).kept_revisions)
    """
    for name, argv in kept:
        command(name=name, argv=list(argv))
