"""``k2_checkpoint_fetcher: auto`` resolved before the deploy changes anything: who talks to
the Hub is chosen by what can reach it (:mod:`k2fleet.planning.fetcher_plan` plans the
question and the rule; this module asks).

Called by :func:`k2fleet.deploy.fleet_run.fleet_run` once, after pyinfra connected and
before the control-machine step and any operation: every host that loads weights is asked
at once, over pyinfra's own connection to it (the bastion, if any, carries only the
question), whether it opens the Hub endpoint (:class:`~k2fleet.deploy.facts.HubReach`,
read-only); the inventory is then validated and planned again with the choice, so every
later step (Hub client wheelhouse, firewall egress, fan-out root) sees a concrete fetcher.
A host chosen once is remembered in the deployment's control state directory and not asked
again while it loads weights (a settled fleet's re-run pays no extra round trip).
"""

from __future__ import annotations

import os
import sys
from contextlib import suppress
from pathlib import Path
from typing import Any

from k2fleet.control.artifacts import state_dir

from k2fleet.deploy.facts import HubReach
from k2fleet.deploy.gate import check_hosts
from k2fleet.inventory.loader import host_data
from k2fleet.planning.deployment import Deployment
from k2fleet.planning.desired import loads_weights
from k2fleet.planning.fetcher_plan import AUTO, CONTROL, choose, reach_argv, static_choice
from k2fleet.planning.processes import Plan


def ask(inventory: Any, names: list[str], endpoint: str | None) -> dict[str, bool]:
    """Host → whether it opened the Hub endpoint (all asked at once; one that cannot be
    asked counts as not reaching it)."""
    import gevent

    argv = reach_argv(endpoint)

    def one(name: str) -> bool:
        try:
            return inventory.get_host(name).get_fact(HubReach, argv=argv) is True
        except Exception:  # noqa: BLE001 - a host that cannot answer does not fetch
            return False

    jobs = {name: gevent.spawn(one, name) for name in names}
    gevent.joinall(list(jobs.values()))
    return {name: bool(job.value) for name, job in jobs.items()}


def resolve(inventory: Any, dep: Deployment, plan: Plan) -> tuple[Deployment, Plan, str | None]:
    """(dep, plan, the choice) with ``auto`` replaced by a host or ``control`` (validated and
    planned again); unchanged (choice None) when the inventory names a fetcher itself."""
    if dep.s.checkpoint_fetcher != AUTO:
        return dep, plan, None
    choice, how = static_choice(dep), ""
    if choice is None:
        candidates = [h.name for h in dep.fleet.hosts if loads_weights(plan.hosts[h.name])]
        memo = state_dir(dep) / CHOICE_FILE
        choice = remembered(memo, candidates)
        if choice is not None:
            how = f"; chosen by an earlier deploy, remembered in {memo} (delete it to ask the hosts again)"
        else:
            choice = choose(candidates, ask(inventory, candidates, dep.s.hub_endpoint))
            if choice != CONTROL:
                remember(memo, choice)
    hosts = [(name, {**data, "k2_checkpoint_fetcher": choice}, groups) for name, data, groups in host_data(inventory)]
    dep, plan = check_hosts(plan.source, hosts)
    sys.stderr.write(f"k2fleet: checkpoint fetcher (auto): {choice}"
                     + (" (no host that loads weights reaches the Hub endpoint)" if choice == CONTROL else
                        f" (it reaches the Hub endpoint; it feeds the fleet file by file{how})") + "\n")
    return dep, plan, choice


CHOICE_FILE = "checkpoint-fetcher"  # in the deployment's control state directory


def remembered(path: Path, candidates: list[str]) -> str | None:
    """The host an earlier deploy chose, when it still loads weights in this inventory (None:
    ask the hosts). A settled fleet's re-run asks nothing: the question costs every host a round
    trip, and only a host whose checkpoint is missing needs the answer. The control machine is
    never remembered (a host may reach the Hub next time)."""
    try:
        name = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if name in candidates else None


def remember(path: Path, choice: str) -> None:
    """Keep ``choice`` for the next deploys (a 0600 file in the 0700 state directory)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    with suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(choice + "\n")
    os.replace(tmp, path)
