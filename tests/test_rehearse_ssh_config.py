"""Issue #33 item 7, the cheap parts: a rehearsal moves an inventory's hosts (and its bastion)
to sandbox addresses, so the inventory's ssh_config is rewritten to land there with its
meaning kept — every ``Host`` pattern (IPs, names, wildcards, negations) still matched
against the names as written, the same ``ProxyJump``, ``User`` and ``Port``. Checked with
OpenSSH's own parser (``ssh -G``: the configuration ssh would use, no connection made) and
with pyinfra's (paramiko's ``SSHConfig``), on the rewritten file itself. The deploy's own
side channels (k2fleet's ``ssh`` argv) take the file's ``User``/``Port`` as pyinfra does, and
a failing control-machine step is one line, not a traceback. The rehearsal through a real
bastion: tests/test_company_network.py (sandbox)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from k2sandbox import company_network

IP_CONFIG = """\
# the fleet behind the company's jump host, by address
Host jump
    HostName 203.0.113.5
    User ops
    Port 2222

Host 198.51.100.* !198.51.100.99
    ProxyJump jump
    User ops
    Port 2222
    ConnectTimeout 15
"""
MOVES = {"198.51.100.10": "10.213.1.12", "198.51.100.11": "10.213.1.13", "jump": "10.213.0.11"}


def ssh_g(config: Path, host: str) -> dict[str, str]:
    """What OpenSSH would use for ``host`` with ``config`` (``ssh -G``: parses, connects nowhere)."""
    out = subprocess.run(["ssh", "-G", "-F", str(config), host], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)


@pytest.fixture
def hosts(tmp_path: Path) -> list[tuple[str, dict, tuple]]:
    config = tmp_path / "corp.ssh_config"
    config.write_text(IP_CONFIG)
    data = {"ssh_config_file": str(config), "_sudo": True}
    return [("gpu-0", {**data, "ssh_hostname": "198.51.100.10"}, ()),
            ("gpu-1", {**data, "ssh_hostname": "198.51.100.11"}, ())]


def test_an_ip_pattern_bastion_is_found_with_its_user_and_port(hosts) -> None:
    hops = company_network.jump_hosts(hosts)
    assert set(hops) == {"gpu-0", "gpu-1"}
    assert hops["gpu-0"] == company_network.Hop("203.0.113.5", "ops", 2222, "jump")
    # pyinfra logs in with the file's User and Port (its connector lets them win over ssh_user/ssh_port)
    assert company_network.login("gpu-0", hosts[0][1]) == {"user": "ops", "port": 2222, "sudo": True}
    assert company_network.login("gpu-0", {**hosts[0][1], "ssh_user": "root", "ssh_port": 22})["user"] == "ops"
    # IP addresses are not names for the company resolver
    assert company_network.planned_addresses(hosts) == {}


@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs OpenSSH's client (ssh -G)")
def test_the_rewritten_config_keeps_the_meaning_for_openssh(hosts, tmp_path: Path) -> None:
    moved = tmp_path / "moved.ssh_config"
    moved.write_text(company_network.rewrite_ssh_config(IP_CONFIG, MOVES, "Host *\n    IdentitiesOnly yes\n"))
    original = tmp_path / "corp.ssh_config"
    for name, sandbox_address in (("198.51.100.10", "10.213.1.12"), ("198.51.100.11", "10.213.1.13")):
        before, after = ssh_g(original, name), ssh_g(moved, name)
        assert before["hostname"] == name and after["hostname"] == sandbox_address
        for key in ("proxyjump", "user", "port", "connecttimeout"):  # the same way in, through the same jump
            assert after[key] == before[key], key
        assert after["proxyjump"] == "jump"
    jump_before, jump_after = ssh_g(original, "jump"), ssh_g(moved, "jump")
    assert (jump_before["hostname"], jump_after["hostname"]) == ("203.0.113.5", "10.213.0.11")
    assert (jump_after["user"], jump_after["port"]) == ("ops", "2222") and "proxyjump" not in jump_after
    # a negated address keeps its meaning: still not through the jump host
    assert "proxyjump" not in ssh_g(moved, "198.51.100.99")
    assert ssh_g(moved, "192.0.2.1").get("proxyjump") is None  # nor any other address


def test_the_rewritten_config_keeps_the_meaning_for_pyinfra(tmp_path: Path) -> None:
    """pyinfra's own parser (the one its SSH connector connects with) on the rewritten file:
    patterns by name with wildcards, HostName of the file overridden only for moved names."""
    from pyinfra.connectors.sshuserclient.client import get_ssh_config

    text = ("Host bastion.corp.example\n    User ops\n    Port 2222\n"
            "Host *.fleet.corp.example\n    ProxyJump ops@bastion.corp.example:2222\n    User ops\n"
            "Host gpu-?\n    HostName %h.fleet.corp.example\n    ProxyJump bastion.corp.example\n")
    moves = {"gpu-0.fleet.corp.example": "10.213.1.12", "gpu-1": "10.213.1.13", "bastion.corp.example": "10.213.0.11"}
    moved = tmp_path / "moved"
    moved.write_text(company_network.rewrite_ssh_config(text, moves))
    config = get_ssh_config(str(moved))
    a, b, hop = config.lookup("gpu-0.fleet.corp.example"), config.lookup("gpu-1"), config.lookup("bastion.corp.example")
    assert (a["hostname"], a["proxyjump"], a["user"]) == ("10.213.1.12", "ops@bastion.corp.example:2222", "ops")
    assert (b["hostname"], b["proxyjump"]) == ("10.213.1.13", "bastion.corp.example")
    assert (hop["hostname"], hop["user"], hop["port"]) == ("10.213.0.11", "ops", "2222")
    assert config.lookup("gpu-2")["hostname"] == "gpu-2.fleet.corp.example"  # not moved: as written


def test_side_channels_log_in_as_pyinfra_does(hosts) -> None:
    """k2fleet's own ssh (checkpoint transfers, relay tunnels) takes the file's User and Port for
    the host, as pyinfra's connection does: one login for both, on the port the host listens on."""
    from k2fleet.deploy.fleet_run import side_channel

    where, argv, become = side_channel({**hosts[0][1], "ssh_user": "root"}, "gpu-0")
    assert where == "ops@198.51.100.10" and argv[argv.index("-p") + 1] == "2222"
    assert become[:2] == ["sudo", "-n"]
    where, argv, _ = side_channel({"ssh_hostname": "192.0.2.5", "ssh_user": "admin", "ssh_port": 2200}, "n")
    assert where == "admin@192.0.2.5" and argv[argv.index("-p") + 1] == "2200"


def test_a_failing_control_step_is_one_line_not_a_traceback(monkeypatch, capsys, tmp_path: Path) -> None:
    """The second finding: `apt-get download` failing inside the control step (there: a resolver
    that does not know deb.debian.org) ended the deploy in a traceback."""
    from k2fleet.control import deb_bundles
    from k2fleet.deploy import fleet_run
    from tests.inventory_factory import write_inventory

    from k2fleet.cli import load_plan

    # the control machine fetches (the fetcher is not asked of hosts: this State has no inventory)
    dep, plan = load_plan(write_inventory(tmp_path, hosts=1, k2_checkpoint_fetcher="control"))

    def fails(*args, **kwargs):
        raise deb_bundles.BundleError("command failed (100): apt-get download -q haproxy prometheus-node-exporter\n"
                                      "W: Some index files failed to download.\n"
                                      "E: Failed to fetch http://deb.debian.org/x  Temporary failure resolving "
                                      "'deb.debian.org'\n")

    monkeypatch.setattr(fleet_run, "prepare_control_artifacts", fails)
    monkeypatch.setattr(fleet_run, "manifest_pins", lambda dep, fetch: {})  # no Hub here: the pin is not this test's
    monkeypatch.setenv("K2FLEET_STATE_DIR", str(tmp_path / "state"))

    class State:
        k2fleet_checked = (dep, plan)
        k2fleet_dry = False

    with pytest.raises(SystemExit) as stopped:
        fleet_run.fleet_run(State(), [], dry=False)
    assert stopped.value.code == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("k2fleet: the control machine's step failed: command failed (100): apt-get download")
    assert line.endswith("Temporary failure resolving 'deb.debian.org'")
