"""The harness's view of a pyinfra run (k2sandbox.pyinfra_cli.DeployResult), offline."""

from __future__ import annotations

from k2sandbox.pyinfra_cli import DeployResult

# the shape of pyinfra 3's log when a host's command fails (as in a failed sandbox run, 2026-11-27):
# the command's own output on that host's lines, then its Error line, then the other operations
LOG = "\n".join([
    "--> Starting operation: k2fleet: firewall | reload k2fleet's nftables table (rules changed or not loaded) ",
    "    [k2sb-1] Job for k2-firewall.service failed.",
    "    [k2sb-1] /etc/k2fleet/firewall.nft:12:3-20: Error: the journal's line naming the cause",
    "    [k2sb-1] Error: executed 0/1 commands",
    *[f"--> Starting operation: k2fleet: services | step {i}\n    [k2sb-2] No changes" for i in range(400)],
    "--> Results:",
])


def test_a_failed_runs_tail_leads_with_the_first_host_error_and_what_came_before_it() -> None:
    tail = DeployResult(["pyinfra"], 1, "", LOG).tail()
    assert "the journal's line naming the cause" in tail and "Job for k2-firewall.service failed." in tail
    assert tail.index("Error: executed 0/1 commands") < tail.index("--> Results:")
    assert "the journal's line" not in DeployResult(["pyinfra"], 0, "", LOG).tail()  # a passing run: its end only
