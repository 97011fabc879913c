"""The SSH mesh between fleet hosts (pure rendering).

A dedicated key pair per deployment (never the operator's key), a separate sshd on
``k2_mesh_port`` that accepts only that key, only for ``k2_mesh_user``, only from
fleet addresses, and a known_hosts file pinning every host's mesh host key — so mpirun
(and any host-to-host SSH an operator runs with it) never prompts.
"""

from __future__ import annotations

from k2fleet.planning.deployment import Deployment
from k2fleet.planning.quoting import (
    authorized_keys_from,
    known_hosts_host,
    ssh_config_word,
    ssh_public_key,
    ssh_user_name,
    sshd_allow_user,
    sshd_config_word,
    systemd_exec,
)
from k2fleet.inventory.spec import HostEntry

UNIT = "k2-mesh-sshd.service"


def mesh_dir(dep: Deployment) -> str:
    return f"{dep.s.config_dir}/mesh"


def fleet_addresses(dep: Deployment) -> list[str]:
    return [h.address for h in dep.fleet.hosts]


def allow_users(dep: Deployment) -> str:
    """sshd's ``AllowUsers`` words: the mesh user from every fleet address (one line for the fleet)."""
    return " ".join(sshd_allow_user(dep.s.mesh_user, a) for a in fleet_addresses(dep))


def sshd_config(dep: Deployment, entry: HostEntry, allow: str | None = None) -> str:
    """The mesh sshd's config on ``entry``; ``allow``: :func:`allow_users` when the caller
    has it already (it is the same on every host)."""
    d = mesh_dir(dep)
    allow = allow_users(dep) if allow is None else allow
    return "\n".join([
        "# k2fleet SSH mesh: a separate sshd for this deployment only.",
        f"Port {dep.s.mesh_port:d}",
        f"ListenAddress {sshd_config_word(entry.address)}",
        f"HostKey {sshd_config_word(f'{d}/ssh_host_ed25519_key')}",
        "PidFile /run/k2-mesh-sshd.pid",
        f"AuthorizedKeysFile {sshd_config_word(f'{d}/authorized_keys', expand=True)}",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PermitRootLogin prohibit-password",
        f"AllowUsers {allow}",
        "X11Forwarding no",
        "AllowTcpForwarding no",
        "UseDNS no",
        "",
    ])


def authorized_keys(dep: Deployment, public_key: str) -> str:
    sources = authorized_keys_from(fleet_addresses(dep))
    return f"{sources},no-agent-forwarding,no-port-forwarding,no-X11-forwarding {ssh_public_key(public_key)}\n"


def known_hosts(dep: Deployment, host_keys: dict[str, str]) -> str:
    """``[address]:port key`` for every host; ``host_keys`` maps host name → public key line."""
    lines = []
    for h in dep.fleet.hosts:
        key_type, key = ssh_public_key(host_keys[h.name]).split(" ")[:2]
        lines.append(f"{known_hosts_host(h.address, dep.s.mesh_port)} {key_type} {key}")
    return "\n".join(lines) + "\n"


def ssh_config(dep: Deployment) -> str:
    """Client options every mesh user (mpirun, rsync) passes with ``-F``."""
    d = mesh_dir(dep)
    return "\n".join([
        "Host *",
        f"  Port {dep.s.mesh_port:d}",
        f"  User {ssh_config_word(ssh_user_name(dep.s.mesh_user))}",
        f"  IdentityFile {ssh_config_word(f'{d}/id_ed25519', expand=True)}",
        "  IdentitiesOnly yes",
        f"  UserKnownHostsFile {ssh_config_word(f'{d}/known_hosts', expand=True)}",
        "  StrictHostKeyChecking yes",
        "  BatchMode yes",
        "",
    ])


def unit_file(dep: Deployment) -> str:
    cfg = f"{mesh_dir(dep)}/sshd_config"
    return "\n".join([
        "# Rendered by k2fleet: the deployment's SSH mesh.",
        "[Unit]",
        "Description=k2fleet SSH mesh (sshd on the mesh port, deployment key only)",
        "After=network-online.target",
        "Wants=network-online.target",
        "",
        "[Service]",
        "RuntimeDirectory=k2-mesh-sshd",
        f"ExecStartPre={systemd_exec(['/bin/mkdir', '-p', '/run/sshd'])}",
        f"ExecStartPre={systemd_exec(['/usr/sbin/sshd', '-t', '-f', cfg])}",
        f"ExecStart={systemd_exec(['/usr/sbin/sshd', '-D', '-e', '-f', cfg])}",
        "Restart=on-failure",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ])
