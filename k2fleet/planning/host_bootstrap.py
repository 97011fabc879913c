"""What takes one bare host to GPU-ready: the bootstrap plan (pure).

:func:`bootstrap_plan` reads the resolved :class:`~k2fleet.planning.deployment.Deployment` and the
tables of :mod:`k2fleet.planning.os_tables` and returns a :class:`BootstrapPlan` for one
host and OS: package repositories, packages with their pins, holds (and the
unattended-upgrades blacklist), kernel modules, services, files (IMEX nodes_config.cfg),
commands run after installing (``nvidia-ctk``), group memberships, and the gates that
must pass before the engine starts (GPU count and type, driver branch, loaded module =
installed driver, NVLink fabric state Completed). It connects to nothing; ``k2fleet plan
--json`` shows it per host under ``desired.bootstrap``; ``k2fleet/deploy/roles/bootstrap.py`` carries
it out. The decisions that need the host's state (which packages are pending, which are
obsolete, whether a reboot is needed, what refuses the host) are pure functions of the
plan and the HostState fact's :class:`~k2fleet.planning.preflight_checks.BootState` below.

``k2_gpu_stack: provided`` (hosts as delivered): :func:`provided_plan` instead — no NVIDIA,
AMD or Docker package, repository, hold, module load, service start or reboot; what the
host must already have, which :func:`provided_problems` compares with the fact in preflight.

Simulated GPUs (the sandbox): NVIDIA's and AMD's repositories are replaced by k2fleet's
TEST DOUBLE repository (:mod:`k2sandbox.driver_doubles`, same package names, installed
through the same apt path from the offline bundle) and ``modprobe`` by the double's
module loader; everything else (pins, holds, services, reboots, gates) is the same.

Pins: with ``k2_driver_version`` every driver-family package (driver, fabric manager,
NSCQ, NVSDM, IMEX) is pinned to that version; without it the branch is selected by
package name / pinning package / module stream and the fabric packages are marked
``same_as_driver``: the deploy installs them at the version the driver resolved to (a
fact), never the repository's newest — a fabric manager one patch release away from the
driver is the CUDA error 802 this exists to prevent.

>>> Package("nvidia-fabricmanager", "580.95.05").spec("apt")
'nvidia-fabricmanager=580.95.05*'
>>> Package("nvidia-fabricmanager", "580.95.05").spec("dnf")
'nvidia-fabricmanager-580.95.05'
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from k2fleet.planning.host_archive import host_argv
from k2fleet.planning import mirrors
from k2fleet.planning import os_tables as t
from k2fleet.planning.deployment import Deployment
from k2fleet.planning.host_fact import BootState, HostReport
from k2fleet.inventory.spec import HostEntry

CUDA_REPO_URL = t.NVIDIA_REPO_BASE + "/{os}/{arch}/"
CUDA_KEYRING = CUDA_REPO_URL + "cuda-keyring_1.1-1_all.deb"
CTK_APT = ("deb [signed-by=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg] "
           "https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH) /")
CTK_KEY = "https://nvidia.github.io/libnvidia-container/gpgkey"
CTK_DNF = "https://nvidia.github.io/libnvidia-container/stable/rpm/nvidia-container-toolkit.repo"
ROCM_KEY = "https://repo.radeon.com/rocm/rocm.gpg.key"
IMEX_NODES = "/etc/nvidia-imex/nodes_config.cfg"
IB_UMAD_CONF = "/etc/modules-load.d/k2fleet-ib_umad.conf"
PEERMEM_CONF = "/etc/modules-load.d/k2fleet-nvidia-peermem.conf"  # GPUDirect RDMA by nvidia-peermem, at every boot
CDI_SPEC = "/etc/cdi/nvidia.yaml"
HOLD_PATTERNS = {"apt": ("nvidia-*", "libnvidia-*", "libnvsdm*"), "dnf": ("*nvidia*{branch}*",)}
DOUBLE_REPO = "k2fleet TEST DOUBLE repository of {vendor}'s packages (k2sandbox.driver_doubles), in the offline bundle"
# The stand-ins for `modprobe` (vendor, simulated) → argv; simulated: the double driver's loader.
MODULE_LOADERS: dict[tuple[str, bool], tuple[str, ...]] = {
    ("nvidia", False): ("modprobe", "-a", "nvidia", "nvidia-uvm"),
    ("nvidia", True): ("/usr/lib/k2fleet-doubles/nvidia/load-module",),
    ("amd", False): ("modprobe", "amdgpu"),
    ("amd", True): ("/usr/lib/k2fleet-doubles/amdgpu/load-module",),
}
KERNEL_MODULE = {"nvidia": "nvidia", "amd": "amdgpu"}
# Packages named after a driver branch (apt): one of another branch than the plan's is
# obsolete and removed when the branch changes (their unversioned successors stay).
BRANCH_NAMED = re.compile(r"^(nvidia-open|cuda-drivers|nvidia-driver-pinning|nvidia-fabricmanager|libnvidia-nscq"
                          r"|libnvsdm|nvidia-imex)-(?P<branch>[0-9]{3})$")
GATE_TIMEOUT_S = {False: 300, True: 60}
GPU_GATE_CHECK = "gpu-ready"  # HostState check: the GPU gate passes as it is (timeout 0)
DOCKER_RUNTIME_CHECK = "docker-nvidia-runtime"  # HostState check: nvidia-ctk configured Docker
DOCKER_DAEMON_JSON = "/etc/docker/daemon.json"
FACT_PATTERNS = ("nvidia-*", "libnvidia-*", "libnvsdm*", "cuda-drivers*", "linux-headers-*", "amdgpu-dkms")  # the fabric manager trains NVLink for up to minutes; doubles at once


@dataclass(frozen=True)
class Package:
    """One package. ``version``: exact upstream version (the package manager's spec pins
    it); ``same_as_driver``: pinned at deploy time to the installed driver's version;
    ``hold``: held after install (apt-mark hold / dnf versionlock)."""

    name: str
    version: str | None = None
    same_as_driver: bool = False
    hold: bool = False

    def spec(self, manager: str) -> str:
        if self.version is None:
            return self.name
        return self.name + t.PACKAGE_MANAGERS[manager].version_spec.format(version=self.version)

    def to_json(self, manager: str) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "spec": self.spec(manager),
                "same_as_driver": self.same_as_driver, "hold": self.hold}


@dataclass(frozen=True)
class Repo:
    """A package source: an apt sources line (+ keyring), a dnf .repo file URL, or a dnf
    module stream to enable."""

    name: str
    kind: str  # "apt" (sources line) | "apt-keyring-deb" | "dnf-repo" (.repo URL) | "dnf-baseurl" | "dnf-module"
    # | "k2fleet-file" (a mirror in k2fleet's own source file, k2fleet.planning.mirrors, written before: source = its URL)
    source: str
    key: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "source": self.source, "key": self.key}


def repo_paths(repo: Repo) -> tuple[str, ...]:
    """The files the bootstrap writes to make ``repo`` known (``k2_package_source: apt``): an apt
    sources list and its keyring, or a dnf ``.repo`` file (the bootstrap role writes them,
    ``k2fleet down`` removes them). The others come from packages or the package manager.

    >>> repo_paths(Repo("cuda", "apt", "deb https://x/ /", "https://x/key"))
    ('/etc/apt/sources.list.d/cuda.list', '/usr/share/keyrings/cuda-keyring.gpg')
    """
    if repo.kind == "apt":
        return (f"/etc/apt/sources.list.d/{repo.name}.list", f"/usr/share/keyrings/{repo.name}-keyring.gpg")
    if repo.kind == "dnf-baseurl":
        return (f"/etc/yum.repos.d/{repo.name}.repo",)
    return ()


@dataclass(frozen=True)
class Gate:
    """A check after bootstrap: ``what`` must equal/contain ``expect``, read by ``how``."""

    name: str
    expect: Any
    how: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "expect": self.expect, "how": self.how}


@dataclass(frozen=True)
class BootstrapPlan:
    """Everything the bootstrap stage does on one host (see the module doc)."""

    host: str
    os: str
    os_from: str  # "k2_os" | "default"
    manager: str
    vendor: str | None  # "nvidia" | "amd" | None (a host without GPUs)
    arch: str
    package_source: str
    reboot: str
    driver: t.DriverChoice | None = None
    fabric: str | None = None
    repos: tuple[Repo, ...] = ()
    packages: tuple[Package, ...] = ()
    kernel_headers: str = ""
    holds: tuple[str, ...] = ()
    hold_patterns: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()
    services: tuple[str, ...] = ()
    files: dict[str, str] = field(default_factory=dict)
    commands: tuple[tuple[str, ...], ...] = ()
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)
    gates: tuple[Gate, ...] = ()
    driver_package: str | None = None  # the package whose version is the driver's
    module_load: tuple[str, ...] = ()  # loads the GPU kernel module without a reboot (first install)
    modprobe: tuple[str, ...] = ()  # further modules loaded now (ib_umad) besides modules-load.d
    simulated: bool = False
    gate_expect: dict[str, Any] = field(default_factory=dict)  # `hoststate.py --gate` input
    # k2_gpu_stack: provided — the host's GPU stack is taken as delivered: what it must have
    # (see provided_plan; empty: k2fleet installs it) and paths the fact reports as existing
    provided: dict[str, Any] = field(default_factory=dict)
    reads: tuple[str, ...] = ()

    def package(self, name: str) -> Package | None:
        return next((p for p in self.packages if p.name == name), None)

    def specs(self, packages: "tuple[Package, ...] | list[Package] | None" = None) -> list[str]:
        """Install specs of ``packages`` (default: all); a package pinned to the driver's
        version at deploy time is pinned to the branch here (the bundle holds one build)."""
        branch = f"{self.driver.branch}." if self.driver else None
        out = []
        for p in self.packages if packages is None else packages:
            if p.same_as_driver and branch and self.manager == "apt":  # dnf: the module stream selects it
                p = Package(p.name, branch, hold=p.hold)
            out.append(p.spec(self.manager))
        return out

    def to_json(self) -> dict[str, Any]:
        d = self.driver
        return {
            "os": self.os, "os_from": self.os_from, "manager": self.manager, "vendor": self.vendor,
            "arch": self.arch, "package_source": self.package_source, "reboot": self.reboot,
            "driver": None if d is None else {
                "branch": d.branch, "flavour": d.flavour, "version": d.version, "minimum": d.minimum,
                "minimum_reason": d.minimum_reason, "default_branch": d.default_branch, "cuda": d.cuda},
            "fabric": self.fabric,
            "repos": [r.to_json() for r in self.repos],
            "packages": [p.to_json(self.manager) for p in self.packages],
            "kernel_headers": self.kernel_headers,
            "holds": list(self.holds), "hold_patterns": list(self.hold_patterns),
            "modules": list(self.modules), "services": list(self.services),
            "files": dict(self.files), "commands": [list(c) for c in self.commands],
            "groups": {u: list(g) for u, g in self.groups.items()},
            "gates": [g.to_json() for g in self.gates],
            "driver_package": self.driver_package, "module_load": list(self.module_load),
            "modprobe": list(self.modprobe), "simulated": self.simulated, "gate_expect": self.gate_expect,
            "provided": dict(self.provided), "reads": list(self.reads),
        }


# --------------------------------------------------------------------------- pieces


def _branch_named(base: str, branch: int, since_unversioned: int = t.UNVERSIONED_FABRIC_SINCE) -> str:
    """``nvidia-fabricmanager`` from branch 580, ``nvidia-fabricmanager-570`` before ([gdc])."""
    return base if branch >= since_unversioned else f"{base}-{branch}"


def nvidia_driver_packages(manager: str, d: t.DriverChoice) -> tuple[list[Repo], list[Package]]:
    """The driver at branch ``d.branch`` in flavour ``d.flavour`` ([dig])."""
    meta = "nvidia-open" if d.flavour == "open" else "cuda-drivers"
    if manager == "dnf":
        stream = f"nvidia-driver:{d.branch}-{'open' if d.flavour == 'open' else 'dkms'}"
        return [Repo("nvidia-driver-stream", "dnf-module", stream)], [Package(meta, d.version, hold=True)]
    if d.branch >= t.APT_PINNING_SINCE:  # the pinning package selects the branch from then on; this
        # transaction pins it itself (apt reads preferences before installing the pinning package)
        return [], [Package(f"nvidia-driver-pinning-{d.branch}", hold=True),
                    Package(meta, d.version or f"{d.branch}.", hold=True)]
    # The branch meta package depends on one exact build of the driver; apt does not fall
    # back to an older candidate for it when a newer branch is in the repository, so the
    # driver itself is named at the branch too (or the pinned version).
    return [], [Package(f"{meta}-{d.branch}", d.version, hold=True), Package(meta, d.version or f"{d.branch}.", hold=True)]


def fabric_packages(fabric: str | None, d: t.DriverChoice, arch: str) -> tuple[list[Package], list[str], list[str]]:
    """(packages, kernel modules, services) of the GPU's NVLink fabric, at the driver's version."""
    if fabric is None:
        return [], [], []

    def pinned(base: str) -> Package:
        return Package(_branch_named(base, d.branch), d.version, same_as_driver=d.version is None, hold=True)

    if fabric == t.IMEX:
        return [pinned("nvidia-imex")], [], ["nvidia-imex"]
    pkgs = [pinned("nvidia-fabricmanager"), pinned("libnvidia-nscq")]
    modules: list[str] = []
    if fabric == t.NVLINK5:
        if arch == "x86_64":  # [gdc] libnvsdm packages are not available for arm64
            pkgs.append(pinned("libnvsdm"))
        pkgs += [Package("nvlsm"), Package("infiniband-diags")]
        modules = ["ib_umad"]
    return pkgs, modules, ["nvidia-fabricmanager"]


def cuda_repo(table: t.OsTable, arch: str, settings: Any = None) -> Repo:
    """NVIDIA's CUDA repository: NVIDIA's ``cuda-keyring`` package / ``.repo`` file, or, with
    ``k2_nvidia_repo``, k2fleet's own source file for the mirror (:mod:`k2fleet.planning.mirrors`,
    written with its keyring before any package is installed)."""
    if settings is not None and settings.nvidia_repo:  # source: the repository's URL at the mirror; key: the host keyring
        return Repo("cuda", "k2fleet-file", mirrors.nvidia_repo_url(settings, table, arch),
                    mirrors.keyring_path(table.manager, mirrors.NVIDIA, settings.nvidia_repo_keyring or ""))
    url = CUDA_REPO_URL.format(os=table.cuda_repo, arch=arch)
    if table.manager == "dnf":
        return Repo("cuda", "dnf-repo", url + f"cuda-{table.cuda_repo}.repo")
    return Repo("cuda", "apt-keyring-deb", CUDA_KEYRING.format(os=table.cuda_repo, arch=arch))


def container_repos(table: t.OsTable, vendor: str | None, settings: Any = None, arch: str = "x86_64") -> list[Repo]:
    """Docker CE's repository (RHEL family; Ubuntu and Debian take ``docker.io`` from the
    distribution) and, with NVIDIA GPUs, the container toolkit's: the vendors' own, or with
    ``k2_docker_repo`` / ``k2_container_toolkit_repo`` k2fleet's own source files for the
    mirrors (:mod:`k2fleet.planning.mirrors`, written with their keyrings before any package)."""
    repos = []
    if table.docker_repo and settings is not None and settings.docker_repo:
        repos.append(Repo("docker-ce", "k2fleet-file", mirrors.docker_repo_url(settings),
                          mirrors.keyring_path(table.manager, mirrors.DOCKER, settings.docker_repo_keyring or "")))
    elif table.docker_repo:
        repos.append(Repo("docker-ce", "dnf-repo", table.docker_repo))
    if vendor == "nvidia" and settings is not None and settings.container_toolkit_repo:
        repos.append(Repo("nvidia-container-toolkit", "k2fleet-file", mirrors.ctk_repo_url(settings, table, arch),
                          mirrors.keyring_path(table.manager, mirrors.CTK, settings.container_toolkit_repo_keyring or "")))
    elif vendor == "nvidia":
        repos.append(Repo("nvidia-container-toolkit", "dnf-repo", CTK_DNF) if table.manager == "dnf"
                     else Repo("nvidia-container-toolkit", "apt", CTK_APT, CTK_KEY))
    return repos


def unattended_blacklist() -> str:
    """apt.conf snippet: unattended-upgrades never touches drivers, fabric or kernels
    (list entries append to the distribution's own blacklist)."""
    lines = ["// k2fleet: drivers, fabric and kernels change only in a planned bootstrap with its reboot",
             "Unattended-Upgrade::Package-Blacklist {"]
    lines += [f'    "{prefix}";' for prefix in t.UNATTENDED_BLACKLIST]
    return "\n".join(lines + ["};"]) + "\n"


def nvidia_gates(dep: Deployment, d: t.DriverChoice, needs: t.GpuDriverNeeds, fabric: str | None,
                 services: list[str]) -> list[Gate]:
    smi = "nvidia-smi --query-gpu={} --format=csv,noheader"
    gates = [
        Gate("gpu-count", dep.gpus_per_node, smi.format("index")),
        Gate("gpu-type", needs.marketing, smi.format("name")),
        Gate("driver-branch", d.branch, smi.format("driver_version") + " (major)"),
        Gate("driver-minimum", d.minimum, smi.format("driver_version") + " (major, at least)"),
        Gate("module-matches-installed", "installed driver version", "/sys/module/nvidia/version"),
    ]
    if d.version:
        gates.append(Gate("driver-version", d.version, smi.format("driver_version")))
    if fabric:
        gates.append(Gate("fabric-state", "Completed", "nvidia-smi -q: Fabric > State of every GPU"))
        gates.append(Gate("fabric-status", "Success", "nvidia-smi -q: Fabric > Status of every GPU"))
    gates += [Gate(f"service-{s}", "active", f"systemctl is-active {s}") for s in services]
    return gates


def amd_gates(dep: Deployment, marketing: str) -> list[Gate]:
    return [
        Gate("module-loaded", "amdgpu", "/sys/module/amdgpu"),
        Gate("gpu-count", dep.gpus_per_node, "/sys/class/kfd/kfd/topology/nodes/*/properties with simd_count > 0"),
        Gate("gpu-type", marketing, "/sys/class/drm/card*/device/product_name"),
        Gate("kfd", "present", "/dev/kfd"),
    ]


# --------------------------------------------------------------------------- the plan


def host_needs_gpu_stack(host: HostEntry) -> bool:
    """Every role carries GPUs but the SGLang router and the SLURM login node."""
    return host.settings.role not in t.GPU_ROLES_WITHOUT_GPUS


def bootstrap_plan(dep: Deployment, host: HostEntry, host_os: str | None = None,
                   docker: bool | None = None) -> BootstrapPlan:
    """The bootstrap of ``host`` on OS ``host_os`` (default: its ``k2_os``, else
    :data:`~k2fleet.planning.os_tables.DEFAULT_OS`); ``docker``: the host runs containers (default: the fleet's runtime is
    ``container``), so it gets Docker (and, with NVIDIA GPUs, the container toolkit).
    Pure: tables in, plan out."""
    os_name = host_os or t.host_os(host)
    os_from = "argument" if host_os else ("k2_os" if host.settings.os else "default")
    table = t.OS_TABLES[os_name]
    gpu = dep.gpu
    assert gpu is not None
    vendor = gpu.vendor if host_needs_gpu_stack(host) else None
    needs = t.NVIDIA_GPUS.get(gpu.name) if vendor == "nvidia" else None
    arch = needs.arch if needs else "x86_64"
    manager = table.manager
    simulated = dep.s.simulated_gpus
    common = dict(host=host.name, os=os_name, os_from=os_from, manager=manager, vendor=vendor, arch=arch,
                  package_source=dep.s.package_source, reboot=dep.s.reboot, simulated=simulated)
    container = dep.runtime == "container" if docker is None else docker
    if dep.s.gpu_stack == "provided":
        return provided_plan(dep, host, common, table, vendor, container)
    if vendor is None:  # router / SLURM login node: no GPU stack (Docker if it runs containers)
        if not container:
            return BootstrapPlan(**common)
        return BootstrapPlan(**common, repos=tuple(container_repos(table, None, dep.s, arch)),
                             packages=tuple(Package(name) for name in table.docker), services=("docker",))
    repos: list[Repo] = []
    packages: list[Package] = [Package(name) for name in table.hold_tool]
    modules: list[str] = []
    services: list[str] = []
    files: dict[str, str] = {}
    commands: list[tuple[str, ...]] = []
    groups: dict[str, tuple[str, ...]] = {}
    fabric = None
    if vendor == "nvidia":
        d = dep.driver
        assert d is not None and needs is not None
        fabric = needs.fabric if needs.fabric != t.NVSWITCH or dep.gpus_per_node == t.HGX_GPUS else None
        repos.append(cuda_repo(table, arch, dep.s))
        driver_repos, driver_pkgs = nvidia_driver_packages(manager, d)
        repos += driver_repos
        packages += driver_pkgs
        f_pkgs, modules, f_services = fabric_packages(fabric, d, arch)
        packages += f_pkgs
        services = ["nvidia-persistenced", *f_services]
        if fabric == t.IMEX:
            files[IMEX_NODES] = "".join(a + "\n" for a in t.imex_addresses(dep.fleet))
        if fabric == t.NVLINK5:
            files[IB_UMAD_CONF] = "".join(m + "\n" for m in modules)
        if container:  # after Docker (below): nvidia-ctk configures its daemon.json
            packages.append(Package("nvidia-container-toolkit"))
            commands += [("nvidia-ctk", "runtime", "configure", "--runtime=docker"),
                         ("nvidia-ctk", "cdi", "generate", f"--output={CDI_SPEC}"),
                         ("systemctl", "restart", "docker")]
        gates = nvidia_gates(dep, d, needs, fabric, services)
        hold_patterns = tuple(p.format(branch=d.branch) for p in HOLD_PATTERNS[manager])
        driver_package = driver_pkgs[-1].name
        gate_expect = {"vendor": "nvidia", "count": dep.gpus_per_node, "name": needs.marketing, "branch": d.branch,
                       "minimum": d.minimum, "version": d.version, "driver_package": driver_package,
                       "fabric": fabric is not None, "services": services, "timeout": GATE_TIMEOUT_S[simulated]}
    else:
        repos.append(Repo("amdgpu", "dnf-baseurl" if manager == "dnf" else "apt", table.amdgpu_repo, ROCM_KEY))
        packages.append(Package("amdgpu-dkms", hold=True))
        groups[dep.s.mesh_user] = ("video", "render")
        gates = amd_gates(dep, t.AMD_MARKETING.get(gpu.name, gpu.name.upper()))
        hold_patterns = ()
        driver_package = "amdgpu-dkms"
        gate_expect = {"vendor": "amd", "count": dep.gpus_per_node, "services": [],
                       "timeout": GATE_TIMEOUT_S[simulated]}
    if simulated:  # NVIDIA's / AMD's repositories → the TEST DOUBLE one (in the bundle)
        repos = [Repo(vendor, "test-double", DOUBLE_REPO.format(vendor=vendor.upper()))]
    if container:
        repos += [r for r in container_repos(table, vendor, dep.s, arch) if not (simulated and r.name == "nvidia-container-toolkit")]
        packages += [Package(name) for name in table.docker]
        services.append("docker")
    if host.settings.ib_hcas or fabric == t.NVLINK5:
        packages += [Package(name) for name in table.rdma if not any(p.name == name for p in packages)]
    peermem: tuple[str, ...] = ()
    if vendor == "nvidia" and host.settings.ib_hcas and dep.driver is not None and not simulated:
        # GPUDirect RDMA where DMA-BUF is out of reach: the driver's nvidia-peermem, loaded now and at boot
        # (os_tables [gpu-operator-rdma], [nvidia-peermem])
        if t.gpudirect_rdma(os_name, dep.driver.branch, dep.driver.flavour == "open")[0] == "nvidia-peermem":
            peermem = (t.PEERMEM_MODPROBE,)
            files[PEERMEM_CONF] = t.PEERMEM_MODPROBE + "\n"
    kernel = (table.kernel_holds or {}).get(arch, ())
    holds = tuple(p.name for p in packages if p.hold) + kernel
    if manager == "apt":
        files[t.UNATTENDED_FILE] = unattended_blacklist()
    return BootstrapPlan(**common, driver=dep.driver if vendor == "nvidia" else None, fabric=fabric,
                         repos=tuple(repos), packages=tuple(packages), kernel_headers=table.kernel_headers,
                         holds=holds, hold_patterns=hold_patterns, modules=tuple(modules),
                         services=tuple(services), files=files, commands=tuple(commands), groups=groups,
                         gates=tuple(gates), driver_package=driver_package,
                         module_load=MODULE_LOADERS[(vendor, simulated)],
                         modprobe=() if simulated else tuple(modules) + peermem, gate_expect=gate_expect)


# --------------------------------------------------------------------------- k2_gpu_stack: provided

# What Docker's ``--gpus`` runs (moby: the ``nvidia-container-runtime-hook`` prestart hook,
# looked up on PATH), from NVIDIA's ``nvidia-container-toolkit`` package; sandbox hosts
# pass no ``--gpus`` (their GPUs are simulated) and the TEST DOUBLE toolkit has ``nvidia-ctk``.
TOOLKIT_PATH = {False: "/usr/bin/nvidia-container-runtime-hook", True: "/usr/bin/nvidia-ctk"}
DOCKER_PATH = "/usr/bin/docker"
IB_UMAD_PATH = "/sys/module/ib_umad"  # NVLink5: fabric manager + NVLSM talk to the switches through it ([gdc])
PROVIDED = "the GPU stack is provided (k2_gpu_stack: provided) and cannot serve"


def provided_plan(dep: Deployment, host: HostEntry, common: dict[str, Any], table: t.OsTable, vendor: str | None,
                  container: bool) -> BootstrapPlan:
    """``k2_gpu_stack: provided``: the host arrives with its GPU stack (driver, fabric manager,
    container toolkit, Docker) and k2fleet installs, removes, holds and starts none of it and
    never reboots for it (no repositories, no unattended-upgrades blacklist, no module load).
    The plan says what the host must already have (``provided``: the oldest driver the
    engine's CUDA build runs on, ``k2_driver_branch``/``k2_driver_version`` when set, the
    fabric's service, the toolkit, Docker, the kernel modules), which
    :func:`provided_problems` compares with the fact before any change; the GPU gate (count,
    type, driver, NVLink fabric, services) runs after, as with ``install``. Only the RDMA user
    space of ``k2_ib_hcas`` (no NVIDIA or Docker package) is still installed."""
    s = dep.s
    packages = tuple(Package(n) for n in table.rdma) if host.settings.ib_hcas and vendor else ()
    services: list[str] = []
    reads: list[str] = []
    provided: dict[str, Any] = {"toolkit": None, "docker": container, "modules": []}
    gates: list[Gate] = []
    gate_expect: dict[str, Any] = {}
    groups: dict[str, tuple[str, ...]] = {}
    fabric = None
    if vendor == "nvidia":
        d, needs = dep.driver, t.NVIDIA_GPUS[dep.gpu.name]
        assert d is not None
        fabric = needs.fabric if needs.fabric != t.NVSWITCH or dep.gpus_per_node == t.HGX_GPUS else None
        services = {None: [], t.IMEX: ["nvidia-imex"]}.get(fabric, ["nvidia-fabricmanager"])
        minimum = t.minimum_driver_version(d.cuda, needs.min_branch)
        provided |= {"module": "nvidia", "minimum_version": minimum, "minimum_reason": d.minimum_reason,
                     "cuda": d.cuda, "branch": s.driver_branch, "version": s.driver_version, "fabric": fabric,
                     "modules": ["nvidia"] + (["ib_umad"] if fabric == t.NVLINK5 else [])}
        if fabric == t.NVLINK5 and not common["simulated"]:
            reads.append(IB_UMAD_PATH)
        if container:
            provided["toolkit"] = TOOLKIT_PATH[common["simulated"]]
            reads.append(provided["toolkit"])
        smi = "nvidia-smi --query-gpu={} --format=csv,noheader"
        gates = [Gate("gpu-count", dep.gpus_per_node, smi.format("index")),
                 Gate("gpu-type", needs.marketing, smi.format("name")),
                 Gate("driver-minimum-version", minimum, smi.format("driver_version") + " (at least)")]
        if s.driver_branch is not None:
            gates.append(Gate("driver-branch", s.driver_branch, smi.format("driver_version") + " (major)"))
        if s.driver_version:
            gates.append(Gate("driver-version", s.driver_version, smi.format("driver_version")))
        if fabric:
            gates += [Gate("fabric-state", "Completed", "nvidia-smi -q: Fabric > State of every GPU"),
                      Gate("fabric-status", "Success", "nvidia-smi -q: Fabric > Status of every GPU")]
        gate_expect = {"vendor": "nvidia", "count": dep.gpus_per_node, "name": needs.marketing,
                       "branch": s.driver_branch, "minimum": d.minimum, "minimum_version": minimum,
                       "version": s.driver_version, "driver_package": None, "fabric": fabric is not None,
                       "services": services, "timeout": GATE_TIMEOUT_S[common["simulated"]]}
    elif vendor == "amd":
        provided |= {"module": "amdgpu", "modules": ["amdgpu"]}
        groups[s.mesh_user] = ("video", "render")
        gates = amd_gates(dep, t.AMD_MARKETING.get(dep.gpu.name, dep.gpu.name.upper()))
        gate_expect = {"vendor": "amd", "count": dep.gpus_per_node, "services": services,
                       "timeout": GATE_TIMEOUT_S[common["simulated"]]}
    if container:
        services.append("docker")
        reads.append(DOCKER_PATH)
    gates += [Gate(f"service-{u}", "active", f"systemctl is-active {u}") for u in services]
    return BootstrapPlan(**common, driver=dep.driver if vendor == "nvidia" else None, fabric=fabric,
                         packages=packages, services=tuple(services), groups=groups, gates=tuple(gates),
                         gate_expect=gate_expect, provided=provided, reads=tuple(reads))


def provided_problems(plan: BootstrapPlan, fact: HostReport) -> list[str]:
    """Why a host whose GPU stack is provided cannot serve (empty: it can), each naming what
    the fact found and what is needed; one entry, the host's one line, or none."""
    if not plan.provided:
        return []
    want, boot, found = plan.provided, fact.boot, []
    module = want.get("module")
    loaded = boot.modules.get(module) if module else None
    if module and loaded is None:
        found.append(f"no {module} kernel module is loaded" + (" (nouveau drives the GPUs)" if boot.nouveau else ""))
    elif module == "nvidia" and loaded:
        need = want["minimum_version"]
        if t.version_key(loaded) < t.version_key(need):
            cuda = t.cuda_of_driver(loaded)
            runs = f"CUDA {cuda} at most" if cuda else f"older than CUDA {min(t.CUDA_DRIVER, key=t.version_key)}"
            found.append(f"driver {loaded} is loaded ({runs}), {need} or newer is needed: {want['minimum_reason']}")
        if want.get("branch") is not None and t.version_key(loaded)[0] != want["branch"]:
            found.append(f"driver {loaded} is loaded, k2_driver_branch is {want['branch']}")
        if want.get("version") and loaded != want["version"]:
            found.append(f"driver {loaded} is loaded, k2_driver_version is {want['version']}")
        fm = {n: v for n, v in boot.package_versions.items() if re.fullmatch(r"nvidia-fabricmanager(-[0-9]{3})?", n)}
        if want.get("fabric") and want["fabric"] != t.IMEX and fm and all(upstream(v) != loaded for v in fm.values()):
            name, version = sorted(fm.items())[0]
            found.append(f"{name} {upstream(version)} is installed, the driver is {loaded}: they must be equal "
                         "(CUDA error 802)")
    for path, what in ((IB_UMAD_PATH, "the ib_umad kernel module is not loaded (NVLink5's fabric manager needs it)"),
                       (want.get("toolkit"), f"no NVIDIA container toolkit ({want.get('toolkit')} is missing)"),
                       (DOCKER_PATH, f"no Docker ({DOCKER_PATH} is missing)")):
        if path in plan.reads and not fact.exists.get(path):
            found.append(what)
    for unit in plan.services:
        if not (unit == "docker" and not fact.exists.get(DOCKER_PATH)) and not fact.unit_active(f"{unit}.service"):
            state = fact.units.get(f"{unit}.service", {}).get("ActiveState") or "not there"
            found.append(f"{unit}.service is {state}")
    return [f"{PROVIDED}: " + "; ".join(found)] if found else []


# --------------------------------------------------------------------------- decisions on the host's state


def gate_argv(plan: BootstrapPlan, timeout: float | None = None) -> list[str]:
    """``hoststate --gate`` (from the host archive) with this plan's expectations (``timeout`` overrides its own)."""
    want = dict(plan.gate_expect)
    if timeout is not None:
        want["timeout"] = timeout
    return host_argv("hoststate", "--gate", json.dumps(want, sort_keys=True))


def fact_checks(plan: BootstrapPlan) -> dict[str, list[str]]:
    """Read-only checks the HostState fact runs for the bootstrap: the GPU gate as the host
    is now, and whether the container toolkit configured Docker."""
    checks = {GPU_GATE_CHECK: gate_argv(plan, timeout=0)} if plan.vendor else {}
    if plan.package("nvidia-container-toolkit"):
        checks[DOCKER_RUNTIME_CHECK] = ["/usr/bin/grep", "-q", "nvidia-container-runtime", DOCKER_DAEMON_JSON]
    return checks


def fact_patterns(plan: BootstrapPlan) -> list[str]:
    """Package names/globs whose installed versions the HostState fact reports."""
    return sorted({*FACT_PATTERNS, *(p.name for p in plan.packages), *plan.holds})


def upstream(version: str) -> str:
    """A package version without epoch and Debian/RPM revision.

    >>> upstream("1:580.95.05-1ubuntu1"), upstream("590.44.01")
    ('580.95.05', '590.44.01')
    """
    return version.split(":", 1)[-1].split("-", 1)[0]


def _satisfied(p: Package, installed: dict[str, str], driver_version: str | None) -> bool:
    have = installed.get(p.name)
    if have is None:
        return False
    if p.same_as_driver:
        return driver_version is not None and upstream(have) == driver_version
    return p.version is None or upstream(have).startswith(p.version)


def installed_driver(plan: BootstrapPlan, boot: BootState) -> str | None:
    """Upstream version of the installed driver package, if it is the plan's."""
    name = plan.driver_package
    have = boot.package_versions.get(name) if name else None
    pkg = plan.package(name) if name else None
    if have is None or pkg is None or not _satisfied(pkg, boot.package_versions, None):
        return None
    return upstream(have)


def pending_packages(plan: BootstrapPlan, boot: BootState) -> list[Package]:
    """The plan's packages not installed at the planned version (empty: nothing to do).

    A package pinned to the driver's version is pending until it has the installed
    driver's exact version, so a fabric manager one patch away is reinstalled.
    """
    driver = installed_driver(plan, boot)
    return [p for p in plan.packages if not _satisfied(p, boot.package_versions, driver)]


def obsolete_packages(plan: BootstrapPlan, boot: BootState) -> list[str]:
    """Installed packages named after another driver branch than the plan's (removed when
    the branch changes; e.g. ``nvidia-open-580`` on the way to 590)."""
    if plan.provided:  # the host's own packages: never removed
        return []
    wanted = {p.name for p in plan.packages}
    return sorted(n for n in boot.package_versions if BRANCH_NAMED.match(n) and n not in wanted)


def missing_headers(plan: BootstrapPlan, boot: BootState) -> list[str]:
    """The running kernel's headers package, when the plan's driver is built by DKMS against it
    (``kernel_headers``; online installs of real GPUs only) and the host does not have it."""
    if not plan.kernel_headers or not plan.vendor or plan.simulated or plan.package_source != "apt":
        return []
    wanted = plan.kernel_headers.format(kernel=boot.kernel)
    return [] if wanted in boot.package_versions else [wanted]


def missing_holds(plan: BootstrapPlan, boot: BootState) -> list[str]:
    """Held-to-be packages that are (or will be) installed and not held yet, or that this
    run installs (apt drops the hold of a package it changes with
    ``--allow-change-held-packages``); kernel meta packages only where installed (a
    container host has none)."""
    planned = {p.name for p in plan.packages}
    changing = {p.name for p in pending_packages(plan, boot)}  # apt drops, dnf's lock is deleted first
    return [n for n in plan.holds
            if (n not in boot.holds or n in changing) and (n in planned or n in boot.package_versions)]


def reboot_reason(plan: BootstrapPlan, boot: BootState) -> str | None:
    """Why this host must reboot in this bootstrap (None: it need not): the loaded GPU
    module differs from the driver it will run (a driver change, or one installed before
    without its reboot), nouveau holds the GPUs, or a new kernel waits."""
    if plan.vendor is None or plan.provided:  # a provided stack: k2fleet never reboots for it
        return None
    loaded = boot.modules.get(KERNEL_MODULE[plan.vendor])
    kernel = [p for p in boot.reboot_required if p.startswith(("linux-image", "linux-base", "kernel"))]
    if kernel:
        return f"a new kernel waits for a reboot ({', '.join(kernel)})"
    if loaded is None:
        if plan.vendor == "nvidia" and boot.nouveau:
            return "nouveau drives the GPUs; the NVIDIA module loads after a reboot"
        return None  # first install: the module is loaded without a reboot
    pending = {p.name for p in pending_packages(plan, boot)}
    if plan.driver_package in pending:
        d = plan.driver
        target = (d.version or f"the newest of branch {d.branch}") if d else f"a new {plan.driver_package}"
        return f"driver {loaded} is loaded and {target} will be installed"
    installed = installed_driver(plan, boot)
    if plan.vendor == "nvidia" and installed and installed != loaded:
        return f"driver {loaded} is loaded but {installed} is installed"
    return None


def os_id(boot: BootState) -> str | None:
    """The k2_os value of the host's /etc/os-release (None: not a release k2fleet plans)."""
    rel = boot.os
    version = rel.get("version_id", "")
    return t.OS_RELEASE_IDS.get((rel.get("id", ""), version)) or t.OS_RELEASE_IDS.get(
        (rel.get("id", ""), version.split(".")[0]))


def bootstrap_problems(plan: BootstrapPlan, boot: BootState) -> list[str]:
    """Reasons the bootstrap must not touch this host (empty: go ahead)."""
    problems = []
    found = os_id(boot)
    if boot.os and found != plan.os and not (found in ("rhel-9", "rocky-9") and plan.os in ("rhel-9", "rocky-9")):
        where = "the default" if plan.os_from == "default" else "k2_os"
        seen = f"{boot.os.get('id', '?')} {boot.os.get('version_id', '?')}"
        problems.append(f"k2_os is {plan.os} ({where}) but the host runs {seen}; set k2_os: {found}" if found else
                        f"the host runs {seen}, which k2fleet has no package table for "
                        f"(k2_os: {', '.join(sorted(t.OS_TABLES))})")
    if plan.vendor is None:
        return problems
    hw = boot.hardware
    if hw and not plan.simulated and hw.get("simulated"):
        problems.append("the host has TEST DOUBLE GPUs (/etc/k2fleet-doubles/gpus.json): a sandbox host")
    if hw and hw.get("vendor") not in (None, plan.vendor):
        problems.append(f"the plan is for {plan.vendor} GPUs, the host's PCI bus has {hw['vendor']} GPUs")
    module = boot.modules.get(KERNEL_MODULE[plan.vendor])
    if (plan.vendor == "nvidia" and boot.secure_boot and module is None
            and plan.driver_package in {p.name for p in pending_packages(plan, boot)}):
        problems.append("Secure Boot is on and the driver's DKMS modules are unsigned until a Machine Owner Key is "
                        "enrolled: `mokutil --import /var/lib/dkms/mok.pub`, reboot and confirm it in the MOK "
                        "manager (or turn Secure Boot off), then deploy again")
    return problems
