"""The closed fleet on the sandbox: ``inventories/sandbox.py`` deployed as it is (k2_firewall
on by default) to 2 hosts booted without the Docker flags (nspawn gives them
CAP_NET_ADMIN only: the firewall's own capability), seen from outside the fleet (the
control machine, 10.213.0.1 on the sandbox bridge) and from inside (the other host)."""

from __future__ import annotations

import socket

import pytest

from k2sandbox.harness import SandboxFleet, http_json, ssh

pytestmark = pytest.mark.sandbox

SANDBOX_HOSTS = 2
SANDBOX_DOCKER = False
MESH_PORT, EPHEMERAL_PORT, OTHER_PORT = 2233, 40123, 9123  # a vLLM fleet runs no mesh sshd: a stand-in listens there


def from_control(address: str, port: int) -> str:
    """'open', 'refused' or 'timeout': a TCP connect from the control machine."""
    try:
        with socket.create_connection((address, port), timeout=3):
            return "open"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "timeout"


def from_host(host: dict, address: str, port: int) -> str:
    code = ("import socket\ntry:\n    socket.create_connection(({a!r}, {p}), timeout=3).close(); print('open')\n"
            "except ConnectionRefusedError:\n    print('refused')\nexcept OSError:\n    print('timeout')\n")
    return ssh(host, f"python3 -c {quote(code.format(a=address, p=port))}").stdout.strip()


def quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def listen(host: dict, port: int) -> None:
    """A listener on every address of ``host`` at ``port``, as a transient unit (not k2fleet's)."""
    ssh(host, f"systemctl stop k2fw-probe-{port} 2>/dev/null; systemd-run --unit k2fw-probe-{port} "
              f"python3 -m http.server {port} --bind 0.0.0.0 && for i in $(seq 50); do "
              f"python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}), timeout=1)' 2>/dev/null "
              "&& exit 0; sleep 0.1; done; exit 1")


def test_rendezvous_ports_are_the_fleets_the_api_and_ssh_everyones(fleet: SandboxFleet) -> None:
    result = fleet.deploy()
    assert result.returncode == 0, result.tail()  # the health gate passed with the table loaded
    one, two = fleet.hosts
    table = ssh(one, "nft list table inet k2fleet").stdout
    assert "k2fleet rules" in table and "policy accept" in table
    assert ssh(one, "systemctl is-enabled k2-firewall.service").stdout.strip() == "enabled"
    for port in (MESH_PORT, EPHEMERAL_PORT, OTHER_PORT):
        listen(one, port)
    try:
        addr = one["address"]
        # outside the fleet: the mesh sshd and an ephemeral-range port are closed (TCP reset) ...
        assert from_control(addr, MESH_PORT) == "refused"
        assert from_control(addr, EPHEMERAL_PORT) == "refused"
        # ... while the fleet reaches both (so it was the table, not a missing listener)
        assert from_host(two, addr, MESH_PORT) == "open"
        assert from_host(two, addr, EPHEMERAL_PORT) == "open"
        # SSH, the API and a port k2fleet does not use stay reachable from outside
        assert from_control(addr, 22) == "open"
        assert from_control(addr, OTHER_PORT) == "open"
        status, models = http_json(f"http://{addr}:8000/v1/models")
        assert status == 200, models
    finally:
        for port in (MESH_PORT, EPHEMERAL_PORT, OTHER_PORT):
            ssh(one, f"systemctl stop k2fw-probe-{port}", check=False)
    again = fleet.deploy()
    assert again.returncode == 0 and again.changed == 0, again.changed_operations or again.tail()


def test_a_flushed_table_comes_back_and_off_removes_it(fleet: SandboxFleet) -> None:
    fleet.ensure_deployed()
    one = fleet.hosts[0]
    listen(one, MESH_PORT)  # the stand-in listener on the mesh port (a vLLM fleet has no mesh)
    ssh(one, "nft flush ruleset")
    assert from_control(one["address"], MESH_PORT) == "open"  # someone else's flush: nothing rejects
    back = fleet.deploy()
    assert back.returncode == 0 and back.changed > 0, back.tail()
    assert "k2fleet rules" in ssh(one, "nft list table inet k2fleet").stdout
    assert from_control(one["address"], MESH_PORT) == "refused"
    off = fleet.deploy({"k2_firewall": False})
    assert off.returncode == 0, off.tail()
    for host in fleet.hosts:
        assert ssh(host, "nft list table inet k2fleet", check=False).returncode != 0
        assert ssh(host, "ls /etc/systemd/system/k2-firewall.service /etc/k2fleet/firewall.nft", check=False).returncode != 0
    assert from_control(one["address"], MESH_PORT) == "open"
    ssh(one, f"systemctl stop k2fw-probe-{MESH_PORT}", check=False)


def test_no_local_user_binds_a_port_k2fleet_serves_on(fleet: SandboxFleet) -> None:
    """Hosts booted without the Docker flags (/proc/sys/net writable as on a real host, nothing
    more): the deploy raised net.ipv4.ip_unprivileged_port_start (k2fleet's drop-in), so uid
    65534 binds neither the API port nor the relay's, even while the engine is stopped (a
    rolling restart's window); a port above the value stays an ordinary user's."""
    fleet.ensure_deployed()
    one = fleet.hosts[0]
    probe = ("import errno, socket\n"
             "for port in (8000, 29700, 29701):\n"
             "    try:\n        socket.socket().bind(('127.0.0.1', port)); print(port, 'ok')\n"
             "    except OSError as e:\n        print(port, errno.errorcode[e.errno])\n")
    seen = ssh(one, "cat /proc/sys/net/ipv4/ip_unprivileged_port_start; systemctl stop k2-vllm.service; "
                    f"setpriv --reuid=65534 --regid=65534 --clear-groups python3 -c {quote(probe)}; "
                    "systemctl start k2-vllm.service").stdout.splitlines()
    assert seen == ["29701", "8000 EACCES", "29700 EACCES", "29701 ok"], seen
    again = fleet.deploy()  # the engine back, healthy; the value settled: no operation for it
    assert again.returncode == 0 and not [o for o in again.changed_operations if "privileged" in o], again.tail()
