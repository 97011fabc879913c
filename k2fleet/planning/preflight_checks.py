"""Preflight: can this host run its part of the plan? Pure checks over a HostReport.

The deploy's preflight role gathers a :class:`HostReport` per host (one fact) and calls
:func:`check_host`; any problem stops the deploy before the first change, naming the
host and the reason. The fabric gate (:func:`check_fabric`) is one of them: every
``k2_ib_hcas`` port present, ACTIVE, of the declared link layer and rate, with a RoCE v2
GID on Ethernet, so no engine starts on a fleet whose RDMA fabric is down.
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
    if dep.engine_impl.experts_in_host_ram:  # KTransformers: the routed experts live in RAM
        min_ram = max(min_ram, dep.checkpoint_bytes)
    if serves_gpus and report.mem_total < min_ram:
        problems.append(f"RAM is {_gib(report.mem_total)}, needs at least {_gib(min_ram)}")
    if serves_gpus and not checkpoint_present:
        need = int(dep.checkpoint_bytes * 1.05)
        if report.disk_free < need:
            problems.append(f"{_gib(report.disk_free)} free under {s.model_dir}, the checkpoint needs {_gib(need)} "
                            f"(k2_revision {s.revision[:12]}, fetched beside the revisions the host keeps: "
                            f"k2_keep_revisions {s.keep_revisions}); nothing was changed")
    nic = entry.settings.nic
    if nic and nic not in report.nics:
        problems.append(f"k2_nic {nic} does not exist (NICs: {', '.join(sorted(report.nics))})")
    if serves_gpus:  # a router's or SLURM submit host's k2_ib_hcas (set fleet-wide) carry no NCCL/NVSHMEM traffic
        problems += check_fabric(entry, report, sandbox=s.simulated_gpus)
        problems += check_gpudirect(dep, entry, report)
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


IB_ACTIVE = "4: ACTIVE"  # the kernel's ports/N/state for IB_PORT_ACTIVE (drivers/infiniband/core/sysfs.c state_show)
ROCE_V2 = "RoCE v2"  # ports/N/gid_attrs/types/K of a RoCE v2 GID (drivers/infiniband/core/cache.c gid_type_str)


def shown(text: object) -> str:
    """A value from a host or an argument, fit for one line: printable ASCII, at most 40 characters."""
    out = "".join(c if " " <= c <= "~" else "?" for c in str(text))
    return out[:40] + ("..." if len(out) > 40 else "")


def _port_order(number: str) -> tuple[int, str]:
    return len(number), number  # numeric order of digit strings, and no error on anything else


def rate_gbps(rate: str) -> float | None:
    """Gb/s of a sysfs ``rate`` ("400 Gb/sec (4X NDR)", "2.5 Gb/sec (1X SDR)"; None: not one).

    >>> rate_gbps("400 Gb/sec (4X NDR)"), rate_gbps("2.5 Gb/sec (1X SDR)"), rate_gbps("fast")
    (400.0, 2.5, None)
    """
    head = rate.split(" ", 1)[0]
    try:
        return float(head) if rate[len(head):].startswith(" Gb/sec") else None
    except ValueError:
        return None


def hca_ports(hca: str, found: dict[str, dict]) -> tuple[str, list[str]]:
    """(device, the ports the gate checks) of one ``k2_ib_hcas`` entry: ``mlx5_0:1`` that port,
    ``mlx5_0`` every port the device has (NCCL uses all of a device named without a port).

    >>> hca_ports("mlx5_0:2", {}), hca_ports("mlx5_1", {"mlx5_1": {"2": {}, "1": {}}})
    (('mlx5_0', ['2']), ('mlx5_1', ['1', '2']))
    """
    device, _, port = hca.partition(":")
    if port:
        return device, [str(int(port))]
    return device, sorted((p for p in found.get(device, {}) if p.isdigit() and len(p) <= 3), key=_port_order)


def port_problems(entry: HostEntry, device: str, number: str, port: dict) -> list[str]:
    """What keeps one RDMA port (:func:`k2fleet.hostprogs.hoststate.ib_port`) from the
    inventory's fabric (empty: it serves)."""
    where = f"HCA {device} port {number}"
    s = entry.settings
    problems = []
    state = port.get("state", "")
    if state != IB_ACTIVE:
        word = state.partition(": ")[2] or state or "unreadable"
        physical = port.get("phys_state")
        problems.append(f"{where} is {shown(word)}" + (f" (physical state {shown(physical)})" if physical else "")
                        + ", needs ACTIVE: check the cable, the switch port and the subnet manager (ibstat)")
    layer = port.get("link_layer", "")
    if s.ib_link_layer and layer != s.ib_link_layer:
        problems.append(f"{where} link layer is {shown(layer or 'unreadable')}, k2_ib_link_layer is {s.ib_link_layer}")
    rate = rate_gbps(port.get("rate", ""))
    if s.ib_rate_gbps and state == IB_ACTIVE and (rate is None or rate < s.ib_rate_gbps):  # a down port has no rate
        problems.append(f"{where} runs at {shown(port.get('rate') or 'an unreadable rate')}, below k2_ib_rate_gbps "
                        f"{s.ib_rate_gbps}: a link trained down (cable, transceiver or switch port)")
    if layer == "Ethernet":
        gids = port.get("gids") or {}
        v2 = sorted((int(k) for k, g in gids.items() if str(k).isdigit() and len(g) > 1 and g[1] == ROCE_V2))
        if s.ib_gid_index is not None and s.ib_gid_index not in v2:
            has = f"RoCE v2 GIDs at {', '.join(map(str, v2))}" if v2 else "no RoCE v2 GID"
            problems.append(f"{where} (RoCE) has no RoCE v2 GID at k2_ib_gid_index {s.ib_gid_index} ({has})")
        elif not v2:
            problems.append(f"{where} (RoCE) has no RoCE v2 GID: give its netdev an IP address "
                            "(NCCL and NVSHMEM cannot connect over RoCE without one)")
    return problems


def check_fabric(entry: HostEntry, report: HostReport, sandbox: bool = False) -> list[str]:
    """The fabric gate: every ``k2_ib_hcas`` device present, each of its ports (or the one
    named, ``HCA:PORT``) ACTIVE, of ``k2_ib_link_layer`` and at least ``k2_ib_rate_gbps``, and
    an Ethernet (RoCE) port with a RoCE v2 GID (at ``k2_ib_gid_index`` when set); one line
    per port that fails, naming HCA and port. ``sandbox``: the inventory is a sandbox's
    (simulated GPUs), whose RDMA devices are the TEST DOUBLE tree; elsewhere that tree is refused."""
    hcas = entry.settings.ib_hcas
    if not hcas:
        return []
    if report.ib_simulated and not sandbox:
        return ["the host's RDMA devices are TEST DOUBLES (/etc/k2fleet-doubles/infiniband): a sandbox host"]
    missing = [h for h in hcas if h.partition(":")[0] not in report.ib_hcas]
    problems = [f"IB HCAs {', '.join(missing)} not present (found: {', '.join(map(shown, report.ib_hcas)) or 'none'})"] \
        if missing else []
    for hca in hcas:
        device, numbers = hca_ports(hca, report.ib_ports)
        if hca in missing:
            continue
        ports = report.ib_ports.get(device)
        if not ports:
            problems.append(f"HCA {device}: the probe read no port of it (/sys/class/infiniband/{device}/ports)")
            continue
        for number in numbers:
            if number not in ports:
                problems.append(f"HCA {device} port {number} does not exist (ports: "
                                f"{', '.join(shown(p) for p in sorted(ports, key=_port_order))})")
            else:
                problems += port_problems(entry, device, number, ports[number])
    return problems


def _param_on(params: dict[str, str], key: str, word: str | None = None) -> bool:
    """Is ``key`` of /proc/driver/nvidia/params set to 1 (or, with ``word``, does its string set ``word=1``)?

    >>> _param_on({"EnableStreamMemOPs": "1"}, "EnableStreamMemOPs")
    True
    >>> _param_on({"RegistryDwords": '"PeerMappingOverride=0x1;"'}, "RegistryDwords", "PeerMappingOverride")
    True
    >>> _param_on({"RegistryDwords": '""'}, "RegistryDwords", "PeerMappingOverride")
    False
    """
    value = params.get(key, "").strip().strip('"')
    if word is None:
        return value == "1"
    for item in value.split(";"):
        name, _, number = item.partition("=")
        if name.strip() == word:
            try:
                return int(number.strip(), 0) == 1
            except ValueError:
                return False
    return False


def check_gpudirect(dep: Deployment, entry: HostEntry, report: HostReport) -> list[str]:
    """GPUDirect RDMA on a host whose GPU stack is provided (``k2_gpu_stack: provided``; with
    ``install`` k2fleet loads nvidia-peermem itself where needed) and that lists HCAs: on the
    host's own kernel and loaded driver, DMA-BUF (open modules >= 515, kernel >= 5.12) or
    else the driver's nvidia-peermem module loaded; where the engine runs DeepEP, NVSHMEM's
    IBGDA prerequisite: GDRCopy's gdrdrv module loaded, or the driver option
    (``EnableStreamMemOPs=1``, ``PeerMappingOverride=1``) in effect. Sources:
    :mod:`k2fleet.planning.os_tables` [gpu-operator-rdma], [nvidia-peermem], [gdrcopy], [deepep].
    Nothing to read without HCAs, on a sandbox host or before an NVIDIA module is loaded."""
    from k2fleet.planning import os_tables as t
    from k2fleet.planning.fabric_plan import deepep_hosts

    boot = report.boot
    loaded = boot.modules.get("nvidia")
    if (not entry.settings.ib_hcas or dep.s.gpu_stack != "provided" or dep.s.simulated_gpus or boot.simulated
            or dep.gpu is None or dep.gpu.vendor != "nvidia" or not loaded):
        return []
    problems = []
    open_modules = boot.nvidia_driver.get("open")
    branch = t.version_key(loaded)[0] if loaded[:1].isdigit() else 0
    kernel = t.kernel_of(boot.kernel)
    how, _ = t.gpudirect_on(kernel, branch, bool(open_modules))
    if how == "nvidia-peermem" and not boot.modules.get(t.PEERMEM_MODULE):
        found = f"{'open' if open_modules else 'proprietary'} modules of branch {branch} on kernel {kernel[0]}.{kernel[1]}"
        problems.append(f"GPUDirect RDMA: the {t.PEERMEM_MODPROBE} module is not loaded ({found}: "
                        f"DMA-BUF needs open modules >= {t.DMABUF_MIN_BRANCH} on kernel >= 5.12): modprobe "
                        f"{t.PEERMEM_MODPROBE}, or run the open modules")
    params = boot.nvidia_driver.get("params") or {}
    option = _param_on(params, "EnableStreamMemOPs") and _param_on(params, "RegistryDwords", "PeerMappingOverride")
    if entry.name in deepep_hosts(dep) and not boot.modules.get(t.GDRCOPY_MODULE) and not option:
        table = t.OS_TABLES.get(entry.settings.os or t.DEFAULT_OS)
        manager = table.manager if table is not None else "apt"
        cuda = dep.driver.cuda if dep.driver is not None else "13.0"
        problems.append(f"DeepEP's NVSHMEM IBGDA: GDRCopy's {t.GDRCOPY_MODULE} module is not loaded and the driver "
                        f"option is not in effect (/proc/driver/nvidia/params): install GDRCopy "
                        f"({t.gdrcopy_source(entry.settings.os or t.DEFAULT_OS, manager, cuda)}), or set "
                        f"`{t.DEEPEP_IBGDA_DRIVER_OPTION}` and reboot")
    return problems
