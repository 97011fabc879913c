"""A sandbox shaped like a company network, for rehearsing an inventory that reaches its
hosts through a bastion (issue #22): the rehearsal keeps the inventory's names, user, port,
sudo and jump host, and maps only addresses (and the credentials: the sandbox's key and
known_hosts stand in for the user's).

The shape, on the sandbox bridge:

- **the bastion** (the first sandbox host): the control machine reaches it at its sandbox
  address; it also holds :data:`BASTION_FLEET_ADDRESS` on the fleet subnet. It takes the
  ProxyJump's user and port. IP forwarding stays off (a new network namespace's default):
  only its sshd's forwarded channels cross it.
- **the fleet hosts**: their addresses are on :data:`FLEET_SUBNET` alone, where the control
  machine has no address and no route, so every connection to them goes through the
  bastion (the control machine holds an ``unreachable`` route for the subnet, removed with
  the sandbox, so nothing leaves by its default route either). They take the inventory's user (passwordless sudo when it uses ``_sudo``) and
  port, and refuse root's SSH login.
- **a resolver**: Debian's dnsmasq, run in the bastion's network namespace, answering the
  inventory's names and nothing else (``--no-resolv``): the fleet names with their fleet
  addresses, the bastion's name with the address of the subnet the question came from
  (``--localise-queries``). The fleet hosts' ``/etc/resolv.conf`` names it, and the deploy's
  control process resolves through it (:meth:`CompanyNetwork.resolving`: a mount namespace
  whose ``/etc/resolv.conf`` names it), so names are resolved the way the inventory expects.
- **the inventory's ssh_config**, rewritten (:func:`rewrite_ssh_config`): each name a connection
  is looked up by (a host's ``ssh_hostname`` — IP or DNS name — and the ProxyJump's host) lands on
  the sandbox address that stands for it, while the file's own ``Host`` patterns, ``ProxyJump``,
  ``User`` and ``Port`` apply as written; a host addressed by IP takes its fleet address as
  ``k2_address`` (an IP is not a name the resolver can move).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k2fleet.inventory.spec import POSIX_USER_RE
from k2sandbox import nspawn as sandbox

FLEET_SUBNET = sandbox.COMPANY_SUBNET  # the fleet hosts' network: no address or route of the control machine's
BASTION_FLEET_ADDRESS = f"{FLEET_SUBNET}.1"
RESOLVER_TIMEOUT_S = 2


class CompanyNetworkError(RuntimeError):
    """The company-shaped sandbox could not be made (one line; the rehearsal reports it)."""


@dataclass(frozen=True)
class Hop:
    """The bastion an inventory's ProxyJump names: its DNS name (or address), user and port, and
    the host part of the ProxyJump as written (``token``: what ssh looks up in the config)."""

    name: str
    user: str
    port: int
    token: str = ""


DEFAULT_SSH_CONFIG = "~/.ssh/config"  # what pyinfra (and ssh) read when a host names no ssh_config_file


def config_file(data: Mapping[str, Any]) -> str | None:
    """The ssh_config a host's connection reads: its ``ssh_config_file``, else the user's own
    ``~/.ssh/config`` when there is one (pyinfra reads it then, as ssh does)."""
    path = data.get("ssh_config_file")
    if path:
        return str(path)
    return DEFAULT_SSH_CONFIG if os.path.isfile(os.path.expanduser(DEFAULT_SSH_CONFIG)) else None


def target(name: str, data: Mapping[str, Any]) -> str:
    """What pyinfra looks a host up by in its ssh_config (``ssh_hostname``, else its name)."""
    return str(data.get("ssh_hostname") or name)


def _config(path: str) -> Any:
    import paramiko

    try:
        return paramiko.SSHConfig.from_path(os.path.expanduser(path))
    except OSError as exc:
        raise CompanyNetworkError(f"ssh_config_file {path}: {exc.strerror or exc}") from None


def jump_hosts(hosts: Sequence[tuple[str, Mapping[str, Any], Any]]) -> dict[str, Hop]:
    """Host name → the one bastion its ``ssh_config_file`` sends it through (ProxyJump), read
    as pyinfra reads it (paramiko's ``SSHConfig.lookup`` of the host's ``ssh_hostname``);
    hosts without one are left out. Several hops, or different bastions, are refused."""
    out: dict[str, Hop] = {}
    for name, data, _ in hosts:
        path = config_file(data)
        if not path:
            continue
        config = _config(str(path))
        found = config.lookup(target(name, data))
        jump = found.get("proxyjump")
        if not jump or jump.lower() == "none":
            continue
        if "," in jump:
            raise CompanyNetworkError(f"{name}: ProxyJump {jump!r} has several hops; a rehearsal makes one bastion")
        user, _, hostport = jump.rpartition("@")
        hop_name, _, port = hostport.partition(":")
        own = config.lookup(hop_name)
        user, port = user or own.get("user") or "root", str(port or own.get("port") or 22)
        if not re.fullmatch(POSIX_USER_RE, user) or not port.isdigit() or not 1 <= int(port) <= 65535 \
                or not re.fullmatch(r"[A-Za-z0-9.-]{1,253}", own.get("hostname", hop_name)):
            raise CompanyNetworkError(f"{name}: ProxyJump {jump!r}: a rehearsal takes a user name, a host name and "
                                      "a port 1-65535")
        out[name] = Hop(own.get("hostname", hop_name), user, int(port), hop_name)
    if len(set(out.values())) > 1:
        raise CompanyNetworkError("the inventory's hosts go through different bastions; a rehearsal makes one")
    return out


def unknown(name: str) -> list[str]:
    """The planning resolver's answer for a name the company network does not serve."""
    raise OSError(f"{name}: not a name of the company network")


def fleet_address(sandbox_address: str) -> str:
    """A fleet host's address on :data:`FLEET_SUBNET` (its sandbox address's last octet).

    >>> fleet_address("10.213.0.12") == f"{FLEET_SUBNET}.12"
    True
    """
    return f"{FLEET_SUBNET}.{sandbox_address.rsplit('.', 1)[1]}"


def planned_addresses(hosts: Sequence[tuple[str, Mapping[str, Any], Any]]) -> dict[str, str]:
    """Each fleet host's DNS name (``ssh_hostname``, else its name, and a ``k2_address`` that is a
    name) → the fleet address it will have: the i-th inventory host is sandbox host i + 2 (the
    bastion is the first)."""
    out = {}
    for i, (name, data, _) in enumerate(hosts):
        for where in (data.get("k2_address"), target(name, data)):
            if where and not is_ip(str(where)):
                out[str(where)] = fleet_address(sandbox.host_address(i + 2))
    return out


def is_ip(text: str) -> bool:
    """Is ``text`` an IP address (not a name)?

    >>> is_ip("198.51.100.7"), is_ip("gpu-0.fleet.corp.example")
    (True, False)
    """
    import ipaddress

    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def login(name: str, data: Mapping[str, Any]) -> dict[str, Any]:
    """The user and port pyinfra logs into a host with: its ssh_config's ``User``/``Port`` for the
    host when the file gives them (pyinfra's connector lets them win), else ``ssh_user``/``ssh_port``
    (root, 22); and ``_sudo``.

    >>> login("n1", {"ssh_user": "ops", "ssh_port": 2222, "_sudo": True})
    {'user': 'ops', 'port': 2222, 'sudo': True}
    """
    user, port = str(data.get("ssh_user") or "root"), int(data.get("ssh_port") or 22)
    path = config_file(data)
    if path:
        found = _config(path).lookup(target(name, data))
        user, port = str(found.get("user") or user), int(found.get("port") or port)
    return {"user": user, "port": port, "sudo": bool(data.get("_sudo"))}


def rewrite_ssh_config(text: str, moves: Mapping[str, str], header: str = "") -> str:
    """The inventory's ssh_config ``text`` made to land on the sandbox with its meaning kept.
    ``moves``: each name ssh looks a connection up by — a fleet host's ``ssh_hostname`` (or host
    name), be it an IP or a DNS name, and the ProxyJump's host — → the sandbox address that
    stands for it. A ``Host NAME`` block giving ``HostName ADDRESS`` comes first for each (ssh and
    pyinfra keep the first value obtained), then ``header`` (the sandbox's credentials), then the
    file unchanged: its ``Host`` patterns (IPs, names, wildcards, negations) are still matched
    against the names as written, so the same ``ProxyJump``, ``User``, ``Port`` and the rest apply,
    and only where each connection lands moves.

    >>> import paramiko
    >>> text = ("Host bastion\\n    HostName 203.0.113.5\\n    User ops\\n    Port 2222\\n"
    ...         "Host 198.51.100.* !198.51.100.99\\n    ProxyJump bastion\\n    User deploy\\n")
    >>> moved = rewrite_ssh_config(text, {"198.51.100.10": "10.213.1.12", "bastion": "10.213.0.11"})
    >>> cfg = paramiko.SSHConfig.from_text(moved)
    >>> [cfg.lookup("198.51.100.10").get(k) for k in ("hostname", "proxyjump", "user")]
    ['10.213.1.12', 'bastion', 'deploy']
    >>> [cfg.lookup("bastion").get(k) for k in ("hostname", "user", "port")]
    ['10.213.0.11', 'ops', '2222']
    """
    blocks = "".join(f"Host {name}\n    HostName {address}\n" for name, address in moves.items())
    return f"# k2fleet rehearse: the sandbox's addresses, then the inventory's file unchanged\n{blocks}\n{header}\n{text}"


@dataclass
class CompanyNetwork:
    """The company-shaped sandbox made by :func:`build`."""

    bastion: sandbox.SandboxHost
    hop: Hop
    names: dict[str, str]  # DNS name → fleet address
    resolv_conf: Path
    known_hosts: Path
    ssh_config: dict[str, Path]  # the inventory's ssh_config_file → its rehearsal copy
    cursors: dict[str, str]  # fleet host → its sshd journal's cursor once the network was shaped
    resolver: subprocess.Popen[bytes] | None = None
    overlay: dict[str, dict[str, Any]] = field(default_factory=dict)

    def resolve(self, name: str) -> list[str]:
        """The sandbox resolver's answer for ``name``, for planning in this process (the gate's
        ``resolver`` seam): the same table dnsmasq serves."""
        return [self.names[name]] if name in self.names else unknown(name)

    def resolving(self, argv: list[str]) -> list[str]:
        """``argv`` run in a mount namespace whose ``/etc/resolv.conf`` names the sandbox's
        resolver (the control machine's own resolver is left as it is)."""
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                'mount --bind "$0" /etc/resolv.conf && exec "$@"', str(self.resolv_conf), *argv]

    def close(self) -> None:
        if self.resolver is not None and self.resolver.poll() is None:
            self.resolver.send_signal(signal.SIGTERM)
            try:
                self.resolver.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.resolver.kill()


def _root(host: sandbox.SandboxHost, command: str, what: str) -> None:
    done = sandbox.ssh(host, command, timeout=60)
    if done.returncode:
        raise CompanyNetworkError(f"{host.name}: {what}: {done.stderr.strip()[-300:]}")


def _ip(netns: str, *args: str) -> None:
    done = subprocess.run(["ip", "-n", netns, *args], capture_output=True, text=True)
    if done.returncode:
        raise CompanyNetworkError(f"ip -n {netns} {' '.join(args)}: {done.stderr.strip()}")


def _user_step(user: str, sudo: bool) -> str:
    q = shlex.quote(user)
    step = (f"{{ id {q} >/dev/null 2>&1 || useradd --create-home --shell /bin/bash {q}; }} && usermod -p '*' {q} && "
            f"install -d -m 700 -o {q} -g {q} ~{user}/.ssh && "
            f"install -m 600 -o {q} -g {q} /root/.ssh/authorized_keys ~{user}/.ssh/authorized_keys")
    if sudo:
        step += (f" && echo {shlex.quote(user + ' ALL=(ALL) NOPASSWD:ALL')} > /etc/sudoers.d/k2-rehearse"
                 " && chmod 440 /etc/sudoers.d/k2-rehearse")
    return step


def _sshd_step(port: int, deny_root: bool) -> str:
    lines = [f"Port {port}"] + (["DenyUsers root"] if deny_root else ["Port 22"] if port != 22 else [])
    text = "\\n".join(dict.fromkeys(lines)) + "\\n"
    return (f"install -d /etc/ssh/sshd_config.d && printf '{text}' > /etc/ssh/sshd_config.d/k2-rehearse.conf && "
            "{ grep -q '^Include /etc/ssh/sshd_config.d' /etc/ssh/sshd_config || "
            "sed -i '1i Include /etc/ssh/sshd_config.d/*.conf' /etc/ssh/sshd_config; } && systemctl reload ssh")


def build(hosts: Sequence[tuple[str, Mapping[str, Any], Any]], kept: Mapping[str, Mapping[str, Any]], hop: Hop,
          sb_hosts: Sequence[sandbox.SandboxHost], work: Path) -> CompanyNetwork:
    """Shape the booted sandbox (``sb_hosts``: the bastion, then one per inventory host) like
    a company network (see the module doc) and return it, its resolver running."""
    if shutil.which("dnsmasq") is None:
        raise CompanyNetworkError("dnsmasq is not installed on the control machine (apt-get install dnsmasq-base)")
    bastion, fleet = sb_hosts[0], list(sb_hosts[1:])
    names = planned_addresses(hosts)
    pinned = {line.split(" ", 1)[0]: line.split(" ", 1)[1]
              for line in Path(bastion.ssh_known_hosts_file).read_text().splitlines() if " " in line}
    # the bastion: the hop's user and port; the fleet hosts: the inventory's, root refused
    bastion_steps = [f"printf 'nameserver {BASTION_FLEET_ADDRESS}\\n' > /etc/resolv.conf",  # its sshd resolves jump targets
                     _user_step(hop.user, False), _sshd_step(hop.port, False)]
    _root(bastion, " && ".join(f"{{ {s}; }}" for s in bastion_steps), "the bastion's way in")
    cursors: dict[str, str] = {}
    for (name, _, _), sb in zip(hosts, fleet):
        mine = kept[name]
        steps = [f"printf 'nameserver {BASTION_FLEET_ADDRESS}\\noptions timeout:{RESOLVER_TIMEOUT_S}\\n' > /etc/resolv.conf"]
        if mine["user"] != "root":
            steps.append(_user_step(mine["user"], mine["sudo"]))
        steps.append(_sshd_step(mine["port"], deny_root=mine["user"] != "root"))
        steps.append("journalctl -q -u ssh -n 0 --show-cursor")  # logins after this one are the rehearsal's to count
        done = sandbox.ssh(sb, " && ".join(f"{{ {s}; }}" for s in steps), timeout=60)
        cursor = done.stdout.strip().rpartition("-- cursor: ")[2]
        if done.returncode or not cursor:
            raise CompanyNetworkError(f"{sb.name}: the inventory's way in: {done.stderr.strip()[-300:]}")
        cursors[sb.name] = cursor
    # addresses: the fleet moves to the fleet subnet; the bastion stands on both
    for sb in fleet:
        _ip(sb.name, "addr", "add", f"{fleet_address(sb.address)}/{sandbox.PREFIX_LEN}", "dev", sandbox.HOST_NIC)
        _ip(sb.name, "addr", "del", f"{sb.address}/{sandbox.PREFIX_LEN}", "dev", sandbox.HOST_NIC)
    _ip(bastion.name, "addr", "add", f"{BASTION_FLEET_ADDRESS}/{sandbox.PREFIX_LEN}", "dev", sandbox.HOST_NIC)
    # here, the fleet subnet is unreachable (not sent to the default route); removed with the sandbox
    route = subprocess.run(["ip", "route", "replace", "unreachable", f"{FLEET_SUBNET}.0/{sandbox.PREFIX_LEN}"],
                           capture_output=True, text=True)
    if route.returncode:
        raise CompanyNetworkError(f"the unreachable route for {FLEET_SUBNET}.0/{sandbox.PREFIX_LEN}: {route.stderr.strip()}")
    # the resolver, in the bastion's network namespace
    hosts_file = work / "company-hosts"
    bastion_names = [n for n in dict.fromkeys((hop.name, hop.token)) if n and not is_ip(n)]
    hosts_file.write_text("".join(f"{address} {name}\n" for name, address in names.items())
                          + "".join(f"{bastion.address} {n}\n{BASTION_FLEET_ADDRESS} {n}\n" for n in bastion_names))
    resolver = subprocess.Popen(
        ["ip", "netns", "exec", bastion.name, "dnsmasq", "--keep-in-foreground", "--no-resolv", "--no-hosts",
         "--no-poll", f"--addn-hosts={hosts_file}", f"--listen-address={bastion.address}",
         f"--listen-address={BASTION_FLEET_ADDRESS}", "--bind-interfaces", "--localise-queries", "--user=root",
         "--pid-file", f"--log-facility={work / 'dnsmasq.log'}"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    resolv_conf = work / "resolv.conf"
    resolv_conf.write_text(f"nameserver {bastion.address}\noptions timeout:{RESOLVER_TIMEOUT_S} attempts:2\n")
    # credentials: the sandbox's key and host keys, under the inventory's names and ports
    def pin(where: str, port: int, key: str) -> str:
        return f"[{where}]:{port} {key}" if port != 22 else f"{where} {key}"

    known = [pin(n, hop.port, pinned[bastion.address]) for n in dict.fromkeys((hop.name, hop.token, bastion.address)) if n]
    for (name, data, _), sb in zip(hosts, fleet):
        for port in dict.fromkeys((kept[name]["port"], *kept[name].get("ports", ()))):
            known += [pin(target(name, data), port, pinned[sb.address]), pin(fleet_address(sb.address), port, pinned[sb.address])]
    known_hosts = work / "company-known_hosts"
    known_hosts.write_text("\n".join(known) + "\n")
    # every connection lands where it stands in the sandbox: the fleet hosts' names (IPs or DNS
    # names, as the inventory looks them up) on their fleet addresses, the ProxyJump's host on the
    # bastion's sandbox address
    moves = {target(name, data): fleet_address(sb.address) for (name, data, _), sb in zip(hosts, fleet)}
    moves[hop.token or hop.name] = bastion.address
    copies: dict[str, Path] = {}
    for _, data, _ in hosts:
        original = config_file(data) or ""
        if original and original not in copies:
            copy = work / f"ssh_config.{len(copies)}"
            body = Path(os.path.expanduser(original)).read_text()
            # first obtained value wins (ssh_config(5)): the sandbox's addresses and credentials, then
            # the inventory's file
            copy.write_text(rewrite_ssh_config(body, moves, f"Host *\n    IdentityFile {bastion.ssh_key}\n"
                                               f"    IdentitiesOnly yes\n    UserKnownHostsFile {known_hosts}\n"
                                               "    StrictHostKeyChecking yes\n"))
            copies[original] = copy
    net = CompanyNetwork(bastion, hop, names, resolv_conf, known_hosts, copies, cursors, resolver)
    for (name, data, _), sb in zip(hosts, fleet):
        net.overlay[name] = {"ssh_key": bastion.ssh_key, "ssh_known_hosts_file": str(known_hosts),
                             "ssh_strict_host_key_checking": "yes", "k2_nic": sandbox.HOST_NIC}
        where = str(data.get("k2_address") or target(name, data))
        if is_ip(where):  # an address of the real network: the host's fleet address stands for it
            net.overlay[name]["k2_address"] = fleet_address(sb.address)
        if config_file(data):
            net.overlay[name]["ssh_config_file"] = str(copies[config_file(data) or ""])
    return net


def logins(net: CompanyNetwork, host: sandbox.SandboxHost, user: str, port: int) -> list[str]:
    """The source addresses of every SSH login the fleet host ``host`` accepted since the
    network was shaped (its sshd's journal after :attr:`CompanyNetwork.cursors`), read
    through the bastion as ``user`` with sudo."""
    config = net.known_hosts.with_name("company-ssh_config")  # the jump's own ssh reads only the file's settings
    config.write_text(f"Host *\n    IdentityFile {host.ssh_key}\n    IdentitiesOnly yes\n    BatchMode yes\n"
                      f"    UserKnownHostsFile {net.known_hosts}\n    StrictHostKeyChecking yes\n"
                      f"Host {FLEET_SUBNET}.*\n    ProxyJump {net.hop.user}@{net.bastion.address}:{net.hop.port}\n")
    argv = ["ssh", "-F", str(config), "-p", str(port), f"{user}@{fleet_address(host.address)}",
            f"sudo -n journalctl -q -o cat -u ssh --no-pager --after-cursor={shlex.quote(net.cursors[host.name])} "
            "| grep -o 'Accepted publickey for [^ ]* from [^ ]*'"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if done.returncode:
        raise CompanyNetworkError(f"{host.name}: reading its SSH logins: {done.stderr.strip()[-300:]}")
    return [line.rsplit(" ", 1)[1] for line in done.stdout.splitlines() if line.strip()]
