"""A fleet reached as a non-root user with sudo, root SSH login refused (issue #22's first
part, on the real sandbox: sshd, sudo, systemd): the deploy from bare hosts — facts,
uploads (private files too), packages, the checkpoint's relay transfers over the control
machine's own SSH, units, health gates — goes through ``ops`` + ``sudo`` alone, the
endpoint serves (on the host's fleet address only: ``k2_bind_address: fleet``), and a
re-run changes nothing."""

from __future__ import annotations

import pytest

from k2sandbox.harness import SandboxFleet, http_json, ssh

pytestmark = pytest.mark.sandbox
SANDBOX_HOSTS = 2
SANDBOX_DOCKER = False
OPS = {"ssh_user": "ops", "_sudo": True, "k2_bind_address": "fleet"}


def make_ops_only(host: dict) -> None:
    """``ops`` with passwordless sudo and root's authorized key; root's SSH login refused."""
    ssh(host, "id ops >/dev/null 2>&1 || useradd --create-home --shell /bin/bash ops; usermod -p '*' ops; "
              "install -d -m 700 -o ops -g ops ~ops/.ssh && install -m 600 -o ops -g ops /root/.ssh/authorized_keys "
              "~ops/.ssh/authorized_keys && echo 'ops ALL=(ALL) NOPASSWD:ALL' > /etc/sudoers.d/ops && "
              "chmod 440 /etc/sudoers.d/ops && install -d /etc/ssh/sshd_config.d && "
              "echo 'DenyUsers root' > /etc/ssh/sshd_config.d/k2-no-root.conf && "
              "grep -q '^Include /etc/ssh/sshd_config.d' /etc/ssh/sshd_config || "
              "sed -i '1i Include /etc/ssh/sshd_config.d/*.conf' /etc/ssh/sshd_config; "
              "systemctl reload ssh")


def ssh_as_ops(host: dict, command: str):
    import subprocess
    return subprocess.run(["ssh", "-i", host["ssh_key"], "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
                           "-o", f"UserKnownHostsFile={host['ssh_known_hosts_file']}", f"ops@{host['address']}", command],
                          capture_output=True, text=True, timeout=60)


def test_a_sudo_user_deploys_the_fleet_without_root_ssh(sandbox_fleet: SandboxFleet) -> None:
    fleet = sandbox_fleet
    for host in fleet.hosts:
        make_ops_only(host)
        refused = ssh(host, "true", check=False)
        assert refused.returncode != 0, f"{host['name']}: root SSH login still works"
    first = fleet.deploy(OPS)
    assert first.returncode == 0, first.tail()
    # the deploy ends with where it serves and a line to try it
    assert "k2fleet: serving " in first.log and "k2fleet: try: curl -s http://" in first.log, first.tail()
    head = fleet.hosts[0]
    status, models = http_json(f"http://{head['address']}:8000/v1/models")
    assert status == 200, models
    body = {"model": models["data"][0]["id"], "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16}
    status, answer = http_json(f"http://{head['address']}:8000/v1/chat/completions", body)
    assert status == 200 and answer["choices"][0]["message"]["content"].strip(), answer
    # k2_bind_address: fleet — the engine listens on the host's fleet address alone
    loopback = ssh_as_ops(head, "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 8000), 3)\"")
    assert loopback.returncode != 0, "the engine still listens on 127.0.0.1"
    again = fleet.deploy(OPS)
    assert again.returncode == 0 and again.changed == 0, again.changed_operations or again.tail()
