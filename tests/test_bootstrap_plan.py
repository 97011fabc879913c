"""The bootstrap plan (bare host → GPU-ready), offline: for each OS × GPU family the
plan holds what k2fleet.planning.os_tables say — driver at the pinned branch, fabric
manager only on NVSwitch systems and at the driver's exact version, NVLSM + ib_umad only
on B200/B300, IMEX only on GB200/GB300 with the inventory's addresses, no NVIDIA package
on AMD — plus branch defaults and refusals through the real CLI (exit 2, one line).

Inventories are real files loaded by pyinfra's inventory loader (tests.inventory_factory);
nothing is contacted.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from k2fleet.planning import deployment, os_tables as t
from k2fleet.planning.host_bootstrap import IB_UMAD_CONF, IMEX_NODES, BootstrapPlan, bootstrap_plan
from k2fleet.cli import load_plan, plan_document
from k2fleet.inventory.spec import SpecError
from k2sandbox.harness import tool
from tests.inventory_factory import scenario_inventories, write_inventory

ROOT = Path(__file__).resolve().parents[1]
OSES = ("ubuntu-22.04", "ubuntu-24.04", "debian-12", "rhel-9")
NVFP4 = {"k2_model": "nvidia/Kimi-K2-Thinking-NVFP4", "k2_revision": "1" * 40}
# The factory's K2-Thinking at a pin with no kimi_k2 reasoning parser (vLLM 0.11.0, SGLang 0.5.4:
# catalog.KIMI_PARSERS) is refused; these driver tests name a non-Kimi parser, which the table does not cover.
NO_KIMI_REASONING: dict[str, dict[str, Any]] = {"vllm": {"k2_reasoning_parser": "deepseek_r1"},
                                                "sglang": {"k2_reasoning_parser": "deepseek-r1"}}
GPU_FLEETS: dict[str, dict[str, Any]] = {
    "h200-hgx": {"k2_gpu": "h200"},  # vLLM 0.33 (venv), 8 GPUs on an HGX board
    "b200": NVFP4 | {"k2_engine": "trtllm", "k2_gpu": "b200"},  # container runtime
    "gb200": NVFP4 | {"k2_engine": "trtllm", "k2_gpu": "gb200"},
    "mi300x": {"k2_gpu": "mi300x"},  # vLLM ROCm container
}
GB200_HOSTS = [("gb200-0", {"ssh_hostname": "10.0.0.1"}), ("gb200-1", {"ssh_hostname": "10.0.0.2"})]
NVIDIA_PREFIXES = ("nvidia-", "libnvidia-", "cuda-", "libnvsdm", "nvlsm")


def plans(tmp_path: Path, hosts: Any = 1, name: str = "fleet", **data: Any) -> dict[str, BootstrapPlan]:
    dep, _ = load_plan(write_inventory(tmp_path, hosts, name=name, **data))
    return {h.name: bootstrap_plan(dep, h) for h in dep.fleet.hosts}


def one(tmp_path: Path, **data: Any) -> BootstrapPlan:
    return next(iter(plans(tmp_path, **data).values()))


def names(plan: BootstrapPlan) -> list[str]:
    return [p.name for p in plan.packages]


def driver_name(plan: BootstrapPlan) -> str:
    """The driver package as the OS table family names it (open flavour)."""
    d = plan.driver
    assert d is not None
    if plan.manager == "dnf" or d.branch >= t.APT_PINNING_SINCE:
        return "nvidia-open"
    return f"nvidia-open-{d.branch}"


def check_common(plan: BootstrapPlan, os_name: str) -> None:
    table = t.OS_TABLES[os_name]
    assert plan.os == os_name and plan.os_from == "k2_os" and plan.manager == table.manager
    assert plan.kernel_headers == table.kernel_headers
    kernel = table.kernel_holds[plan.arch]
    assert set(kernel) <= set(plan.holds), "kernel meta packages are held with the driver"
    if table.manager == "apt":
        blacklist = plan.files[t.UNATTENDED_FILE]
        assert "Unattended-Upgrade::Package-Blacklist" in blacklist
        assert all(f'"{p}";' in blacklist for p in t.UNATTENDED_BLACKLIST)
    else:
        assert t.UNATTENDED_FILE not in plan.files
        assert names(plan)[0] == "python3-dnf-plugin-versionlock", "the hold tool comes first"


def check_nvidia_driver(plan: BootstrapPlan, branch: int) -> None:
    d = plan.driver
    assert d is not None and d.branch == branch and d.flavour == "open"
    assert driver_name(plan) in names(plan) and driver_name(plan) in plan.holds
    if plan.manager == "dnf":
        assert ("dnf-module", f"nvidia-driver:{branch}-open") in [(r.kind, r.source) for r in plan.repos]
    cuda = next(r for r in plan.repos if r.name == "cuda")
    assert f"/cuda/repos/{t.OS_TABLES[plan.os].cuda_repo}/{plan.arch}/" in cuda.source
    assert "nvidia-persistenced" in plan.services
    gates = {g.name: g.expect for g in plan.gates}
    assert gates["driver-branch"] == branch and gates["driver-minimum"] == d.minimum


def fabric_packages(plan: BootstrapPlan) -> list[str]:
    """Packages pinned to the driver's version that are not the driver itself."""
    driver = {driver_name(plan), plan.driver_package}
    return [p.name for p in plan.packages if p.same_as_driver or (p.version and p.name not in driver)]


@pytest.mark.parametrize("os_name", OSES)
@pytest.mark.parametrize("family", GPU_FLEETS)
def test_os_by_gpu_family(tmp_path: Path, family: str, os_name: str) -> None:
    data = GPU_FLEETS[family] | {"k2_os": os_name}
    hosts: Any = GB200_HOSTS if family == "gb200" else 1
    if family == "gb200" and "sbsa" not in t.OS_TABLES[os_name].cuda_arches:
        with pytest.raises(SpecError) as err:
            plans(tmp_path, hosts, **data)
        assert err.value.key == "k2_os" and "sbsa" in err.value.message
        return
    fleet = plans(tmp_path, hosts, **data)
    plan = next(iter(fleet.values()))
    check_common(plan, os_name)
    table = t.OS_TABLES[os_name]
    pkgs = names(plan)
    if family == "mi300x":
        assert plan.vendor == "amd" and plan.driver is None and plan.fabric is None
        assert not [n for n in pkgs if n.startswith(NVIDIA_PREFIXES)], "AMD hosts get no NVIDIA package"
        assert not [r for r in plan.repos if "nvidia" in r.source]
        assert "amdgpu-dkms" in pkgs and "amdgpu-dkms" in plan.holds
        assert plan.groups == {"root": ("video", "render")}
        assert set(table.docker) <= set(pkgs) and "docker" in plan.services, "ROCm engines run in a container"
        assert next(r for r in plan.repos if r.name == "amdgpu").source == table.amdgpu_repo
        return
    assert plan.vendor == "nvidia"
    check_nvidia_driver(plan, 580)
    fm, imex = "nvidia-fabricmanager", "nvidia-imex"
    if family == "h200-hgx":
        assert plan.fabric == t.NVSWITCH and plan.arch == "x86_64"
        assert fabric_packages(plan) == [fm, "libnvidia-nscq"]
        assert fm in plan.services and imex not in pkgs and "nvlsm" not in pkgs and not plan.modules
        assert "docker" not in plan.services, "the venv runtime needs no container runtime"
    if family == "b200":
        assert plan.fabric == t.NVLINK5
        assert fabric_packages(plan) == [fm, "libnvidia-nscq", "libnvsdm"]
        assert {"nvlsm", "infiniband-diags"} <= set(pkgs) and set(table.rdma) <= set(pkgs)
        assert plan.modules == ("ib_umad",) and plan.files[IB_UMAD_CONF] == "ib_umad\n"
        assert imex not in pkgs
    if family in ("b200", "gb200"):
        assert {"nvidia-container-toolkit", *table.docker} <= set(pkgs)
        assert ("nvidia-ctk", "runtime", "configure", "--runtime=docker") in plan.commands
        assert "nvidia-container-toolkit" in [r.name for r in plan.repos]
        if table.manager == "dnf":
            assert "docker-ce" in pkgs and table.docker_repo in [r.source for r in plan.repos]
        else:
            assert "docker.io" in pkgs
    if family == "gb200":
        assert plan.fabric == t.IMEX and plan.arch == "sbsa"
        assert fabric_packages(plan) == [imex] and imex in plan.services and fm not in pkgs
        for p in fleet.values():
            assert p.files[IMEX_NODES] == "10.0.0.1\n10.0.0.2\n"
    if family != "gb200":
        assert IMEX_NODES not in plan.files
    assert {g.name: g.expect for g in plan.gates}["fabric-state"] == "Completed"
    for name in fabric_packages(plan):
        pkg = plan.package(name)
        assert pkg is not None and pkg.same_as_driver and pkg.version is None and name in plan.holds


@pytest.mark.parametrize("os_name", OSES)
def test_fabric_pinned_to_exact_driver_version(tmp_path: Path, os_name: str) -> None:
    plan = one(tmp_path, k2_gpu="b200", k2_os=os_name, k2_driver_version="580.95.05", **NVFP4, k2_engine="trtllm")
    manager = t.OS_TABLES[os_name].manager
    driver = plan.package(driver_name(plan))
    assert driver is not None and driver.version == "580.95.05"
    for name in ("nvidia-fabricmanager", "libnvidia-nscq", "libnvsdm"):
        pkg = plan.package(name)
        assert pkg is not None and pkg.version == "580.95.05" and not pkg.same_as_driver
        want = f"{name}=580.95.05*" if manager == "apt" else f"{name}-580.95.05"
        assert pkg.spec(manager) == want
    assert {g.name: g.expect for g in plan.gates}["driver-version"] == "580.95.05"


def test_branch_named_packages_before_580_and_pinning_package_from_590(tmp_path: Path) -> None:
    old = one(tmp_path / "a", k2_engine_version="0.11.0", **NO_KIMI_REASONING["vllm"])  # vLLM 0.11 → CUDA 12.8 → 570
    assert old.driver is not None and old.driver.branch == 570
    assert names(old) == ["nvidia-open-570", "nvidia-open", "nvidia-fabricmanager-570", "libnvidia-nscq-570"]
    assert old.specs()[:2] == ["nvidia-open-570", "nvidia-open=570.*"]  # the meta alone would take a newer branch
    new = one(tmp_path / "b", k2_driver_branch=590)
    assert names(new)[:2] == ["nvidia-driver-pinning-590", "nvidia-open"]
    assert "nvidia-fabricmanager" in names(new)
    rhel = one(tmp_path / "c", k2_engine_version="0.11.0", k2_os="rocky-9", **NO_KIMI_REASONING["vllm"])
    assert names(rhel)[1:] == ["nvidia-open", "nvidia-fabricmanager-570", "libnvidia-nscq-570"]
    assert rhel.hold_patterns == ("*nvidia*570*",)


def test_proprietary_flavour_on_hopper(tmp_path: Path) -> None:
    apt = one(tmp_path / "a", k2_driver_flavour="proprietary")
    assert "cuda-drivers-580" in names(apt) and "nvidia-open-580" not in names(apt)
    rhel = one(tmp_path / "b", k2_driver_flavour="proprietary", k2_os="rhel-9")
    assert "cuda-drivers" in names(rhel)
    assert "nvidia-driver:580-dkms" in [r.source for r in rhel.repos]


def test_four_gpus_per_host_is_no_nvswitch_system(tmp_path: Path) -> None:
    plan = one(tmp_path, k2_gpu="h20", k2_gpus_per_node=1, k2_tp=1, k2_model="moonshotai/Kimi-K2-Instruct",
               k2_revision="fd1984e2b7a3350dbf7305fe73a4ede25c14de50", k2_engine="ktransformers",
               k2_engine_version="0.3.2", k2_quantization="gguf", k2_gguf_repo="unsloth/Kimi-K2-Instruct-GGUF",
               k2_gguf_revision="dc35109e1b6ecf981f1d30d57c117b9a58c0b31b", k2_gguf_pattern="UD-Q3_K_XL/*")
    assert plan.fabric is None and "nvidia-fabricmanager" not in names(plan)
    assert not any(g.name.startswith("fabric") for g in plan.gates)


@pytest.mark.parametrize("engine,version,gpu,branch", [
    ("vllm", "0.33.0", "h200", 580), ("vllm", "0.11.0", "h200", 570), ("vllm", "0.10.0", "h200", 570),
    ("sglang", "0.5.23", "h200", 580), ("sglang", "0.5.4", "h200", 570), ("sglang", "0.4.9", "h200", 570),
    ("vllm", "0.11.0", "b200", 570), ("vllm", "0.11.0", "b300", 580),
])
def test_default_branch(tmp_path: Path, engine: str, version: str, gpu: str, branch: int) -> None:
    extra = NO_KIMI_REASONING[engine] if deployment.parser_refusal(engine, version, "reasoning", "kimi_k2") else {}
    dep, _ = load_plan(write_inventory(tmp_path, 1, k2_engine=engine, k2_engine_version=version, k2_gpu=gpu, **extra))
    assert dep.driver is not None and dep.driver.branch == branch == dep.driver.default_branch


def test_default_branch_skips_feature_branches() -> None:
    """TRT-LLM 1.0 is a CUDA 12.9 build (driver 575, a new-feature branch): default 580."""
    assert t.minimum_branch("trtllm", "1.0.0", "b200")[0] == 575
    assert t.default_branch(575) == 580


def test_every_pinned_engine_has_a_cuda_entry() -> None:
    from k2fleet.planning import catalog

    for engine, versions in catalog.ENGINE_VERSIONS.items():
        for version in versions:
            assert t.ENGINE_CUDA[(engine, version)].cuda in t.CUDA_DRIVER


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("k2fleet"), *args], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_branch_below_engine_minimum_is_refused_by_validate(tmp_path: Path) -> None:
    inv = write_inventory(tmp_path, 1)  # vLLM 0.33.0
    out = run_cli("validate", str(inv), "--data", "k2_driver_branch=535")
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {inv}: k2_driver_branch: 535 is below the minimum 580")
    assert "CUDA 13.0" in lines[0]
    ok = run_cli("validate", str(inv), "--data", "k2_driver_branch=580")
    assert ok.returncode == 0, ok.stderr


@pytest.mark.parametrize("data,key,words", [
    ({"k2_gpu": "b300", "k2_engine_version": "0.11.0", "k2_driver_branch": 570} | NO_KIMI_REASONING["vllm"],
     "k2_driver_branch", "minimum 580: b300"),
    (NVFP4 | {"k2_engine": "trtllm", "k2_gpu": "b200", "k2_driver_flavour": "proprietary"}, "k2_driver_flavour", "open"),
    ({"k2_driver_version": "570.195.03"}, "k2_driver_version", "branch 580"),
    ({"k2_driver_version": "580.95\nx"}, "k2_driver_version", "control character"),
    ({"k2_driver_branch": True}, "k2_driver_branch", "valid integer"),
    ({"k2_gpu": "mi300x", "k2_driver_branch": 580}, "k2_driver_branch", "amdgpu"),
    ({"k2_os": "centos-7"}, "k2_os", "ubuntu-22.04"),
    ({"k2_reboot": "always"}, "k2_reboot", "rolling"),
])
def test_refusals(tmp_path: Path, data: dict[str, Any], key: str, words: str) -> None:
    with pytest.raises(SpecError) as err:
        load_plan(write_inventory(tmp_path, 1, **data))
    assert err.value.key == key and words in err.value.message


def test_imex_lists_ip_addresses(tmp_path: Path) -> None:
    """IMEX's nodes_config.cfg takes IP addresses: a host known only by a name that does not
    resolve is refused before planning (naming k2_address); with its address (and here its
    own k2_imex_address on the NVLink domain) the file lists IPs in inventory order."""
    named = [("gb200-0", {"ssh_hostname": "gb200-0.rack1.example"}), ("gb200-1", {"ssh_hostname": "10.0.0.2"})]
    with pytest.raises(SpecError) as err:
        plans(tmp_path / "a", named, **GPU_FLEETS["gb200"])
    assert err.value.key == "ssh_hostname" and "gb200-0" in err.value.message and "k2_address" in err.value.message
    named[0][1].update(k2_address="10.0.0.1", k2_imex_address="10.9.0.1")
    fleet = plans(tmp_path / "b", named, **GPU_FLEETS["gb200"])
    assert fleet["gb200-1"].files[IMEX_NODES] == "10.9.0.1\n10.0.0.2\n"


def test_every_seed_inventory_plans_a_bootstrap_per_host() -> None:
    seeds = [ROOT / p for p in scenario_inventories()]
    assert len(seeds) >= 11  # the sandbox inventories read the running sandbox fleet: not seeds
    for inv in seeds:
        dep, plan = load_plan(inv)
        doc = plan_document(dep, plan)
        for name, host in doc["hosts"].items():
            boot = host["desired"]["bootstrap"]
            assert boot["os"] == t.DEFAULT_OS and boot["os_from"] == "default", (inv.name, name)
            gpu_host = host["role"] not in t.GPU_ROLES_WITHOUT_GPUS
            assert (boot["vendor"] is not None) == gpu_host, (inv.name, name)
            if gpu_host and boot["vendor"] == "nvidia":
                assert boot["driver"]["branch"] >= boot["driver"]["minimum"]


def test_imex_port_is_reserved_on_gb200(tmp_path: Path) -> None:
    """IMEX listens on 50000 on every GB200 host: SGLang's default --dist-init-addr port
    there is refused (naming the key), another port plans."""
    data = NVFP4 | {"k2_engine": "sglang", "k2_gpu": "gb200", "k2_tp": 8}
    with pytest.raises(SpecError) as err:
        plans(tmp_path / "a", GB200_HOSTS, **data)
    assert err.value.key == "k2_dist_init_port" and "nvidia-imex" in err.value.message
    assert plans(tmp_path / "b", GB200_HOSTS, **data, k2_dist_init_port=50001)["gb200-0"].fabric == t.IMEX
    assert plans(tmp_path / "c", 2, **data | {"k2_gpu": "b200", "k2_tp": 16})["node-0"].fabric == t.NVLINK5


def test_docs_compatibility_table_is_the_code_table() -> None:
    readme = (ROOT / "docs" / "bootstrap.md").read_text()
    for (engine, version), ec in t.ENGINE_CUDA.items():
        cd = t.CUDA_DRIVER[ec.cuda]
        row = (f"| {engine} {version} | {ec.cuda} | {cd.branch} ({cd.version}) | {t.default_branch(cd.branch)} | "
               f"{'yes' if ec.verified else 'no'} |")
        assert row in readme, f"docs/bootstrap.md's compatibility table is stale: {row}"


def test_arm64_gpus_need_an_sbsa_repository_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule for an OS table without NVIDIA's sbsa tree (every table has one today)."""
    import dataclasses

    monkeypatch.setitem(t.OS_TABLES, "debian-12", dataclasses.replace(t.DEBIAN_12, cuda_arches=("x86_64",)))
    with pytest.raises(SpecError) as err:
        plans(tmp_path, GB200_HOSTS, **GPU_FLEETS["gb200"], k2_os="debian-12")
    assert err.value.key == "k2_os" and "sbsa" in err.value.message
