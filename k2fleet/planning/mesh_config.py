"""The SSH mesh between fleet hosts (pure rendering).

Only where a process logs into other hosts (``Service.ssh_to``: mpirun's head → its rank
hosts; :func:`mesh_links`): a fleet without one has no mesh at all. Each such head has its
own key pair (never the operator's key); on every host it reaches, a separate sshd on
``k2_mesh_port`` accepts only those heads' keys, only for ``k2_mesh_user``, only from those
heads' addresses; a known_hosts file pins every mesh host's key, so mpirun never prompts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from k2fleet.planning.processes import Plan
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

if TYPE_CHECKING:  # types only: the engines' renderers import this module
    from k2fleet.planning.deployment import Deployment

UNIT = "k2-mesh-sshd.service"


def mesh_dir(dep: Deployment) -> str:
    return f"{dep.s.config_dir}/mesh"


def fleet_addresses(dep: Deployment) -> list[str]:
    return [h.address for h in dep.fleet.hosts]


def mesh_links(plan: Plan) -> dict[str, tuple[str, ...]]:
    """Host that logs into others over the mesh (mpirun's head) → the hosts it logs into;
    empty: the fleet needs no mesh."""
    return {h.name: tuple(t for s in h.services for t in s.ssh_to)
            for h in plan.hosts.values() if any(s.ssh_to for s in h.services)}


def mesh_members(plan: Plan) -> list[str]:
    """The hosts that take part in the mesh (heads and the hosts they reach), in plan order."""
    links = mesh_links(plan)
    involved = set(links) | {t for targets in links.values() for t in targets}
    return [name for name in plan.hosts if name in involved]


def logins_into(plan: Plan, name: str) -> list[str]:
    """The heads that log into host ``name`` over the mesh."""
    return [head for head, targets in mesh_links(plan).items() if name in targets]


def keys_not_held(dep: Deployment, files: dict[str, object]) -> list[str]:
    """The mesh's private keys (and their public halves) a host must not hold: every one not
    among its mesh ``files`` (a rank host once given the fleet's shared client key, a host
    that left the mesh)."""
    d = mesh_dir(dep)
    keys = [f"{d}/id_ed25519", f"{d}/id_ed25519.pub", f"{d}/ssh_host_ed25519_key", f"{d}/ssh_host_ed25519_key.pub"]
    return [k for k in keys if k not in files]


def allow_users(dep: Deployment, sources: list[str] | None = None) -> str:
    """sshd's ``AllowUsers`` words: the mesh user from each of ``sources`` (addresses;
    default every fleet address)."""
    return " ".join(sshd_allow_user(dep.s.mesh_user, a) for a in (fleet_addresses(dep) if sources is None else sources))


def sshd_config(dep: Deployment, entry: HostEntry, allow: str | None = None) -> str:
    """The mesh sshd's config on ``entry``; ``allow``: its :func:`allow_users` words (default
    every fleet address; empty: nobody may log in, ``DenyUsers *``)."""
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
        f"AllowUsers {allow}" if allow else "DenyUsers *",
        "X11Forwarding no",
        "AllowTcpForwarding no",
        "UseDNS no",
        "",
    ])


def authorized_keys(dep: Deployment, public_key: str, sources: list[str] | None = None) -> str:
    """One ``authorized_keys`` line: ``public_key`` only from ``sources`` (addresses; default
    every fleet address), no forwarding."""
    allowed = authorized_keys_from(fleet_addresses(dep) if sources is None else sources)
    return f"{allowed},no-agent-forwarding,no-port-forwarding,no-X11-forwarding {ssh_public_key(public_key)}\n"


def known_hosts(dep: Deployment, host_keys: dict[str, str]) -> str:
    """``[address]:port key`` for every host of ``host_keys`` (host name → public key line)."""
    lines = []
    for h in dep.fleet.hosts:
        if h.name not in host_keys:
            continue
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
        "KillMode=process",  # stopping the listener leaves running sessions (mpirun's orted) alone, as ssh.service does
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ])
