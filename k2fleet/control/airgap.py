"""Air-gapped bundles: ``k2fleet bundle INVENTORY --out DIR`` and ``k2_bundle: DIR``.

On a connected control machine, :func:`make_bundle` gathers everything the
inventory's fleet needs into ``DIR``, for the fleet hosts' OS release and CPU
architecture (not the control machine's):

- ``debs/bundle-<key>.tar`` per host package set: the full Depends closure of the host
  packages and the bootstrap stack (driver, fabric, Docker, RDMA), resolved against the
  hosts' release with a private apt configuration (:class:`k2fleet.control.aptroot.AptRoot`:
  the release's archive plus NVIDIA's / AMD's repository, or, for simulated GPUs, the
  TEST DOUBLE repository);
- ``wheels/<key>/`` per wheel set: for venv runtimes the engine at its pin with Ray, the
  router and what otherwise downloads at run time, for the hosts' Python and arch
  (``--rehearsal``: the engine TEST DOUBLE wheel in the engine's place); the Hub client
  for a ``k2_checkpoint_fetcher`` host;
- ``images/*.tar.gz``: the container image, ``docker save`` d and pinned by image ID
  (``--rehearsal``: the engine TEST DOUBLE image);
- ``checkpoint/<org>--<name>/<revision>/`` with ``.k2fleet/manifest.json`` when the
  inventory's source is the Hub fetched by the control machine (``--rehearsal``: the
  synthetic checkpoint of the inventory's model and revision);
- ``engine-cache/<engine>.tar.gz`` with ``--engine-cache SRC``: an operator's warmed copy of
  the engine's compile/JIT cache directory (:mod:`k2fleet.planning.engine_cache`), archived
  deterministically with links refused and sizes capped (:mod:`k2fleet.hostprogs.cache_archive`);
  a later build without ``--engine-cache`` keeps the bundle's archive (``--no-engine-cache``
  drops it);
- ``k2fleet.lock`` (:mod:`k2fleet.control.lockfile`): every artifact with name, version, sha256
  (images also their ID) and origin.

Re-running fetches only what changed (apt, pip and image caches; files already in DIR
with the right sha256 are not copied again). ``--locked LOCK`` rebuilds and fails naming
every artifact that drifted from LOCK.

With ``k2_bundle: DIR`` in the inventory, :func:`read_bundle` is the deploy's only
source of packages, wheels and images (nothing is fetched, by the control machine or
any host): each artifact is hashed as it is read and a file whose sha256 is not the
lock's is refused by name. The engine cache's archive goes to each host that runs the
engine, where the deploy unpacks it (its sha256 checked against the lock again, on the host)
only into an absent or empty cache directory.
"""

from __future__ import annotations

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
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k2fleet.hostprogs import cache_archive
from k2fleet.planning.engine_side import host_python
from k2fleet.control import aptroot, deb_bundles as bundle, wheelhouse
from k2fleet.planning.host_bootstrap import Repo
from k2fleet.control.deb_bundles import sha256_file
from k2fleet.planning.os_tables import MIRROR_LAYOUTS, OS_TABLES
from k2fleet.planning import engine_cache, gpu_exporter, mirrors
from k2fleet.planning.deployment import Deployment
from k2fleet.planning.desired import (bundle_request, engine_requirements, host_arch, host_bootstrap,
                             package_set)
from k2fleet.control.lockfile import LOCK_NAME, Artifact, Lock, LockError, drift
from k2fleet.control.stand_ins import engine_doubles_for, stand_ins
from k2fleet.planning.processes import Plan

DEFAULT_CACHE = Path("/var/cache/k2fleet")
DEB_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}
UBUNTU_KEYRING = Path("/usr/share/keyrings/ubuntu-archive-keyring.gpg")  # Debian package ubuntu-keyring
UBUNTU_MIRROR = "http://archive.ubuntu.com/ubuntu"
UBUNTU_PORTS = "http://ports.ubuntu.com/ubuntu-ports"
CHECKPOINT_DIR = "checkpoint"
ENGINE_CACHE_DIR = "engine-cache"
PART_KINDS = {"debs": ("deb", "deb-repo"), "wheels": ("wheel",), "images": ("image",),
              "checkpoints": ("checkpoint-manifest", "checkpoint-file"),
              "engine_caches": ("engine-cache",)}  # bundle part → its artifacts' kinds
BUILT_PARTS = ("debs", "wheels", "images", "checkpoints")  # what a build makes from the inventory (--only)
Say = Callable[[str], None]


class AirgapError(RuntimeError):
    """A bundle cannot be made or used; the message names what and the fix."""


@dataclass(frozen=True)
class Caches:
    """Where a bundle build keeps what it downloaded or built, for the next build."""

    root: Path = DEFAULT_CACHE

    @property
    def debs(self) -> Path:
        return self.root / "bundles"

    @property
    def apt(self) -> Path:
        return self.root / "aptroot"

    @property
    def wheels(self) -> Path:
        return self.root / "wheelhouses"

    @property
    def images(self) -> Path:
        return self.root / "images"

    @property
    def doubles(self) -> Path:
        return self.root / "nvidia-doubles"

    @property
    def keyrings(self) -> Path:
        return self.root / "keyrings"


# ----------------------------------------------------------------------------- what the fleet needs (pure)


@dataclass(frozen=True)
class WheelSet:
    """One wheelhouse: ``use`` (engine | hub), the pins, Pythons and architectures."""

    use: str
    requirements: tuple[str, ...]
    pythons: tuple[str, ...]
    archs: tuple[str, ...]

    @property
    def key(self) -> str:
        return wheelhouse.wheelhouse_key(list(self.requirements), self.pythons, self.archs)


@dataclass(frozen=True)
class DebSet:
    """One host package set, for one OS release and architecture (``vendors``: GPU
    repositories its packages need; ``simulated``: the TEST DOUBLE repository's)."""

    os: str
    arch: str
    packages: tuple[str, ...]
    repos: tuple[Repo, ...]
    simulated: bool
    os_mirror: str | None = None  # k2_os_mirror: the distribution's archive is read there
    os_keyring: str | None = None  # k2_os_mirror_keyring (None: the distribution's own key)
    os_security_mirror: str | None = None  # k2_os_security_mirror: Debian's security archive, read there
    # a vendor repository at a mirror (k2_nvidia_repo, k2_container_toolkit_repo, ...): its name → its
    # control-machine keyring (k2fleet.planning.mirrors.repo_keyrings)
    mirror_keyrings: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Needs:
    """Everything a fleet's bundle holds, computed from the deployment and plan (pure)."""

    debs: tuple[DebSet, ...]
    wheels: tuple[WheelSet, ...]
    images: tuple[str, ...]  # refs
    checkpoints: tuple[tuple[str, str, tuple[str, ...] | None], ...]  # (repo, revision, patterns)


def bundle_needs(dep: Deployment, plan: Plan) -> Needs:
    """What ``k2fleet bundle`` gathers for this deployment (pure: connects to nothing).

    Host package sets are per host (role and bootstrap); engine wheels per host venv; the
    Hub client for a fetcher host; images for container runtimes; the checkpoint when the
    Hub is the source and the control machine fetches it."""
    debs, wheels = set(), set()
    doubles = engine_doubles_for(dep)
    for h in dep.fleet.hosts:
        hp = plan.hosts[h.name]
        boot = host_bootstrap(dep, hp, h)
        names = package_set(bundle_request(dep, plan, hp, boot))
        if names:
            debs.add(DebSet(boot.os, DEB_ARCH[host_arch(dep)], names, tuple(boot.repos), dep.s.simulated_gpus,
                            dep.s.os_mirror, dep.s.os_mirror_keyring, dep.s.os_security_mirror,
                            tuple(sorted(mirrors.repo_keyrings(dep.s).items()))))
        reqs = engine_requirements(dep, hp, True, doubles)
        if reqs:
            wheels.add(WheelSet("engine", tuple(reqs), (host_python(boot.os),), (host_arch(dep),)))
    if dep.s.checkpoint_fetcher not in ("control", "auto"):  # an air-gapped bundle: auto is the control copy
        wheels.add(WheelSet("hub", (wheelhouse.hub_client_requirement(),), wheelhouse.PYTHONS, tuple(wheelhouse.PLATFORMS)))
    images = (dep.image,) if dep.runtime == "container" and dep.image else ()
    if any(gpu_exporter.runs_on(dep, hp.role) for hp in plan.hosts.values()):
        images += (dep.s.gpu_exporter_image,)  # k2_gpu_exporter: dcgm-exporter's image
    checkpoints = tuple((ws.repo, ws.revision, ws.patterns) for ws in dep.weight_sets
                        if ws.source == "hub" and dep.s.checkpoint_fetcher in ("control", "auto"))
    return Needs(tuple(sorted(debs, key=repr)), tuple(sorted(wheels, key=repr)), images, checkpoints)


def engine_cache_rel(engine: str) -> str:
    """Where an engine's cache archive sits in a bundle.

    >>> engine_cache_rel("vllm")
    'engine-cache/vllm.tar.gz'
    """
    return f"{ENGINE_CACHE_DIR}/{engine}.tar.gz"


def checkpoint_rel(repo: str, revision: str) -> str:
    """Where a checkpoint sits in a bundle.

    >>> checkpoint_rel("moonshotai/Kimi-K2-Thinking", "a" * 40)[:40]
    'checkpoint/moonshotai--Kimi-K2-Thinking/'
    """
    return f"{CHECKPOINT_DIR}/{repo.replace('/', '--')}/{revision}"


# ----------------------------------------------------------------------------- building (control-machine effects)


def _os_sources(os_name: str, arch: str, mirror: str | None = None, keyring: str | None = None,
                security_mirror: str | None = None) -> tuple[list[str], list[Path]]:
    """Archive sources and keyrings of a target OS release: at ``mirror`` (``k2_os_mirror``, its
    suites and components from the OS table's mirror layout, checked with ``keyring`` or the
    distribution's own key; Debian's security suite at ``security_mirror``,
    ``k2_os_security_mirror``), else the distribution's own archive."""
    table = OS_TABLES[os_name]
    if table.manager != "apt":
        raise AirgapError(f"k2_os {os_name}: `k2fleet bundle` makes apt repositories; {os_name} (dnf) bundles "
                          "are not supported yet (use k2_package_source: apt with a local mirror)")
    components = table.components.split()
    if mirror:
        layout = MIRROR_LAYOUTS[os_name]
        key = Path(keyring) if keyring else (aptroot.DEBIAN_KEYRING if os_name.startswith("debian") else UBUNTU_KEYRING)
        return [f"deb {url} {suite} {layout.components}"
                for url, suites in mirrors.os_archives(mirror, security_mirror, layout) for suite in suites], [key]
    if os_name.startswith("debian"):
        return aptroot.debian_sources(table.codename, components=components), [aptroot.DEBIAN_KEYRING]
    if not UBUNTU_KEYRING.is_file():
        raise AirgapError(f"k2_os {os_name}: {UBUNTU_KEYRING} is missing on the control machine; "
                          "install Debian's ubuntu-keyring package")
    mirror = UBUNTU_MIRROR if arch == "amd64" else UBUNTU_PORTS
    pockets = ["{c}", "{c}-updates", "{c}-security"]
    return ([f"deb {mirror} {p.format(c=table.codename)} main universe" for p in pockets], [UBUNTU_KEYRING])


def _fetch(url: str, dest: Path) -> Path:
    """Download ``url`` to ``dest`` once (a control-machine effect; only when building)."""
    import urllib.request  # only when a bundle is made (a settled k2_bundle run reads one)

    if not dest.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
        try:
            with urllib.request.urlopen(url, timeout=60) as resp, tmp.open("wb") as out:
                shutil.copyfileobj(resp, out)
        except OSError as exc:
            raise AirgapError(f"could not fetch {url}: {exc}") from None
        tmp.replace(dest)
    return dest


def _vendor_sources(repos: Iterable[Repo], arch: str, caches: Caches,
                    mirror_keyrings: dict[str, str] | None = None) -> tuple[list[str], list[Path]]:
    """apt sources + keyrings for NVIDIA's / AMD's repositories of a real fleet (those at a
    mirror, ``k2_nvidia_repo`` or ``k2_container_toolkit_repo`` with its keyring: a
    ``k2fleet-file`` repository, flat)."""
    sources, keyrings = [], []
    for repo in repos:
        if repo.kind == "k2fleet-file" and (mirror_keyrings or {}).get(repo.name):  # a flat repository at the mirror
            sources.append(f"deb {repo.source} /")
            keyrings.append(Path((mirror_keyrings or {})[repo.name]))
        elif repo.kind == "apt-keyring-deb":  # NVIDIA's CUDA repository: its keyring ships as a .deb beside it
            deb = _fetch(repo.source, caches.keyrings / Path(repo.source).name)
            out = caches.keyrings / f"{repo.name}-{sha256_file(deb)[:12]}"
            if not out.is_dir():
                bundle._run(["dpkg-deb", "-x", str(deb), str(out)])
            keyrings += sorted(out.glob("usr/share/keyrings/*.gpg"))
            sources.append(f"deb {repo.source.rsplit('/', 1)[0]}/ /")
        elif repo.kind == "apt":
            armored = _fetch(repo.key or "", caches.keyrings / f"{repo.name}.asc")
            keyring = caches.keyrings / f"{repo.name}.gpg"
            if not keyring.is_file():
                bundle._run(["gpg", "--batch", "--yes", "--dearmor", "-o", str(keyring), str(armored)])
            keyrings.append(keyring)
            line = repo.source.replace("$(ARCH)", arch)
            sources.append(line if line.startswith("deb ") else f"deb {line}")
        else:
            raise AirgapError(f"repository {repo.name} ({repo.kind}) cannot go into an apt bundle")
    return sources, keyrings


def _apt_root(deb: DebSet, caches: Caches) -> aptroot.AptRoot:
    sources, keyrings = _os_sources(deb.os, deb.arch, deb.os_mirror, deb.os_keyring, deb.os_security_mirror)
    if deb.simulated:
        if any(r.kind != "test-double" for r in deb.repos):
            raise AirgapError("simulated GPUs take their driver stack from the TEST DOUBLE repository only")
        if deb.repos:
            sources.append(f"deb [trusted=yes] file:{stand_ins().driver_repo(caches.doubles)} ./")
    else:
        more, keys = _vendor_sources(deb.repos, deb.arch, caches, dict(deb.mirror_keyrings))
        sources, keyrings = sources + more, keyrings + keys
    return aptroot.AptRoot(sources, arch=deb.arch, cache_dir=caches.apt, keyrings=keyrings)


def _place(src: Path, dest: Path) -> tuple[bool, str]:
    """Put ``src`` at ``dest`` unless an identical file is there; (copied?, its sha256)."""
    digest = sha256_file(src)
    if dest.is_file() and dest.stat().st_size == src.stat().st_size and sha256_file(dest) == digest:
        return False, digest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
    shutil.copyfile(src, tmp)
    tmp.replace(dest)
    return True, digest


def _place_bytes(data: bytes, dest: Path) -> tuple[bool, str]:
    digest = hashlib.sha256(data).hexdigest()
    if dest.is_file() and dest.read_bytes() == data:
        return False, digest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(dest)
    return True, digest


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


class _Builder:
    """One ``k2fleet bundle`` run: places artifacts in ``out`` and records them."""

    def __init__(self, out: Path, caches: Caches, say: Say, index: str | None = None) -> None:
        self.out, self.caches, self.say = out, caches, say
        self.index = index  # k2_pypi_index (None: pip's own configuration)
        self.artifacts: list[Artifact] = []
        self.parts: dict[str, list[dict[str, Any]]] = {part: [] for part in PART_KINDS}
        self.copied = self.kept = 0

    def add(self, rel: str, src: Path | bytes, kind: str, name: str, version: str, origin: str, **extra: str) -> None:
        dest = self.out / rel
        changed, digest = _place_bytes(src, dest) if isinstance(src, bytes) else _place(src, dest)
        self.copied, self.kept = self.copied + changed, self.kept + (not changed)
        self.artifacts.append(Artifact(rel, kind, name, version, digest, dest.stat().st_size, origin, **extra))

    def debs(self, deb: DebSet) -> None:
        t0 = time.monotonic()
        self.say(f"debs: {deb.os} {deb.arch}: resolving {len(deb.packages)} packages and their closure")
        root = _apt_root(deb, self.caches)
        tar = bundle.ensure_bundle(list(deb.packages), self.caches.debs, apt_root=root)
        rel = f"debs/{tar.name}"
        manifest = bundle.read_manifest(tar)
        origin = " | ".join(manifest.get("sources", []))
        self.add(rel, tar, "deb-repo", tar.stem, str(manifest["key"]), origin)
        for name, info in sorted(manifest["packages"].items()):
            self.artifacts.append(Artifact(f"{rel}!{info['filename']}", "deb", f"{name}:{info['architecture']}",
                                           info["version"], info["sha256"], 0, origin, inside=rel))
        self.parts["debs"].append({"os": deb.os, "arch": deb.arch, "packages": list(deb.packages), "path": rel})
        self.say(f"debs: {deb.os} {deb.arch}: {len(manifest['packages'])} packages, "
                 f"{_size(tar.stat().st_size)} ({time.monotonic() - t0:.0f}s)")

    def wheels(self, ws: WheelSet, rehearsal: bool, constraints: list[str]) -> None:
        t0 = time.monotonic()
        project = stand_ins().engine_project if rehearsal else None
        double = [r for r in ws.requirements if project and r.startswith(f"{project}==")]
        fetched = [r for r in ws.requirements if r not in double]
        self.say(f"wheels ({ws.use}): {' '.join(ws.requirements)} for CPython {','.join(ws.pythons)} "
                 f"{','.join(ws.archs)}: downloading what is not cached")
        rel_dir = f"wheels/{ws.key}"
        if fetched:
            house = wheelhouse.ensure_wheelhouse(fetched, self.caches.wheels, ws.pythons, ws.archs,
                                                 constraints=constraints, progress=self.say, index=self.index)
            origin = f"pypi:{' '.join(fetched)} (pip download, {wheelhouse.index_url(self.index)})"
            for whl in sorted(house.glob("*.whl")):
                name, version = wheelhouse.wheel_name_version(whl.name)
                self.add(f"{rel_dir}/{whl.name}", whl, "wheel", name, version, origin)
        if double:
            name, data, version = stand_ins().engine_wheel()
            self.add(f"{rel_dir}/{name}", data, "wheel", project, version, "k2fleet (engine TEST DOUBLES, k2sandbox)")
        self.parts["wheels"].append({"use": ws.use, "requirements": list(ws.requirements), "pythons": list(ws.pythons),
                                     "archs": list(ws.archs), "path": rel_dir})
        total = sum(a.bytes for a in self.artifacts if a.path.startswith(rel_dir + "/"))
        count = sum(1 for a in self.artifacts if a.path.startswith(rel_dir + "/"))
        self.say(f"wheels ({ws.use}): {count} wheels, {_size(total)} ({time.monotonic() - t0:.0f}s)")

    def image(self, dep: Deployment, plan: Plan, ref: str, rehearsal: bool) -> None:
        t0 = time.monotonic()
        exporter = ref == dep.s.gpu_exporter_image and ref != dep.image
        if rehearsal and exporter:
            made = stand_ins().gpu_exporter_image(ref, build=True, cache=self.caches.images)
            assert made is not None
            (path, image_id), origin = made, "k2fleet (dcgm-exporter TEST DOUBLE image)"
        elif rehearsal:
            made = stand_ins().image(ref, plan, build=True, cache=self.caches.images)
            assert made is not None
            (path, image_id), origin = made, "k2fleet (engine TEST DOUBLE image)"
        else:
            path, image_id = save_image(ref, pinned_id(dep, ref), self.caches.images, self.say)
            origin = f"docker pull {ref}; docker save"
        rel = f"images/{path.name}"
        self.add(rel, path, "image", ref, image_id, origin, image_id=image_id)
        self.parts["images"].append({"ref": ref, "image_id": image_id, "path": rel})
        self.say(f"image: {ref} {image_id[:19]}…, {_size(path.stat().st_size)} ({time.monotonic() - t0:.0f}s)")

    def checkpoint(self, dep: Deployment, repo: str, revision: str, patterns: tuple[str, ...] | None,
                   rehearsal: bool) -> None:
        from k2fleet.hostprogs.manifest import manifest_path
        from k2fleet.hostprogs.verify import load_manifest

        t0 = time.monotonic()
        rel = checkpoint_rel(repo, revision)
        dest = self.out / rel
        if rehearsal:
            provider = stand_ins()
            src = (provider.checkpoint(repo, revision) if repo == dep.s.model
                   else provider.gguf(repo, revision, dep.s.gguf_pattern))
            for path in sorted(p for p in Path(src).rglob("*") if p.is_file() and ".k2fleet" not in
                               p.relative_to(src).parts[:1] or p.name == "manifest.json"):
                _place(path, dest / path.relative_to(src))
            origin = "k2fleet (synthetic checkpoint for rehearsals)"
        else:
            from k2fleet.control.checkpoint_copy import prepare_control_copy

            self.say(f"checkpoint: {repo}@{revision}: downloading into {dest} (resumable)")
            prepare_control_copy(repo, revision, str(dest), hub=True, endpoint=dep.s.hub_endpoint,
                                 token_file=dep.s.hub_token_file, patterns=list(patterns) if patterns else None)
            origin = f"hub:{repo}@{revision}"
        mpath = manifest_path(dest)
        manifest = load_manifest(str(mpath))
        self.add(str(mpath.relative_to(self.out)), mpath, "checkpoint-manifest", repo, revision, origin)
        for name, entry in sorted(manifest["files"].items()):
            # LFS files: the Hub's sha256 (the download verified it); small git files carry only a
            # git blob sha1 in the manifest, so their sha256 is read from the bundle's copy
            digest = entry.get("sha256") or sha256_file(dest / name)
            self.artifacts.append(Artifact(f"{rel}/{name}", "checkpoint-file", f"{repo}/{name}", revision,
                                           str(digest), int(entry.get("size") or 0), origin))
        self.parts["checkpoints"].append({"repo": repo, "revision": revision,
                                          "patterns": list(patterns) if patterns else None, "path": rel})
        total = sum(int(e.get("size") or 0) for e in manifest["files"].values())
        self.say(f"checkpoint: {repo}@{revision[:12]}: {len(manifest['files'])} files, {_size(total)} "
                 f"({time.monotonic() - t0:.0f}s)")

    def engine_cache(self, dep: Deployment, src: Path) -> None:
        """``--engine-cache SRC``: ``SRC`` archived (:func:`k2fleet.hostprogs.cache_archive.pack`)
        as ``engine-cache/<engine>.tar.gz``; AirgapError naming the entry that breaks a rule."""
        t0 = time.monotonic()
        rel = engine_cache_rel(dep.engine)
        dest = self.out / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
        self.say(f"engine cache: archiving {src} for {dep.engine} (links refused, at most "
                 f"{_size(cache_archive.MAX_TOTAL_BYTES)})")
        try:
            with tmp.open("wb") as out:
                files, total = cache_archive.pack(str(src), out, allowed_top=engine_cache.cache_subdirs(dep.engine))
            digest = sha256_file(tmp)
            same = dest.is_file() and sha256_file(dest) == digest  # deterministic: an unchanged SRC, unchanged bytes
            if not same:
                tmp.replace(dest)
            self.copied, self.kept = self.copied + (not same), self.kept + same
            self.artifacts.append(Artifact(rel, "engine-cache", dep.engine, dep.version, digest, dest.stat().st_size,
                                           f"k2fleet bundle --engine-cache {src}"))
        except (cache_archive.CacheArchiveError, OSError) as exc:
            raise AirgapError(f"--engine-cache: {exc}") from None
        finally:
            tmp.unlink(missing_ok=True)
        self.parts["engine_caches"].append({"engine": dep.engine, "files": files, "bytes": total, "path": rel})
        self.say(f"engine cache: {dep.engine}: {files} files, {_size(total)} → {_size(dest.stat().st_size)} "
                 f"({time.monotonic() - t0:.0f}s)")

    def keep_engine_cache(self, dep: Deployment, previous: Lock) -> None:
        """No ``--engine-cache``: the previous build's archive stays when it is this engine's and
        still has the lock's sha256 (otherwise it is dropped, said)."""
        for part in previous.part("engine_caches"):
            entry = previous.by_path().get(part.get("path", ""))
            path = self.out / str(part.get("path", ""))
            if part.get("engine") != dep.engine:
                self.say(f"engine cache: dropped {part.get('path')} ({part.get('engine')}'s; the fleet runs {dep.engine})")
            elif entry is None or not path.is_file() or sha256_file(path) != entry.sha256:
                self.say(f"engine cache: dropped {path}: missing or not the lock's sha256")
            else:
                self.parts["engine_caches"].append(part)
                self.artifacts.append(entry)
                self.kept += 1
                self.say(f"engine cache: kept {path} ({entry.origin}; --no-engine-cache drops it)")

    def remove_stale(self) -> int:
        """Delete files of ``out`` no artifact names (a previous build's), except the
        checkpoint role's own records under ``.k2fleet``; return how many."""
        keep = {self.out / LOCK_NAME} | {self.out / a.path for a in self.artifacts if not a.inside}
        removed = 0
        for path in sorted(self.out.rglob("*")):
            if path.is_file() and path not in keep and ".k2fleet" not in path.relative_to(self.out).parts:
                path.unlink()
                removed += 1
        return removed


def pinned_id(dep: Deployment, ref: str) -> str | None:
    """The image ID the inventory pins ``ref`` to: ``k2_image_id`` for the engine's image,
    ``k2_gpu_exporter_image_id`` for dcgm-exporter's (None: not pinned)."""
    if ref == dep.image:
        return dep.s.image_id
    return dep.s.gpu_exporter_image_id if ref == dep.s.gpu_exporter_image else None


def save_image(ref: str, image_id: str | None, cache: Path, say: Say) -> tuple[Path, str]:
    """``docker pull`` ``ref`` (refused if it is not ``image_id``) and ``docker save`` it,
    gzipped, into ``cache`` once per image ID; (archive, image ID)."""
    docker = shutil.which("docker")
    if docker is None:
        raise AirgapError(f"image {ref}: docker is not installed on this control machine (needed to pull and save it)")
    say(f"image: docker pull {ref}")
    pulled = subprocess.run([docker, "pull", ref], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if pulled.returncode:
        raise AirgapError(f"image {ref}: docker pull failed: {pulled.stderr.strip()[-500:]}")
    got = subprocess.run([docker, "image", "inspect", "--format", "{{.Id}}", ref], capture_output=True, text=True,
                         check=True).stdout.strip()
    if image_id and got != image_id:
        raise AirgapError(f"image {ref} is {got}, not the pinned image ID {image_id} (k2_image_id or "
                          "k2_gpu_exporter_image_id); fix the ID or the reference")
    path = cache / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', ref)}-{got.split(':')[-1][:16]}.tar.gz"
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        with tmp.open("wb") as out:
            save = subprocess.Popen([docker, "save", ref], stdout=subprocess.PIPE)
            gz = subprocess.run(["gzip", "-n", "-6"], stdin=save.stdout, stdout=out)
            if save.wait() or gz.returncode:
                raise AirgapError(f"image {ref}: docker save failed")
        tmp.replace(path)
    return path, got


def make_bundle(dep: Deployment, plan: Plan, out: Path, *, inventory: str, rehearsal: bool,
                locked: Lock | None = None, caches: Caches = Caches(), only: Iterable[str] = (),
                engine_cache_src: Path | None = None, drop_engine_cache: bool = False,
                say: Say = print) -> tuple[Lock, list[str]]:
    """Build (or bring up to date) the bundle ``out`` for ``dep``; write ``out/k2fleet.lock``.

    ``locked``: the lock to reproduce (wheels resolved with its versions as constraints);
    returns (the new lock, what drifted from ``locked``; empty when identical).
    ``only``: build just these parts (debs, wheels, images, checkpoints); the others stay.
    ``engine_cache_src``: an operator's warmed engine cache directory to archive into the
    bundle; without it the bundle's previous archive stays unless ``drop_engine_cache``.
    """
    needs = bundle_needs(dep, plan)
    wanted = set(only) or set(BUILT_PARTS)
    if engine_cache_src is not None or drop_engine_cache:
        wanted.add("engine_caches")
    out.mkdir(parents=True, exist_ok=True)
    b = _Builder(out, caches, say, index=dep.s.pypi_index)
    t0 = time.monotonic()
    constraints = sorted({f"{a.name}=={a.version}" for a in (locked.artifacts if locked else ())
                          if a.kind == "wheel" and a.origin.startswith("pypi:")})
    try:
        for deb in needs.debs if "debs" in wanted else ():
            b.debs(deb)
        for ws in needs.wheels if "wheels" in wanted else ():
            b.wheels(ws, rehearsal, constraints)
        for ref in needs.images if "images" in wanted else ():
            b.image(dep, plan, ref, rehearsal)
        for repo, revision, patterns in needs.checkpoints if "checkpoints" in wanted else ():
            b.checkpoint(dep, repo, revision, patterns, rehearsal)
        if engine_cache_src is not None:
            b.engine_cache(dep, engine_cache_src)
    except (bundle.BundleError, RuntimeError) as exc:
        raise AirgapError(str(exc)) from None
    if wanted != set(PART_KINDS) and (out / LOCK_NAME).is_file():  # --only: the other parts stay as they were
        try:
            previous = Lock.from_text((out / LOCK_NAME).read_text())
        except LockError:
            previous = None
        for part in sorted(set(PART_KINDS) - wanted) if previous else ():
            assert previous is not None
            if part == "engine_caches":  # checked: this engine's, its bytes the lock's
                b.keep_engine_cache(dep, previous)
                continue
            b.parts[part] = previous.part(part)
            b.artifacts += [a for a in previous.artifacts if a.kind in PART_KINDS[part]]
    lock = Lock(inventory, rehearsal, b.parts, tuple(sorted(b.artifacts)))
    removed = b.remove_stale()
    text = lock.to_text()
    if not (out / LOCK_NAME).is_file() or (out / LOCK_NAME).read_text() != text:
        _place_bytes(text.encode(), out / LOCK_NAME)
    files = [a for a in lock.artifacts if not a.inside]
    say(f"bundle {out}: {len(lock.artifacts)} artifacts in {len(files)} files, "
        f"{_size(sum(a.bytes for a in lock.artifacts if not a.inside))}; copied {b.copied}, unchanged {b.kept}, "
        f"removed {removed} stale ({time.monotonic() - t0:.0f}s)")
    return lock, drift(locked, lock) if locked is not None else []


# ----------------------------------------------------------------------------- using a bundle (k2_bundle)


def read_lock(bundle_dir: str | Path) -> Lock:
    """``DIR/k2fleet.lock``, parsed (AirgapError naming the fix when absent or unreadable)."""
    path = Path(bundle_dir) / LOCK_NAME
    try:
        return Lock.from_text(path.read_text())
    except FileNotFoundError:
        raise AirgapError(f"{path} does not exist; make the bundle with `k2fleet bundle INVENTORY --out {bundle_dir}`") from None
    except (OSError, LockError) as exc:
        raise AirgapError(f"{path} cannot be read: {exc}") from None


def verified(bundle_dir: Path, rel: str, lock: Lock) -> Path:
    """``bundle_dir/rel`` after checking its sha256 against the lock (AirgapError naming
    the file, and for a .deb tar the package inside that differs)."""
    entry = lock.by_path().get(rel)
    path = bundle_dir / rel
    if entry is None:
        raise AirgapError(f"{path}: not in {bundle_dir / LOCK_NAME}; rebuild the bundle")
    if not path.is_file():
        raise AirgapError(f"{path}: missing from the bundle (k2fleet.lock lists it); copy the whole bundle again")
    got = sha256_file(path)
    if got != entry.sha256:
        inside = _tampered_debs(path, [a for a in lock.artifacts if a.inside == rel]) if entry.kind == "deb-repo" else []
        what = f" ({', '.join(inside)} inside)" if inside else ""
        raise AirgapError(f"{path}{what}: sha256 {got[:16]}… is not the lock's {entry.sha256[:16]}…: the bundle was "
                          "altered or corrupted; refusing it (copy it again from the media)")
    return path


def _tampered_debs(tar_path: Path, debs: list[Artifact]) -> list[str]:
    try:
        with tarfile.open(tar_path) as tar:
            names = {a.path.rsplit("!", 1)[1]: a for a in debs}
            bad = []
            for member in tar.getmembers():
                entry = names.get(member.name)
                fh = tar.extractfile(member) if entry else None
                if entry and fh and hashlib.sha256(fh.read()).hexdigest() != entry.sha256:
                    bad.append(f"{entry.name} {entry.version}")
            return bad
    except (OSError, tarfile.TarError):
        return []


def _matching(parts: list[dict[str, Any]], **want: Any) -> dict[str, Any] | None:
    return next((p for p in parts if all(p.get(k) == v for k, v in want.items())), None)


@dataclass(frozen=True)
class BundleArtifacts:
    """What a deploy takes from a bundle, verified: package set → tar, engine wheel set →
    wheels, the Hub client's wheels, image ref → (archive, ID)."""

    debs: dict[tuple[str, ...], str]
    engine_wheels: dict[tuple[str, ...], dict[str, bytes]]
    hub_wheels: dict[str, bytes] | None
    images: dict[str, tuple[str, str]]
    engine_cache: tuple[str, str] | None = None  # the engine's cache archive: (path, the lock's sha256)


def read_bundle(dep: Deployment, plan: Plan, bundle_dir: str | Path) -> BundleArtifacts:
    """Every artifact this deployment needs, from the bundle only, each sha256-checked;
    AirgapError naming the first one missing or altered."""
    root = Path(bundle_dir)
    lock = read_lock(root)
    needs = bundle_needs(dep, plan)
    fix = f"rebuild it with `k2fleet bundle {lock.inventory or 'INVENTORY'} --out {root}`"
    debs = {}
    for deb in needs.debs:
        part = _matching(lock.part("debs"), os=deb.os, arch=deb.arch, packages=list(deb.packages))
        if part is None:
            raise AirgapError(f"bundle {root} has no {deb.os} {deb.arch} packages for {' '.join(deb.packages[:6])}…; {fix}")
        debs[deb.packages] = str(verified(root, part["path"], lock))
    engine, hub = {}, None
    for ws in needs.wheels:
        part = _matching(lock.part("wheels"), use=ws.use, requirements=list(ws.requirements),
                         pythons=list(ws.pythons), archs=list(ws.archs))
        if part is None:
            raise AirgapError(f"bundle {root} has no wheels for {' '.join(ws.requirements)} (CPython "
                              f"{','.join(ws.pythons)} {','.join(ws.archs)}); {fix}")
        files = {Path(a.path).name: verified(root, a.path, lock).read_bytes()
                 for a in lock.artifacts if a.kind == "wheel" and a.path.startswith(part["path"] + "/")}
        if ws.use == "hub":
            hub = files
        else:
            engine[ws.requirements] = files
    images = {}
    for ref in needs.images:
        part = _matching(lock.part("images"), ref=ref)
        if part is None:
            raise AirgapError(f"bundle {root} has no image {ref}; {fix}")
        want = pinned_id(dep, ref)
        if want and part["image_id"] != want:
            key = "k2_image_id" if want == dep.s.image_id else "k2_gpu_exporter_image_id"
            raise AirgapError(f"bundle {root} holds {ref} as {part['image_id']}, not {key} {want}; {fix}")
        images[ref] = (str(verified(root, part["path"], lock)), part["image_id"])
    for repo, revision, _ in needs.checkpoints:
        part = _matching(lock.part("checkpoints"), repo=repo, revision=revision)
        if part is None:
            raise AirgapError(f"bundle {root} has no checkpoint {repo}@{revision}; {fix}")
        verified(root, f"{part['path']}/.k2fleet/manifest.json", lock)
    cache = None
    part = _matching(lock.part("engine_caches"), engine=dep.engine)  # another engine's: of no use here
    if part is not None:
        cache = (str(verified(root, part["path"], lock)), lock.by_path()[part["path"]].sha256)
    return BundleArtifacts(debs, engine, hub, images, cache)


# ----------------------------------------------------------------------------- CLI


def bundle_overlay(rehearsal: bool) -> dict[str, Any]:
    """``--data`` a rehearsal bundle is computed with: the sandbox's simulated GPUs, engine
    doubles, OS and no HCAs, packages from the bundle, the Hub checkpoint (synthetic, in
    the bundle). ``k2fleet rehearse --bundle`` deploys with the same."""
    if not rehearsal:
        return {}
    return {"k2_simulated_gpus": True, "k2_engine_doubles": True, "k2_package_source": "bundle",
            "k2_os": stand_ins().host_os, "k2_checkpoint_source": "hub", "k2_gguf_source": "hub",
            "k2_checkpoint_fetcher": "control", "k2_ib_hcas": []}  # sandbox hosts have no InfiniBand HCAs
