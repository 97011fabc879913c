"""Facts the bootstrap plans with: engine → CUDA → driver branch, GPU families, and
package names per OS family (pure data + the one rule that picks the driver).

Every fact names its source; ``verified=False`` marks a fact k2fleet derived without
reading the engine's own metadata for that exact release (see each entry's evidence).

Sources (read for this table; cite these when a number looks wrong):

- [wheels] the engines' wheels from PyPI (``pip download --no-deps``), their
  ``*.dist-info/METADATA``: the ``torch==`` pin and CUDA extras; then the pinned torch's
  PyPI wheel METADATA (PEP 658 ``.metadata`` file of the manylinux x86_64 cp311 wheel):
  ``nvidia-cuda-runtime-cu12==12.6.77`` (torch 2.7.1), ``==12.8.90`` (torch 2.8.0, 2.9.1),
  ``cuda-toolkit[...]==13.0.3`` (torch 2.14.0, 2.14.1).
- [cuda-rn] CUDA Toolkit release notes, table "CUDA Toolkit and Corresponding Driver
  Versions" (docs.nvidia.com/cuda/cuda-toolkit-release-notes): 12.6 GA ≥ 560.28.03,
  12.8 GA ≥ 570.26, 12.9 GA ≥ 575.51.03, 13.0 GA ≥ 580.65.06 (Linux x86_64).
- [dig] NVIDIA Driver Installation Guide (docs.nvidia.com/datacenter/tesla/
  driver-installation-guide): "kernel-modules" (open flavour default since 560; Ubuntu/
  Debian ``nvidia-open`` vs ``cuda-drivers``; RHEL 8/9 ``dnf module enable
  nvidia-driver:<branch>-open`` + ``dnf install nvidia-open``), "version-locking"
  (``python3-dnf-plugin-versionlock``; Ubuntu/Debian 590 and later:
  ``nvidia-driver-pinning-<branch>`` before the unversioned ``nvidia-open``/``cuda-drivers``).
- [open-km] NVIDIA, "NVIDIA Transitions Fully Towards Open-Source GPU Kernel Modules"
  (2024): open modules are required on Grace Hopper and Blackwell (the proprietary
  flavour is unsupported there) and recommended for Turing and newer.
- [gdc] NVIDIA/gpu-driver-container (the GPU Operator's driver container), snapshot of
  2026-08-17: ``ubuntu22.04/install.sh`` and ``rhel9/install.sh`` install
  ``nvidia-fabricmanager``, ``libnvidia-nscq``, ``libnvsdm`` (x86_64 only) and
  ``nvidia-imex`` at ``=${DRIVER_VERSION}`` and hold them (``apt-mark hold`` /
  ``dnf versionlock add``), ``nvlsm`` + ``infiniband-diags`` unversioned; commit dc7857e
  (2025-09-24, "Fix: precompiled R580 package install error"): from branch 580 NVIDIA's
  repository names these packages without the branch (``nvidia-fabricmanager-580`` became
  a virtual package provided by ``nvidia-fabricmanager 580.65.06-1``); before 580 they are
  ``nvidia-fabricmanager-<branch>``, ``libnvidia-nscq-<branch>``, ``libnvsdm-<branch>``
  (560+), ``nvidia-imex-<branch>`` (550+); NVLSM from 570. ``ubuntu22.04/nvidia-driver``:
  an NVLink5 system (HGX B200/B300: an InfiniBand device whose VPD holds ``SW_MNG``)
  starts fabric manager with NVLSM and waits for the ``mlx5_core`` and ``ib_umad`` modules.
- [imex] NVIDIA IMEX Service User's Guide, "IMEX Service Config Options": the node
  config file (default ``/etc/nvidia-imex/nodes_config.cfg``) holds the IP addresses of
  the IMEX domain's nodes; ``SERVER_PORT`` defaults to 50000.
- [ctk] NVIDIA Container Toolkit install guide: apt repository
  ``https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH) /`` (key
  ``.../libnvidia-container/gpgkey``), dnf repository file
  ``.../stable/rpm/nvidia-container-toolkit.repo``; ``nvidia-ctk runtime configure
  --runtime=docker`` then restart Docker; ``nvidia-ctk cdi generate``. The repository's own
  files (NVIDIA/libnvidia-container ``stable/deb/nvidia-container-toolkit.list``: ``deb
  .../stable/deb/$(ARCH) /``; ``stable/rpm/nvidia-container-toolkit.repo``: ``baseurl=
  .../stable/rpm/$basearch``, ``repo_gpgcheck=1``, ``gpgcheck=0``: the metadata is signed, the
  packages are not).
- [docker-rhel] Docker CE's ``https://download.docker.com/linux/rhel/docker-ce.repo``:
  ``[docker-ce-stable]`` ``baseurl=https://download.docker.com/linux/rhel/$releasever/$basearch/stable``,
  ``gpgcheck=1``, ``gpgkey=https://download.docker.com/linux/rhel/gpg`` (as quoted by installation
  guides that copy it; the file itself was not fetched here).
- [cuda-repo] NVIDIA's CUDA network repositories
  ``https://developer.download.nvidia.com/compute/cuda/repos/<os>/<arch>/`` with
  ``<os>`` ubuntu2204, ubuntu2404, debian12, rhel9 and ``<arch>`` x86_64 or sbsa (arm64
  servers: Grace in GB200/GB300); keyring package ``cuda-keyring_1.1-1_all.deb``, dnf
  repository file ``cuda-rhel9.repo``; Debian needs the ``contrib`` component
  (NVIDIA/apt-packaging-fabric-manager issue #2).
- [trtllm] TensorRT-LLM: README badges at 1.2.0rc6 "cuda-13.0.0, torch-2.9.0"
  (NVIDIA/TensorRT-LLM PR #11224); triton tensorrtllm_backend PR #820 moved the TRT-LLM
  base image from ``pytorch:25.06-py3`` (CUDA 12.9, NCCL +cuda12.9) to
  ``pytorch:25.10-py3`` (CUDA 13.0) for the 1.2 line.
- [rocm] ROCm install docs (rocm.docs.amd.com): the ``amdgpu-dkms`` kernel driver from
  ``repo.radeon.com/amdgpu``, key ``repo.radeon.com/rocm/rocm.gpg.key``; users of the GPUs
  join the ``video`` and ``render`` groups.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from k2fleet.hostprogs.hoststate import version_key  # one ordering of driver versions, host and plan (re-exported)
from k2fleet.planning import catalog
from k2fleet.inventory.spec import Fleet, HostEntry, SpecError

# ======================================================================================
# engine → CUDA → driver branch
# ======================================================================================


@dataclass(frozen=True)
class EngineCuda:
    """The CUDA release an engine's default build (wheel or image) is made with."""

    cuda: str
    evidence: str
    verified: bool = True


ENGINE_CUDA: dict[tuple[str, str], EngineCuda] = {
    ("vllm", "0.33.0"): EngineCuda("13.0", "[wheels] vllm 0.33.0: torch==2.14.0; torch 2.14.0: cuda-toolkit==13.0.3"),
    ("vllm", "0.11.0"): EngineCuda("12.8", "[wheels] vllm 0.11.0: torch==2.8.0; torch 2.8.0: nvidia-cuda-runtime-cu12==12.8.90"),
    ("vllm", "0.10.0"): EngineCuda("12.6", "[wheels] vllm 0.10.0: torch==2.7.1; torch 2.7.1: nvidia-cuda-runtime-cu12==12.6.77"),
    ("sglang", "0.5.23"): EngineCuda(
        "13.0",
        "[wheels] sglang 0.5.23: torch==2.14.1, cuda-python>=13.0, flashinfer_python[cu13]; torch 2.14.1: "
        "cuda-toolkit==13.0.3 (METADATA read from the wheel's zip directory: PyPI has no PEP 658 file for it)",
    ),
    ("sglang", "0.5.4"): EngineCuda("12.8", "[wheels] sglang 0.5.4: torch==2.8.0; torch 2.8.0: nvidia-cuda-runtime-cu12==12.8.90"),
    ("sglang", "0.4.9"): EngineCuda("12.6", "[wheels] sglang 0.4.9 [srt]: torch==2.7.1; torch 2.7.1: nvidia-cuda-runtime-cu12==12.6.77"),
    ("trtllm", "1.2.0"): EngineCuda("13.0", "[trtllm] 1.2 line: CUDA 13.0 base image (read at 1.2.0rc6, not the final tag)", verified=False),
    ("trtllm", "1.0.0"): EngineCuda("12.9", "[trtllm] 1.0 line: pytorch:25.06-py3 base image, CUDA 12.9", verified=False),
    ("ktransformers", "0.7.2"): EngineCuda(
        "13.0",
        "[wheels] sglang-kt 0.7.2: cuda-python>=13.1,<13.3 (CUDA 13 bindings) although kt-kernel 0.7.2 pins "
        "torch==2.9.1 (PyPI build: CUDA 12.8); the stricter one is taken",
        verified=False,
    ),
    ("ktransformers", "0.3.2"): EngineCuda(
        "12.8", "no PyPI metadata for ktransformers 0.3.2 (wheels per CUDA/torch on GitHub); assumed", verified=False
    ),
}


@dataclass(frozen=True)
class CudaDriver:
    """The toolkit driver of one CUDA release: branch and first version ([cuda-rn])."""

    branch: int
    version: str


CUDA_DRIVER: dict[str, CudaDriver] = {
    "12.6": CudaDriver(560, "560.28.03"),
    "12.8": CudaDriver(570, "570.26"),
    "12.9": CudaDriver(575, "575.51.03"),
    "13.0": CudaDriver(580, "580.65.06"),
}

# NVIDIA data-center production / long-term-support branches k2fleet defaults to (a
# new-feature branch such as 575 is never a default; pin it with k2_driver_branch).
DATACENTER_BRANCHES = (535, 550, 570, 580)

# Ubuntu/Debian: from this branch a ``nvidia-driver-pinning-<branch>`` package selects the
# branch and the driver meta packages are unversioned ([dig], version locking).
APT_PINNING_SINCE = 590
# NVIDIA's repository drops the branch from the fabric/IMEX/NSCQ/NVSDM names ([gdc] dc7857e).
UNVERSIONED_FABRIC_SINCE = 580

# ======================================================================================
# GPU families
# ======================================================================================
NVSWITCH, NVLINK5, IMEX = "nvswitch", "nvlink5", "imex"


@dataclass(frozen=True)
class GpuDriverNeeds:
    """What a GPU type needs from the host: the lowest driver branch that supports it,
    whether the open kernel modules are required, its NVLink fabric and CPU arch."""

    min_branch: int
    evidence: str
    open_required: bool
    fabric: str | None  # NVSWITCH (HGX, fabric manager), NVLINK5 (+ NVLSM, ib_umad), IMEX (NVL72)
    arch: str = "x86_64"  # "sbsa": arm64 server (Grace)
    marketing: str = ""  # what nvidia-smi / amd-smi names it (the gate's GPU type check)


_HOPPER = "Hopper (sm_90) since CUDA 11.8 / R520; never binding for the pinned engines (all need 560+)"
_BW = "[cuda-rn] CUDA 12.8 is the first toolkit with Blackwell (sm_100); its driver branch is 570"
_BW_ULTRA = ("Blackwell Ultra (sm_103) from CUDA 12.9; NVIDIA's data-center support for B300/GB300 "
             "starts with the R580 branch (not verified against a release note)")
NVIDIA_GPUS: dict[str, GpuDriverNeeds] = {
    "h100": GpuDriverNeeds(520, _HOPPER, False, NVSWITCH, marketing="H100"),
    "h800": GpuDriverNeeds(520, _HOPPER, False, NVSWITCH, marketing="H800"),
    "h20": GpuDriverNeeds(520, _HOPPER, False, NVSWITCH, marketing="H20"),
    "h200": GpuDriverNeeds(520, _HOPPER, False, NVSWITCH, marketing="H200"),
    "b200": GpuDriverNeeds(570, _BW, True, NVLINK5, marketing="B200"),
    "b300": GpuDriverNeeds(580, _BW_ULTRA, True, NVLINK5, marketing="B300"),
    "gb200": GpuDriverNeeds(570, _BW, True, IMEX, arch="sbsa", marketing="GB200"),
    "gb300": GpuDriverNeeds(580, _BW_ULTRA, True, IMEX, arch="sbsa", marketing="GB300"),
}
# [imex] SERVER_PORT default: every host of an IMEX domain listens on it, so no engine
# process may take it there (k2fleet.planning.planner checks it with the other ports).
IMEX_SERVER_PORT = 50000


def reserved_ports(gpu: str) -> dict[str, int]:
    """Ports the bootstrap's daemons take on every host of a ``gpu`` fleet.

    >>> reserved_ports("gb200"), reserved_ports("h200")
    ({'nvidia-imex (its SERVER_PORT)': 50000}, {})
    """
    needs = NVIDIA_GPUS.get(gpu)
    return {"nvidia-imex (its SERVER_PORT)": IMEX_SERVER_PORT} if needs and needs.fabric == IMEX else {}


# An HGX baseboard carries 8 GPUs behind NVSwitches; fewer GPUs per host (HGX 4-GPU, PCIe
# cards, NVL bridges) means no NVSwitch and no fabric manager.
HGX_GPUS = 8

AMD_MARKETING = {"mi300x": "MI300X", "mi325x": "MI325X", "mi355x": "MI355X"}
# amdgpu kernel driver release of the ROCm 7.0 line (the default ROCm images are
# rocm700 builds). The repository path layout is from the ROCm 6.x docs; the 7.x driver
# numbering ("30.10") is not verified here.
AMDGPU_RELEASE = "30.10"

# ======================================================================================
# OS families (one table each, like per-OS task files)
# ======================================================================================


@dataclass(frozen=True)
class OsTable:
    """Package names and repositories of one OS release."""

    name: str  # the k2_os value
    manager: str  # "apt" | "dnf"
    cuda_repo: str  # [cuda-repo] <os> directory
    cuda_arches: tuple[str, ...]  # arch directories NVIDIA publishes for it (as k2fleet knows)
    codename: str = ""
    components: str = "main"
    kernel_holds: dict[str, tuple[str, ...]] | None = None  # arch → kernel meta packages to hold
    kernel_headers: str = ""  # for DKMS, {kernel} = the running kernel (a fact)
    docker: tuple[str, ...] = ()
    docker_repo: str = ""
    rdma: tuple[str, ...] = ()
    hold_tool: tuple[str, ...] = ()  # packages that provide the hold command
    amdgpu_repo: str = ""
    # the interpreter engine venvs are made with (`PYTHON -m venv`), its version (what the
    # bundle's wheels are for) and the packages that provide it with venv support
    python: str = "python3"
    python_version: str = ""
    venv_packages: tuple[str, ...] = ("python3-venv",)
    # the package of the HAProxy that runs k2fleet's API front (k2fleet.planning.api_front;
    # binary /usr/sbin/haproxy, config features of 2.2+: `http-request return`); the
    # release's version in the comment of each table, with where it was read
    haproxy: str = "haproxy"
    # k2_node_exporter: the release's Prometheus node exporter package (its own unit, port
    # 9100), None where the base repositories have none (k2fleet refuses the key there)
    node_exporter: str | None = "prometheus-node-exporter"


UBUNTU_2204 = OsTable(
    name="ubuntu-22.04", manager="apt", cuda_repo="ubuntu2204", cuda_arches=("x86_64", "sbsa"), codename="jammy",
    # python3 is 3.10, below vLLM 0.32+'s Requires-Python (>=3.11): jammy's universe python3.11
    python="python3.11", python_version="3.11", venv_packages=("python3.11", "python3.11-venv"),
    # haproxy 2.4.x in jammy main (packages.ubuntu.com/jammy/haproxy; not fetched here)
    haproxy="haproxy",
    # prometheus-node-exporter 1.3.x in jammy universe (packages.ubuntu.com/jammy/prometheus-node-exporter; not fetched here)
    node_exporter="prometheus-node-exporter",
    kernel_holds={"x86_64": ("linux-generic", "linux-image-generic", "linux-headers-generic"),
                  "sbsa": ("linux-generic", "linux-image-generic", "linux-headers-generic")},
    kernel_headers="linux-headers-{kernel}",
    docker=("docker.io",),
    rdma=("rdma-core", "ibverbs-utils", "infiniband-diags", "perftest"),
    amdgpu_repo=f"https://repo.radeon.com/amdgpu/{AMDGPU_RELEASE}/ubuntu jammy main",
)
UBUNTU_2404 = OsTable(
    name="ubuntu-24.04", manager="apt", cuda_repo="ubuntu2404", cuda_arches=("x86_64", "sbsa"), codename="noble",
    python_version="3.12",
    haproxy="haproxy",  # 2.8.x in noble main (packages.ubuntu.com/noble/haproxy; not fetched here)
    node_exporter="prometheus-node-exporter",  # 1.7.x in noble universe (packages.ubuntu.com/noble; not fetched here)
    kernel_holds=UBUNTU_2204.kernel_holds,
    kernel_headers="linux-headers-{kernel}",
    docker=("docker.io",),
    rdma=("rdma-core", "ibverbs-utils", "infiniband-diags", "perftest"),
    amdgpu_repo=f"https://repo.radeon.com/amdgpu/{AMDGPU_RELEASE}/ubuntu noble main",
)
DEBIAN_12 = OsTable(
    # sbsa: referenced as https://developer.download.nvidia.com/compute/cuda/repos/debian12/sbsa by
    # third-party repository configurations (not read from NVIDIA's own page)
    name="debian-12", manager="apt", cuda_repo="debian12", cuda_arches=("x86_64", "sbsa"), codename="bookworm",
    python_version="3.11",
    # 2.6.12-1+deb12u4 from bookworm main: installed from deb.debian.org on the control machine
    # (`apt-get install haproxy`, /usr/sbin/haproxy; tests/test_api_front.py runs it)
    haproxy="haproxy",
    # 1.5.0-1+b* from bookworm main (apt-cache policy prometheus-node-exporter on the control machine,
    # deb.debian.org bookworm; /usr/bin/prometheus-node-exporter, unit prometheus-node-exporter.service)
    node_exporter="prometheus-node-exporter",
    components="main contrib",
    kernel_holds={"x86_64": ("linux-image-amd64", "linux-headers-amd64"),
                  "sbsa": ("linux-image-arm64", "linux-headers-arm64")},
    kernel_headers="linux-headers-{kernel}",
    docker=("docker.io",),
    rdma=("rdma-core", "ibverbs-utils", "infiniband-diags", "perftest"),
    # AMD's Debian 12 instructions use the Ubuntu 22.04 (jammy) amdgpu packages (not verified for 7.x)
    amdgpu_repo=f"https://repo.radeon.com/amdgpu/{AMDGPU_RELEASE}/ubuntu jammy main",
)
DEBIAN_13 = OsTable(
    # NVIDIA publishes repos/debian13 for CUDA 13 (x86_64 and sbsa); AMD's packages for
    # Debian 13 are the Ubuntu 24.04 (noble) ones (neither verified here)
    name="debian-13", manager="apt", cuda_repo="debian13", cuda_arches=("x86_64", "sbsa"), codename="trixie",
    python_version="3.13",
    haproxy="haproxy",  # 3.0.x in trixie main (packages.debian.org/trixie/haproxy; not fetched here)
    node_exporter="prometheus-node-exporter",  # 1.9.x in trixie main (packages.debian.org/trixie; not fetched here)
    components="main contrib",
    kernel_holds=DEBIAN_12.kernel_holds,
    kernel_headers="linux-headers-{kernel}",
    docker=("docker.io",),
    rdma=("rdma-core", "ibverbs-utils", "infiniband-diags", "perftest"),
    amdgpu_repo=f"https://repo.radeon.com/amdgpu/{AMDGPU_RELEASE}/ubuntu noble main",
)
RHEL_9 = OsTable(
    name="rhel-9", manager="dnf", cuda_repo="rhel9", cuda_arches=("x86_64", "sbsa"),
    # python3 is 3.9; AppStream's python3.12 (RHEL 9.4+) carries venv itself
    python="python3.12", python_version="3.12", venv_packages=("python3.12",),
    # haproxy 2.4.x in the AppStream repository (RHEL 9 "Configuring and managing networking"/
    # load balancer docs name the package `haproxy`; not fetched here)
    haproxy="haproxy",
    # no node exporter in RHEL 9's BaseOS/AppStream (Red Hat ships it only inside its own
    # products' monitoring stacks): k2_node_exporter is refused on RHEL-family hosts
    node_exporter=None,
    kernel_holds={"x86_64": ("kernel", "kernel-core", "kernel-modules", "kernel-devel"),
                  "sbsa": ("kernel", "kernel-core", "kernel-modules", "kernel-devel")},
    kernel_headers="kernel-devel-{kernel}",
    # RHEL ships Podman, not Docker; k2fleet's container runtime, nvidia-ctk's
    # `--runtime=docker` and the engines' `docker run` lines are Docker's, so Docker CE
    # from Docker's own repository rather than switching runtimes per OS.
    docker=("docker-ce", "docker-ce-cli", "containerd.io"),
    docker_repo="https://download.docker.com/linux/rhel/docker-ce.repo",
    rdma=("rdma-core", "libibverbs-utils", "infiniband-diags", "perftest"),
    hold_tool=("python3-dnf-plugin-versionlock",),
    amdgpu_repo=f"https://repo.radeon.com/amdgpu/{AMDGPU_RELEASE}/el/9.6/main/x86_64/",
)
OS_TABLES: dict[str, OsTable] = {t.name: t for t in (UBUNTU_2204, UBUNTU_2404, DEBIAN_12, DEBIAN_13, RHEL_9)}
OS_TABLES["rocky-9"] = RHEL_9  # Rocky Linux 9 is RHEL 9's package set
DEFAULT_OS = "ubuntu-22.04"
# /etc/os-release (ID, VERSION_ID major.minor or major) → k2_os, for the deploy-time OS fact
OS_RELEASE_IDS: dict[tuple[str, str], str] = {
    ("ubuntu", "22.04"): "ubuntu-22.04", ("ubuntu", "24.04"): "ubuntu-24.04", ("debian", "12"): "debian-12", ("debian", "13"): "debian-13",
    ("rhel", "9"): "rhel-9", ("rocky", "9"): "rocky-9", ("almalinux", "9"): "rhel-9",
}


# ======================================================================================
# Distribution mirrors (k2_os_mirror): what k2fleet's own source file lists under the
# mirror's base URL, and the key a mirror of the distribution's own signed archive is
# checked with when no k2_os_mirror_keyring is given.
# ======================================================================================


@dataclass(frozen=True)
class MirrorLayout:
    """apt: ``suites`` × ``components`` under the base URL (deb822 ``.sources``); dnf:
    ``repos`` (id, path under the base URL with {arch}) in one ``.repo`` file."""

    archive_key: str  # the distribution's archive key on a stock install
    suites: tuple[str, ...] = ()
    components: str = ""
    repos: tuple[tuple[str, str], ...] = ()
    security_suites: tuple[str, ...] = ()  # Debian: the separate security archive's (k2_os_security_mirror)


# Ubuntu: the archive's suites (sources.list(5) of a stock jammy/noble install: release,
# -updates, -security, all four components; ubuntu-keyring's /usr/share/keyrings/
# ubuntu-archive-keyring.gpg). arm64 (sbsa) hosts need a mirror of ports.ubuntu.com.
# Debian: the main archive's release and -updates (debian-archive-keyring); security
# updates live in the separate debian-security archive (sources.list(5) of a stock bookworm
# install: `deb http://security.debian.org/debian-security bookworm-security main`, signed by a
# key in the same debian-archive-keyring), which k2_os_security_mirror names.
# RHEL 9 family: the Rocky/Alma release-tree layout (BaseOS/<arch>/os, AppStream/<arch>/os;
# a reposync'd RHEL mirror must be laid out the same), keys from redhat-release /
# rocky-release under /etc/pki/rpm-gpg. None of these were fetched here.
MIRROR_LAYOUTS: dict[str, MirrorLayout] = {
    "ubuntu-22.04": MirrorLayout("/usr/share/keyrings/ubuntu-archive-keyring.gpg",
                                 ("jammy", "jammy-updates", "jammy-security"), "main restricted universe multiverse"),
    "ubuntu-24.04": MirrorLayout("/usr/share/keyrings/ubuntu-archive-keyring.gpg",
                                 ("noble", "noble-updates", "noble-security"), "main restricted universe multiverse"),
    "debian-12": MirrorLayout("/usr/share/keyrings/debian-archive-keyring.gpg",
                              ("bookworm", "bookworm-updates"), "main contrib",
                              security_suites=("bookworm-security",)),
    "debian-13": MirrorLayout("/usr/share/keyrings/debian-archive-keyring.gpg",
                              ("trixie", "trixie-updates"), "main contrib",
                              security_suites=("trixie-security",)),
    "rhel-9": MirrorLayout("/etc/pki/rpm-gpg/RPM-GPG-KEY-redhat-release",
                           repos=(("baseos", "BaseOS/{arch}/os/"), ("appstream", "AppStream/{arch}/os/"))),
    "rocky-9": MirrorLayout("/etc/pki/rpm-gpg/RPM-GPG-KEY-Rocky-9",
                            repos=(("baseos", "BaseOS/{arch}/os/"), ("appstream", "AppStream/{arch}/os/"))),
}
# NVIDIA's CUDA repository tree ([cuda-repo]); k2_nvidia_repo replaces this base URL
NVIDIA_REPO_BASE = "https://developer.download.nvidia.com/compute/cuda/repos"
# The NVIDIA Container Toolkit's repository ([ctk]: stable/deb/<deb arch>/ flat, stable/rpm/<dnf arch>/);
# k2_container_toolkit_repo replaces this base URL
CTK_REPO_BASE = "https://nvidia.github.io/libnvidia-container"
# Docker CE's RHEL repository ([docker-rhel]); k2_docker_repo replaces this base URL
DOCKER_RHEL_BASE = "https://download.docker.com/linux/rhel"
# apt's name of an architecture directory
DEB_ARCH = {"x86_64": "amd64", "sbsa": "arm64"}
# dnf's name of an architecture directory (NVIDIA's tree calls arm64 servers sbsa)
DNF_ARCH = {"x86_64": "x86_64", "sbsa": "aarch64"}


@dataclass(frozen=True)
class PackageManager:
    """How one package manager installs a pinned version and holds it."""

    install: tuple[str, ...]
    version_spec: str  # "{name}" + this, with {version}
    hold: tuple[str, ...]
    unhold: tuple[str, ...]
    # shell: the installed upstream version of package {name} into $v (no epoch/revision)
    version_of: str
    # shell word pinning {name} to the version in $v
    pinned_to_v: str
    # shell line installing held packages at other versions ({options}: the bundle's apt options)
    install_changing: str
    remove_suffix: str | None  # apt: "name-" in an install removes it in the same transaction
    refresh: str  # shell line re-reading the repositories' indexes after one was added


PACKAGE_MANAGERS: dict[str, PackageManager] = {
    # [gdc] pins `name=${DRIVER_VERSION}*` and holds with apt-mark
    "apt": PackageManager(("apt-get", "install", "-y", "--no-install-recommends"), "={version}*",
                          ("apt-mark", "hold"), ("apt-mark", "unhold"),
                          version_of="v=$(dpkg-query -W -f='${{Version}}' {name}) && v=${{v#*:}} && v=${{v%%-*}}",
                          pinned_to_v='"{name}=${{v}}*"',
                          install_changing="DEBIAN_FRONTEND=noninteractive apt-get -q -y -o Dpkg::Options::=--force-confold "
                                           "--no-install-recommends --allow-change-held-packages --allow-downgrades "
                                           "{options} install",
                          remove_suffix="-", refresh="DEBIAN_FRONTEND=noninteractive apt-get -q -y update"),
    # [gdc] `dnf install name-${DRIVER_VERSION}`, `dnf versionlock add name`; [dig] version locking
    "dnf": PackageManager(("dnf", "install", "-y"), "-{version}", ("dnf", "versionlock", "add"),
                          ("dnf", "versionlock", "delete"),
                          version_of="v=$(rpm -q --qf '%{{VERSION}}' {name})",
                          pinned_to_v='"{name}-${{v}}"',
                          install_changing="dnf -y install",
                          remove_suffix=None, refresh="dnf -y makecache"),
}

# unattended-upgrades must never upgrade these (regular expressions, apt.conf list).
UNATTENDED_BLACKLIST = ("nvidia-", "libnvidia-", "cuda-drivers", "libnvsdm", "nvlsm", "linux-image-",
                        "linux-headers-", "linux-modules-", "linux-generic", "amdgpu-")
UNATTENDED_FILE = "/etc/apt/apt.conf.d/51k2fleet-hold-drivers"

# ======================================================================================
# the driver choice (one owner: the rule below)
# ======================================================================================


@dataclass(frozen=True)
class DriverChoice:
    """The NVIDIA driver a fleet gets: branch, flavour, optional exact version, and why
    the minimum is what it is."""

    branch: int
    flavour: str  # "open" | "proprietary"
    version: str | None  # exact driver version (k2_driver_version) or None: newest of the branch
    minimum: int
    minimum_reason: str
    default_branch: int
    cuda: str
    reboot: str


def minimum_branch(engine: str, version: str, gpu: str) -> tuple[int, str, str]:
    """(branch, reason, cuda) the pinned engine and the GPU need, the higher of the two.

    >>> minimum_branch("vllm", "0.33.0", "h200")[:2]
    (580, 'vllm 0.33.0 is built with CUDA 13.0 (driver 580.65.06 or newer)')
    >>> minimum_branch("vllm", "0.11.0", "b300")[:2]
    (580, 'b300 needs driver branch 580 or newer')
    """
    needs = NVIDIA_GPUS[gpu]
    ec = ENGINE_CUDA[(engine, version)]
    cd = CUDA_DRIVER[ec.cuda]
    if cd.branch >= needs.min_branch:
        return cd.branch, f"{engine} {version} is built with CUDA {ec.cuda} (driver {cd.version} or newer)", ec.cuda
    return needs.min_branch, f"{gpu} needs driver branch {needs.min_branch} or newer", ec.cuda


def minimum_driver_version(cuda: str, min_branch: int) -> str:
    """The oldest driver that serves an engine built with ``cuda`` on a GPU that needs
    ``min_branch`` ([cuda-rn] for the CUDA side): the toolkit driver's exact version,
    or the GPU's branch when that is higher.

    >>> minimum_driver_version("13.0", 520), minimum_driver_version("12.8", 580)
    ('580.65.06', '580')
    """
    toolkit = CUDA_DRIVER[cuda].version
    return toolkit if version_key(toolkit) >= version_key(str(min_branch)) else str(min_branch)


def cuda_of_driver(version: str) -> str | None:
    """The newest CUDA release of :data:`CUDA_DRIVER` that driver ``version`` runs (None:
    older than all of them).

    >>> cuda_of_driver("570.195.03"), cuda_of_driver("580.95.05"), cuda_of_driver("535.247.01")
    ('12.8', '13.0', None)
    """
    fits = [c for c, d in CUDA_DRIVER.items() if version_key(version) >= version_key(d.version)]
    return max(fits, key=version_key) if fits else None


def provided_note(driver: "DriverChoice | None", gpu: str) -> str:
    """``k2fleet plan``'s note under ``k2_gpu_stack: provided``: what the hosts' own stack must be.

    >>> provided_note(None, "mi300x")
    'k2_gpu_stack: provided: the hosts keep their own GPU stack (k2fleet installs, removes, holds and starts none of it, and never reboots for it); preflight refuses a host whose stack cannot serve'
    """
    head = ("k2_gpu_stack: provided: the hosts keep their own GPU stack (k2fleet installs, removes, holds and starts "
            "none of it, and never reboots for it); preflight refuses a host whose stack cannot serve")
    if driver is None:
        return head
    need = minimum_driver_version(driver.cuda, NVIDIA_GPUS[gpu].min_branch)
    return f"{head}: a loaded NVIDIA driver {need} or newer ({driver.minimum_reason})"


def default_branch(minimum: int) -> int:
    """The first data-center production/LTS branch at or above ``minimum``.

    >>> default_branch(575), default_branch(560), default_branch(580)
    (580, 570, 580)
    """
    return next((b for b in DATACENTER_BRANCHES if b >= minimum), minimum)


def choose_driver(fleet: Fleet, gpu: catalog.GpuType, engine: str, version: str) -> DriverChoice | None:
    """Resolve ``k2_driver_branch``/``k2_driver_flavour``/``k2_driver_version`` (None on AMD);
    raises SpecError naming the key and the minimum."""
    s = fleet.settings
    src = fleet.source
    if gpu.vendor != "nvidia":
        for key in ("driver_branch", "driver_flavour", "driver_version"):
            if getattr(s, key) is not None:
                raise SpecError(f"k2_{key}", f"is an NVIDIA driver setting; {gpu.name} hosts get the amdgpu "
                                "kernel driver (remove it)", src)
        return None
    minimum, reason, cuda = minimum_branch(engine, version, gpu.name)
    default = default_branch(minimum)
    branch = s.driver_branch if s.driver_branch is not None else default
    if branch < minimum:
        raise SpecError("k2_driver_branch", f"{branch} is below the minimum {minimum}: {reason}; set "
                        f"k2_driver_branch to {minimum} or newer (default {default})", src)
    needs = NVIDIA_GPUS[gpu.name]
    if s.gpu_stack == "provided" and s.driver_flavour is not None:
        raise SpecError("k2_driver_flavour", "chooses the driver k2fleet installs; with k2_gpu_stack: provided the "
                        "hosts' driver is taken as delivered (remove k2_driver_flavour)", src)
    flavour = s.driver_flavour or "open"
    if flavour == "proprietary" and needs.open_required:
        raise SpecError("k2_driver_flavour", f"{gpu.name} (Blackwell) runs only the open kernel modules; "
                        "set k2_driver_flavour: open", src)
    if s.driver_version is not None and not s.driver_version.startswith(f"{branch}."):
        raise SpecError("k2_driver_version", f"{s.driver_version} is not a release of driver branch {branch}; "
                        f"set a version {branch}.x.y or change k2_driver_branch", src)
    for h in gpu_hosts(fleet):
        os_name = host_os(h)
        if needs.arch not in OS_TABLES[os_name].cuda_arches:
            raise SpecError("k2_os", f"host {h.name}: {gpu.name} hosts are arm64 (sbsa) and NVIDIA's CUDA repository "
                            f"has no sbsa tree for {os_name} that k2fleet knows; use ubuntu-22.04, ubuntu-24.04 "
                            "or rhel-9", src)
    if needs.fabric == IMEX:
        imex_addresses(fleet)  # refuses a host without an IP address for nodes_config.cfg
    return DriverChoice(branch=branch, flavour=flavour, version=s.driver_version, minimum=minimum,
                        minimum_reason=reason, default_branch=default, cuda=cuda, reboot=s.reboot)


def host_os(host: HostEntry) -> str:
    """The OS table a host is planned with: ``k2_os``, else :data:`DEFAULT_OS`."""
    return host.settings.os or DEFAULT_OS


GPU_ROLES_WITHOUT_GPUS = ("router", "slurm-submit")


def gpu_hosts(fleet: Fleet) -> list[HostEntry]:
    """Hosts that carry GPUs (every role but the SGLang router and the SLURM login node)."""
    return [h for h in fleet.hosts if h.settings.role not in GPU_ROLES_WITHOUT_GPUS]


def imex_addresses(fleet: Fleet) -> list[str]:
    """The IMEX domain's node addresses, inventory order: ``k2_imex_address`` or the host's
    address, which must be an IP literal ([imex]: nodes_config.cfg lists IP addresses)."""
    out = []
    for h in gpu_hosts(fleet):
        addr = h.settings.imex_address or h.address
        try:
            ipaddress.ip_address(addr)
        except ValueError:
            raise SpecError("k2_imex_address", f"host {h.name}: IMEX's nodes_config.cfg lists IP addresses and "
                            f"{addr!r} is a name; set k2_imex_address to its IP on the NVLink domain's "
                            "network", fleet.source) from None
        out.append(addr)
    return out


# --------------------------------------------------------------------------- GPUDirect RDMA (issue 34 item 2)
# How the HCA reaches GPU memory, per kernel-module flavour and kernel, with its source:
# [gpu-operator-rdma] NVIDIA GPU Operator, "GPUDirect RDMA and GPUDirect Storage"
#   (docs.nvidia.com/datacenter/cloud-native/gpu-operator/latest/gpu-operator-rdma.html): "The kernel mode
#   support is provided by one of two approaches: DMA-BUF from the Linux kernel or the legacy nvidia-peermem
#   kernel module. NVIDIA recommends using the DMA-BUF"; DMA-BUF needs the open GPU kernel modules (driver
#   R515 and later) and Linux 5.12 or later; nvidia-peermem ships with the driver since R470/CUDA 11.4
#   ([gpu-operator 1.8] same page) and needs the HCA's peer-memory support (MLNX_OFED/DOCA, not inbox rdma-core).
# [nccl-env] NCCL environment variables: NCCL_DMABUF_ENABLE (default 1 since NCCL 2.19) uses DMA-BUF when
#   the kernel and driver support it; vLLM's Kimi-K3 recipe sets NCCL_DMABUF_ENABLE=0 on mlx5 for errno 524.
# [deepep] deepseek-ai/DeepEP: deep_ep/buffer.py sets NVSHMEM_IB_ENABLE_IBGDA=1 and
#   NVSHMEM_IBGDA_NIC_HANDLER=gpu itself when the buffer spans RDMA ranks; third-party/README.md "Enable
#   NVSHMEM IBGDA support": either the driver option
#   ``options nvidia NVreg_EnableStreamMemOPs=1 NVreg_RegistryDwords="PeerMappingOverride=1;"`` (then
#   update-initramfs and reboot) or GDRCopy with its gdrdrv kernel module (CPU-assisted IBGDA).
DMABUF_MIN_KERNEL = (5, 12)  # [gpu-operator-rdma]
DMABUF_MIN_BRANCH = 515  # [gpu-operator-rdma]: the open kernel modules with DMA-BUF export
OS_KERNEL = {  # each release's GA kernel (the distributions' own; not fetched here)
    "ubuntu-22.04": (5, 15), "ubuntu-24.04": (6, 8), "debian-12": (6, 1), "rhel-9": (5, 14), "rocky-9": (5, 14)}
DEEPEP_IBGDA_DRIVER_OPTION = 'options nvidia NVreg_EnableStreamMemOPs=1 NVreg_RegistryDwords="PeerMappingOverride=1;"'
# [gdrcopy] NVIDIA/gdrcopy: packages/build-deb-packages.sh builds gdrdrv-dkms (the gdrdrv kernel module, DKMS),
#   libgdrapi (the library), gdrcopy-tests and the gdrcopy meta package; packages/gdrcopy.spec builds
#   gdrcopy-kmod (DKMS), gdrcopy and gdrcopy-devel. NVIDIA publishes them prebuilt, as files (not an apt/dnf
#   repository), under developer.download.nvidia.com/compute/redist/gdrcopy/CUDA <x.y>/<os>/<arch>/ (index pages
#   seen: "CUDA 13.0/ubuntu24_04" gdrdrv-dkms_2.6-1_arm64.Ubuntu24_04.deb, libgdrapi_2.6-1..., "CUDA 12.0/
#   ubuntu20_04", "CUDA 13.0/rhel10" gdrcopy-kmod-2.6-1dkms.el10.noarch.rpm). The module is gdrdrv (/dev/gdrdrv).
# [nvidia-peermem] the driver's GPUDirect RDMA module ``nvidia-peermem.ko`` (since R470), loaded with
#   ``modprobe nvidia-peermem``, seen as /sys/module/nvidia_peermem ([gpu-operator-rdma]: the legacy mechanism).
GDRCOPY_PACKAGES = {"apt": ("gdrdrv-dkms", "libgdrapi", "gdrcopy-tests"),  # [gdrcopy] per package manager
                    "dnf": ("gdrcopy-kmod", "gdrcopy")}
GDRCOPY_REDIST = "https://developer.download.nvidia.com/compute/redist/gdrcopy/CUDA {cuda}/{os}/{arch}/"  # [gdrcopy]
GDRCOPY_REDIST_OS = {"ubuntu-22.04": "ubuntu22_04", "ubuntu-24.04": "ubuntu24_04", "rhel-9": "rhel9",
                     "rocky-9": "rhel9"}  # [gdrcopy] the directory names' pattern; Debian: none published (build it)
GDRCOPY_MODULE = "gdrdrv"  # [gdrcopy] /sys/module/gdrdrv, /dev/gdrdrv
PEERMEM_MODULE = "nvidia_peermem"  # [nvidia-peermem] /sys/module name of `modprobe nvidia-peermem`
PEERMEM_MODPROBE = "nvidia-peermem"


def gdrcopy_source(os_name: str, manager: str, cuda: str, arch: str = "x64") -> str:
    """Where GDRCopy's packages for ``os_name`` come from, in words ([gdrcopy]).

    >>> gdrcopy_source("ubuntu-24.04", "apt", "13.0")
    'gdrdrv-dkms, libgdrapi, gdrcopy-tests from https://developer.download.nvidia.com/compute/redist/gdrcopy/CUDA 13.0/ubuntu24_04/x64/'
    >>> gdrcopy_source("debian-12", "apt", "13.0")
    'gdrdrv-dkms, libgdrapi, gdrcopy-tests: NVIDIA publishes none for debian-12 (build them: NVIDIA/gdrcopy packages/build-deb-packages.sh)'
    """
    names = ", ".join(GDRCOPY_PACKAGES.get(manager, GDRCOPY_PACKAGES["apt"]))
    where = GDRCOPY_REDIST_OS.get(os_name)
    if where is None:
        script = "build-rpm-packages.sh" if manager == "dnf" else "build-deb-packages.sh"
        return f"{names}: NVIDIA publishes none for {os_name} (build them: NVIDIA/gdrcopy packages/{script})"
    return f"{names} from {GDRCOPY_REDIST.format(cuda=cuda, os=where, arch=arch)}"


def gpudirect_rdma(os_name: str, branch: int, open_modules: bool = True) -> tuple[str, str]:
    """(mechanism, why) of GPUDirect RDMA on ``os_name`` with driver ``branch``: ``dma-buf``
    (nothing to load: NCCL and NVSHMEM register GPU memory through the kernel) or
    ``nvidia-peermem`` (the driver's module, ``modprobe nvidia-peermem``), per [gpu-operator-rdma].

    >>> gpudirect_rdma("ubuntu-24.04", 580)
    ('dma-buf', 'open kernel modules of branch 580 (>= 515) on kernel 6.8 (>= 5.12) [gpu-operator-rdma]')
    >>> gpudirect_rdma("ubuntu-22.04", 570, open_modules=False)[0]
    'nvidia-peermem'
    """
    return gpudirect_on(OS_KERNEL.get(os_name, (0, 0)), branch, open_modules)


def kernel_of(release: str) -> tuple[int, int]:
    """(major, minor) of a ``uname -r`` release ((0, 0): not one).

    >>> kernel_of("6.8.0-45-generic"), kernel_of("5.14.0-427.el9.x86_64"), kernel_of("x")
    ((6, 8), (5, 14), (0, 0))
    """
    parts = release.split("-", 1)[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return 0, 0


def gpudirect_on(kernel: tuple[int, int], branch: int, open_modules: bool) -> tuple[str, str]:
    """:func:`gpudirect_rdma` on a given kernel (a host's own, :func:`kernel_of`)."""
    shown = ".".join(map(str, kernel))
    if open_modules and branch >= DMABUF_MIN_BRANCH and kernel >= DMABUF_MIN_KERNEL:
        return "dma-buf", (f"open kernel modules of branch {branch} (>= {DMABUF_MIN_BRANCH}) on kernel {shown} "
                           f"(>= {'.'.join(map(str, DMABUF_MIN_KERNEL))}) [gpu-operator-rdma]")
    return "nvidia-peermem", (f"{'open' if open_modules else 'proprietary'} modules of branch {branch} on kernel "
                              f"{shown}: DMA-BUF needs open modules >= {DMABUF_MIN_BRANCH} and kernel >= 5.12; "
                              "load the driver's nvidia-peermem (needs MLNX_OFED/DOCA peer memory) [gpu-operator-rdma]")
