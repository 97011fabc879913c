"""The sandbox's TEST DOUBLE driver repository (k2sandbox.driver_doubles).

Offline: the repository builds reproducibly, its packages carry the names, versions,
dependencies and files the bootstrap plan installs, real apt reads and resolves it, and
the double programs behave like the real ones for what k2fleet reads.

Sandbox (one host, under the sandbox lock): real apt installs the 580 driver stack from
the repository, the "module" loads only through its boot unit, fabric manager brings the
fabric to Completed; installing 590 leaves the loaded 580 module in place (version
mismatch, fabric manager refuses) until a simulated reboot; nvidia-ctk configures the
real Docker daemon and ``docker run --runtime=nvidia`` runs a container through runc.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k2fleet.control import deb_bundles as bundle
from k2sandbox import nspawn as sandbox
from k2sandbox import driver_doubles as nd
from k2sandbox.harness import SandboxFleet
from tests.test_bundle import parse_stanzas

SANDBOX_HOSTS = 1  # read by the sandbox_fleet fixture (tests/conftest.py)
SANDBOX_DOCKER = True
V580, V590 = nd.DRIVER_VERSIONS[580], nd.DRIVER_VERSIONS[590]
H200 = nd.gpus_json("nvidia", "NVIDIA H200", 8, 143771, True)

@pytest.fixture(scope="module")
def dpkg_tools() -> None:
    """dpkg-deb and dpkg-scanpackages: ./dev.sh installs dpkg-dev before the run, not the suite midway."""
    assert shutil.which("dpkg-deb") and shutil.which("dpkg-scanpackages"), "dpkg-dev is missing (./dev.sh installs it)"


needs_dpkg = pytest.mark.usefixtures("dpkg_tools")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (sandbox)")


def sha256s(repo: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(repo.iterdir())}


def deb_field(deb: Path, *names: str) -> list[str]:
    out = subprocess.run(["dpkg-deb", "--field", str(deb)], capture_output=True, text=True, check=True)
    fields = parse_stanzas(out.stdout)[0]
    return [fields.get(n, "") for n in names]


def deb_contents(deb: Path) -> dict[str, str]:
    """path -> 'mode owner/group' of every member (``dpkg-deb --contents``)."""
    out = subprocess.run(["dpkg-deb", "--contents", str(deb)], capture_output=True, text=True, check=True).stdout
    rows = {}
    for line in out.splitlines():
        mode, owner, _size, _date, _time, path = line.split(None, 5)
        rows[path.removeprefix(".")] = f"{mode} {owner}"
    return rows


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return nd.ensure_double_repo(tmp_path_factory.mktemp("doubles-a"))


# --------------------------------------------------------------------------- offline


@needs_dpkg
def test_builds_are_byte_identical_and_cached(repo: Path, tmp_path: Path) -> None:
    other = nd.ensure_double_repo(tmp_path)
    assert other.name == repo.name  # same content key
    first = sha256s(repo)
    assert sha256s(other) == first
    assert {"Packages", "Release"} <= set(first) and len([n for n in first if n.endswith(".deb")]) == len(nd.double_packages()) == 23
    before = (repo / "Packages").stat()
    again = nd.ensure_double_repo(repo.parent)
    assert again == repo and (repo / "Packages").stat().st_mtime_ns == before.st_mtime_ns
    assert (repo / "Release").read_text().startswith("Date: Thu, 01 Jan 2026 00:00:00 GMT\n")


@needs_dpkg
def test_packages_names_versions_dependencies(repo: Path) -> None:
    debs = {p.name: p for p in repo.glob("*.deb")}
    expect = {
        f"nvidia-open_{V580}-1_amd64.deb": ("nvidia-open", f"{V580}-1", "amd64", "python3"),
        f"nvidia-open_{V590}-1_amd64.deb": ("nvidia-open", f"{V590}-1", "amd64", "python3"),
        f"nvidia-open-580_{V580}-1_amd64.deb": ("nvidia-open-580", f"{V580}-1", "amd64", f"nvidia-open (= {V580}-1)"),
        "nvidia-driver-pinning-590_590-1_all.deb": ("nvidia-driver-pinning-590", "590-1", "all", ""),
        "nvidia-driver-pinning-580_580-1_all.deb": ("nvidia-driver-pinning-580", "580-1", "all", ""),
        f"nvidia-fabricmanager_{V580}-1_amd64.deb": ("nvidia-fabricmanager", f"{V580}-1", "amd64", "python3"),
        f"libnvidia-nscq_{V590}-1_amd64.deb": ("libnvidia-nscq", f"{V590}-1", "amd64", ""),
        f"libnvsdm_{V580}-1_amd64.deb": ("libnvsdm", f"{V580}-1", "amd64", ""),
        f"nvidia-imex_{V590}-1_amd64.deb": ("nvidia-imex", f"{V590}-1", "amd64", "python3"),
        "nvlsm_2025.06.5-1_amd64.deb": ("nvlsm", "2025.06.5-1", "amd64", ""),
        "nvidia-container-toolkit_1.18.0-1_amd64.deb": ("nvidia-container-toolkit", "1.18.0-1", "amd64", "python3"),
        "amdgpu-dkms_6.12.12.60400-2187269.22.04_all.deb": ("amdgpu-dkms", nd.AMDGPU_VERSION, "all", "python3"),
    }
    for filename, (name, version, arch, depends) in expect.items():
        assert deb_field(debs[filename], "Package", "Version", "Architecture", "Depends") == [name, version, arch,
                                                                                              depends]
    for deb in debs.values():
        assert "TEST DOUBLE" in deb_field(deb, "Description")[0], deb.name
    assert not any(n.startswith(("infiniband-diags", "nvidia-open-590")) for n in debs)
    assert deb_field(debs["nvidia-driver-pinning-590_590-1_all.deb"], "Provides", "Conflicts") == \
        ["nvidia-driver-pinning", "nvidia-driver-pinning"]


@needs_dpkg
def test_driver_package_files(repo: Path) -> None:
    rows = deb_contents(repo / f"nvidia-open_{V580}-1_amd64.deb")
    assert rows["/usr/bin/nvidia-smi"] == "-rwxr-xr-x root/root"
    assert rows[nd.NVIDIA_LOAD_MODULE] == "-rwxr-xr-x root/root"
    assert rows[nd.NVIDIA_INSTALLED_VERSION] == "-rw-r--r-- root/root"
    assert {f"/lib/systemd/system/{nd.MODULE_UNIT}", "/lib/systemd/system/nvidia-persistenced.service"} <= set(rows)
    pkg = next(p for p in nd.double_packages() if p.name == "nvidia-open" and p.version == f"{V580}-1")
    unit = pkg.files[f"/lib/systemd/system/{nd.MODULE_UNIT}"].text
    assert "Before=nvidia-persistenced.service nvidia-fabricmanager.service nvidia-imex.service" in unit
    assert "WantedBy=multi-user.target" in unit and f"ExecStart={nd.NVIDIA_LOAD_MODULE}" in unit
    assert f"systemctl --quiet enable {nd.MODULE_UNIT}" in pkg.scripts["postinst"]
    assert pkg.files[nd.NVIDIA_INSTALLED_VERSION].text == f"{V580}\n"
    pin = next(p for p in nd.double_packages() if p.name == "nvidia-driver-pinning-590")
    prefs = pin.files["/etc/apt/preferences.d/nvidia-driver-pinning-590"].text
    assert "Pin: version 590.*\nPin-Priority: 1000" in prefs and "nvidia-fabricmanager" in prefs
    fm = deb_contents(repo / f"nvidia-fabricmanager_{V590}-1_amd64.deb")
    assert {"/usr/bin/nv-fabricmanager", "/lib/systemd/system/nvidia-fabricmanager.service",
            "/usr/lib/k2fleet-doubles/nvidia-fabricmanager/version"} <= set(fm)
    ctk = deb_contents(repo / "nvidia-container-toolkit_1.18.0-1_amd64.deb")
    assert {"/usr/bin/nvidia-ctk", "/usr/bin/nvidia-container-runtime"} <= set(ctk)


@needs_dpkg
def test_packages_index_parses_and_matches_files(repo: Path) -> None:
    stanzas = parse_stanzas((repo / "Packages").read_text())
    assert len(stanzas) == len(nd.double_packages())
    for s in stanzas:
        deb = repo / s["Filename"].removeprefix("./")
        assert hashlib.sha256(deb.read_bytes()).hexdigest() == s["SHA256"] and int(s["Size"]) == deb.stat().st_size
    release = (repo / "Release").read_text()
    assert hashlib.sha256((repo / "Packages").read_bytes()).hexdigest() in release


def pin_text(branch: int) -> str:
    pkg = next(p for p in nd.double_packages() if p.name == f"nvidia-driver-pinning-{branch}")
    return pkg.files[f"/etc/apt/preferences.d/nvidia-driver-pinning-{branch}"].text


@needs_dpkg
@needs_root
def test_real_apt_resolves_the_repository(repo: Path, tmp_path: Path) -> None:
    """apt (the control machine's, against its own dpkg status for python3) reads the
    flat repository; ``nvidia-open-580`` resolves only with the driver named at its
    version or the branch pinned, as on NVIDIA's repository; the pins select the branch."""
    (tmp_path / "lists/partial").mkdir(parents=True)
    (tmp_path / "archives/partial").mkdir(parents=True)
    prefs = tmp_path / "prefs"
    prefs.mkdir()
    (tmp_path / "sources.list").write_text(f"deb [trusted=yes] file:{repo} ./\n")
    opts = ["-o", f"Dir::Etc::sourcelist={tmp_path / 'sources.list'}", "-o", "Dir::Etc::sourceparts=-",
            "-o", f"Dir::State::Lists={tmp_path / 'lists'}", "-o", f"Dir::Cache={tmp_path}",
            "-o", f"Dir::Cache::archives={tmp_path / 'archives'}", "-o", f"Dir::Etc::preferencesparts={prefs}",
            "-o", "Dir::Etc::preferences=/dev/null", "-o", "Debug::NoLocking=1", "-q"]
    env = dict(os.environ, LC_ALL="C")

    def apt(*args: str, tool: str = "apt-get") -> subprocess.CompletedProcess[str]:
        return subprocess.run([tool, *opts, *args], capture_output=True, text=True, env=env)

    assert apt("update").returncode == 0
    bare = apt("-s", "install", "nvidia-open-580", f"nvidia-fabricmanager={V580}-1")
    assert bare.returncode == 100
    assert f"Depends: nvidia-open (= {V580}-1) but {V590}-1 is to be installed" in bare.stdout
    named = apt("-s", "install", "nvidia-open-580", f"nvidia-open={V580}-1", f"nvidia-fabricmanager={V580}-1")
    assert named.returncode == 0, named.stdout + named.stderr
    assert {f"Inst nvidia-open ({V580}-1", f"Inst nvidia-open-580 ({V580}-1",
            f"Inst nvidia-fabricmanager ({V580}-1"} <= {line.split(" localhost")[0] for line in named.stdout.splitlines()}
    (prefs / "nvidia-driver-pinning-580").write_text(pin_text(580))
    pinned = apt("-s", "install", "nvidia-open-580", "nvidia-fabricmanager", "libnvidia-nscq")
    assert pinned.returncode == 0, pinned.stdout
    assert sorted(line.split(" localhost")[0] for line in pinned.stdout.splitlines() if line.startswith("Inst")) == \
        [f"Inst libnvidia-nscq ({V580}-1", f"Inst nvidia-fabricmanager ({V580}-1", f"Inst nvidia-open ({V580}-1",
         f"Inst nvidia-open-580 ({V580}-1"]
    (prefs / "nvidia-driver-pinning-580").unlink()
    (prefs / "nvidia-driver-pinning-590").write_text(pin_text(590))
    policy = apt("policy", "nvidia-open", tool="apt-cache").stdout
    assert f"Candidate: {V590}-1" in policy
    assert f"     {V590}-1 1000\n" in policy and f"     {V580}-1 500\n" in policy, policy


# --------------------------------------------------------------------------- the programs, offline


def run_double(env_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, K2FLEET_DOUBLE_HARDWARE=str(env_dir / "gpus.json"),
               K2FLEET_DOUBLE_STATE=str(env_dir / "run"), K2FLEET_DOUBLE_LIB=str(env_dir / "lib"))
    return subprocess.run([sys.executable, str(nd.DOUBLE_PROGRAM), *args], capture_output=True, text=True, env=env)


def test_smi_states_offline(tmp_path: Path) -> None:
    (tmp_path / "lib/nvidia").mkdir(parents=True)
    (tmp_path / "lib/nvidia/installed-version").write_text(f"{V580}\n")
    query = ["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader"]
    no_gpus = run_double(tmp_path, *query)
    assert no_gpus.returncode == 9 and "couldn't communicate with the NVIDIA driver" in no_gpus.stdout
    assert run_double(tmp_path, "load-module").returncode == 1  # no GPU: modprobe fails (No such device)
    (tmp_path / "gpus.json").write_text(H200)
    assert run_double(tmp_path, *query).returncode == 9  # not loaded yet
    assert run_double(tmp_path, "load-module").returncode == 0
    out = run_double(tmp_path, *query)
    assert out.returncode == 0 and out.stdout.splitlines() == [f"{i}, NVIDIA H200, 143771 MiB, {V580}" for i in range(8)]
    nounits = run_double(tmp_path, "nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,nounits")
    assert nounits.stdout.splitlines()[:2] == ["driver_version, memory.total", f"{V580}, 143771"]
    assert run_double(tmp_path, "nvidia-smi", "--query-gpu=bogus", "--format=csv").returncode == 2
    q = run_double(tmp_path, "nvidia-smi", "-q").stdout
    assert q.count("        State                                          : In Progress\n") == 8
    assert "    Product Name                                       : NVIDIA H200\n" in q
    (tmp_path / "lib/nvidia/installed-version").write_text(f"{V590}\n")  # new driver on disk, module stays
    assert run_double(tmp_path, "load-module").returncode == 0
    assert (tmp_path / "run/nvidia/module-version").read_text() == f"{V580}\n"
    mismatch = run_double(tmp_path, *query)
    assert mismatch.returncode == 18
    assert mismatch.stdout == "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 590.44\n"


def test_fabric_manager_and_imex_refusals_offline(tmp_path: Path) -> None:
    for pkg, version in (("nvidia", V580), ("nvidia-fabricmanager", V590), ("nvidia-imex", V580)):
        (tmp_path / "lib" / pkg).mkdir(parents=True)
        (tmp_path / "lib" / pkg / ("installed-version" if pkg == "nvidia" else "version")).write_text(version + "\n")
    (tmp_path / "gpus.json").write_text(H200)
    run_double(tmp_path, "load-module")
    fm = run_double(tmp_path, "nv-fabricmanager")
    assert fm.returncode == 1 and f"version {V590} don't match with driver version {V580}" in fm.stderr
    (tmp_path / "gpus.json").write_text(nd.gpus_json("nvidia", "NVIDIA H200", 4, 143771, False))
    (tmp_path / "lib/nvidia-fabricmanager/version").write_text(f"{V580}\n")
    no_switch = run_double(tmp_path, "nv-fabricmanager")
    assert no_switch.returncode == 1 and "NV_WARN_NOTHING_TO_DO" in no_switch.stderr
    assert not (tmp_path / "run/nvidia/fabric-state").exists()
    imex = run_double(tmp_path, "nvidia-imex")  # no nodes_config.cfg at the default path here
    assert imex.returncode == 1 and "nodes_config.cfg" in imex.stderr


def test_amdgpu_module_offline(tmp_path: Path) -> None:
    (tmp_path / "lib/amdgpu").mkdir(parents=True)
    (tmp_path / "lib/amdgpu/installed-version").write_text("6.12.12.60400-2187269.22.04\n")
    assert run_double(tmp_path, "amdgpu-load-module").returncode == 1  # no AMD GPU: No such device
    (tmp_path / "gpus.json").write_text(nd.gpus_json("amd", "AMD Instinct MI300X", 8, 196592))
    assert run_double(tmp_path, "amdgpu-load-module").returncode == 0
    assert (tmp_path / "run/amdgpu/module-version").read_text() == "6.12.12.60400-2187269.22.04\n"
    assert run_double(tmp_path, "nvidia-smi", "-q").returncode == 9  # an AMD host has no NVIDIA driver


def test_nvidia_ctk_offline(tmp_path: Path) -> None:
    daemon = tmp_path / "daemon.json"
    daemon.write_text('{"log-driver": "json-file", "runtimes": {"other": {"path": "/bin/other"}}}')
    args = ["nvidia-ctk", "runtime", "configure", "--runtime=docker", f"--config={daemon}"]
    assert run_double(tmp_path, *args).returncode == 0
    first = daemon.read_bytes()
    config = json.loads(first)
    assert config["runtimes"]["nvidia"] == {"args": [], "path": "/usr/bin/nvidia-container-runtime"}
    assert config["runtimes"]["other"] == {"path": "/bin/other"} and config["log-driver"] == "json-file"
    assert run_double(tmp_path, *args).returncode == 0 and daemon.read_bytes() == first
    (tmp_path / "gpus.json").write_text(H200)
    (tmp_path / "lib/nvidia").mkdir(parents=True)
    (tmp_path / "lib/nvidia/installed-version").write_text(f"{V580}\n")
    assert run_double(tmp_path, "nvidia-ctk", "cdi", "generate", f"--output={tmp_path / 'cdi.yaml'}").returncode == 1
    run_double(tmp_path, "load-module")
    assert run_double(tmp_path, "nvidia-ctk", "cdi", "generate", f"--output={tmp_path / 'cdi.yaml'}").returncode == 0
    spec = (tmp_path / "cdi.yaml").read_text()
    assert "kind: nvidia.com/gpu\n" in spec
    assert [line for line in spec.splitlines() if line.startswith("- name:")] == \
        [f'- name: "{i}"' for i in range(8)] + ['- name: "all"']
    yaml = pytest.importorskip("yaml")
    parsed = yaml.safe_load(spec)
    assert [d["name"] for d in parsed["devices"]] == [*map(str, range(8)), "all"]
    assert all(d["containerEdits"]["env"] for d in parsed["devices"])


# --------------------------------------------------------------------------- one sandbox host

REMOTE_REPO = "/var/lib/k2fleet/double-repo"
REMOTE_DOCKER_REPO = "/var/lib/k2fleet/double-test-docker"
SOURCES = "/etc/apt/k2fleet-double-test.list"
APT = (f"DEBIAN_FRONTEND=noninteractive apt-get -q -y -o Dir::Etc::sourcelist={SOURCES} "
       "-o Dir::Etc::sourceparts=- -o APT::Get::List-Cleanup=0")


def sh(host: sandbox.SandboxHost, command: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return sandbox.ssh(host, command, timeout=timeout)


def ok(host: sandbox.SandboxHost, command: str, timeout: float = 120) -> str:
    proc = sh(host, command, timeout)
    assert proc.returncode == 0, f"{command}: rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def host(sandbox_fleet: SandboxFleet, tmp_path_factory: pytest.TempPathFactory) -> sandbox.SandboxHost:
    """The one sandbox host with the double repository (and a Docker bundle) as its only
    apt sources and the simulated 8 x H200 hardware file."""
    started = time.monotonic()
    repo = nd.ensure_double_repo()
    docker_tar = bundle.ensure_bundle(["docker.io", "rsync"])
    shared = sandbox.DEFAULT_STATE_DIR / "shared" / "double-test"
    shutil.rmtree(shared, ignore_errors=True)
    shutil.copytree(repo, shared / "repo")
    shutil.copy2(docker_tar, shared / "docker.tar")
    h = sandbox_fleet.ensure_up().sandbox_hosts[0]
    mnt = f"{sandbox.SHARED_MOUNT}/double-test"
    ok(h, f"rm -rf {REMOTE_REPO} {REMOTE_DOCKER_REPO} && mkdir -p {REMOTE_DOCKER_REPO} && "
          f"cp -r {mnt}/repo {REMOTE_REPO} && tar -xf {mnt}/docker.tar -C {REMOTE_DOCKER_REPO} && "
          f"printf 'deb [trusted=yes] file:{REMOTE_REPO} ./\\ndeb [trusted=yes] file:{REMOTE_DOCKER_REPO} ./\\n' "
          f"> {SOURCES} && mkdir -p /etc/k2fleet-doubles && printf '%s' '{H200}' > {nd.HARDWARE_FILE} && "
          f"{APT} update")
    print(f"\nsandbox host prepared (repo copied, apt lists) in {time.monotonic() - started:.1f}s")
    return h


def smi_query(host: sandbox.SandboxHost) -> subprocess.CompletedProcess[str]:
    return sh(host, "nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader,nounits")


@needs_root
@pytest.mark.sandbox
def test_driver_install_load_fabric_upgrade_reboot(host: sandbox.SandboxHost) -> None:
    started = time.monotonic()
    ok(host, f"{APT} install nvidia-open-580 nvidia-open={V580}-1 nvidia-fabricmanager={V580}-1 "
             f"libnvidia-nscq={V580}-1 && "
             f"apt-mark hold nvidia-open nvidia-open-580 nvidia-fabricmanager libnvidia-nscq")
    assert ok(host, f"systemctl is-enabled {nd.MODULE_UNIT}").strip() == "enabled"
    before = smi_query(host)
    assert before.returncode == 9 and "couldn't communicate with the NVIDIA driver" in before.stdout
    assert sh(host, "systemctl start nvidia-fabricmanager").returncode != 0  # no module yet
    ok(host, f"systemctl start {nd.MODULE_UNIT}")  # what boot does
    after = smi_query(host)
    assert after.returncode == 0, after.stdout
    assert after.stdout.splitlines() == [f"{i}, NVIDIA H200, 143771, {V580}" for i in range(8)]
    assert "In Progress" in ok(host, "nvidia-smi -q")
    ok(host, "systemctl start nvidia-persistenced nvidia-fabricmanager")
    assert ok(host, "systemctl is-active nvidia-persistenced nvidia-fabricmanager").split() == ["active", "active"]
    q = ok(host, "nvidia-smi -q")
    assert q.count("        State                                          : Completed\n") == 8
    assert q.count("        Status                                         : Success\n") == 8
    print(f"\n580 installed and fabric Completed in {time.monotonic() - started:.1f}s")

    # the 590 release: pinning package, then the driver family at 590 (held packages move)
    ok(host, f"{APT} install nvidia-driver-pinning-590 && {APT} install --allow-change-held-packages "
             f"nvidia-open={V590}-1 nvidia-fabricmanager={V590}-1 libnvidia-nscq={V590}-1 nvidia-open-580-")
    versions = ok(host, "dpkg-query -W -f '${Package}=${Version}\\n' nvidia-open nvidia-fabricmanager libnvidia-nscq")
    assert sorted(versions.split()) == [f"libnvidia-nscq={V590}-1", f"nvidia-fabricmanager={V590}-1",
                                        f"nvidia-open={V590}-1"]
    assert "Pin: version 590.*" in ok(host, "cat /etc/apt/preferences.d/nvidia-driver-pinning-590")
    mismatch = smi_query(host)
    assert mismatch.returncode == 18 and "Driver/library version mismatch" in mismatch.stdout
    restart = sh(host, "systemctl restart nvidia-fabricmanager")
    assert restart.returncode != 0
    assert sh(host, "systemctl restart nvidia-persistenced").returncode != 0  # loaded 580 != installed 590
    journal = ok(host, "journalctl -u nvidia-fabricmanager --no-pager -n 20")
    assert f"version {V590} don't match with driver version {V580}" in journal
    assert sh(host, f"test -e {nd.FABRIC_STATE}").returncode != 0
    ok(host, f"systemctl restart {nd.MODULE_UNIT}")  # a loaded module is not replaced
    assert ok(host, f"cat {nd.NVIDIA_LOADED_VERSION}").strip() == V580
    assert smi_query(host).returncode == 18
    # the reboot (simulated: /run cleared, the boot unit runs again; the real one is the lead's test)
    ok(host, f"systemctl stop nvidia-persistenced; rm -rf {nd.STATE_DIR} && systemctl restart {nd.MODULE_UNIT}")
    final = smi_query(host)
    assert final.returncode == 0 and final.stdout.splitlines() == [f"{i}, NVIDIA H200, 143771, {V590}" for i in range(8)]
    ok(host, "systemctl start nvidia-fabricmanager nvidia-persistenced")
    assert ok(host, "nvidia-smi -q").count("        State                                          : Completed\n") == 8
    ok(host, "systemctl stop nvidia-fabricmanager")
    assert sh(host, f"test -e {nd.FABRIC_STATE}").returncode != 0  # removed on stop
    # IMEX (GB200's daemon): refuses without its nodes_config.cfg, runs with one
    ok(host, f"{APT} install nvidia-imex={V590}-1 && rm -f /etc/nvidia-imex/nodes_config.cfg")
    assert sh(host, "systemctl start nvidia-imex").returncode != 0
    ok(host, "mkdir -p /etc/nvidia-imex && printf '10.213.0.11\\n10.213.0.12\\n' > /etc/nvidia-imex/nodes_config.cfg "
             "&& systemctl start nvidia-imex")
    assert ok(host, "systemctl is-active nvidia-imex").strip() == "active"
    assert "domain of 2 nodes" in ok(host, "journalctl -u nvidia-imex --no-pager -n 5")
    print(f"driver lifecycle on the sandbox host: {time.monotonic() - started:.1f}s")


@needs_root
@pytest.mark.sandbox
def test_container_toolkit_configures_real_docker(host: sandbox.SandboxHost) -> None:
    started = time.monotonic()
    ok(host, f"{APT} install --no-install-recommends docker.io nvidia-container-toolkit", timeout=300)
    ok(host, "mkdir -p /etc/docker && printf '{\"log-driver\": \"json-file\"}' > /etc/docker/daemon.json && "
             "nvidia-ctk runtime configure --runtime=docker")
    first = ok(host, "sha256sum /etc/docker/daemon.json")
    ok(host, "nvidia-ctk runtime configure --runtime=docker")
    assert ok(host, "sha256sum /etc/docker/daemon.json") == first  # idempotent, byte for byte
    config = json.loads(ok(host, "cat /etc/docker/daemon.json"))
    assert config == {"log-driver": "json-file",
                      "runtimes": {"nvidia": {"args": [], "path": "/usr/bin/nvidia-container-runtime"}}}
    ok(host, "nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml")
    assert 'name: "all"' in ok(host, "cat /etc/cdi/nvidia.yaml")
    ok(host, "systemctl restart docker", timeout=120)
    assert "nvidia" in ok(host, "docker info --format '{{json .Runtimes}}'")
    # a one-file image from the host's own dash + libc (no registry is reachable)
    ok(host, "rm -rf /tmp/img && mkdir -p /tmp/img/bin /tmp/img/lib/x86_64-linux-gnu /tmp/img/lib64 && "
             "cp /bin/dash /tmp/img/bin/sh && cp /lib/x86_64-linux-gnu/libc.so.6 /tmp/img/lib/x86_64-linux-gnu/ && "
             "cp /lib64/ld-linux-x86-64.so.2 /tmp/img/lib64/ && tar -C /tmp/img -c . | docker import - k2dbl:1")
    out = ok(host, "docker run --rm --runtime=nvidia --network host k2dbl:1 /bin/sh -c 'echo ran-through-runc'",
             timeout=120)
    assert out.strip() == "ran-through-runc"
    print(f"\ncontainer toolkit + docker on the sandbox host: {time.monotonic() - started:.1f}s")
