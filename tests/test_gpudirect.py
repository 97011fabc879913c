"""#34 item 2: GPUDirect RDMA per driver branch and kernel (DMA-BUF, else the driver's
nvidia-peermem) and DeepEP's NVSHMEM IBGDA prerequisite (GDRCopy's gdrdrv, or the driver
option), as table data with sources (k2fleet.planning.os_tables [gpu-operator-rdma],
[nvidia-peermem], [gdrcopy], [deepep]): the host probe reads the modules and the driver's
own /proc files, the fabric gate decides where the GPU stack is provided, and an installed
stack gets nvidia-peermem loaded where DMA-BUF is out of reach."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k2fleet.cli import load_plan
from k2fleet.hostprogs import hoststate
from k2fleet.planning import os_tables as t
from k2fleet.planning.host_bootstrap import PEERMEM_CONF, bootstrap_plan
from k2fleet.planning.host_fact import HostReport
from k2fleet.planning.preflight_checks import check_gpudirect
from tests.inventory_factory import write_inventory

HCAS = ["mlx5_0", "mlx5_1"]
OPTION = {"EnableStreamMemOPs": "1", "RegistryDwords": '"PeerMappingOverride=1;"'}
OPEN = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs-builder@U22)"
PROPRIETARY = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.195.03  Release Build  (dvs-builder@U16)"


def fleet(tmp_path: Path, deepep: bool, **data):
    """One H200 host with HCAs, its GPU stack provided; with ``deepep`` an SGLang EP16 instance
    over two hosts (DeepEP across nodes)."""
    base = {"k2_ib_hcas": HCAS, "k2_gpu_stack": "provided", "k2_nic": "ens10f0np0"}
    if deepep:
        hosts = [("node-0", {"ssh_hostname": "192.0.2.10"}), ("node-1", {"ssh_hostname": "192.0.2.11"})]
        base |= {"k2_engine": "sglang", "k2_tp": 16, "k2_ep": 16, "k2_dist_init_port": 50000}
    else:
        hosts = [("node-0", {"ssh_hostname": "192.0.2.10"})]
    dep, _ = load_plan(write_inventory(tmp_path, hosts=hosts, **(base | data)))
    return dep, dep.fleet.hosts[0]


def report(kernel: str, driver: str | None, open_modules: bool | None, modules: dict | None = None,
           params: dict | None = None) -> HostReport:
    return HostReport.from_json(json.loads(json.dumps({
        "gpus": {"vendor": "nvidia", "names": ["NVIDIA H200"] * 8, "memory_mib": [143771] * 8, "driver": driver},
        "disk_free": 0, "mem_total": 0, "shm_size": 0, "nics": {}, "ib_hcas": HCAS, "ib_ports": {},
        "bootstrap": {"kernel": kernel, "hardware": {"vendor": "nvidia", "count": 8, "simulated": False},
                      "modules": {"nvidia": driver, "amdgpu": None, **(modules or {})},
                      "nvidia_driver": {"open": open_modules, "params": params or {}}}})))


def test_dma_buf_needs_nothing_loaded(tmp_path: Path) -> None:
    dep, entry = fleet(tmp_path, deepep=False)
    assert check_gpudirect(dep, entry, report("6.8.0-45-generic", "580.95.05", True)) == []


def test_proprietary_modules_need_nvidia_peermem(tmp_path: Path) -> None:
    dep, entry = fleet(tmp_path, deepep=False)
    without = report("5.15.0-119-generic", "570.195.03", False)
    assert check_gpudirect(dep, entry, without) == [
        "GPUDirect RDMA: the nvidia-peermem module is not loaded (proprietary modules of branch 570 on kernel 5.15: "
        "DMA-BUF needs open modules >= 515 on kernel >= 5.12): modprobe nvidia-peermem, or run the open modules"]
    loaded = report("5.15.0-119-generic", "570.195.03", False, {"nvidia_peermem": "loaded"})
    assert check_gpudirect(dep, entry, loaded) == []
    # open modules on a kernel older than 5.12 (RHEL 8's 4.18): no DMA-BUF either
    assert check_gpudirect(dep, entry, report("4.18.0-553.el8_10.x86_64", "580.95.05", True))[0].startswith(
        "GPUDirect RDMA: the nvidia-peermem module is not loaded (open modules of branch 580 on kernel 4.18")


@pytest.mark.parametrize("modules, params, ok", [
    ({}, {}, False),
    ({"gdrdrv": "2.5.1"}, {}, True),
    ({}, OPTION, True),
    ({}, OPTION | {"EnableStreamMemOPs": "0"}, False),  # half the option does not enable IBGDA
    ({}, OPTION | {"RegistryDwords": '"PeerMappingOverride=0x1"'}, True),
])
def test_deepep_needs_gdrcopy_or_the_driver_option(tmp_path: Path, modules: dict, params: dict, ok: bool) -> None:
    dep, entry = fleet(tmp_path, deepep=True)
    problems = check_gpudirect(dep, entry, report("6.8.0-45-generic", "580.95.05", True, modules, params))
    if ok:
        assert problems == []
    else:
        (line,) = problems
        assert line.startswith("DeepEP's NVSHMEM IBGDA: GDRCopy's gdrdrv module is not loaded and the driver option "
                               "is not in effect"), line
        assert "gdrdrv-dkms, libgdrapi, gdrcopy-tests from https://developer.download.nvidia.com/compute/redist/" \
               "gdrcopy/CUDA 13.0/ubuntu22_04/x64/" in line and "PeerMappingOverride=1" in line


def test_nothing_is_read_before_a_driver_is_loaded_or_when_k2fleet_installs_it(tmp_path: Path) -> None:
    dep, entry = fleet(tmp_path / "a", deepep=True)
    assert check_gpudirect(dep, entry, report("5.15.0-119-generic", None, None)) == []
    dep, entry = fleet(tmp_path / "b", deepep=True, k2_gpu_stack="install")
    assert check_gpudirect(dep, entry, report("5.15.0-119-generic", "570.195.03", False)) == []


def test_an_installed_proprietary_driver_gets_nvidia_peermem_loaded(tmp_path: Path) -> None:
    dep, entry = fleet(tmp_path / "a", deepep=False, k2_gpu_stack="install", k2_driver_flavour="proprietary")
    plan = bootstrap_plan(dep, entry)
    assert "nvidia-peermem" in plan.modprobe and plan.files[PEERMEM_CONF] == "nvidia-peermem\n"
    dep, entry = fleet(tmp_path / "b", deepep=False, k2_gpu_stack="install", k2_os="ubuntu-24.04")
    plan = bootstrap_plan(dep, entry)
    assert "nvidia-peermem" not in plan.modprobe and PEERMEM_CONF not in plan.files  # DMA-BUF


def test_the_probe_reads_the_driver_flavour_and_its_params(tmp_path: Path) -> None:
    proc = tmp_path / "proc-driver-nvidia"
    proc.mkdir()
    (proc / "version").write_text(OPEN + "\nGCC version:  gcc version 12.3.0\n")
    (proc / "params").write_text('ResmanDebugLevel: 4294967295\nEnableStreamMemOPs: 1\n'
                                 'RegistryDwords: "PeerMappingOverride=1;"\nEnableGpuFirmware: 18\n')
    assert hoststate.nvidia_driver(False, str(proc)) == {"open": True, "params": OPTION}
    (proc / "version").write_text(PROPRIETARY + "\n")
    assert hoststate.nvidia_driver(False, str(proc))["open"] is False
    assert hoststate.nvidia_driver(False, str(tmp_path / "none")) == {"open": None, "params": {}}
    assert hoststate.nvidia_driver(True, str(proc)) == {"open": None, "params": {}}


def test_gdrcopy_table() -> None:
    assert t.GDRCOPY_PACKAGES["dnf"] == ("gdrcopy-kmod", "gdrcopy")
    assert t.gdrcopy_source("rocky-9", "dnf", "12.9").endswith("/gdrcopy/CUDA 12.9/rhel9/x64/")
    assert "build-rpm-packages.sh" in t.gdrcopy_source("fedora-40", "dnf", "12.9")
