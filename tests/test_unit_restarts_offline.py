"""Which units a deploy restarts, offline (the real roles on pyinfra's ``@fake`` hosts,
:mod:`tests.test_roles_offline`'s machinery): an engine flag change restarts exactly the
serving units that read the changed files, and nothing else — not ``k2-firewall.service``
(its rules are a function of the fleet's addresses and ports, not of their order in the
inventory); a firewall rule change reloads the firewall and restarts no serving unit.

test_rehearse_restart.py edits a group's engine flag by moving that group's line to the
end of the generated inventory: the fleet's host order changes. The rules listed the
fleet's addresses in inventory order, so every host's rules file changed and every host's
firewall was reloaded by a flag change (the sandbox test then left the firewall unit out
of the units it compares); the rules' sets are in address order now.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from k2fleet.planning import firewall as plan_firewall
from tests.test_roles_offline import (ControlCalls, H200, Outcome, digests, planned, run_roles,  # noqa: F401
                                      settled_fleet)

REPO = Path(__file__).resolve().parents[1]
PD = REPO / "inventories" / "h200-sglang-pd.py"
FIREWALL = plan_firewall.UNIT


def unit_commands(out: Outcome, host: str) -> list[str]:
    """The systemctl/upload commands of ``host``, each cut at its first `` || `` (retry/explain),
    but the reachability check's transient listener (``k2-reach``: it runs before any serving
    unit starts or restarts; tests/test_roles_offline.py checks it)."""
    return [c.split(" || ")[0] for c in out.commands(host)
            if c.startswith(("systemctl", "<upload>")) and "k2-reach.service" not in c]


def touching(out: Outcome, host: str, what: str) -> list[str]:
    return [c for c in unit_commands(out, host) if what in c]


def pd_copy(tmp_path: Path, name: str, groups: dict[str, Any], order: list[str]) -> Path:
    """The PD seed's groups written as one-line groups in ``order`` (as the rehearsal writes
    an inventory and test_rehearse_restart rewrites one), with its group data."""
    folder = tmp_path / "inv"
    (folder / "group_data").mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "inventories" / "group_data" / "all.py", folder / "group_data" / "all.py")
    shutil.copy(REPO / "inventories" / "group_data" / f"{PD.stem}.py", folder / "group_data" / f"{name}.py")
    path = folder / f"{name}.py"
    path.write_text("".join(f"{g} = {groups[g]!r}\n" for g in order))
    return path


def pd_groups() -> dict[str, Any]:
    ns: dict[str, Any] = {}
    exec(PD.read_text(), ns)  # noqa: S102 - the repository's own seed inventory
    return {g: ns[g] for g in ("prefill", "decode", "router")}


def test_the_rules_do_not_depend_on_the_inventory_order(tmp_path: Path) -> None:
    groups = pd_groups()
    _, _, first = planned(str(pd_copy(tmp_path, "pd-a", groups, ["prefill", "decode", "router"])))
    dep, _, moved = planned(str(pd_copy(tmp_path, "pd-b", groups, ["router", "decode", "prefill"])))
    assert [h.name for h in dep.fleet.hosts][0] == "router-0"  # the order did change
    for host, d in first.items():
        assert digests(moved[host]) == digests(d), host


def test_a_flag_change_that_moves_a_group_restarts_only_its_serving_units(tmp_path: Path) -> None:
    """test_rehearse_restart's SGLang PD case: decode's max-running-requests changed, the
    decode group's line moved to the end of the file."""
    groups = pd_groups()
    dep0, _, before = planned(str(pd_copy(tmp_path, "pd-before", groups, ["prefill", "decode", "router"])))
    hosts, data = groups["decode"]
    edited = {**groups, "decode": (hosts, {**data, "k2_engine_args": {**data["k2_engine_args"],
                                                                       "max-running-requests": 4096}})}
    dep, plan, desired = planned(str(pd_copy(tmp_path, "pd-after", edited, ["prefill", "router", "decode"])))
    assert [h.name for h in dep.fleet.hosts] != [h.name for h in dep0.fleet.hosts]
    out = run_roles(dep, plan, desired, settled_fleet(dep0, before), tmp_path, ControlCalls())
    for host in ("decode-0", "decode-1"):
        assert unit_commands(out, host) == ["<upload> /etc/systemd/system/k2-sglang-decode.service",
                                            "systemctl daemon-reload", "systemctl stop k2-sglang-decode.service",
                                            "systemctl start k2-sglang-decode.service"], unit_commands(out, host)
    for host in ("prefill-0", "prefill-1", "router-0"):
        assert unit_commands(out, host) == [], (host, unit_commands(out, host))
    for host in desired:
        assert touching(out, host, FIREWALL) == [] and touching(out, host, "firewall.nft") == []
        assert not [n for n in out.changed(host) if "firewall" in n or "nftables" in n], out.changed(host)


def test_a_flag_change_by_data_leaves_the_firewall_alone(tmp_path: Path) -> None:
    dep0, _, before = planned(str(H200))
    assert dep0.s.firewall and all(FIREWALL in d.units for d in before.values())
    dep, plan, desired = planned(str(H200), ('k2_engine_args={"max-num-seqs": 64}',))
    out = run_roles(dep, plan, desired, settled_fleet(dep0, before), tmp_path, ControlCalls())
    for host in desired:
        assert touching(out, host, FIREWALL) == [] and touching(out, host, "firewall.nft") == []
        assert [c for c in unit_commands(out, host) if c.startswith("systemctl") and "daemon-reload" not in c] == [
            "systemctl stop k2-vllm.service", "systemctl start k2-vllm.service"]


def test_a_firewall_rule_change_reloads_the_firewall_and_restarts_no_serving_unit(tmp_path: Path) -> None:
    """The control: k2_api_clients changes the rules (the API port closes to others): the
    rules file is written and the loaded table reloaded in one transaction on every host;
    the engines keep running."""
    dep0, _, before = planned(str(H200))
    dep, plan, desired = planned(str(H200), ('k2_api_clients=["198.51.100.0/24"]',))
    rules = plan_firewall.rules_path(dep)
    out = run_roles(dep, plan, desired, settled_fleet(dep0, before), tmp_path, ControlCalls())
    for host in desired:
        assert digests(desired[host])[rules] != digests(before[host])[rules]
        assert unit_commands(out, host) == [f"<upload> {rules}", "systemctl daemon-reload",
                                            f"systemctl reload {FIREWALL}"], unit_commands(out, host)
        assert "stage 0: stop k2-vllm (its files changed or hosts rebooted)" not in out.changed(host)
