"""``k2_bind_address``: where the engines and the PD router listen (offline, every scenario)."""

from __future__ import annotations


import pytest

from k2fleet.cli import load_plan
from k2fleet.planning.desired import health_argv
from tests.inventory_factory import scenario_inventories

SCENARIOS = scenario_inventories()


@pytest.mark.parametrize("inventory", SCENARIOS)
def test_fleet_binding_leaves_no_wildcard_listener_and_the_gate_calls_the_address(inventory: str) -> None:
    dep, plan = load_plan(inventory)
    wildcard = [(h.name, s.name) for h in plan.hosts.values() for s in h.services
                if any(w == "0.0.0.0" and s.argv[i - 1] == "--host" for i, w in enumerate(s.argv) if i)]
    dep, bound = load_plan(inventory, ["k2_bind_address=fleet"])
    for host in bound.hosts.values():
        for svc in host.services:
            argv = svc.argv
            assert "0.0.0.0" not in argv and "::" not in argv, (host.name, svc.name, argv)
            if (host.name, svc.name) in wildcard:
                assert argv[argv.index("--host") + 1] == host.address
        gate = health_argv(dep, host, 60)
        if gate:
            assert gate[gate.index("--base") + 1].startswith(f"http://{host.address}:"), gate
    if any("--host" in s.argv for h in plan.hosts.values() for s in h.services):
        assert wildcard, "the default binds every interface (the vendors' way)"
