"""Offline apt bundles: every .deb an air-gapped host needs, in one tar.

A bundle is built on the control machine from its own apt lists (same Debian
release as the fleet) and holds the FULL ``Depends`` + ``Pre-Depends`` closure
of the requested packages, with virtual packages and alternatives resolved by
apt's own solver and no Recommends/Suggests.  The closure is resolved against
an *empty* dpkg status, so nothing already installed on the control machine
is assumed present on the hosts; apt on a host skips what it already has.

Tar layout (flat, usable as ``deb [trusted=yes] file:/DIR ./`` once extracted)::

    *.deb            the packages
    Packages         index written by dpkg-scanpackages
    Release          unsigned Release with the index's SHA256
    manifest.json    {"key", "requested", "packages": {name: {version, architecture,
                      filename, sha256}}}

Bundles are cached as ``CACHE_DIR/bundle-<key>.tar`` where ``key`` hashes the
sorted request and the resolved ``name:arch=version`` list, so a rebuild with
the same inputs and the same apt lists reuses the tar without downloading.

With an ``apt_root`` (a :class:`k2fleet.control.aptroot.AptRoot`: a private apt
configuration, e.g. another Debian release plus an extra repository) the
closure is resolved and downloaded against that root's sources instead of the
machine's own, and the key and manifest also hold those sources, so bundles for
different releases or repositories never share a tar.

Usage: ``python -m k2fleet.control.deb_bundles build PKG... [--out DIR]`` prints the tar path.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from email.utils import formatdate
from pathlib import Path
from typing import Protocol

from k2fleet.hostprogs import locks

DEFAULT_CACHE_DIR = Path("/var/cache/k2fleet/bundles")
APT_LISTS_DIR = Path("/var/lib/apt/lists")
# Bump when the bundle's layout changes, to invalidate cached tars.
BUNDLE_FORMAT = 2  # 2: Release dated 0 (byte-reproducible tars), file: sources named by their last directory
KEY_LENGTH = 16
MANIFEST_NAME = "manifest.json"
INDEX_NAME = "Packages"
RELEASE_NAME = "Release"
# tool on PATH -> Debian package providing it
BUILD_TOOLS: dict[str, str] = {"dpkg-scanpackages": "dpkg-dev", "dpkg-deb": "dpkg"}

_INST_RE = re.compile(r"^Inst (?P<name>\S+) (?:\[\S+\] )?\((?P<version>\S+) .*\[(?P<arch>[^\]\s]+)\]\)")
_BUNDLE_NAME_RE = re.compile(r"^bundle-(?P<key>[0-9a-f]+)\.tar$")


class BundleError(RuntimeError):
    """Raised when a bundle cannot be resolved, downloaded or packed."""


@dataclass(frozen=True, order=True)
class ResolvedPackage:
    """One package of a closure, pinned to the version apt chose."""

    name: str
    version: str
    arch: str

    @property
    def spec(self) -> str:
        """``name:arch=version``, as ``apt-get download`` takes it."""
        return f"{self.name}:{self.arch}={self.version}"


class AptSources(Protocol):
    """What a bundle needs from a private apt configuration (:class:`k2fleet.control.aptroot.AptRoot`)."""

    @property
    def sources(self) -> tuple[str, ...]: ...

    @property
    def lists_dir(self) -> Path: ...

    def update(self, force: bool = False) -> bool: ...

    def resolve(self, packages: Iterable[str]) -> list[ResolvedPackage]: ...

    def download(self, resolved: Iterable[ResolvedPackage], dest: Path) -> dict[ResolvedPackage, Path]: ...


# --------------------------------------------------------------------------
# control machine prerequisites


def _run(cmd: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None,
         stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (no shell); raise BundleError with its stderr on failure."""
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=stdout,
                          stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise BundleError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr.strip()}")
    return proc


def _apt_env() -> dict[str, str]:
    return dict(os.environ, DEBIAN_FRONTEND="noninteractive", LC_ALL="C")


def apt_lists_present(lists_dir: Path = APT_LISTS_DIR) -> bool:
    """True if apt has at least one non-empty ``Packages`` list."""
    return any(p.stat().st_size > 0 for p in lists_dir.glob("*_Packages*") if p.is_file())


def ensure_apt_lists() -> None:
    """Run ``apt-get update`` only if the apt lists are missing or empty."""
    if not apt_lists_present():
        _run(["apt-get", "update", "-q"], env=_apt_env())


def ensure_tools() -> None:
    """Install the packages providing the index tools, if missing."""
    missing = sorted({pkg for tool, pkg in BUILD_TOOLS.items() if shutil.which(tool) is None})
    if not missing:
        return
    ensure_apt_lists()
    _run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing], env=_apt_env())


# --------------------------------------------------------------------------
# closure resolution


def _normalize(packages: Iterable[str]) -> list[str]:
    """Sorted, de-duplicated, stripped package names; rejects an empty request."""
    names = sorted({p.strip() for p in packages if p.strip()})
    if not names:
        raise BundleError("no packages requested")
    return names


def parse_simulation(output: str) -> list[ResolvedPackage]:
    """Packages from the ``Inst`` lines of an ``apt-get -s install`` run, sorted."""
    found = {ResolvedPackage(m["name"], m["version"], m["arch"])
             for m in map(_INST_RE.match, output.splitlines()) if m}
    return sorted(found)


def resolve_closure(packages: Iterable[str], env: dict[str, str] | None = None) -> list[ResolvedPackage]:
    """Full Depends/Pre-Depends closure of ``packages``, resolved by apt.

    apt simulates the install against an empty dpkg status, so every dependency
    (essential ones included) is part of the answer, virtual packages and
    alternatives are resolved to concrete packages, and Recommends/Suggests are
    left out.  ``env`` selects another apt configuration (``APT_CONFIG``, see
    :meth:`k2fleet.control.aptroot.AptRoot.env`) whose own dpkg status must be empty: it
    is kept, so apt reuses that configuration's package cache instead of
    rebuilding it (seconds) for a throwaway status.  Without ``env`` the
    machine's own lists are used (fetched once if missing) with a throwaway
    empty status.
    """
    names = _normalize(packages)
    if env is None:
        ensure_apt_lists()
    with tempfile.TemporaryDirectory(prefix="k2fleet-resolve-") as tmp:
        status = Path(tmp) / "status"
        status.touch()
        empty_status = [] if env is not None else [
            "-o", f"Dir::State::status={status}",
            "-o", f"Dir::State::extended_states={Path(tmp) / 'extended_states'}"]
        cmd = ["apt-get", "-s", "-q", *empty_status,
               "-o", "Debug::NoLocking=1", "-o", "APT::Install-Recommends=0",
               "-o", "APT::Install-Suggests=0", "install", *names]
        resolved = parse_simulation(_run(cmd, env=env or _apt_env()).stdout)
    wanted = {n.split("=", 1)[0].split(":", 1)[0] for n in names}
    if not {r.name for r in resolved} >= wanted:
        raise BundleError(f"apt did not resolve all of {names}: got {[r.name for r in resolved]}")
    return resolved


def _lists_signature(lists_dir: Path = APT_LISTS_DIR) -> str:
    """Identity of the apt lists the closure is resolved against (name, size, mtime)."""
    entries = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in lists_dir.glob("*_Packages*"))
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def _memo_resolve(names: list[str], cache_dir: Path, apt_root: AptSources | None = None) -> list[ResolvedPackage]:
    """:func:`resolve_closure`, remembered per request and apt lists state: a no-op
    deploy must not pay apt's solver (seconds) to find the bundle it already has."""
    if apt_root is None:
        inputs: list[object] = [BUNDLE_FORMAT, names, _lists_signature()]
    else:
        inputs = [BUNDLE_FORMAT, names, list(apt_root.sources), _lists_signature(apt_root.lists_dir)]
    key = hashlib.sha256(json.dumps(inputs).encode()).hexdigest()[:24]
    memo = cache_dir / f"resolved-{key}.json"
    if memo.is_file():
        return [ResolvedPackage(**r) for r in json.loads(memo.read_text())]
    resolved = resolve_closure(names) if apt_root is None else apt_root.resolve(names)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps([{"name": r.name, "version": r.version, "arch": r.arch} for r in resolved]))
    tmp.replace(memo)
    return resolved


def stable_sources(sources: Iterable[str]) -> list[str]:
    """Sources as a bundle records them: a local ``file:`` repository by its last directory
    only (its bytes are in the bundle; where a cache kept it must not change the tar).

    >>> stable_sources(["deb [trusted=yes] file:/var/cache/x/repo-ab12 ./", "deb http://d.org/debian trixie main"])
    ['deb [trusted=yes] file:repo-ab12 ./', 'deb http://d.org/debian trixie main']
    """
    return [re.sub(r"file:/\S*/([^/\s]+)", r"file:\1", line) for line in sources]


def bundle_key(packages: Iterable[str], resolved: Iterable[ResolvedPackage],
               sources: Iterable[str] | None = None) -> str:
    """Cache key: hash of the sorted request and the resolved closure, and of the
    apt sources when they are not the machine's own."""
    payload: dict[str, object] = {"format": BUNDLE_FORMAT, "requested": _normalize(packages),
                                  "resolved": sorted(r.spec for r in resolved)}
    if sources is not None:
        payload["sources"] = list(sources)
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    return digest[:KEY_LENGTH]


def bundle_path(key: str, cache_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    """Where the bundle with ``key`` lives in ``cache_dir``."""
    return cache_dir / f"bundle-{key}.tar"


def key_of(tar_path: Path) -> str:
    """The key in a bundle file name ``bundle-<key>.tar``."""
    match = _BUNDLE_NAME_RE.match(tar_path.name)
    if not match:
        raise BundleError(f"not a bundle file name: {tar_path.name}")
    return match["key"]


# --------------------------------------------------------------------------
# building


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _deb_identity(deb: Path) -> tuple[str, str, str]:
    """(Package, Version, Architecture) from a .deb's control file."""
    out = _run(["dpkg-deb", "--showformat=${Package}\\t${Version}\\t${Architecture}", "--show", str(deb)])
    name, version, arch = out.stdout.strip().split("\t")
    return name, version, arch


def pool_filename(pkg: ResolvedPackage) -> str:
    """Debian pool style file name: ``name_version_arch.deb``, epoch dropped.

    ``apt-get download`` writes an epoch's colon as ``%3a``, which apt would
    URL-decode when it reads the file back through a ``file:`` source.
    """
    return f"{pkg.name}_{pkg.version.split(':', 1)[-1]}_{pkg.arch}.deb"


def download(resolved: list[ResolvedPackage], dest: Path,
             env: dict[str, str] | None = None) -> dict[ResolvedPackage, Path]:
    """``apt-get download`` every package into ``dest``; map each to its file.
    ``env`` selects another apt configuration, as for :func:`resolve_closure`."""
    _run(["apt-get", "download", "-q", *(r.spec for r in resolved)], cwd=dest, env=env or _apt_env())
    files: dict[ResolvedPackage, Path] = {}
    for deb in sorted(dest.glob("*.deb")):
        pkg = ResolvedPackage(*_deb_identity(deb))
        files[pkg] = deb.rename(dest / pool_filename(pkg))
    # arch "all" packages are requested as :all and report Architecture: all
    missing = sorted(set(resolved) - set(files))
    if missing:
        raise BundleError(f"downloaded files lack {[r.spec for r in missing]}")
    return files


def write_index(repo: Path, date: float | None = None) -> None:
    """Write the flat repository's ``Packages`` and an unsigned ``Release`` (its Date:
    ``date`` in seconds since the epoch, default now)."""
    with (repo / INDEX_NAME).open("w") as out:
        _run(["dpkg-scanpackages", "--multiversion", ".", "/dev/null"], cwd=repo, stdout=out)
    index = repo / INDEX_NAME
    release = (f"Date: {formatdate(date, usegmt=True)}\n"
               f"SHA256:\n {sha256_file(index)} {index.stat().st_size} {INDEX_NAME}\n")
    (repo / RELEASE_NAME).write_text(release)


def write_manifest(repo: Path, key: str, packages: list[str],
                   files: dict[ResolvedPackage, Path],
                   sources: Iterable[str] | None = None) -> dict[str, object]:
    """Write ``manifest.json`` (package -> version, arch, file, sha256, and the apt
    sources when not the machine's own); return it."""
    manifest: dict[str, object] = {
        "key": key,
        "format": BUNDLE_FORMAT,
        "requested": packages,
        "packages": {
            pkg.name: {"version": pkg.version, "architecture": pkg.arch,
                       "filename": deb.name, "sha256": sha256_file(deb)}
            for pkg, deb in sorted(files.items())
        },
    }
    if sources is not None:
        manifest["sources"] = list(sources)
    (repo / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def _reset(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """Reproducible member metadata: root-owned, mode 0644, epoch mtime."""
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    info.mode = 0o644
    info.mtime = 0
    return info


def pack(repo: Path, tar_path: Path) -> None:
    """Tar the flat files of ``repo`` (sorted) into ``tar_path`` atomically."""
    tar_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tar_path.with_name(f".{tar_path.name}.{os.getpid()}.tmp")
    try:
        with tarfile.open(tmp, "w", format=tarfile.GNU_FORMAT) as tar:
            for path in sorted(repo.iterdir()):
                tar.add(path, arcname=path.name, filter=_reset)
        os.replace(tmp, tar_path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def _locked(cache_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``cache_dir`` (one builder at a time)."""
    with locks.exclusive(cache_dir / ".lock"):
        yield


def build(packages: list[str], resolved: list[ResolvedPackage], tar_path: Path,
          apt_root: AptSources | None = None) -> None:
    """Download ``resolved`` (from ``apt_root`` if given), index it and pack it into ``tar_path``."""
    ensure_tools()
    with tempfile.TemporaryDirectory(prefix="k2fleet-bundle-", dir=tar_path.parent) as tmp:
        repo = Path(tmp)
        files = download(resolved, repo) if apt_root is None else apt_root.download(resolved, repo)
        write_index(repo, date=0)
        write_manifest(repo, key_of(tar_path), packages, files,
                       None if apt_root is None else stable_sources(apt_root.sources))
        pack(repo, tar_path)


def ensure_bundle(packages: list[str], cache_dir: Path = DEFAULT_CACHE_DIR,
                  apt_root: AptSources | None = None) -> Path:
    """Path of the bundle for ``packages``, built only if not cached yet.

    With ``apt_root`` the packages come from that private apt configuration
    (its lists are refreshed only when stale) instead of the machine's own.

    Example::

        tar = ensure_bundle(["openmpi-bin", "rsync"])
        # /var/cache/k2fleet/bundles/bundle-3f1c....tar
        tar = ensure_bundle(["jq"], apt_root=AptRoot(debian_sources("trixie")))
    """
    names = _normalize(packages)
    if apt_root is not None:
        apt_root.update()
    resolved = _memo_resolve(names, cache_dir, apt_root)
    sources = None if apt_root is None else stable_sources(apt_root.sources)
    tar_path = bundle_path(bundle_key(names, resolved, sources), cache_dir)
    with _locked(cache_dir):
        if not tar_path.is_file():
            build(names, resolved, tar_path, apt_root)
    return tar_path


def read_manifest(tar_path: Path) -> dict[str, object]:
    """The ``manifest.json`` inside a bundle tar."""
    with tarfile.open(tar_path) as tar:
        member = tar.extractfile(MANIFEST_NAME)
        if member is None:
            raise BundleError(f"{tar_path} has no {MANIFEST_NAME}")
        return json.load(io.TextIOWrapper(member, encoding="utf-8"))


# --------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None) -> int:
    """CLI: ``build PKG... [--out DIR]`` prints the bundle tar path."""
    parser = argparse.ArgumentParser(prog="k2fleet bundle", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_build = sub.add_parser("build", help="build (or reuse) the bundle for PKG...")
    p_build.add_argument("packages", nargs="+", metavar="PKG")
    p_build.add_argument("--out", type=Path, default=DEFAULT_CACHE_DIR, help="cache directory")
    args = parser.parse_args(argv)
    try:
        print(ensure_bundle(args.packages, args.out))
    except BundleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
