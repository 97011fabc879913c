"""A closed fleet: each host's nftables rules, computed from the plan (pure).

:func:`host_firewall` lists every port k2fleet's processes listen on, on one host, with who
may reach it, and renders k2fleet's own table ``inet k2fleet`` from that list:

- the SSH port pyinfra reaches the host on (``ssh_port``, default 22; 22 too): anyone,
  never closed;
- the API port (``k2_port``; the PD router's ``k2_router_port``): ``k2_api_clients``
  (and the fleet), or anyone when the key is unset. Behind the API front
  (:mod:`k2fleet.planning.api_front`) it is HAProxy's; the engine's own
  ``k2_api_backend_port`` listens on 127.0.0.1 only and is closed to all but the fleet too;
  the table's output chain resets a loopback connection to it from any socket not root's
  (another local user: the engine takes no key, the front is its only client). Metrics are served on the API
  port (vLLM and SGLang ``/metrics``); k2fleet plans no separate metrics port, so a
  scraper is an API client;
- every rendezvous and control port, only from the fleet's own addresses: Ray's GCS
  (``k2_ray_port``), its client server and worker ports (``ray start`` defaults
  10001 and 10002–19999) and dashboard (8265); torch's store (``k2_master_port``); vLLM's
  DP RPC (``k2_dp_rpc_port``); SGLang's dist-init port and the ZMQ ports SGLang derives from
  it (dist-init + 1 … + 8 + DP size), its NCCL store port (chosen at random in API + 100 …
  API + 1100); the PD bootstrap port and the PD backends' API ports (the router reaches
  them); the mesh sshd (``k2_mesh_port``); the checkpoint relay (``k2_relay_port``); and, on
  hosts that run engine ranks, the kernel's ephemeral range 32768–60999, where NCCL, Gloo,
  ZMQ, Ray's node processes and MPI bind the ports nobody names.

The fleet's addresses (every host's fleet IP — ``k2_address``, else ``ssh_hostname``, a DNS
name resolved once on the control machine by the gate — and IP ``ssh_hostname``) may reach any
port of any fleet host: ranks meet on ports chosen at run time. The table's input chain
has policy accept and only rejects new TCP connections to the ports above from
elsewhere: traffic to other ports, and other tables' rules, are left as they are (a packet
still has to pass every other table). It is loaded atomically (``nft -f``: create, delete,
define, in one transaction) by ``k2-firewall.service``, a oneshot ordered before the
network and before every k2fleet unit, so it holds from boot on.

:func:`format_network` (``k2fleet plan``) and :func:`network_json` (``plan --json``'s
``network``) give a network team each host's list, whether ``k2_firewall`` is on or not: the
places it fetches from (:func:`k2fleet.planning.fetches.host_fetches`, host and port), its
ports from outside the fleet (:func:`host_openings`), and every port between fleet hosts.

>>> Opening(2233, 2233, FLEET, "k2_mesh_port").ports
'2233'
>>> Opening(32768, 60999, FLEET, "ephemeral").ports
'32768-60999'
"""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

from k2fleet.planning.api_front import BACKEND_KEY
from k2fleet.planning.deployment import Deployment
from k2fleet.planning.fetches import Fetch, closed, destinations, host_fetches
from k2fleet.planning.mesh_config import UNIT as MESH_UNIT
from k2fleet.planning.metrics import exporter_ports
from k2fleet.planning.processes import HostPlan, Plan
from k2fleet.planning.quoting import shell_word, systemd_exec, systemd_value

UNIT = "k2-firewall.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT}"
TABLE = "inet k2fleet"
NFT = "/usr/sbin/nft"
CHECK = "firewall"  # the HostState check: the loaded table is the rules file's
PACKAGE = "nftables"

ANYONE, FLEET, CLIENTS, SCRAPERS = "anyone", "fleet", "api-clients", "metrics-scrapers"
EPHEMERAL = (32768, 60999)  # Linux's default net.ipv4.ip_local_port_range
RAY_CLIENT_AND_WORKERS = (10001, 19999)  # ray start: --ray-client-server-port 10001, --min/--max-worker-port 10002-19999
RAY_DASHBOARD = 8265
API_KEYS = ("k2_port", "k2_router_port", "k2_load_balancer_port")  # the API: k2_api_clients
PORT_WHAT = {
    "k2_ray_port": "Ray GCS",
    "k2_master_port": "torch distributed store (--master-port)",
    "k2_dp_rpc_port": "vLLM DP RPC",
    "k2_dist_init_port": "SGLang --dist-init-addr store",
    "k2_bootstrap_port": "SGLang PD bootstrap",
    "k2_api_backend_port": "the engine behind the API front (listens on 127.0.0.1 only)",
}


EGRESS_ALWAYS = (  # what k2_egress: mirrors-only lets every host send besides the fleet and the mirrors
    ('udp dport 53 accept', "DNS (the hosts' resolvers)"),
    ('tcp dport 53 accept', "DNS over TCP"),
    ('udp dport 123 accept', "NTP"),
    ('udp dport { 67, 547 } accept', "DHCP/DHCPv6 renewals"),
    ('meta l4proto { icmp, ipv6-icmp } accept', "ICMP: IPv6 neighbour discovery, path MTU"),
)


def egress_names(dep: Deployment) -> list[str]:
    """Every host name the hosts' plans fetch from (sorted,
    :func:`k2fleet.planning.fetches.destinations`): the repositories of each host's bootstrap
    (``k2_package_source: apt``; ``k2_os_mirror`` and ``k2_os_security_mirror``, NVIDIA's or ``k2_nvidia_repo``, the container
    toolkit's or ``k2_container_toolkit_repo``, Docker's or ``k2_docker_repo``, AMD's) and their
    keys' URLs, the pip index of a host venv install (``k2_pypi_index``, else PyPI), the Hub
    endpoint of a fetcher host and the image registries of the container runtime and of
    dcgm-exporter. ``k2_egress: mirrors-only`` allows exactly these (resolved to IPs on the
    control machine, :func:`k2fleet.control.addresses.resolve_egress`), and the inventory gate
    refuses it before when one is not the inventory's (:func:`k2fleet.planning.fetches.refusal`)."""
    return destinations(dep)


def rules_path(dep: Deployment) -> str:
    return f"{dep.s.config_dir}/firewall.nft"


@dataclass(frozen=True)
class Opening:
    """Ports ``first``-``last`` (TCP) and who may open connections to them."""

    first: int
    last: int
    who: str  # ANYONE, FLEET, CLIENTS or SCRAPERS
    what: str

    @property
    def ports(self) -> str:
        return str(self.first) if self.first == self.last else f"{self.first}-{self.last}"

    def to_json(self) -> dict[str, Any]:
        return {"ports": self.ports, "proto": "tcp", "who": self.who, "what": self.what}


@dataclass(frozen=True)
class HostFirewall:
    """One host's openings and the fleet/client addresses they name."""

    host: str
    openings: tuple[Opening, ...]
    fleet: tuple[str, ...]  # IP addresses
    clients: tuple[str, ...] | None  # networks; None: anyone
    before: tuple[str, ...] = ()  # the host's k2fleet units (the table is loaded before them)
    egress: tuple[str, ...] | None = None  # k2_egress: mirrors-only: the mirrors' IPs (None: outbound untouched)
    egress_names: tuple[str, ...] = ()  # the names those IPs were resolved from
    scrapers: tuple[str, ...] = ()  # k2_metrics_scrapers (k2_metrics): the exporter ports' and /metrics' clients
    root_only: tuple[int, ...] = ()  # loopback ports only root's sockets may connect to (the engine behind the API front)

    def closed(self) -> list[Opening]:
        return [o for o in self.openings if o.who != ANYONE]

    @cached_property
    def body(self) -> str:
        """The table's sets and chains (rendered once: the rules file and the check both need them)."""
        return _table_body(self)

    @cached_property
    def digest(self) -> str:
        """What :func:`marker` and :func:`marker_chain` carry: the digest of :attr:`body`."""
        return hashlib.sha256(self.body.encode()).hexdigest()[:32]

    def rules(self) -> str:
        """The nftables file: ``nft -f`` loads it in one transaction (the table is created
        if missing, deleted and defined again, so a reload never leaves the ports open)."""
        body, digest = self.body, self.digest
        return ("#!/usr/sbin/nft -f\n"
                f"# k2fleet: {self.host}'s table, rendered from the fleet plan; edits are overwritten.\n"
                f"# Only table {TABLE} is k2fleet's; no other table or chain is read or changed.\n"
                f"table {TABLE}\ndelete table {TABLE}\ntable {TABLE} {{\n"
                f"\tcomment {_q(marker(digest))}\n"
                f"\tchain {marker_chain(digest)} {{\n"
                f"\t\tcomment {_q('no hook, no rule: its name is the digest of these rules, which the check lists')}\n"
                f"\t}}\n{body}}}\n")

    def marker(self) -> str:
        return marker(self.digest)

    def marker_chain(self) -> str:
        return marker_chain(self.digest)

    def to_json(self) -> dict[str, Any]:
        return {"table": TABLE, "unit": UNIT, "fleet": list(self.fleet),
                "api_clients": None if self.clients is None else list(self.clients),
                **({"metrics_scrapers": list(self.scrapers)} if self.scrapers else {}),
                **({"root_only": list(self.root_only)} if self.root_only else {}),
                "ports": [o.to_json() for o in self.openings],
                "egress": None if self.egress is None else {"names": list(self.egress_names), "addresses": list(self.egress),
                                                            "also": [what for _, what in EGRESS_ALWAYS]}}


def marker(digest: str) -> str:
    return f"k2fleet rules {digest}"


def marker_chain(digest: str) -> str:
    """The empty chain whose name carries the rules' digest (the check asks nft for it by
    name: one process, no shell or grep on every probe)."""
    return f"rules_{digest}"


def _q(text: str) -> str:
    assert '"' not in text and "\\" not in text
    return f'"{text}"'


def _family(addresses: tuple[str, ...] | list[str] | None, version: int) -> list[str]:
    """The ``version`` addresses (or networks) of ``addresses``, each once, in address order:
    a set's elements, so the rules (and their digest) do not depend on the order the
    inventory lists hosts or clients in (a group moved in the file is not a firewall change).

    >>> _family(["10.0.0.12", "10.0.0.9", "fd00::1", "10.0.0.9", "10.0.0.0/8"], 4)
    ['10.0.0.0/8', '10.0.0.9', '10.0.0.12']
    """
    return families(addresses)[version]


def families(addresses: tuple[str, ...] | list[str] | None) -> dict[int, list[str]]:
    """:func:`_family` of both versions, each address parsed once; the same addresses are
    parsed once in all (every host's table lists the whole fleet: parsed per host, a fleet's
    tables cost N² address parses, 50 ms at 128 hosts). Read it, do not change it.

    >>> families(["fd00::2", "10.0.0.2", "fd00::1"])
    {4: ['10.0.0.2'], 6: ['fd00::1', 'fd00::2']}
    """
    return _families(tuple(addresses or ()))


@lru_cache(maxsize=64)
def _families(addresses: tuple[str, ...]) -> dict[int, list[str]]:
    found = {a: ipaddress.ip_network(a, strict=False) for a in addresses}
    return {version: sorted((a for a, net in found.items() if net.version == version), key=lambda a: (found[a], a))
            for version in (4, 6)}


def _set(name: str, kind: str, elements: list[str], interval: bool) -> str:
    lines = [f"\tset {name} {{", f"\t\ttype {kind}"]
    if interval:
        lines.append("\t\tflags interval")
    if elements:
        lines.append(f"\t\telements = {{ {', '.join(elements)} }}")
    return "\n".join(lines + ["\t}"]) + "\n"


def _ports(openings: list[Opening]) -> str:
    """An nft set of the openings' ports, overlapping and adjacent ranges merged (nft
    refuses overlapping intervals).

    >>> _ports([Opening(50000, 50000, FLEET, ""), Opening(32768, 60999, FLEET, ""), Opening(22, 22, ANYONE, "")])
    '{ 22, 32768-60999 }'
    """
    merged: list[list[int]] = []
    for first, last in sorted((o.first, o.last) for o in openings):
        if merged and first <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], last)
        else:
            merged.append([first, last])
    return "{ " + ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in merged) + " }"


def _table_body(fw: HostFirewall) -> str:
    fleet = families(fw.fleet)
    out = _set("fleet4", "ipv4_addr", fleet[4], False) + _set("fleet6", "ipv6_addr", fleet[6], False)
    api = [o for o in fw.openings if o.who == CLIENTS]
    scraped = [o for o in fw.openings if o.who == SCRAPERS]
    if api:
        clients = families(fw.clients)
        out += _set("api_clients4", "ipv4_addr", clients[4], True)
        out += _set("api_clients6", "ipv6_addr", clients[6], True)
    if scraped or (api and fw.scrapers):
        scrapers = families(fw.scrapers)
        out += _set("scrapers4", "ipv4_addr", scrapers[4], True)
        out += _set("scrapers6", "ipv6_addr", scrapers[6], True)
    rules = ['iif "lo" accept', "ct state established,related accept"]
    ssh = [o for o in fw.openings if o.who == ANYONE and o.what.startswith("ssh")]
    rules.append(f'tcp dport {_ports(ssh)} accept comment "ssh_port: pyinfra reaches the host"')
    rules += ['ip saddr @fleet4 accept comment "the fleet: rendezvous, NCCL/Gloo/ZMQ/Ray/MPI ports"',
              "ip6 saddr @fleet6 accept"]
    open_api = [o for o in fw.openings if o.who == ANYONE and not o.what.startswith("ssh")]
    if open_api:  # before the rejects: an API port inside a closed range stays open
        rules.append(f'tcp dport {_ports(open_api)} accept comment "API: anyone (k2_api_clients unset)"')
    if api and fw.scrapers:  # /metrics is served on the API port
        rules += [f'tcp dport {_ports(api)} ip saddr @scrapers4 accept comment "k2_metrics_scrapers: /metrics"',
                  f"tcp dport {_ports(api)} ip6 saddr @scrapers6 accept"]
    if scraped:
        rules += [f'tcp dport {_ports(scraped)} ip saddr @scrapers4 accept comment "exporters: k2_metrics_scrapers"',
                  f"tcp dport {_ports(scraped)} ip6 saddr @scrapers6 accept",
                  f'tcp dport {_ports(scraped)} reject with tcp reset comment "exporters: k2_metrics_scrapers and the fleet only"']
    if api:
        rules += [f"tcp dport {_ports(api)} ip saddr @api_clients4 accept",
                  f"tcp dport {_ports(api)} ip6 saddr @api_clients6 accept",
                  f'tcp dport {_ports(api)} reject with tcp reset comment "API: k2_api_clients only"']
    fleet_only = [o for o in fw.openings if o.who == FLEET]
    if fleet_only:
        rules.append(f'tcp dport {_ports(fleet_only)} reject with tcp reset comment "rendezvous and control: the fleet only"')
    out += "\tchain input {\n\t\ttype filter hook input priority filter; policy accept;\n"
    out += "".join(f"\t\t{rule}\n" for rule in rules)
    out += "\t}\n"
    if fw.root_only:
        out += _root_only_chain(fw)
    if fw.egress is not None:
        out += _egress_chain(fw)
    return out


def _root_only_chain(fw: HostFirewall) -> str:
    """The engine behind the API front listens on 127.0.0.1 without a key: a connection to
    its port over loopback from a socket that is not root's (another local user) is reset;
    the front (HAProxy, run as root by its unit) and root's own tools pass."""
    ports = _ports([Opening(p, p, FLEET, "") for p in fw.root_only])
    rule = (f'oif "lo" tcp dport {ports} meta skuid != 0 reject with tcp reset '
            f'comment "{BACKEND_KEY}: root only (the API front), no other local user"')
    return ("\tchain output_root_only {\n\t\ttype filter hook output priority filter; policy accept;\n"
            f"\t\t{rule}\n\t}}\n")


def _egress_chain(fw: HostFirewall) -> str:
    """``k2_egress: mirrors-only``: new outbound connections only to the fleet, the mirrors'
    addresses and :data:`EGRESS_ALWAYS`; answers to inbound connections (SSH, the API) pass as
    established traffic; anything else is rejected (a TCP reset: apt and pip fail at once)."""
    egress = families(fw.egress)
    out = _set("egress4", "ipv4_addr", egress[4], False) + _set("egress6", "ipv6_addr", egress[6], False)
    rules = ['oif "lo" accept', "ct state established,related accept",
             'ip daddr @fleet4 accept comment "the fleet"', "ip6 daddr @fleet6 accept",
             'ip daddr @egress4 accept comment "the declared mirrors, repositories and indexes"', "ip6 daddr @egress6 accept"]
    rules += [f'{rule} comment "{what}"' for rule, what in EGRESS_ALWAYS]
    rules += ['meta l4proto tcp reject with tcp reset comment "k2_egress: mirrors-only"',
              'reject comment "k2_egress: mirrors-only"']
    out += "\tchain output {\n\t\ttype filter hook output priority filter; policy accept;\n"
    out += "".join(f"\t\t{rule}\n" for rule in rules)
    return out + "\t}\n"


def unit_file(dep: Deployment, fw: HostFirewall) -> str:
    """``k2-firewall.service``: a oneshot that loads the table at boot before the network
    and every k2fleet unit of the host, reloads it atomically, and deletes it when stopped
    (``systemctl disable --now``). It is not stopped at shutdown (no default dependencies)."""
    path = rules_path(dep)
    before = " ".join(["network-pre.target", *fw.before])
    return "\n".join([
        "# Rendered by k2fleet from the fleet plan; edits are overwritten.",
        "[Unit]",
        f"Description={systemd_value(f'k2fleet: nftables table {TABLE} (the closed fleet)')}",
        "DefaultDependencies=no",
        "After=local-fs.target nftables.service",
        f"Before={before}",
        "Wants=network-pre.target",
        "",
        "[Service]",
        "Type=oneshot",
        "RemainAfterExit=yes",
        f"ExecStart={systemd_exec([NFT, '-f', path])}",
        f"ExecReload={systemd_exec([NFT, '-f', path])}",
        f"ExecStop=-{systemd_exec([NFT, 'delete', 'table', *TABLE.split()])}",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ])


def check_argv(fw: HostFirewall) -> list[str]:
    """Exit 0 only when the kernel holds k2fleet's table as the rules file defines it
    (an empty chain's name carries the digest of the rules; an ``nft flush ruleset`` or an
    older table fails it, so the next deploy loads it again)."""
    return [NFT, "list", "chain", *TABLE.split(), fw.marker_chain()]


def runs_engine_ranks(hp: HostPlan) -> bool:
    """A host whose processes bind unnamed ports (every GPU host: mpirun ranks too; as
    :func:`k2fleet.planning.desired.loads_weights`)."""
    return hp.role not in ("router", "slurm-submit") or any(s.needs_checkpoint for s in hp.services)


def _runs_ray_start(argv: list[str]) -> bool:
    """``ray start`` (a Ray head or worker), from a venv or as a container's entrypoint.

    >>> _runs_ray_start(["/opt/v/bin/ray", "start", "--head"])
    True
    >>> _runs_ray_start(["/usr/bin/docker", "run", "--entrypoint", "ray", "img", "start", "--block"])
    True
    >>> _runs_ray_start(["/usr/bin/docker", "run", "--entrypoint", "vllm", "img", "serve", "/m"])
    False
    """
    if not argv:
        return False
    if argv[0].rsplit("/", 1)[-1] == "ray":
        return "start" in argv
    if "--entrypoint" in argv[:-1] and argv[argv.index("--entrypoint") + 1] == "ray":
        return "start" in argv[argv.index("--entrypoint") + 2:]
    return False


def host_openings(dep: Deployment, hp: HostPlan) -> tuple[Opening, ...]:
    """Every TCP port k2fleet's processes listen on (and SSH's), on host ``hp``, with who may
    reach it, whether or not ``k2_firewall`` enforces it: what the table closes, what
    :mod:`k2fleet.planning.privileged_ports` keeps from local users, and what ``k2fleet plan``
    lists for the network team (:mod:`k2fleet.planning.fetches`)."""
    name = hp.name
    entry = next(h for h in dep.fleet.hosts if h.name == name)
    api_who = ANYONE if dep.s.api_clients is None else CLIENTS
    found: list[Opening] = [Opening(p, p, ANYONE, "ssh_port: pyinfra (never closed)")
                            for p in sorted({22, entry.ssh_port or 22})]
    for svc in hp.services:
        for key, port in sorted(svc.ports.items()):
            if key in API_KEYS and svc.role in ("prefill", "decode"):
                found.append(Opening(port, port, FLEET, f"{key}: PD backend the router reaches ({svc.name})"))
            elif key in API_KEYS:
                found.append(Opening(port, port, api_who, f"{key}: the OpenAI API, metrics ({svc.name})"))
            else:
                found.append(Opening(port, port, FLEET, f"{key}: {PORT_WHAT.get(key, key)} ({svc.name})"))
            if key == "k2_dist_init_port":
                pool = dep.pools.get(svc.role)
                dp = pool.dp if pool else 1
                found.append(Opening(port + 1, min(65535, port + 8 + dp), FLEET,
                                     f"SGLang ZMQ ports derived from k2_dist_init_port ({svc.name})"))
        if _runs_ray_start(svc.argv):
            found.append(Opening(*RAY_CLIENT_AND_WORKERS, FLEET, f"Ray client server and worker ports ({svc.name})"))
            found.append(Opening(RAY_DASHBOARD, RAY_DASHBOARD, FLEET, f"Ray dashboard ({svc.name})"))
        window = dep.engine_impl.torch_store_window
        if window and svc.needs_checkpoint and svc.argv:
            lo, hi = window
            # relative to the engine's own --port: behind the API front, k2_api_backend_port
            port, key = (svc.ports[BACKEND_KEY], BACKEND_KEY) if BACKEND_KEY in svc.ports else (dep.s.port, "k2_port")
            found.append(Opening(min(65535, port + lo), min(65535, port + hi), FLEET,
                                 f"SGLang NCCL/torch store port, random in {key}+{lo}..+{hi} ({svc.name})"))
    for port, what in exporter_ports(dep, hp.role):
        found.append(Opening(port, port, SCRAPERS, f"{what}: k2_metrics_scrapers and the fleet"))
    if len(dep.fleet.hosts) > 1:
        found.append(Opening(dep.s.mesh_port, dep.s.mesh_port, FLEET, "k2_mesh_port: the SSH mesh sshd"))
    if runs_engine_ranks(hp):
        found.append(Opening(dep.s.relay_port, dep.s.relay_port, FLEET, "k2_relay_port: the checkpoint relay"))
        found.append(Opening(*EPHEMERAL, FLEET, "ephemeral ports: NCCL, Gloo, ZMQ, Ray, MPI"))
    return tuple(dict.fromkeys(found))


def host_firewall(dep: Deployment, hp: HostPlan) -> HostFirewall | None:
    """The openings of host ``hp`` (None: ``k2_firewall`` is off, or the host runs nothing
    that listens, e.g. a Slurm login host: no table, no unit, no package)."""
    if not dep.s.firewall:
        return None
    name = hp.name
    openings = host_openings(dep, hp)
    egress = egress_names_ = None
    if dep.s.egress == "mirrors-only":
        egress_names_ = tuple(egress_names(dep))
        egress = tuple(dict.fromkeys(ip for n in egress_names_ for ip in dep.fleet.egress_ips.get(n, ())))
    if all(o.who == ANYONE for o in openings) and egress is None:
        return None
    units = [MESH_UNIT] if len(dep.fleet.hosts) > 1 else []
    units += [f"{s.name}.service" for s in hp.services]
    return HostFirewall(host=name, openings=openings, fleet=dep.fleet_ips,
                        clients=None if dep.s.api_clients is None else tuple(dep.s.api_clients),
                        before=tuple(dict.fromkeys(units)), egress=egress, egress_names=egress_names_ or (),
                        scrapers=tuple(dep.s.metrics_scrapers or ()) if dep.s.metrics else (),
                        root_only=tuple(sorted({svc.ports[BACKEND_KEY] for svc in hp.services if BACKEND_KEY in svc.ports})))


def format_firewall(dep: Deployment, plan: Plan) -> str:
    """``k2fleet plan``'s firewall section: every host's ports and who may reach them."""
    if not dep.s.firewall:
        fronted = any(BACKEND_KEY in svc.ports for hp in plan.hosts.values() for svc in hp.services)
        return ("\n== firewall: off (k2_firewall: False): k2fleet's table inet k2fleet and "
                f"{UNIT} are removed; every port is as the hosts' own rules leave it"
                + (f"; the engine behind the API front ({BACKEND_KEY}, no key) is open to every local user"
                   if fronted else "") + "\n")
    clients = "anyone (k2_api_clients unset)" if dep.s.api_clients is None else \
        "k2_api_clients " + ", ".join(dep.s.api_clients) + " and the fleet"
    scrapers = "k2_metrics_scrapers " + ", ".join(dep.s.metrics_scrapers) + " and the fleet" if dep.s.metrics_scrapers \
        else "the fleet only (k2_metrics_scrapers unset)"
    who = {ANYONE: "anyone", FLEET: "the fleet only", CLIENTS: clients, SCRAPERS: scrapers}
    out = [f"\n== firewall (k2_firewall: True): nftables table {TABLE}, loaded by {UNIT}",
           f"  the fleet: {', '.join(dep.fleet_ips)} (may reach every port of every fleet host)",
           "  any other port: untouched (policy accept)"]
    if dep.s.egress == "mirrors-only":
        names = egress_names(dep)
        out.append("  outbound (k2_egress: mirrors-only): the fleet, " + (", ".join(
            f"{n} ({', '.join(dep.fleet.egress_ips.get(n, ())) or 'not resolved'})" for n in names) or "no mirror")
            + "; " + ", ".join(what for _, what in EGRESS_ALWAYS) + "; anything else is rejected")
    for name, hp in plan.hosts.items():
        fw = host_firewall(dep, hp)
        if fw is None:
            out.append(f"  {name}: runs nothing that listens: no table")
            continue
        out.append(f"  {name}:")
        for o in fw.openings:
            reach = "anyone (never closed)" if o.what.startswith("ssh_port") else who[o.who]
            out.append(f"    {o.ports + '/tcp':<18} {reach:<22} {o.what}")
        for port in fw.root_only:
            out.append(f"    {str(port) + '/tcp':<18} {'loopback: root only':<22} {BACKEND_KEY}: another local user's "
                       "connection is reset (the API front is its client)")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- the network team's list


def _outbound(fetches: tuple[Fetch, ...]) -> dict[str, list[str]]:
    """``host:port/tcp`` → what the host fetches there."""
    out: dict[str, list[str]] = {}
    for f in fetches:
        if f.host:
            out.setdefault(f.target, []).append(f.what)
    return out


def network_json(dep: Deployment, plan: Plan) -> dict[str, Any]:
    """``plan --json``'s ``network``: per host its fetches, inbound openings and outbound targets."""
    fetches = host_fetches(dep)
    hosts = {}
    for name, hp in plan.hosts.items():
        mine = fetches.get(name, ())
        hosts[name] = {
            "fetches": [f.to_json() for f in mine],
            "inbound": [o.to_json() for o in host_openings(dep, hp)],
            "outbound": [{"to": "the fleet", "ports": "all"},
                         *({"to": target, "for": whats} for target, whats in _outbound(mine).items())],
        }
    return {"closed_by": closed(dep), "egress": dep.s.egress, "destinations": destinations(dep, fetches),
            "also": [what for _, what in EGRESS_ALWAYS], "hosts": hosts}


def format_network(dep: Deployment, plan: Plan) -> str:
    """``k2fleet plan``'s network section: each host's fetches (URL, host:port, the key that
    decides it) and its ports from outside the fleet, in and out."""
    why = closed(dep)
    who = {ANYONE: "anyone", CLIENTS: f"k2_api_clients {', '.join(dep.s.api_clients or ())}",
           SCRAPERS: f"k2_metrics_scrapers {', '.join(dep.s.metrics_scrapers or ())}"}
    fetches = host_fetches(dep)
    out = ["\n== network: where each host fetches from, and its ports (open these in advance)",
           f"  {'closed by ' + why + ': only the fleet and the declared mirrors' if why else 'open (k2_egress: open)'}; "
           f"places: {', '.join(destinations(dep, fetches)) or 'none'}",
           "  between fleet hosts: every TCP/UDP port, both ways (ranks meet on ports chosen at run time)",
           "  also: " + ", ".join(what for _, what in EGRESS_ALWAYS)]
    for name, hp in plan.hosts.items():
        out.append(f"  {name} ({hp.address}):")
        for f in fetches.get(name, ()):
            out.append(f"    fetch  {f.target:<32} {f.url or '(URLs of the hosts own sources)'}: {f.what} "
                       f"({f.key}{'' if f.declared else ' unset: the default'})")
        for o in host_openings(dep, hp):  # from outside the fleet (the fleet reaches every port)
            if o.who != FLEET and (o.who != SCRAPERS or dep.s.metrics_scrapers):
                out.append(f"    in     {o.ports + '/tcp':<32} from {who[o.who]}: {o.what}")
        targets = ", ".join(_outbound(fetches.get(name, ())))
        out.append(f"    out    the fleet (every port){'; ' + targets if targets else ''}")
    return "\n".join(out) + "\n"
