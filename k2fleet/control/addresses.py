"""Host names → fleet IPs, once per run, on the control machine.

Engines, the SSH mesh and the firewall take IP addresses: ``VLLM_HOST_IP``, ``--data-parallel-address``,
``--dist-init-addr``, mpirun's ``-H``, sshd's ``AllowUsers``/``ListenAddress`` and ``from=``,
nftables sets. An inventory may name its hosts by DNS name (``k2_address``, else
``ssh_hostname``, else the host name); the gate (:func:`k2fleet.deploy.gate.check_hosts`, on
every entry) resolves each such name here, before planning, so the planner stays pure and
receives IPs. ``ssh_hostname`` itself is left as it is: it is what pyinfra connects to
(through a bastion, by its name).

- an IP literal is taken as it is (no lookup); a name is looked up with
  :func:`socket.getaddrinfo` (``/etc/hosts`` and the system resolver), all names at once,
  the whole lookup capped at :data:`RESOLVE_TIMEOUT` seconds;
- a name that does not resolve, resolves to no usable address, or to several
  (dual-stack, round robin) is refused with one line naming the host and the key: set
  ``k2_address`` to the host's IP on the fleet network (an explicit ``k2_address`` always wins);
- two hosts that end up at one address are refused.

The seam for tests is ``resolver``: a callable ``name → addresses`` (raising ``OSError`` when the
name does not resolve) used instead of :func:`system_resolver`.

>>> from k2fleet.inventory.spec import HostEntry, parse_host, build_fleet
>>> base = {"k2_model": "m/x", "k2_revision": "0" * 40, "k2_engine": "vllm", "k2_gpu": "h200", "k2_tp": 16}
>>> fleet = build_fleet("inv", [parse_host("n0", base | {"ssh_hostname": "gpu-0.dc.example"}),
...                             parse_host("n1", base | {"ssh_hostname": "10.0.0.2"})])
>>> [h.address for h in resolve_addresses(fleet, {"gpu-0.dc.example": ["10.0.0.1"]}.__getitem__).hosts]
['10.0.0.1', '10.0.0.2']
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
import threading
from collections.abc import Callable, Sequence

from k2fleet.inventory.spec import Fleet, HostEntry, SpecError

Resolver = Callable[[str], Sequence[str]]
RESOLVE_TIMEOUT = 10.0  # seconds for every name of the inventory together
WORKERS = 16  # lookups at once
PLACEHOLDERS = ipaddress.ip_network("198.18.0.0/15")  # RFC 2544 benchmarking: never a fleet's


def system_resolver(name: str) -> list[str]:
    """The addresses ``name`` resolves to on this machine (``/etc/hosts``, then DNS, as the
    system's resolver is configured), each once, in the resolver's order."""
    infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def placeholder_resolver() -> Resolver:
    """A resolver for a plan whose output holds no address (``k2fleet bundle``: packages,
    wheels, images and checkpoints do not depend on where the hosts are): it looks nothing
    up and gives each name its own address from 198.18.0.0/15 (RFC 2544's benchmarking
    range, never a fleet's), so a bundle is made the same on a control machine that cannot
    resolve the fleet's names (behind a bastion, air-gapped) as on one that can.

    >>> r = placeholder_resolver()
    >>> r("gpu-0.fleet.corp.example"), r("gpu-1.fleet.corp.example"), r("gpu-0.fleet.corp.example")
    (['198.18.0.1'], ['198.18.0.2'], ['198.18.0.1'])
    """
    given: dict[str, str] = {}
    lock = threading.Lock()
    first = PLACEHOLDERS.network_address

    def resolve(name: str) -> list[str]:
        with lock:
            if name not in given:
                if len(given) + 2 >= PLACEHOLDERS.num_addresses:
                    raise OSError(f"more names than placeholder addresses in {PLACEHOLDERS}")
                given[name] = str(first + len(given) + 1)
            return [given[name]]

    return resolve


def is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def lookup_all(names: Sequence[str], resolver: Resolver, timeout: float) -> dict[str, list[str] | BaseException]:
    """Each of ``names`` → its addresses or the exception its lookup raised; a name missing
    from the result did not answer within ``timeout`` seconds (the lookups run on daemon
    threads, so one the resolver never answers cannot hold the process)."""
    pending = list(dict.fromkeys(names))
    total = len(pending)
    results: dict[str, list[str] | BaseException] = {}
    cond = threading.Condition()

    def work() -> None:
        while True:
            with cond:
                if not pending:
                    return
                name = pending.pop(0)
            try:
                answer: list[str] | BaseException = [str(a) for a in resolver(name)]
            except Exception as exc:  # noqa: BLE001 - reported as one line naming the host
                answer = exc
            with cond:
                results[name] = answer
                cond.notify_all()

    for _ in range(min(WORKERS, total)):
        threading.Thread(target=work, name="k2fleet-resolve", daemon=True).start()
    with cond:
        cond.wait_for(lambda: len(results) == total, timeout=timeout)
        return dict(results)


def _why(exc: BaseException) -> str:
    text = getattr(exc, "strerror", None) or " ".join(str(a) for a in getattr(exc, "args", ())) or type(exc).__name__
    return " ".join(str(text).split())[:120]


def _usable(addr: str) -> str | None:
    """``addr`` as a canonical IP peers can reach (None: not an IP, scoped, unspecified, multicast)."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return None
    if "%" in addr or ip.is_unspecified or ip.is_multicast:
        return None
    return str(ip)


def resolve_addresses(fleet: Fleet, resolver: Resolver | None = None, timeout: float = RESOLVE_TIMEOUT) -> Fleet:
    """``fleet`` with every host's DNS-name address resolved to its IP (:attr:`HostEntry.ip`);
    raises :class:`SpecError` naming the host and key for a name that does not resolve to
    exactly one usable address, or when two hosts end up at one address. See module doc."""
    names = [h.configured_address for h in fleet.hosts if not is_ip(h.configured_address)]
    answers = lookup_all(names, resolver or system_resolver, timeout) if names else {}
    hosts: list[HostEntry] = []
    seen: dict[str, HostEntry] = {}
    for h in fleet.hosts:
        name, key = h.configured_address, h.address_key
        what = f"host {h.name}'s {'name' if key == 'inventory' else key} {name}"
        fix = "set k2_address to the host's IP on the fleet network"
        if is_ip(name):
            entry, ip = h, str(ipaddress.ip_address(name))
        else:
            answer = answers.get(name)
            if answer is None:
                raise SpecError(key, f"{what} does not resolve on this control machine (no answer within "
                                f"{timeout:g} s); {fix}, or make the name resolvable here", fleet.source)
            if isinstance(answer, BaseException):
                raise SpecError(key, f"{what} does not resolve on this control machine ({_why(answer)}); engines, "
                                f"the mesh and the firewall take IP addresses: {fix}, or make the name resolvable "
                                "here (DNS, /etc/hosts)", fleet.source)
            usable = list(dict.fromkeys(u for u in map(_usable, answer) if u is not None))
            if not usable:
                shown = ", ".join(answer[:4]) or "nothing"
                raise SpecError(key, f"{what} resolves to no address peers can reach ({shown}); {fix}", fleet.source)
            if len(usable) > 1:
                more = f" and {len(usable) - 4} more" if len(usable) > 4 else ""
                raise SpecError(key, f"{what} resolves to several addresses ({', '.join(usable[:4])}{more}); "
                                f"k2fleet needs one per host: {fix} (one of them)", fleet.source)
            ip = usable[0]
            entry = dataclasses.replace(h, ip=ip)
        other = seen.get(ip)
        if other is not None:
            via = lambda e: "" if is_ip(e.configured_address) else f" ({e.address_key} {e.configured_address})"  # noqa: E731
            raise SpecError(key, f"hosts {other.name}{via(other)} and {h.name}{via(h)} both have address {ip}; "
                            "every host needs its own address (set k2_address)", fleet.source)
        seen[ip] = entry
        hosts.append(entry)
    if all(a is b for a, b in zip(hosts, fleet.hosts)):
        return fleet
    by_name = {h.name: h for h in hosts}
    pools = {role: [by_name[h.name] for h in members] for role, members in fleet.pools.items()}
    return Fleet(source=fleet.source, hosts=hosts, pools=pools)


def resolve_egress(fleet: Fleet, names: Sequence[str], resolver: Resolver | None = None,
                   timeout: float = RESOLVE_TIMEOUT) -> Fleet:
    """``fleet`` with :attr:`Fleet.egress_ips`: each of ``names`` (the hosts the plan fetches from,
    :func:`k2fleet.planning.firewall.egress_names`) → every usable address it resolves to on this
    control machine (a mirror may have several: all are allowed). A name that does not resolve is
    refused with one line naming it; an IP literal is taken as it is."""
    lookup = [n for n in names if not is_ip(n)]
    answers = lookup_all(lookup, resolver or system_resolver, timeout) if lookup else {}
    out: dict[str, tuple[str, ...]] = {}
    for name in names:
        if is_ip(name):
            out[name] = (str(ipaddress.ip_address(name)),)
            continue
        answer = answers.get(name)
        why = ("no answer within " + f"{timeout:g} s") if answer is None else \
            _why(answer) if isinstance(answer, BaseException) else None
        usable = () if why else tuple(dict.fromkeys(u for u in map(_usable, answer) if u is not None))  # type: ignore[arg-type]
        if why or not usable:
            raise SpecError("k2_egress", f"mirrors-only: {name} (a repository, mirror or index the hosts fetch from) "
                            f"does not resolve on this control machine ({why or 'no usable address'}); the firewall "
                            "allows IP addresses: make it resolvable here, or declare a mirror that is "
                            "(k2_os_mirror, k2_os_security_mirror, k2_nvidia_repo, k2_container_toolkit_repo, k2_docker_repo, "
                            "k2_pypi_index, "
                            "k2_hub_endpoint, k2_image)", fleet.source)
        out[name] = usable
    return dataclasses.replace(fleet, egress_ips=out)
