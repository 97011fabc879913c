"""``k2_checkpoint_fetcher: auto`` resolved before the deploy changes anything: who talks to
the Hub is chosen by what can reach it (:mod:`k2fleet.planning.fetcher_plan` plans the
question and the rule; this module asks).

Called by :func:`k2fleet.deploy.fleet_run.fleet_run` once, after pyinfra connected and
before the control-machine step and any operation: every host that loads weights is asked
at once, over pyinfra's own connection to it (the bastion, if any, carries only the
question), whether it opens the Hub endpoint (:class:`~k2fleet.deploy.facts.HubReach`,
read-only); the inventory is then validated and planned again with the choice, so every
later step (Hub client wheelhouse, firewall egress, fan-out root) sees a concrete fetcher.
"""

from __future__ import annotations

import sys
from typing import Any

from k2fleet.deploy.facts import HubReach
from k2fleet.deploy.gate import check_hosts
from k2fleet.inventory.loader import host_data
from k2fleet.planning.deployment import Deployment
from k2fleet.planning.desired import loads_weights
from k2fleet.planning.fetcher_plan import AUTO, choose, reach_argv, static_choice
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
    choice = static_choice(dep)
    if choice is None:
        candidates = [h.name for h in dep.fleet.hosts if loads_weights(plan.hosts[h.name])]
        choice = choose(candidates, ask(inventory, candidates, dep.s.hub_endpoint))
    hosts = [(name, {**data, "k2_checkpoint_fetcher": choice}, groups) for name, data, groups in host_data(inventory)]
    dep, plan = check_hosts(plan.source, hosts)
    sys.stderr.write(f"k2fleet: checkpoint fetcher (auto): {choice}"
                     + (" (no host that loads weights reaches the Hub endpoint)" if choice == "control" else
                        " (it reaches the Hub endpoint; it feeds the fleet file by file)") + "\n")
    return dep, plan, choice
