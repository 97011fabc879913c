"""Which old checkpoint revisions and engine venvs a host keeps (``k2_keep_revisions``; pure).

A revision change fetches the new revision beside the old ones
(``k2_model_dir/<org>--<name>/<revision>``), and an engine version change installs the new
engine beside the old (``k2_venv/<engine>-<version>``), while the old serve; the roll then only
switches the units. After the deploy's health gate passed on what is pinned, each host keeps
``k2_keep_revisions`` of each (the pinned one, then the ones served last) and removes the
others (:mod:`k2fleet.hostprogs.revisions`), so going back to the previous revision re-pins
without a download. The HostState fact runs the same program read-only (``--check``): a
host whose pinned revision is not recorded as served last, or with revisions beyond the
count, is unsettled and gets the one operation; a settled host gets none.

>>> Kept("checkpoint-revisions-kept", "/srv/m/o--n", "a" * 40, "checkpoint", 2).argv(check=True)[2:5]
['revisions', '/srv/m/o--n', '--current']
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from k2fleet.planning.deployment import CHECKPOINT_CHECK, Deployment
from k2fleet.planning.host_archive import host_argv

VENV_CHECK = "engine-venvs-kept"


@dataclass(frozen=True)
class Kept:
    """One directory of revisions on a host: its fact check, the directory, the pinned
    revision in it, its kind (``checkpoint`` or ``venv``) and how many are kept."""

    check: str
    root: str
    current: str
    kind: str
    keep: int

    def argv(self, check: bool = False) -> list[str]:
        return host_argv("revisions", self.root, "--current", self.current, "--keep", str(self.keep),
                         "--kind", self.kind, *(["--check"] if check else []))


def kept_dirs(dep: Deployment, loads_weights: bool, fetches: bool) -> list[Kept]:
    """This host's directories of revisions: each weight set's, where it loads weights and
    fetches them itself (``fetches``: not a host reading another's shared storage), and the
    engine venvs under the venv runtime."""
    keep = dep.s.keep_revisions
    out = []
    if loads_weights and fetches:
        for ws in dep.weight_sets:
            root, current = posixpath.split(ws.path)
            name = "checkpoint" if ws.check == CHECKPOINT_CHECK else ws.check.removesuffix("-verified")
            out.append(Kept(f"{name}-revisions-kept", root, current, "checkpoint", keep))
    if dep.runtime == "venv":
        root, current = posixpath.split(dep.venv)
        out.append(Kept(VENV_CHECK, root, current, "venv", keep))
    return out
