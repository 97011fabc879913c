"""The engine TEST DOUBLE container image, built on the control machine without a daemon.

No image registry is reachable from the sandbox (nor from the control machine), so the
sandbox's ``k2_runtime: container`` scenarios run the engine test doubles
(``files/doubles``) in an image k2fleet writes itself: a ``docker save`` archive
(``manifest.json`` + the image config JSON + one layer tar) produced in pure Python from a
trimmed root filesystem — python3 and the shared libraries it and its extension modules
load, taken from the sandbox's debootstrap root (:func:`k2fleet.sandbox.ensure_rootfs`),
plus the doubles under ``/opt/k2fleet/doubles`` with the engines' entry points
(``trtllm-serve``, ``trtllm-llmapi-launch``, ``vllm``, ``python``) in ``/usr/local/bin``.

The archive is deterministic: entries sorted, owner root, every mtime 0, no ``__pycache__``,
the config's ``created`` fixed, JSON with sorted keys, gzip with mtime 0. The same inputs
give the same bytes, so the image ID (sha256 of the config JSON, what ``docker image
inspect`` reports as ``Id``) is the same on every build and every host.

The archive is tagged (``RepoTags``) with the inventory's own image reference, so the
planned ``docker run ... IMAGE`` runs unchanged; the config's labels say it is a TEST
DOUBLE. Hosts get it with ``docker load`` (:mod:`roles.engine`), and each unit refuses to
start when the reference names another image ID (:mod:`k2fleet.host.image_pin`).

Usage: ``python -m k2fleet.image build IMAGE_REF [--out DIR]`` prints the archive path and ID.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from k2fleet.desired import FILES

CACHE_DIR = Path("/var/cache/k2fleet/images")
IMAGE_FORMAT = 1  # bump when the archive's layout or content rules change
DOUBLES_DIR = "opt/k2fleet/doubles"
ENTRY_POINTS = ("trtllm-serve", "trtllm-llmapi-launch", "vllm")
PYTHON = "usr/bin/python3.11"
BINARIES = (PYTHON, "usr/bin/env", "usr/bin/dash")  # env: the doubles' shebang; dash: /bin/sh
PY_LIB = "usr/lib/python3.11"
PY_LIB_SKIP = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data",
               "__pycache__", "config-3.11-x86_64-linux-gnu", "distutils", "unittest"}
MERGED_USR = {"bin": "usr/bin", "lib": "usr/lib", "lib64": "usr/lib64", "sbin": "usr/sbin"}
SYMLINKS = {"usr/bin/python3": "python3.11", "usr/bin/sh": "dash",
            **{f"usr/local/bin/{name}": f"/{DOUBLES_DIR}/bin/{name}" for name in ENTRY_POINTS},
            "usr/local/bin/python": "/usr/bin/python3.11"}
PASSWD = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
# video/render: the ROCm containers' --group-add video must resolve inside the image.
GROUP = "root:x:0:\nvideo:x:44:\nrender:x:105:\nnogroup:x:65534:\n"
ENV = ("PATH=/usr/local/bin:/usr/bin:/bin", f"PYTHONPATH=/{DOUBLES_DIR}", "PYTHONUNBUFFERED=1")
_LDD_PATH = re.compile(r"(?:=>\s*)?(/\S+)\s+\(0x")


class ImageError(RuntimeError):
    """The double image cannot be built."""


@dataclass(frozen=True)
class DoubleImage:
    """One built archive: its path, the reference it is tagged with and its image ID."""

    path: Path
    ref: str
    image_id: str  # "sha256:<hex>", as docker reports it


# --------------------------------------------------------------------------
# the root filesystem's file list


def _elf_closure(rootfs: Path, elves: list[str]) -> set[str]:
    """Rootfs-relative paths of the shared libraries (and loader) ``elves`` load, as
    the rootfs's own ``ldd`` resolves them inside it (``chroot``)."""
    found: set[str] = set()
    for start in range(0, len(elves), 64):
        proc = subprocess.run(["chroot", str(rootfs), "/usr/bin/ldd", *[f"/{e}" for e in elves[start:start + 64]]],
                              capture_output=True, text=True)
        for line in proc.stdout.splitlines():
            match = _LDD_PATH.search(line)
            if match:
                found.add(match[1].lstrip("/"))
    if not found:
        raise ImageError(f"ldd inside {rootfs} found no libraries: {proc.stderr.strip()[:200]}")
    return found


def _resolve_in(rootfs: Path, rel: str, depth: int = 0) -> tuple[str, set[str]]:
    """(``rel`` with every symlink resolved inside ``rootfs``, the symlinks passed)."""
    if depth > 40:
        raise ImageError(f"symlink loop at {rel} in {rootfs}")
    done: list[str] = []
    links: set[str] = set()
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    for i, part in enumerate(parts):
        if part == "..":
            done = done[:-1]
            continue
        here = "/".join([*done, part])
        if (rootfs / here).is_symlink():
            links.add(here)
            target = os.readlink(rootfs / here)
            base = [] if target.startswith("/") else done
            joined = "/".join([*base, target.lstrip("/"), *parts[i + 1:]])
            resolved, more = _resolve_in(rootfs, joined, depth + 1)
            return resolved, links | more
        done.append(part)
    return "/".join(done), links


def _with_link_targets(rootfs: Path, rel: str) -> set[str]:
    """``rel``, the symlinks on its way (outside the merged-/usr top links) and its
    resolved path, all inside ``rootfs``."""
    target, links = _resolve_in(rootfs, rel)
    return {target, *(link for link in links if link not in MERGED_USR)}


def rootfs_files(rootfs: Path) -> list[str]:
    """Rootfs-relative regular files (and symlinks) the image takes from ``rootfs``."""
    wanted: set[str] = set()
    for rel in BINARIES:
        wanted |= _with_link_targets(rootfs, rel)
    lib = rootfs / PY_LIB
    for path in lib.rglob("*"):
        parts = path.relative_to(lib).parts
        if any(p in PY_LIB_SKIP for p in parts) or path.is_dir():
            continue
        wanted.add(path.relative_to(rootfs).as_posix())
    elves = sorted({*BINARIES, *(p for p in wanted if p.endswith(".so"))})
    for rel in _elf_closure(rootfs, elves):
        wanted |= _with_link_targets(rootfs, rel)
    if (rootfs / "etc/ld.so.cache").is_file():
        wanted.add("etc/ld.so.cache")
    missing = [rel for rel in wanted if not (rootfs / rel).exists() and not (rootfs / rel).is_symlink()]
    if missing:
        raise ImageError(f"{rootfs} lacks {missing[:5]}")
    return sorted(wanted)


# --------------------------------------------------------------------------
# deterministic tar


def _info(name: str, kind: bytes, mode: int, size: int = 0, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.linkname = kind, mode, size, link
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "root", "root"
    return info


def layer_tar(rootfs: Path, doubles: Path = FILES / "doubles") -> bytes:
    """The image's one layer: the rootfs files, the doubles, entry points, /etc basics."""
    entries: dict[str, tuple[bytes, int, bytes | str]] = {}  # name → (type, mode, data or link)

    def add_dirs(name: str) -> None:
        parts = name.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            entries.setdefault("/".join(parts[:i]), (tarfile.DIRTYPE, 0o755, b""))

    for rel in rootfs_files(rootfs):
        path = rootfs / rel
        add_dirs(rel)
        if path.is_symlink():
            entries[rel] = (tarfile.SYMTYPE, 0o777, os.readlink(path))
        else:
            entries[rel] = (tarfile.REGTYPE, 0o755 if os.access(path, os.X_OK) else 0o644, path.read_bytes())
    for path in sorted(doubles.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            rel = f"{DOUBLES_DIR}/{path.relative_to(doubles).as_posix()}"
            add_dirs(rel)
            entries[rel] = (tarfile.REGTYPE, 0o755 if path.parent.name == "bin" else 0o644, path.read_bytes())
    for rel, target in {**MERGED_USR, **SYMLINKS}.items():
        add_dirs(rel)
        entries[rel] = (tarfile.SYMTYPE, 0o777, target)
    for rel, text in {"etc/passwd": PASSWD, "etc/group": GROUP,
                      "etc/k2fleet-test-double": "k2fleet engine TEST DOUBLE image (sandbox only)\n"}.items():
        add_dirs(rel)
        entries[rel] = (tarfile.REGTYPE, 0o644, text.encode())
    for rel, mode in (("tmp", 0o1777), ("root", 0o700), ("dev", 0o755), ("proc", 0o755), ("sys", 0o755)):
        entries[rel] = (tarfile.DIRTYPE, mode, b"")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name in sorted(entries):
            kind, mode, data = entries[name]
            if kind == tarfile.REGTYPE:
                assert isinstance(data, bytes)
                tar.addfile(_info(name, kind, mode, len(data)), io.BytesIO(data))
            elif kind == tarfile.SYMTYPE:
                assert isinstance(data, str)
                tar.addfile(_info(name, kind, mode, link=data))
            else:
                tar.addfile(_info(name, kind, mode))
    return buf.getvalue()


def image_config(ref: str, diff_id: str) -> bytes:
    """The image config JSON (its sha256 is the image ID); labels name it a TEST DOUBLE."""
    config = {
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": {"Env": list(ENV), "WorkingDir": "/",
                   "Labels": {"org.k2fleet.test-double": "true", "org.k2fleet.double-of": ref}},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created": "1970-01-01T00:00:00Z",
                     "created_by": f"k2fleet.image: engine TEST DOUBLE standing in for {ref}"}],
    }
    return json.dumps(config, sort_keys=True, separators=(",", ":")).encode()


def docker_archive(ref: str, layer: bytes) -> tuple[bytes, str]:
    """(``docker load``-able tar, image ID) for one image of one layer tagged ``ref``."""
    diff_hex = hashlib.sha256(layer).hexdigest()
    config = image_config(ref, f"sha256:{diff_hex}")
    image_hex = hashlib.sha256(config).hexdigest()
    manifest = json.dumps([{"Config": f"{image_hex}.json", "RepoTags": [ref], "Layers": [f"{diff_hex}/layer.tar"]}],
                          sort_keys=True, separators=(",", ":")).encode()
    members = {"manifest.json": manifest, f"{image_hex}.json": config, f"{diff_hex}/VERSION": b"1.0",
               f"{diff_hex}/layer.tar": layer}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        tar.addfile(_info(diff_hex, tarfile.DIRTYPE, 0o755))
        for name in sorted(members):
            tar.addfile(_info(name, tarfile.REGTYPE, 0o644, len(members[name])), io.BytesIO(members[name]))
    return buf.getvalue(), f"sha256:{image_hex}"


def gzip_bytes(data: bytes) -> bytes:
    """gzip with no name and mtime 0 (same input, same bytes)."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=6) as gz:
        gz.write(data)
    return buf.getvalue()


# --------------------------------------------------------------------------
# the cached build


def _safe_ref(ref: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", ref)


def build_double_image(ref: str, rootfs: Path, out_dir: Path = CACHE_DIR, doubles: Path = FILES / "doubles",
                       write: bool = True) -> DoubleImage | None:
    """Write ``out_dir/double-<ref>-<image id>.tar.gz`` (deterministic; reused when it
    exists). ``write=False``: only find it (None when it is not there)."""
    archive, image_id = docker_archive(ref, layer_tar(rootfs, doubles))
    path = out_dir / f"double-{_safe_ref(ref)}-{image_id.split(':')[1][:16]}.tar.gz"
    if not write:
        return DoubleImage(path, ref, image_id) if path.is_file() else None
    if not path.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_bytes(gzip_bytes(archive))
        tmp.replace(path)
    return DoubleImage(path, ref, image_id)


def ensure_double_image(ref: str, out_dir: Path = CACHE_DIR) -> DoubleImage:
    """The double image for ``ref`` from the sandbox's root filesystem (built if needed)."""
    from k2fleet import sandbox

    image = build_double_image(ref, sandbox.ensure_rootfs(), out_dir)
    assert image is not None
    return image


def cached_double_image(ref: str, out_dir: Path = CACHE_DIR) -> DoubleImage | None:
    """The double image for ``ref`` if it was built already (reads, writes nothing)."""
    from k2fleet import sandbox

    rootfs = sandbox.ROOTFS_CACHE / sandbox.rootfs_key()
    if not (rootfs / "etc/os-release").exists() or not out_dir.is_dir():
        return None
    try:
        return build_double_image(ref, rootfs, out_dir, write=False)
    except (ImageError, OSError):  # e.g. not root (chroot): reported as not built
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k2fleet.image", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_build = sub.add_parser("build", help="build the double image archive for IMAGE_REF")
    p_build.add_argument("ref")
    p_build.add_argument("--out", type=Path, default=CACHE_DIR)
    args = parser.parse_args(argv)
    image = ensure_double_image(args.ref, args.out)
    print(f"{image.path} {image.image_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
