"""Offline apt bundles: closure resolution (local) and an air-gapped install (sandbox).

The sandbox test boots 2 real hosts with no route out, installs a bundle with
the pyinfra CLI, checks the tools work, then runs the same deploy again and
asserts from pyinfra's ``--json`` results that no operation changed anything.
"""

from __future__ import annotations

import os
import re
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from k2fleet.control import deb_bundles as bundle
from k2sandbox import nspawn as sandbox
from k2sandbox.nspawn import SandboxHost
from k2sandbox.harness import SandboxFleet
from k2sandbox.pyinfra_cli import run_pyinfra, tool
from tests.inventory_factory import write_inventory

REPO_ROOT = Path(__file__).resolve().parents[1]
SANDBOX_PACKAGES = ["openmpi-bin", "rsync", "python3-venv", "python3-mpi4py"]
SANDBOX_HOSTS = 1  # read by the sandbox_fleet fixture (tests/conftest.py): one host proves the bundle install
SANDBOX_DOCKER = False

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (apt, sandbox)")


# --------------------------------------------------------------------------
# helpers


def parse_stanzas(text: str) -> list[dict[str, str]]:
    """Fields of each stanza of a Debian control-style file (continuations joined)."""
    stanzas: list[dict[str, str]] = []
    for block in re.split(r"\n\s*\n", text.strip()):
        fields: dict[str, str] = {}
        last = ""
        for line in block.splitlines():
            if line[:1].isspace() and last:
                fields[last] += "\n" + line.strip()
            elif ":" in line:
                last, _, value = line.partition(":")
                fields[last] = value.strip()
        stanzas.append(fields)
    return stanzas


def relation_groups(field: str) -> list[list[str]]:
    """``a (>= 1) | b, c:any`` -> [["a", "b"], ["c"]] (names only)."""
    groups = []
    for group in field.split(","):
        names = [alt.split("(")[0].split("[")[0].strip().split(":")[0] for alt in group.split("|")]
        groups.append([n for n in names if n])
    return [g for g in groups if g]


def apt_candidates(names: list[str]) -> dict[str, str]:
    """Candidate version of each package, from ``apt-cache policy``."""
    out = subprocess.run(["apt-cache", "policy", *names], capture_output=True, text=True,
                         check=True, env=dict(os.environ, LC_ALL="C")).stdout
    candidates: dict[str, str] = {}
    current = ""
    for line in out.splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            current = line[:-1].split(":")[0]
        elif line.strip().startswith("Candidate:") and current:
            candidates[current] = line.split(":", 1)[1].strip()
    return candidates


def tar_text(tar_path: Path, member: str) -> str:
    with tarfile.open(tar_path) as tar:
        fh = tar.extractfile(member)
        assert fh is not None
        return fh.read().decode()


# --------------------------------------------------------------------------
# (a) closure resolution, no sandbox


@pytest.fixture(scope="module")
def rsync_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bundle.ensure_bundle(["rsync"], tmp_path_factory.mktemp("bundles"))


@needs_root
def test_rsync_bundle_has_rsync_and_its_libs(rsync_bundle: Path) -> None:
    manifest = bundle.read_manifest(rsync_bundle)
    names = set(manifest["packages"])
    assert {"rsync", "libc6", "libpopt0", "libxxhash0", "liblz4-1", "libzstd1", "libssl3"} <= names
    with tarfile.open(rsync_bundle) as tar:
        members = set(tar.getnames())
    assert {"Packages", "Release", "manifest.json"} <= members
    for entry in manifest["packages"].values():
        assert entry["filename"] in members


@needs_root
def test_rsync_bundle_is_dependency_closed(rsync_bundle: Path) -> None:
    """Every Depends/Pre-Depends group of every bundled package is met inside the bundle."""
    stanzas = parse_stanzas(tar_text(rsync_bundle, "Packages"))
    provided = {s["Package"] for s in stanzas}
    for s in stanzas:
        provided |= {g[0] for g in relation_groups(s.get("Provides", ""))}
    for s in stanzas:
        for field in ("Depends", "Pre-Depends"):
            for group in relation_groups(s.get(field, "")):
                assert set(group) & provided, f"{s['Package']} {field}: {group} not in bundle"


@needs_root
def test_rsync_bundle_versions_are_apt_candidates(rsync_bundle: Path) -> None:
    packages = bundle.read_manifest(rsync_bundle)["packages"]
    candidates = apt_candidates(sorted(packages))
    assert {name: entry["version"] for name, entry in packages.items()} == candidates


@needs_root
def test_second_build_reuses_cache(rsync_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = rsync_bundle.stat()

    def no_download(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("cached bundle was downloaded again")

    monkeypatch.setattr(bundle, "download", no_download)
    again = bundle.ensure_bundle(["rsync"], rsync_bundle.parent)
    after = again.stat()
    assert again == rsync_bundle
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (before.st_ino, before.st_mtime_ns,
                                                                before.st_size)


# --------------------------------------------------------------------------
# (b) air-gapped install on the sandbox fleet


DEPLOY = f"""\
from pyinfra import host
from pyinfra.facts.deb import DebPackages
from pyinfra.facts.files import Directory

from k2fleet.control.deb_bundles import ensure_bundle
from k2fleet.deploy.roles.packages import install
from k2fleet.planning.host_packages import bundle_repo_dir
from k2fleet.planning.role_actions import PackagesActions

# the role takes its record: what is missing and whether the bundle is extracted (k2fleet's
# deploy makes it from its HostState fact; this plain deploy asks pyinfra's facts)
tar = ensure_bundle({SANDBOX_PACKAGES!r})
installed = host.get_fact(DebPackages) or {{}}
missing = tuple(p for p in {SANDBOX_PACKAGES!r} if p not in installed)
install(PackagesActions(source="bundle", install=tuple({SANDBOX_PACKAGES!r}) if missing else (), missing=missing,
                        ship_bundle=bool(missing),
                        have_repo=bool(host.get_fact(Directory, path=bundle_repo_dir(tar.name)))),
        bundle=str(tar))
"""


def deploy_bundle(inventory: Path, deploy: Path) -> tuple[dict, float]:
    """The harness's one way to run pyinfra and read its ``--json`` results
    (:func:`k2sandbox.pyinfra_cli.run_pyinfra`), from the deploy's directory (a plain
    pyinfra deploy, not k2fleet's); its results and the wall time."""
    started = time.monotonic()
    result = run_pyinfra([tool("pyinfra"), "-y", "--json", str(inventory), str(deploy)], cwd=deploy.parent)
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.tail()
    return result.results, elapsed


@pytest.fixture(scope="module")
def sandbox_hosts(sandbox_fleet: SandboxFleet) -> list[SandboxHost]:
    """The module's sandbox fleet (SANDBOX_HOSTS hosts, no Docker), from the one fixture and lock."""
    return sandbox_fleet.ensure_up().sandbox_hosts


@pytest.fixture(scope="module")
def deploy_runs(sandbox_hosts: list[SandboxHost], tmp_path_factory: pytest.TempPathFactory
                ) -> list[tuple[dict, float]]:
    """Results and timings of two identical bundle deploys."""
    work = tmp_path_factory.mktemp("pyinfra")
    hosts = [(h.name, {"ssh_hostname": h.address, "ssh_user": h.ssh_user, "ssh_key": h.ssh_key,
                       "ssh_known_hosts_file": h.ssh_known_hosts_file, "ssh_strict_host_key_checking": "yes"})
             for h in sandbox_hosts]
    inventory = write_inventory(work, hosts=hosts, name="inventory")
    deploy = work / "deploy.py"
    deploy.write_text(DEPLOY)
    runs = [deploy_bundle(inventory, deploy) for _ in range(2)]
    for i, (_, elapsed) in enumerate(runs, 1):
        print(f"\nbundle deploy run {i}: {elapsed:.1f}s")
    return runs


def _ssh(host: SandboxHost, command: str) -> subprocess.CompletedProcess[str]:
    return sandbox.ssh(host, command, timeout=60)


@needs_root
@pytest.mark.sandbox
def test_first_deploy_installs(deploy_runs: list[tuple[dict, float]]) -> None:
    results, _ = deploy_runs[0]
    assert results["totals"]["error"] == 0 and not results["failed_hosts"], results
    assert results["totals"]["success"] > 0, results


@needs_root
@pytest.mark.sandbox
@pytest.mark.parametrize("command", ["mpirun --version", "rsync --version",
                                     "python3 -c 'import mpi4py'", "python3 -m venv /tmp/k2-venv"])
def test_tools_work_on_every_host(deploy_runs: list[tuple[dict, float]], sandbox_hosts: list[SandboxHost],
                                  command: str) -> None:
    for host in sandbox_hosts:
        proc = _ssh(host, command)
        assert proc.returncode == 0, (host.name, command, proc.stdout, proc.stderr)


@needs_root
@pytest.mark.sandbox
def test_hosts_still_offline(deploy_runs: list[tuple[dict, float]], sandbox_hosts: list[SandboxHost]) -> None:
    for host in sandbox_hosts:
        proc = _ssh(host, "ip route show default; ip -6 route show default")
        assert proc.returncode == 0 and proc.stdout.strip() == "", (host.name, proc.stdout)


@needs_root
@pytest.mark.sandbox
def test_second_deploy_changes_nothing(deploy_runs: list[tuple[dict, float]]) -> None:
    results, _ = deploy_runs[1]
    changed = {op["name"]: op["success"] for op in results["operations"] if op["success"]}
    assert changed == {}, changed
    assert results["totals"]["success"] == 0 and results["totals"]["error"] == 0, results
    # every package installed: the role plans no operation at all (a settled host gets none)
    assert results["operations"] == [] and deploy_runs[0][0]["operations"], results
