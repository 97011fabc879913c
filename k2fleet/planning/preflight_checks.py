"""Preflight: can this host run its part of the plan? Pure checks over a HostReport.

The deploy's preflight role gathers a :class:`HostReport` per host (one fact) and calls
:func:`check_host`; any problem stops the deploy before the first change, naming the
host and the reason.
"""

from __future__ import annotations

import ipaddress

from k2fleet.inventory.spec import HostEntry
from k2fleet.planning import catalog
from k2fleet.planning.deployment import Deployment
from k2fleet.planning.host_fact import HostReport

GIB = catalog.GIB
REAL_MIN_SHM = 16 * GIB
REAL_MIN_RAM = 64 * GIB
SIMULATED_MIN_SHM = 32 * 2**20
SIMULATED_MIN_RAM = 256 * 2**20


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _check_gpus(dep: Deployment, report: HostReport) -> list[str]:
    """The GPUs are there (on the PCI bus; the driver may not be installed yet: the
    bootstrap installs it and its GPU gate checks driver, module and fabric)."""
    gpu = dep.gpu
    assert gpu is not None
    hw = report.boot.hardware
    if dep.s.simulated_gpus:
        if hw.get("simulated"):
            found = int(hw.get("count", 0))
            return [] if found >= dep.gpus_per_node else [
                f"needs {dep.gpus_per_node} simulated GPUs, the sandbox host has {found}"]
        if report.gpus.count or hw.get("count"):
            return ["inventory declares simulated GPUs but the host has real ones; remove k2_simulated_gpus"]
        return ["inventory declares simulated GPUs but this is not a k2fleet sandbox host "
                "(no /etc/k2fleet-doubles/gpus.json); rehearse with `k2fleet rehearse`"]
    if hw.get("simulated"):
        return ["the host has TEST DOUBLE GPUs (a k2fleet sandbox host); production inventories need real ones"]
    count = max(int(hw.get("count", 0)), report.gpus.count)
    vendor = hw.get("vendor") or report.gpus.vendor
    if count < dep.gpus_per_node:
        return [f"needs {dep.gpus_per_node} {gpu.name} GPUs, found {count} on the PCI bus"]
    problems = []
    if vendor != gpu.vendor:
        problems.append(f"plan is for {gpu.vendor} GPUs, host has {vendor}")
    wrong = [n for n in report.gpus.names if gpu.name.replace("gb", "").upper() not in n.upper()]
    if wrong:
        problems.append(f"plan is for {gpu.name}, host has {', '.join(sorted(set(wrong)))}")
    return problems


def check_host(dep: Deployment, entry: HostEntry, report: HostReport, checkpoint_present: bool) -> list[str]:
    """Reasons ``entry`` cannot run its part of the plan (empty: it can)."""
    s = dep.s
    problems: list[str] = []
    serves_gpus = entry.settings.role not in ("router", "slurm-submit")
    if serves_gpus:
        problems += _check_gpus(dep, report)
    min_shm = SIMULATED_MIN_SHM if s.simulated_gpus else REAL_MIN_SHM
    if serves_gpus and report.shm_size < min_shm:
        problems.append(f"/dev/shm is {_gib(report.shm_size)}, needs at least {_gib(min_shm)} (NCCL and engine IPC)")
    min_ram = SIMULATED_MIN_RAM if s.simulated_gpus else REAL_MIN_RAM
    if dep.engine == "ktransformers":
        min_ram = max(min_ram, dep.checkpoint_bytes)
    if serves_gpus and report.mem_total < min_ram:
        problems.append(f"RAM is {_gib(report.mem_total)}, needs at least {_gib(min_ram)}")
    if serves_gpus and not checkpoint_present:
        need = int(dep.checkpoint_bytes * 1.05)
        if report.disk_free < need:
            problems.append(f"{_gib(report.disk_free)} free under {s.model_dir}, the checkpoint needs {_gib(need)}")
    nic = entry.settings.nic
    if nic and nic not in report.nics:
        problems.append(f"k2_nic {nic} does not exist (NICs: {', '.join(sorted(report.nics))})")
    missing = [h for h in entry.settings.ib_hcas if h not in report.ib_hcas]
    if missing:
        problems.append(f"IB HCAs {', '.join(missing)} not present (found: {', '.join(report.ib_hcas) or 'none'})")
    problems += check_fleet_address(entry, report.nics)
    return problems


def _canonical(address: str) -> str | None:
    try:
        return str(ipaddress.ip_address(address.split("%", 1)[0]))
    except ValueError:
        return None


def check_fleet_address(entry: HostEntry, nics: dict[str, list[str]]) -> list[str]:
    """The host's fleet address (an IP: names were resolved by the gate) is on one of its
    interfaces, and, with ``k2_nic``, on that one: NCCL/Gloo bind ``k2_nic`` while the engines,
    the mesh and the firewall use the fleet address, so the two must be one network.

    >>> from k2fleet.inventory.spec import parse_host
    >>> base = {"k2_model": "m/x", "k2_revision": "0" * 40, "k2_engine": "vllm", "k2_gpu": "h200"}
    >>> h = parse_host("n1", base | {"k2_address": "10.0.0.1", "k2_nic": "eth0"})
    >>> check_fleet_address(h, {"eth0": ["10.0.0.1"], "lo": ["127.0.0.1"]})
    []
    >>> print(*check_fleet_address(h, {"eth0": ["192.168.1.5"], "eth1": ["10.0.0.1"]}))
    fleet address 10.0.0.1 is on eth1, not on k2_nic eth0 (eth0 has 192.168.1.5); set k2_nic: eth1, or k2_address to eth0's address
    """
    want = _canonical(entry.address)
    if not nics or want is None:
        return []
    on = sorted(name for name, addrs in nics.items() if want in {_canonical(a) for a in addrs})
    nic = entry.settings.nic
    if not on:
        return [f"fleet address {entry.address} is not on any interface ({', '.join(sorted(nics))}); set k2_address "
                "to this host's address on the fleet network"]
    if nic and nic in nics and nic not in on:
        has = ", ".join(nics[nic]) or "no address"
        return [f"fleet address {entry.address} is on {', '.join(on)}, not on k2_nic {nic} ({nic} has {has}); "
                f"set k2_nic: {on[0]}, or k2_address to {nic}'s address"]
    return []
