"""Which Debian packages a host needs for its part of the plan (pure)."""

from __future__ import annotations

from k2fleet.planning.engine_side import engine_side_requirements as venv_side_requirements
from k2fleet.planning.os_tables import OS_TABLES, host_os
from k2fleet.planning.api_front import has_front
from k2fleet.planning.load_balancer import LB
from k2fleet.planning.deployment import Deployment
from k2fleet.planning.firewall import PACKAGE as FIREWALL_PACKAGE, host_firewall
from k2fleet.planning.processes import HostPlan


def required_packages(dep: Deployment, host_plan: HostPlan, mesh: bool, firewalled: bool | None = None) -> list[str]:
    """Debian packages for ``host_plan``: rsync for checkpoints, sshd for the mesh,
    OpenMPI where mpirun runs on the host (not in a container), mpi4py for doubles,
    the OS table's venv interpreter packages (``python3-venv``; ubuntu-22.04
    ``python3.11-venv``) and, for vLLM's CPU build (``k2_engine_cpu_build``), libnuma1, for engine venvs (the engine test doubles' too, installed as a
    wheel from a bundle or beside engine-side wheels such as Ray) and for the Hub client of
    ``k2_checkpoint_fetcher``; nftables where k2fleet's firewall table goes; HAProxy where
    k2fleet's API front runs. (Docker is the bootstrap's: :mod:`k2fleet.planning.host_bootstrap`.)
    ``firewalled``: whether k2fleet's table goes there, when the caller knows already (None:
    :func:`~k2fleet.planning.firewall.host_firewall` is asked)."""
    needed = {"rsync"}
    if mesh:
        needed |= {"openssh-server", "openssh-client"}
    uses_mpirun = any(s.argv and s.argv[0].endswith("mpirun") for s in host_plan.services)
    if dep.engine_impl.launches_with_mpirun and dep.runtime != "container" and len(dep.fleet.hosts) > 1:
        uses_mpirun = True  # every rank host needs orted
    if uses_mpirun:
        needed |= {"openmpi-bin"}
        if dep.s.engine_doubles:
            needed |= {"python3-mpi4py"}
    engine_side = venv_side_requirements(dep.engine, dep.venv, [s.argv for s in host_plan.services])
    if dep.runtime == "venv" or dep.s.checkpoint_fetcher == host_plan.name or engine_side:
        entry = next(h for h in dep.fleet.hosts if h.name == host_plan.name)
        needed |= set(OS_TABLES[host_os(entry)].venv_packages)
    if dep.engine_cpu_build and dep.runtime == "venv":  # vLLM's CPU build (k2_engine_cpu_build, the sandbox's
        needed.add("libnuma1")  # Debian hosts): its vllm._C links libnuma; without it the worker dies at start
        if any(pool.tp > 1 for pool in dep.pools.values()):  # with TP, vocab-parallel embedding's masking is
            needed |= {"g++", "python3-dev"}  # torch.compile'd: inductor compiles C++ (with Python.h) at the first forward
    if has_front(host_plan) or any(s.name == LB for s in host_plan.services):  # HAProxy runs k2fleet's API front
        # (k2fleet.planning.api_front) and the replicas' load balancer (k2fleet.planning.load_balancer)
        entry = next(h for h in dep.fleet.hosts if h.name == host_plan.name)
        needed.add(OS_TABLES[host_os(entry)].haproxy)
    if dep.s.metrics and dep.s.node_exporter:  # the OS's exporter and its own unit (validate refused OSes without it)
        entry = next(h for h in dep.fleet.hosts if h.name == host_plan.name)
        package = OS_TABLES[host_os(entry)].node_exporter
        if package:
            needed.add(package)
    if firewalled is None:
        firewalled = host_firewall(dep, host_plan) is not None
    if firewalled:
        needed.add(FIREWALL_PACKAGE)  # nft loads k2fleet's table (k2fleet.planning.firewall)
    return sorted(needed)


BUNDLE_LIST = "/etc/apt/sources.list.d/k2fleet-bundle.list"
REMOTE_TAR_DIR = "/var/cache/k2fleet"  # where a host keeps the offline bundle tar it was sent
REMOTE_REPO_ROOT = "/var/lib/k2fleet/apt-bundle"  # where it is extracted, one directory per bundle


def bundle_repo_dir(tar_name: str) -> str:
    """The host directory of the extracted bundle ``tar_name`` (``bundle-KEY.tar`` → ``.../KEY``).

    >>> bundle_repo_dir("bundle-3f1c.tar")
    '/var/lib/k2fleet/apt-bundle/3f1c'
    """
    stem = tar_name.rsplit("/", 1)[-1].removesuffix(".tar")
    return f"{REMOTE_REPO_ROOT}/{stem.removeprefix('bundle-')}"


def bundle_apt_options(list_path: str = BUNDLE_LIST) -> str:
    """apt-get options that restrict apt to the offline bundle's source list only."""
    return (f"-o Dir::Etc::sourcelist={list_path} -o Dir::Etc::sourceparts=- "
            "-o APT::Get::List-Cleanup=0")
