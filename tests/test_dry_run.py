"""``pyinfra --dry`` changes nothing: not the hosts, not the control machine.

On a deployed sandbox fleet, a dry run that would change an engine flag leaves every
file k2fleet manages on every host byte-identical (and every unit's MainPID), and the
control machine's deployment state too. On a fresh control machine (no mesh keys yet)
a dry run creates no state directory at all: the control-machine step only runs for
real runs (``k2fleet.control.artifacts``), the dry run only reads.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from k2sandbox.harness import SandboxFleet, main_pid, ssh

pytestmark = pytest.mark.sandbox

HOST_SNAPSHOT = ("find /etc/k2fleet /opt/k2fleet /srv/k2fleet /etc/systemd/system -xdev -type f "
                 "\\( -path '/etc/systemd/system/k2-*' -o -path '/etc/k2fleet/*' -o -path '/opt/k2fleet/*' "
                 "-o -path '/srv/k2fleet/*' \\) -print0 2>/dev/null | sort -z | xargs -0 sha256sum")


def control_snapshot(directory: Path) -> dict[str, str]:
    if not directory.exists():
        return {}
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def host_snapshot(fleet: SandboxFleet) -> dict[str, tuple[str, int]]:
    return {h["name"]: (ssh(h, HOST_SNAPSHOT).stdout, main_pid(h, "k2-vllm.service")) for h in fleet.hosts}


def test_dry_run_leaves_hosts_and_control_machine_byte_identical(fleet: SandboxFleet) -> None:
    fleet.ensure_deployed()
    state = Path(fleet.env["K2FLEET_STATE_DIR"])
    hosts_before, control_before = host_snapshot(fleet), control_snapshot(state)
    assert all(files.count("\n") > 10 for files, _ in hosts_before.values()), hosts_before
    assert any(name.endswith("relay.secret") for name in control_before), control_before  # (a vLLM fleet has no mesh keys)

    assert all(pid > 0 for _, pid in hosts_before.values()), hosts_before  # the engines run: a restart would show
    dry = fleet.deploy({"k2_engine_args": {"max-num-seqs": 8}}, extra=("--dry",))
    assert dry.returncode == 0, dry.tail()
    # not vacuous: the dry run planned the change (pyinfra's --json plan; a settled fleet plans
    # no operation at all, as the dry run without the change shows), and made none
    assert dry.payload is not None and dry.payload["results"] is None, dry.tail()
    assert [op for op in dry.payload["plan"] if "unit, env and config of k2-vllm" in op["name"]], dry.payload["plan"]
    # and only what it needs: the roles plan from their records, so the dry plan names the engine
    # unit's write, systemd's reload and the restarts (instance by instance, gated), the steps of
    # the fleet's order (every host plans them, commands only where needed) and the health gate —
    # no other role's operation (before the records, every role's operation was planned on every
    # host, gated by _if at execution time, and the dry plan listed them all)
    fleet_steps = ("k2-vllm", "reload systemd units", "health gate", "load balancer",
                   "checkpoint: check every file", "reachability: open every peer's rendezvous ports")
    names = [op["name"] for op in dry.payload["plan"]]
    print("\n".join(names))
    assert all(any(w in name for w in fleet_steps) for name in names), names
    settled = fleet.deploy(extra=("--dry",))
    assert settled.returncode == 0 and settled.payload is not None and settled.payload["plan"] == [], settled.tail()
    assert host_snapshot(fleet) == hosts_before
    assert control_snapshot(state) == control_before


def test_dry_run_on_a_fresh_control_machine_creates_no_state(fleet: SandboxFleet, tmp_path: Path) -> None:
    fleet.ensure_up()
    fresh = tmp_path / "fresh-state"
    dry = fleet.deploy(env={"K2FLEET_STATE_DIR": str(fresh)}, extra=("--dry",))
    assert dry.returncode == 0, dry.tail()
    assert not fresh.exists(), sorted(os.listdir(fresh))


def test_a_bad_value_with_pyinfra_started_outside_the_checkout_is_one_line_once(fleet: SandboxFleet,
                                                                               tmp_path: Path) -> None:
    """pyinfra run from another directory never reads k2fleet's config.py: the gate comes
    in through k2fleet's pyinfra entry point when it is registered, else the deploy file
    refuses; either way the gate's one line, once, exit 2, no traceback, no host changes."""
    from k2sandbox.harness import ROOT, pyinfra_argv
    from k2sandbox.pyinfra_cli import run_pyinfra

    fleet.ensure_deployed()
    before = host_snapshot(fleet)
    argv = pyinfra_argv(str(ROOT / "inventories" / "sandbox.py"), {"k2_tp": "eight"}, (),
                        str(ROOT / "deploys" / "kimi.py"))
    out = run_pyinfra(argv, fleet.env, cwd=tmp_path)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2, out.tail()
    # with k2fleet's pyinfra.connectors entry point registered, the gate refuses before connecting
    # (tests/test_gate_outside_checkout.py); without it, the deploy file does, naming how to get the gate
    from importlib.metadata import entry_points

    gated = any(ep.name == "k2fleet" for ep in entry_points(group="pyinfra.connectors"))
    assert len(errors) == 1 and "k2_tp" in errors[0] and (gated or "--config" in errors[0]), out.stderr[-3000:]
    assert "Traceback" not in out.stderr + out.stdout
    assert host_snapshot(fleet) == before
