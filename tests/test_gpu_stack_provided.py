"""``k2_gpu_stack: provided`` (hosts as delivered: DGX OS, cloud GPU images, golden images),
offline: the bootstrap plan installs, removes, holds and starts no NVIDIA, AMD or Docker
package and never reboots for them; the pure decision
(:func:`k2fleet.planning.host_bootstrap.provided_problems`) refuses, in one line per host,
a host whose provided stack cannot serve, naming what it found and what is needed; the
real pipeline on pyinfra's ``@fake`` connector stops in preflight before any change; the
GPU gate (``hoststate --gate``) takes any branch and the oldest version the engine needs.
The same on sandbox hosts pre-imaged with the TEST DOUBLE driver:
tests/test_gpu_stack_provided_sandbox.py."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path
from typing import Any

import pytest

from k2fleet.deploy.roles.preflight import PreflightError
from k2fleet.hostprogs import hoststate
from k2fleet.inventory.spec import SpecError
from k2fleet.planning import os_tables as t
from k2fleet.planning.host_bootstrap import (DOCKER_PATH, TOOLKIT_PATH, bootstrap_plan, obsolete_packages,
                                             provided_problems, reboot_reason)
from k2fleet.planning.host_fact import HostReport
from k2fleet.cli import load_plan
from k2sandbox.harness import tool
from tests.inventory_factory import write_inventory
from tests.test_roles_offline import H200, control_calls, planned, run_roles, settled_fleet  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
PROVIDED = ("k2_gpu_stack=provided",)
NVFP4 = {"k2_model": "nvidia/Kimi-K2-Thinking-NVFP4", "k2_revision": "1" * 40}
FLEETS: dict[str, dict[str, Any]] = {
    "h200-hgx": {"k2_gpu": "h200"},  # vLLM 0.33 in a venv, NVSwitch fabric
    "b200": NVFP4 | {"k2_engine": "trtllm", "k2_gpu": "b200"},  # containers, NVLink5
    "gb200": NVFP4 | {"k2_engine": "trtllm", "k2_gpu": "gb200"},  # IMEX
    "mi300x": {"k2_gpu": "mi300x"},  # ROCm container
}
GB200_HOSTS = [("gb200-0", {"ssh_hostname": "10.0.0.1"}), ("gb200-1", {"ssh_hostname": "10.0.0.2"})]
GPU_STACK_PREFIXES = ("nvidia-", "libnvidia-", "cuda-", "libnvsdm", "nvlsm", "amdgpu", "docker", "containerd")
NEED = "580.65.06 or newer is needed: vllm 0.33.0 is built with CUDA 13.0 (driver 580.65.06 or newer)"
HEAD = "the GPU stack is provided (k2_gpu_stack: provided) and cannot serve: "


def provided_plans(tmp_path: Path, family: str, **data: Any):
    hosts = GB200_HOSTS if family == "gb200" else 1
    dep, _ = load_plan(write_inventory(tmp_path, hosts, k2_gpu_stack="provided", **FLEETS[family], **data))
    return dep, {h.name: bootstrap_plan(dep, h) for h in dep.fleet.hosts}


@pytest.mark.parametrize("family", sorted(FLEETS))
def test_a_provided_stack_plans_no_gpu_or_docker_package_repository_hold_module_or_file(
        tmp_path: Path, family: str) -> None:
    dep, plans = provided_plans(tmp_path, family)
    for plan in plans.values():
        assert [p.name for p in plan.packages if p.name.startswith(GPU_STACK_PREFIXES)] == []
        assert plan.repos == () and plan.holds == () and plan.hold_patterns == ()
        assert plan.module_load == () and plan.modprobe == () and plan.commands == ()
        assert plan.files == {}  # no unattended-upgrades blacklist, no IMEX nodes_config.cfg: the image's own
        assert plan.provided and plan.driver_package is None
        assert plan.to_json()["provided"] == plan.provided
    plan = next(iter(plans.values()))
    containers = dep.runtime == "container"
    assert ("docker" in plan.services) == containers and (DOCKER_PATH in plan.reads) == containers
    if plan.vendor == "nvidia":
        assert (TOOLKIT_PATH[False] in plan.reads) == containers
        fabric = {"h200-hgx": ["nvidia-fabricmanager"], "b200": ["nvidia-fabricmanager"], "gb200": ["nvidia-imex"]}
        assert [s for s in plan.services if s != "docker"] == fabric[family]  # read, never started
        assert plan.gate_expect["branch"] is None and plan.gate_expect["driver_package"] is None
        assert plan.gate_expect["fabric"] is True
        assert ("/sys/module/ib_umad" in plan.reads) == (family == "b200")


def test_ib_hcas_still_get_their_rdma_user_space(tmp_path: Path) -> None:
    dep, _ = load_plan(write_inventory(tmp_path, 1, k2_gpu_stack="provided", k2_ib_hcas=["mlx5_0"]))
    plan = bootstrap_plan(dep, dep.fleet.hosts[0])
    assert [p.name for p in plan.packages] == list(t.OS_TABLES[plan.os].rdma)


def provided_fleet(data: tuple[str, ...] = ()):
    dep, plan, desired = planned(str(H200), PROVIDED + data)
    facts = settled_fleet(dep, desired)
    return dep, plan, desired, facts


def with_driver(report: HostReport, loaded: str | None, **boot: Any) -> HostReport:
    return dataclasses.replace(report, boot=dataclasses.replace(report.boot, modules={"nvidia": loaded, "amdgpu": None},
                                                                 **boot))


def test_a_driver_the_engine_can_run_on_passes_and_nothing_is_removed_or_rebooted() -> None:
    _, _, desired, facts = provided_fleet()
    b, fact = desired["h200-0"].bootstrap, facts["h200-0"]
    assert provided_problems(b, fact) == []
    older = with_driver(fact, "570.195.03", package_versions={"nvidia-open-570": "570.195.03-1",
                                                              "nvidia-fabricmanager-570": "570.195.03-1"},
                        reboot_required=("linux-image-6.8.0-61-generic",))
    assert obsolete_packages(b, older.boot) == []  # another branch's packages stay: they are the host's
    assert reboot_reason(b, older.boot) is None  # no reboot, not even for a waiting kernel: the provider's


def test_a_driver_too_old_for_the_engine_is_refused_in_one_line_naming_found_and_needed() -> None:
    _, _, desired, facts = provided_fleet()
    b, fact = desired["h200-0"].bootstrap, facts["h200-0"]
    old = with_driver(fact, "570.195.03", package_versions={"nvidia-fabricmanager-570": "570.195.03-1"})
    assert provided_problems(b, old) == [HEAD + f"driver 570.195.03 is loaded (CUDA 12.8 at most), {NEED}"]
    # the right branch, but older than CUDA 13.0's toolkit driver (a hypothetical early 580 build)
    early = with_driver(fact, "580.40.01", package_versions={"nvidia-fabricmanager": "580.40.01-1"})
    assert provided_problems(b, early) == [HEAD + f"driver 580.40.01 is loaded (CUDA 12.9 at most), {NEED}"]
    ancient = with_driver(fact, "535.247.01", package_versions={})
    assert provided_problems(b, ancient) == [HEAD + f"driver 535.247.01 is loaded (older than CUDA 12.6), {NEED}"]


def test_what_else_a_provided_host_lacks_is_named_in_the_same_line() -> None:
    _, _, desired, facts = provided_fleet()
    b, fact = desired["h200-0"].bootstrap, facts["h200-0"]
    none = with_driver(fact, None, nouveau=True)
    assert provided_problems(b, none) == [
        HEAD + "no nvidia kernel module is loaded (nouveau drives the GPUs)"]
    skew = with_driver(fact, "580.95.05", package_versions={"nvidia-fabricmanager": "580.82.07-1"})
    units = {**fact.units, "nvidia-fabricmanager.service": {"ActiveState": "failed"}}
    both = dataclasses.replace(skew, units=units)
    (line,) = provided_problems(b, both)
    assert line == HEAD + ("nvidia-fabricmanager 580.82.07 is installed, the driver is 580.95.05: they must be equal "
                           "(CUDA error 802); nvidia-fabricmanager.service is failed")


def test_driver_branch_and_version_keys_are_expectations_of_the_provided_driver() -> None:
    _, _, desired, facts = provided_fleet(("k2_driver_branch=590", "k2_driver_version=590.44.01"))
    b = desired["h200-0"].bootstrap
    assert b.gate_expect["branch"] == 590 and b.gate_expect["version"] == "590.44.01"
    assert provided_problems(b, facts["h200-0"]) == [
        HEAD + "driver 580.95.05 is loaded, k2_driver_branch is 590; driver 580.95.05 is loaded, k2_driver_version is "
        "590.44.01"]


def test_containers_need_the_provided_toolkit_and_docker(tmp_path: Path) -> None:
    dep, plans = provided_plans(tmp_path, "b200")
    b = next(iter(plans.values()))
    fact = HostReport.from_json({
        "gpus": {"vendor": "nvidia", "names": [], "memory_mib": [], "driver": None}, "disk_free": 0, "mem_total": 0,
        "shm_size": 0, "nics": {}, "ib_hcas": [], "exists": {"/sys/module/ib_umad": True},
        "units": {"nvidia-fabricmanager.service": {"ActiveState": "active"}},
        "bootstrap": {"modules": {"nvidia": "580.95.05"}}})
    assert provided_problems(b, fact) == [
        HEAD + f"no NVIDIA container toolkit ({TOOLKIT_PATH[False]} is missing); no Docker ({DOCKER_PATH} is missing)"]
    ready = dataclasses.replace(fact, exists={p: True for p in b.reads},
                                units={**fact.units, "docker.service": {"ActiveState": "active"}})
    assert provided_problems(b, ready) == []
    no_umad = dataclasses.replace(ready, exists={**ready.exists, "/sys/module/ib_umad": False})
    assert provided_problems(b, no_umad) == [
        HEAD + "the ib_umad kernel module is not loaded (NVLink5's fabric manager needs it)"]


def test_the_deploy_stops_in_preflight_naming_the_host_before_any_change(
        tmp_path: Path, control_calls: list[str]) -> None:
    dep, plan, desired, facts = provided_fleet()
    facts["h200-1"] = with_driver(facts["h200-1"], "570.195.03", package_versions={})
    with pytest.raises(PreflightError) as err:
        run_roles(dep, plan, desired, facts, tmp_path, control_calls)
    assert str(err.value) == f"h200-1: preflight failed: {HEAD}driver 570.195.03 is loaded (CUDA 12.8 at most), {NEED}"
    assert "\n" not in str(err.value)


def test_a_bare_provided_host_gets_no_package_hold_module_start_or_reboot(
        tmp_path: Path, control_calls: list[str]) -> None:
    dep, plan, desired, facts = provided_fleet()
    # as delivered: the image's own driver packages of its own naming, nothing of k2fleet's held
    facts["h200-1"] = with_driver(facts["h200-1"], "580.95.05", holds=(), package_versions={
        "nvidia-driver-580-server-open": "580.95.05-0ubuntu1", "nvidia-fabricmanager": "580.95.05-1"})
    facts["h200-1"] = dataclasses.replace(facts["h200-1"], checks={**facts["h200-1"].checks, "gpu-ready": 1})
    out = run_roles(dep, plan, desired, facts, tmp_path, control_calls, every_role=True)
    changed = out.changed("h200-1")
    for step in ("install the GPU stack", "hold the driver", "load the GPU kernel module", "reboot",
                 "enable and start the GPU services", "restart the running GPU services", "container toolkit",
                 "package repositories", "update the package lists"):
        assert not any(step in name for name in changed), (step, changed)
    assert "GPU gate: count, type, driver, module, NVLink fabric, services" in " ".join(changed)
    gate = out.op("h200-1", "GPU gate: count").commands[0]
    assert '"branch": null' in gate and '"minimum_version": "580.65.06"' in gate and '"driver_package": null' in gate
    commands = " ".join(out.commands("h200-1"))
    assert "apt-get" not in commands and "apt-mark" not in commands and "modprobe" not in commands


def smi_of(driver: str, count: int = 8):
    return lambda args: (0, "".join(f"NVIDIA H200, 143771, {driver}\n" for _ in range(count)))


def test_the_gpu_gate_takes_any_branch_and_the_oldest_version_the_engine_runs_on() -> None:
    want = {"vendor": "nvidia", "count": 8, "name": "H200", "branch": None, "minimum": 580,
            "minimum_version": "580.65.06", "version": None, "driver_package": None, "fabric": False}
    assert hoststate.nvidia_problems(want, smi_of("590.44.01")) == []
    assert hoststate.nvidia_problems(want, smi_of("580.95.05")) == []
    assert hoststate.nvidia_problems(want, smi_of("580.40.01")) == [
        "driver 580.40.01 is older than 580.65.06, the oldest the engine's CUDA build runs on"]
    assert hoststate.nvidia_problems({**want, "branch": 590}, smi_of("580.95.05")) == [
        "driver 580.95.05 is not of branch 590"]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("k2fleet"), *args], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_validate_refuses_a_bad_value_and_a_flavour_in_one_line(tmp_path: Path) -> None:
    inv = write_inventory(tmp_path, 1)
    bad = run_cli("validate", str(inv), "--data", "k2_gpu_stack=preinstalled")
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1 and "k2_gpu_stack" in bad.stderr, bad.stderr
    assert "'install' or 'provided'" in bad.stderr, bad.stderr
    with pytest.raises(SpecError) as err:
        load_plan(write_inventory(tmp_path, 1, name="flavour", k2_gpu_stack="provided", k2_driver_flavour="open"))
    assert err.value.key == "k2_driver_flavour" and "taken as delivered" in err.value.message
    ok = run_cli("validate", str(inv), "--data", "k2_gpu_stack=provided")
    assert ok.returncode == 0, ok.stderr


def test_plan_says_what_the_provided_stack_must_be(tmp_path: Path) -> None:
    inv = write_inventory(tmp_path, 1)
    out = run_cli("plan", str(inv), "--data", "k2_gpu_stack=provided")
    assert out.returncode == 0, out.stderr
    assert ("# note: k2_gpu_stack: provided: the hosts keep their own GPU stack (k2fleet installs, removes, holds and "
            "starts none of it, and never reboots for it); preflight refuses a host whose stack cannot serve: a loaded "
            "NVIDIA driver 580.65.06 or newer (vllm 0.33.0 is built with CUDA 13.0") in out.stdout
    assert "k2_gpu_stack" not in run_cli("plan", str(inv)).stdout
