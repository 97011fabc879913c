"""Issue #22, peers reaching each other before the engines start, on the sandbox: vLLM DP2 ×
TP8 over two hosts (the head listens on k2_dp_rpc_port for the other rank). A rule of the
site's own — not k2fleet's table — drops the worker's connections to that port: the deploy
stops at the reachability check, naming the host, the port and the fix, and no engine of
the fleet starts (the head's included: the fleet barrier). Without the rule the same deploy
brings the fleet up, and a re-run changes nothing.
"""

from __future__ import annotations

import pytest

from k2sandbox.harness import SandboxFleet, ssh

pytestmark = pytest.mark.sandbox
SANDBOX_HOSTS = 2
SANDBOX_DOCKER = False
DP = {"k2_tp": 8, "k2_dp": 2}
RPC_PORT = 13345  # k2_dp_rpc_port's default


def test_a_blocked_rendezvous_port_stops_the_fleet_before_any_engine_starts(sandbox_fleet: SandboxFleet) -> None:
    fleet = sandbox_fleet
    head, worker = fleet.hosts
    first = fleet.deploy()  # two replicas (no rendezvous port): installs nftables, engines run
    assert first.returncode == 0, first.tail()
    block = (f"nft add table inet site && nft 'add chain inet site input {{ type filter hook input priority -10; }}' "
             f"&& nft add rule inet site input ip saddr {worker['address']} tcp dport {RPC_PORT} drop")
    ssh(head, block)
    try:
        for h in fleet.hosts:
            ssh(h, "systemctl stop k2-vllm.service")
        blocked = fleet.deploy(DP)
        assert blocked.returncode != 0, blocked.tail()
        assert f"reach: {worker['name']} cannot open {head['address']}:{RPC_PORT} (timed out) 3 times in a row" in blocked.log, \
            blocked.tail()
        assert "the reachability check failed on" in blocked.log, blocked.tail()
        for h in fleet.hosts:  # no engine started, on either host
            state = ssh(h, "systemctl is-active k2-vllm.service", check=False).stdout.strip()
            assert state != "active", (h["name"], state)
    finally:
        ssh(head, "nft delete table inet site", check=False)
    ok = fleet.deploy(DP)
    assert ok.returncode == 0, ok.tail()
    assert "reachability: open every peer's rendezvous ports" in ok.log
    again = fleet.deploy(DP)
    assert again.returncode == 0 and again.changed == 0, again.changed_operations or again.tail()
