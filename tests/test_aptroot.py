"""Private apt configurations (k2fleet.control.aptroot) on real apt and the real Debian mirror.

A Debian release other than the control machine's own (TARGET_SUITE) is resolved,
downloaded and bundled through an AptRoot, together with an extra local flat
repository holding a TEST DOUBLE package built here with dpkg-deb (it stands in for
NVIDIA's repository, which cannot be reached); the machine's own apt state must not
change.  Roots live in the fixed CACHE dir so re-runs reuse lists and .debs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

from k2fleet.control import aptroot, deb_bundles as bundle
from k2fleet.control.aptroot import AptRoot, AptRootError, debian_sources
from tests.test_bundle import apt_candidates, parse_stanzas, relation_groups

REPO_ROOT = Path(__file__).resolve().parents[1]
TARGET_SUITE = "trixie"  # not the control machine's release (asserted below)
CACHE = Path(os.environ.get("K2FLEET_APTROOT_CACHE", "/var/cache/k2fleet/aptroot"))
DOUBLE_REPO = CACHE / "test-double-repo"
DOUBLE_PACKAGE = "k2fleet-testdouble-fabricmanager"
# dirs of the control machine's own apt state that no AptRoot may touch
MACHINE_APT_DIRS = [Path("/etc/apt"), Path("/var/lib/apt"), Path("/var/cache/apt")]

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (apt)")


# --------------------------------------------------------------------------
# helpers


def tree_state(*roots: Path) -> dict[str, tuple[int, int]]:
    """path -> (size, mtime_ns) of every entry under ``roots`` (dirs included)."""
    state: dict[str, tuple[int, int]] = {}
    for root in roots:
        for path in [root, *root.rglob("*")]:
            try:
                st = path.lstat()
            except FileNotFoundError:
                continue
            state[str(path)] = (st.st_size, st.st_mtime_ns)
    return state


def build_double_deb(work: Path, version: str, depends: str) -> Path:
    """A tiny TEST DOUBLE .deb (arch all) standing in for an NVIDIA fabric package."""
    tree = work / f"{DOUBLE_PACKAGE}_{version}"
    (tree / "DEBIAN").mkdir(parents=True)
    doc = tree / "usr" / "share" / "doc" / DOUBLE_PACKAGE
    doc.mkdir(parents=True)
    (doc / "README").write_text("TEST DOUBLE: stands in for a package of NVIDIA's repository.\n")
    (tree / "DEBIAN" / "control").write_text(
        f"Package: {DOUBLE_PACKAGE}\nVersion: {version}\nArchitecture: all\n"
        f"Maintainer: k2fleet tests <k2fleet@localhost>\nDepends: {depends}\n"
        "Description: TEST DOUBLE of an NVIDIA repository package\n")
    deb = work / f"{DOUBLE_PACKAGE}_{version}_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(tree), str(deb)], check=True,
                   capture_output=True)
    return deb


def make_double_repo(repo: Path, version: str, depends: str = "jq") -> None:
    """(Re)write the flat TEST DOUBLE repository ``repo`` holding one version of DOUBLE_PACKAGE."""
    repo.mkdir(parents=True, exist_ok=True)
    for old in repo.iterdir():
        if old.is_file():
            old.unlink()
    work = repo.parent / f".{repo.name}-build"
    subprocess.run(["rm", "-rf", str(work)], check=True)
    work.mkdir()
    build_double_deb(work, version, depends).rename(repo / f"{DOUBLE_PACKAGE}_{version}_all.deb")
    subprocess.run(["rm", "-rf", str(work)], check=True)
    bundle.ensure_tools()
    bundle.write_index(repo)


def deb_field(deb: Path, field: str) -> str:
    return subprocess.run(["dpkg-deb", "--field", str(deb), field], check=True, capture_output=True,
                          text=True).stdout.strip()


# --------------------------------------------------------------------------
# pure parts


def test_machine_sources_read_deb822_and_one_line(tmp_path: Path) -> None:
    d = tmp_path / "sources.list.d"
    d.mkdir()
    (tmp_path / "sources.list").write_text("# x\ndeb [arch=amd64 signed-by=/k.gpg] http://m/debian bookworm main\n")
    (d / "a.sources").write_text("Types: deb\nURIs: http://m/debian-security\nSuites: bookworm-security\n"
                                 "Components: main\n\nTypes: deb-src\nURIs: http://src\nSuites: bookworm\n\n"
                                 "Types: deb\nEnabled: no\nURIs: http://off\nSuites: trixie\n")
    assert aptroot.machine_sources(tmp_path) == [("http://m/debian", ["bookworm"]),
                                                 ("http://m/debian-security", ["bookworm-security"])]
    assert aptroot.apt_mirror("bookworm", etc_apt=tmp_path) == "http://m/debian"
    assert aptroot.apt_mirror("bookworm-security", security=True, etc_apt=tmp_path) == "http://m/debian-security"
    with pytest.raises(AptRootError):
        aptroot.apt_mirror("trixie", etc_apt=tmp_path)


def test_debian_sources_use_the_machines_own_mirrors() -> None:
    own = aptroot.control_codename()
    assert own != TARGET_SUITE
    mirror = aptroot.apt_mirror(own)
    security = aptroot.apt_mirror(f"{own}-security", security=True)
    assert debian_sources(TARGET_SUITE, components=["main", "contrib"]) == [
        f"deb {mirror} {TARGET_SUITE} main contrib",
        f"deb {mirror} {TARGET_SUITE}-updates main contrib",
        f"deb {security} {TARGET_SUITE}-security main contrib",
    ]


@pytest.mark.parametrize("line", ["deb http://m/debian trixie main\ndeb http://evil/ x main",
                                  "deb-src http://m/debian trixie main", "deb http://m/debian",
                                  "deb http://m/debian trixie main # c"])
def test_source_lines_are_one_deb_entry_each(line: str, tmp_path: Path) -> None:
    with pytest.raises(AptRootError):
        AptRoot([line], cache_dir=tmp_path)


def test_root_key_follows_sources_and_arch(tmp_path: Path) -> None:
    a = AptRoot(["deb http://m/debian trixie main"], cache_dir=tmp_path)
    assert a.path == AptRoot(["deb  http://m/debian trixie  main"], cache_dir=tmp_path).path
    assert a.path != AptRoot(["deb http://m/debian bullseye main"], cache_dir=tmp_path).path
    assert a.path != AptRoot(["deb http://m/debian trixie main"], arch="arm64", cache_dir=tmp_path).path


# --------------------------------------------------------------------------
# a second Debian release, real mirror


@pytest.fixture(scope="module")
def target_root() -> AptRoot:
    root = AptRoot(debian_sources(TARGET_SUITE), cache_dir=CACHE)
    started = time.monotonic()
    ran = root.update()
    print(f"\n{TARGET_SUITE} update ({'ran' if ran else 'fresh, skipped'}): {time.monotonic() - started:.2f}s")
    return root


@needs_root
def test_target_release_versions_differ_from_the_machines(target_root: AptRoot, tmp_path: Path) -> None:
    started = time.monotonic()
    closure = target_root.resolve(["jq"])
    print(f"\nresolve jq for {TARGET_SUITE}: {time.monotonic() - started:.2f}s, {len(closure)} packages")
    by_name = {r.name: r for r in closure}
    assert {"jq", "libjq1", "libonig5", "libc6"} <= set(by_name)
    assert "adduser" not in by_name  # nothing outside the Depends closure (no Recommends)
    own = apt_candidates(["jq", "libjq1"])
    assert by_name["jq"].version != own["jq"] and by_name["libjq1"].version != own["libjq1"]
    # the version is the target release's: apt-cache in the root shows it coming from that suite
    policy = subprocess.run(["apt-cache", "policy", "jq"], env=target_root.env(), capture_output=True,
                            text=True, check=True).stdout
    version = re.escape(by_name["jq"].version)
    assert re.search(rf"^  Candidate: {version}\n(.*\n)*?\s+{version} \d+\n\s+\d+ \S+ {TARGET_SUITE}(-\w+)?/main ",
                     policy, re.M), policy
    started = time.monotonic()
    files = target_root.download(closure, tmp_path / "debs")
    size = sum(f.stat().st_size for f in files.values())
    print(f"download jq closure: {time.monotonic() - started:.2f}s, {size / 1e6:.1f} MB")
    assert set(files) == set(closure)
    info = subprocess.run(["dpkg-deb", "--info", str(files[by_name["jq"]])], capture_output=True, text=True,
                          check=True).stdout
    assert f"Version: {by_name['jq'].version}" in info


@needs_root
def test_second_update_does_no_network(target_root: AptRoot) -> None:
    target_root.update()
    lists_before = tree_state(target_root.lists_dir)
    started = time.monotonic()
    assert target_root.update() is False
    elapsed = time.monotonic() - started
    print(f"\nwarm update (fresh lists): {elapsed * 1000:.1f} ms")
    assert elapsed < 0.5
    assert tree_state(target_root.lists_dir) == lists_before
    # the freshness gate is what skipped it: the same root with a zero max age asks the mirror
    stale = AptRoot(target_root.sources, cache_dir=CACHE, max_age_s=0)
    assert stale.path == target_root.path and stale.update() is True


@needs_root
def test_target_bundle_is_self_contained_and_keyed_by_sources(target_root: AptRoot, tmp_path: Path) -> None:
    cache = tmp_path / "bundles"
    tar = bundle.ensure_bundle(["jq"], cache_dir=cache, apt_root=target_root)
    manifest = bundle.read_manifest(tar)
    closure = target_root.resolve(["jq"])
    assert {n: e["version"] for n, e in manifest["packages"].items()} == {r.name: r.version for r in closure}
    assert manifest["sources"] == list(target_root.sources)
    # every Depends/Pre-Depends group of every bundled package is met inside the bundle
    with tarfile.open(tar) as t:
        t.extractall(tmp_path / "repo", filter="data")
    stanzas = parse_stanzas((tmp_path / "repo" / "Packages").read_text())
    provided = {s["Package"] for s in stanzas} | {g[0] for s in stanzas for g in relation_groups(s.get("Provides", ""))}
    for s in stanzas:
        for field in ("Depends", "Pre-Depends"):
            for group in relation_groups(s.get(field, "")):
                assert set(group) & provided, f"{s['Package']} {field}: {group} not in bundle"
    # apt with the bundle as its only source installs jq from it alone (empty status)
    only_bundle = AptRoot([f"deb [trusted=yes] file:{tmp_path / 'repo'} ./"], cache_dir=tmp_path / "roots", keyrings=())
    assert only_bundle.resolve(["jq"]) == closure
    # a bundle of the same request from the machine's own release is another tar
    own = bundle.ensure_bundle(["jq"], cache_dir=cache)
    assert own != tar and "sources" not in bundle.read_manifest(own)
    assert bundle.read_manifest(own)["packages"]["jq"]["version"] != manifest["packages"]["jq"]["version"]
    # a second call finds the tar without apt's solver or a download
    started = time.monotonic()
    assert bundle.ensure_bundle(["jq"], cache_dir=cache, apt_root=target_root) == tar
    assert time.monotonic() - started < 0.5


@needs_root
def test_release_signatures_are_checked(tmp_path: Path) -> None:
    """Without the Debian archive keyring in the root, the mirror's InRelease is refused."""
    unkeyed = AptRoot(debian_sources(TARGET_SUITE)[:1], cache_dir=tmp_path, keyrings=())
    with pytest.raises(AptRootError, match="NO_PUBKEY|not signed"):
        unkeyed.update()


@needs_root
def test_cli_resolves_for_a_suite() -> None:
    proc = subprocess.run([sys.executable, "-m", "k2fleet.control.aptroot", "resolve", "jq", "--suite", TARGET_SUITE,
                           "--cache", str(CACHE)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert proc.returncode == 0, proc.stderr
    root = AptRoot(debian_sources(TARGET_SUITE), cache_dir=CACHE)
    assert proc.stdout.split() == [r.spec for r in root.resolve(["jq"])]


# --------------------------------------------------------------------------
# an extra repository next to the OS archive


@needs_root
def test_extra_flat_repo_resolves_with_the_os_archive(target_root: AptRoot) -> None:
    make_double_repo(DOUBLE_REPO, "550.54-1")
    root = AptRoot([*debian_sources(TARGET_SUITE), f"deb [trusted=yes] file:{DOUBLE_REPO} ./"], cache_dir=CACHE)
    closure = root.resolve([f"{DOUBLE_PACKAGE}=550*"])
    by_name = {r.name: r for r in closure}
    assert by_name[DOUBLE_PACKAGE].version == "550.54-1"
    jq = by_name["jq"]  # the double's dependency, from the Debian archive of the target release
    assert jq in target_root.resolve(["jq"])
    files = root.download(closure, DOUBLE_REPO.parent / ".double-download")
    assert deb_field(files[by_name[DOUBLE_PACKAGE]], "Depends") == "jq"
    assert deb_field(files[jq], "Version") == jq.version
    # a new index in the file: repository is seen by the next update, fresh lists or not
    make_double_repo(DOUBLE_REPO, "550.90-1")
    assert root.update() is True
    newer = {r.name: r for r in root.resolve([DOUBLE_PACKAGE])}[DOUBLE_PACKAGE]
    assert newer.version == "550.90-1"
    first = root.download([newer], DOUBLE_REPO.parent / ".double-download")
    assert deb_field(first[newer], "Depends") == "jq"
    # a .deb rebuilt under the same name and version is not served from the pool
    make_double_repo(DOUBLE_REPO, "550.90-1", depends="jq, rsync")
    root.update()
    redone = root.download([newer], DOUBLE_REPO.parent / ".double-download")
    assert deb_field(redone[newer], "Depends") == "jq, rsync"


# --------------------------------------------------------------------------
# isolation and locking (cold root in a temp dir)


@needs_root
def test_cold_roots_leave_the_machines_apt_state_alone(tmp_path: Path) -> None:
    before = tree_state(*MACHINE_APT_DIRS)
    roots = [AptRoot(debian_sources(TARGET_SUITE), cache_dir=tmp_path) for _ in range(2)]
    ran: list[bool] = []
    started = time.monotonic()
    threads = [threading.Thread(target=lambda r=r: ran.append(r.update())) for r in roots]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"\ncold {TARGET_SUITE} update (two builders at once): {time.monotonic() - started:.2f}s")
    assert sorted(ran) == [False, True]  # the lock made the second builder reuse the first's lists
    closure = roots[0].resolve(["rsync"])
    roots[1].download(closure, tmp_path / "debs")
    assert tree_state(*MACHINE_APT_DIRS) == before
