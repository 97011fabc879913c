"""``k2fleet plan``'s RDMA fabric section: per host with ``k2_ib_hcas``, the packages, how the
HCAs reach GPU memory (GPUDirect RDMA per driver branch, :func:`k2fleet.planning.os_tables.gpudirect_rdma`),
what DeepEP's NVSHMEM needs (IBGDA: the driver option or GDRCopy), the containers' devices,
NCCL's and NVSHMEM's environment, and the fabric gate the preflight runs before any change
(:func:`k2fleet.planning.preflight_checks.check_fabric`). Pure: no host is contacted."""

from __future__ import annotations

from k2fleet.inventory.spec import HostEntry
from k2fleet.planning import os_tables as t
from k2fleet.planning.deployment import Deployment
from k2fleet.planning.engine_flags import a2a_backend
from k2fleet.planning.render.common import rdma_docker_args, rdma_env


def gate_line(host: HostEntry) -> str:
    """What the fabric gate expects of one host's ports."""
    s = host.settings
    ports = ", ".join(h if ":" in h else f"{h} (every port)" for h in s.ib_hcas)
    wants = ["ACTIVE (ports/N/state 4: ACTIVE)"]
    wants.append(f"link layer {s.ib_link_layer}" if s.ib_link_layer else "link layer InfiniBand or Ethernet")
    if s.ib_rate_gbps:
        wants.append(f">= {s.ib_rate_gbps} Gb/s")
    roce = (f"a RoCE v2 GID at index {s.ib_gid_index}" if s.ib_gid_index is not None else "a non-zero RoCE v2 GID")
    if s.ib_link_layer != "InfiniBand":
        wants.append(f"on Ethernet {roce}")
    return f"{ports}: {', '.join(wants)}"


def deepep_hosts(dep: Deployment) -> set[str]:
    """Hosts whose engine runs DeepEP (or vLLM's pplx) as its all-to-all: NVSHMEM over the HCAs."""
    names: set[str] = set()
    for pool in dep.pools.values():
        if pool.role in ("router", "slurm-submit"):
            continue
        backend = a2a_backend(dep, pool) or ""
        if backend and dep.engine_impl.rdma_a2a(backend):
            names |= {h.name for h in pool.hosts}
    return names


def format_fabric(dep: Deployment) -> str:
    """The section (empty when no host lists an HCA)."""
    hosts = [h for h in dep.fleet.hosts if h.settings.ib_hcas and h.settings.role not in ("router", "slurm-submit")]
    if not hosts:
        return ""
    out = ["\n== RDMA fabric (k2_ib_hcas)"]
    os_name = dep.s.os or t.DEFAULT_OS
    table = t.OS_TABLES[os_name]
    out.append(f"  packages ({os_name}): {', '.join(table.rdma)}")
    provided = dep.s.gpu_stack == "provided"
    if dep.driver is not None:
        how, why = t.gpudirect_rdma(os_name, dep.driver.branch, dep.driver.flavour == "open")
        load = ""
        if how == "nvidia-peermem":
            load = ("; the fabric gate checks it is loaded (k2_gpu_stack: provided)" if provided else
                    f"; k2fleet loads it (modprobe {t.PEERMEM_MODPROBE}, /etc/modules-load.d)")
        out.append(f"  GPUDirect RDMA: {how}: {why}{load}")
        if provided:
            out.append("  (k2_gpu_stack: provided: the fabric gate decides on the host's own kernel and loaded driver)")
    deepep = deepep_hosts(dep)
    if deepep:
        cuda = dep.driver.cuda if dep.driver is not None else "13.0"
        out.append("  DeepEP/NVSHMEM IBGDA (DeepEP's Buffer sets NVSHMEM_IB_ENABLE_IBGDA=1 and "
                   "NVSHMEM_IBGDA_NIC_HANDLER=gpu itself): needs the driver option "
                   f"`{t.DEEPEP_IBGDA_DRIVER_OPTION}` (then a reboot) or GDRCopy (module {t.GDRCOPY_MODULE}: "
                   f"{t.gdrcopy_source(os_name, table.manager, cuda)}) [deepep third-party/README.md, gdrcopy]; "
                   + ("the fabric gate checks one is in effect" if provided else
                      "NOT installed by k2fleet (NVIDIA publishes GDRCopy as files, not a repository): put one in "
                      "the host image"))
    if dep.runtime == "container":
        out.append(f"  containers: {' '.join(rdma_docker_args(dep.s.simulated_gpus))} --ulimit memlock=-1 "
                   "(every engine container of these hosts)")
    seen: dict[str, list[str]] = {}
    for h in hosts:
        env = " ".join(f"{k}={v}" for k, v in sorted(rdma_env(h).items()))
        line = f"env {env}\n    fabric gate (preflight, before any change or engine start): {gate_line(h)}"
        seen.setdefault(line, []).append(h.name + (" (DeepEP)" if h.name in deepep else ""))
    for line, names in seen.items():
        out.append(f"  {', '.join(names)}:\n    {line}")
    return "\n".join(out) + "\n"
