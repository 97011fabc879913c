"""The engine TEST DOUBLE container image, built on the control machine without a daemon.

No image registry is reachable from the sandbox (nor from the control machine), so the
sandbox's ``k2_runtime: container`` scenarios run the engine test doubles
(``files/doubles``) in an image k2fleet writes itself: a ``docker save`` archive
(``manifest.json`` + the image config JSON + one layer tar) produced in pure Python from a
trimmed root filesystem — python3 and the shared libraries it and its extension modules
load, taken from the sandbox's debootstrap root (:func:`k2sandbox.nspawn.ensure_rootfs`),
plus the doubles under ``/opt/k2fleet/doubles`` with the engines' entry points
(``trtllm-serve``, ``trtllm-llmapi-launch``, ``vllm``, ``python``) in ``/usr/local/bin``.

What the planned container runs besides the engine comes from Debian packages
(:data:`COMMAND_PACKAGES`): the multi-node TensorRT-LLM container form runs the mesh's
``sshd`` on the mesh port and ``mpirun``/``orted`` inside the image, and the trtllm
double's ranks meet with ``mpi4py``. Their .debs (the full closure) come from the offline
bundle (:mod:`k2fleet.control.deb_bundles`), are unpacked (``dpkg-deb -x``) over a copy of the rootfs
(cached per rootfs and bundle, ``ldconfig`` run in it), and the image takes the
:data:`WHOLE_PACKAGES` files (no docs) plus the shared libraries they load, as for python3.

The archive is deterministic: entries sorted, owner root, every mtime 0, no ``__pycache__``,
the config's ``created`` fixed, JSON with sorted keys, gzip with mtime 0. The same inputs
give the same bytes, so the image ID (sha256 of the config JSON, what ``docker image
inspect`` reports as ``Id``) is the same on every build and every host.

The archive is tagged (``RepoTags``) with the inventory's own image reference, so the
planned ``docker run ... IMAGE`` runs unchanged; the config's labels say it is a TEST
DOUBLE. Hosts get it with ``docker load`` (:mod:`k2fleet.deploy.roles.engine`), and each unit refuses to
start when the reference names another image ID (:mod:`k2fleet.hostprogs.image_pin`).

Usage: ``python -m k2sandbox.double_image build IMAGE_REF [--out DIR] [--package DEB ...]`` prints the
archive path and ID.
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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k2sandbox import DOUBLES

CACHE_DIR = Path("/var/cache/k2fleet/images")
IMAGE_FORMAT = 2  # bump when the archive's layout or content rules change
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
SSHD_PASSWD = "sshd:x:100:65534::/run/sshd:/usr/sbin/nologin\n"  # sshd's privilege separation user
# A word of a planned container command → the Debian packages the image needs for it.
COMMAND_PACKAGES = {
    "/usr/sbin/sshd": ("openssh-server",),
    "mpirun": ("openmpi-bin", "openssh-client", "python3-mpi4py"),  # ssh: mpirun's rsh agent
}
# Of the packages' closure, those whose files the image takes whole (docs aside): the
# programs, OpenMPI's and PMIx's dlopen'ed plugins, help texts and config. The rest of the
# closure only lends the shared libraries these load (found with ldd, as for python3).
WHOLE_PACKAGES = frozenset({"openssh-server", "openssh-client", "openssh-sftp-server", "openmpi-bin",
                            "openmpi-common", "libopenmpi3", "libpmix2", "libucx0", "python3-mpi4py"})
SKIPPED_PREFIXES = ("usr/share/doc/", "usr/share/man/", "usr/share/lintian/", "usr/share/bug/", "usr/share/locale/",
                    "usr/include/", "etc/init.d/", "etc/systemd/", "lib/systemd/", "usr/lib/systemd/", "etc/ufw/",
                    "etc/default/", "etc/pam.d/", "etc/network/", "usr/share/apport/", "usr/share/openssh/")
# update-alternatives links the packages' postinst scripts would make (dpkg-deb -x runs none).
ALTERNATIVES = {"openmpi-bin": {"usr/bin/mpirun": "mpirun.openmpi", "usr/bin/mpiexec": "mpiexec.openmpi"}}
# video/render: the ROCm containers' --group-add video must resolve inside the image.
GROUP = "root:x:0:\nvideo:x:44:\nrender:x:105:\nnogroup:x:65534:\n"
ENV = ("PATH=/usr/local/bin:/usr/bin:/bin", f"PYTHONPATH=/{DOUBLES_DIR}", "PYTHONUNBUFFERED=1")
# The dcgm-exporter TEST DOUBLE image (``k2_gpu_exporter`` on simulated GPUs): the same layer,
# with this entry point (files/doubles/gpu_stack/dcgm_exporter.py: Prometheus text on :9400).
GPU_EXPORTER_ENTRYPOINT = ("/usr/bin/python3", f"/{DOUBLES_DIR}/gpu_stack/dcgm_exporter.py")
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


def _is_elf(path: Path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(4) == b"\x7fELF"


def rootfs_files(rootfs: Path, whole: Iterable[str] = ()) -> list[str]:
    """Rootfs-relative regular files (and symlinks) the image takes from ``rootfs``:
    python3 and its library, ``whole`` (packages' files), and the libraries they load."""
    wanted: set[str] = set()
    for rel in BINARIES:
        wanted |= _with_link_targets(rootfs, rel)
    lib = rootfs / PY_LIB
    for path in lib.rglob("*"):
        parts = path.relative_to(lib).parts
        if any(p in PY_LIB_SKIP for p in parts) or path.is_dir():
            continue
        wanted.add(path.relative_to(rootfs).as_posix())
    elves = {*BINARIES, *(p for p in wanted if p.endswith(".so"))}
    for rel in whole:
        path = rootfs / rel
        if rel.startswith(SKIPPED_PREFIXES) or "__pycache__" in rel or rel in MERGED_USR:
            continue
        if path.is_dir():  # a directory, or a packaged link to one: the link alone
            if path.is_symlink():
                wanted.add(rel)
            continue
        if not path.exists() and not path.is_symlink():
            raise ImageError(f"{rootfs} lacks {rel} (a packaged file)")
        wanted |= _with_link_targets(rootfs, rel) if path.exists() else {rel}
        if path.exists() and path.is_file() and _is_elf(path):
            elves.add(_resolve_in(rootfs, rel)[0])
    for rel in _elf_closure(rootfs, sorted(elves)):
        wanted |= _with_link_targets(rootfs, rel)
    if (rootfs / "etc/ld.so.cache").is_file():
        wanted.add("etc/ld.so.cache")
    missing = [rel for rel in wanted if not (rootfs / rel).exists() and not (rootfs / rel).is_symlink()]
    if missing:
        raise ImageError(f"{rootfs} lacks {missing[:5]}")
    return sorted(wanted)


# --------------------------------------------------------------------------
# Debian packages in the image


def packages_for(commands: Iterable[Sequence[str]]) -> tuple[str, ...]:
    """The Debian packages the image needs to run the planned container ``commands``.

    >>> packages_for([["/usr/sbin/sshd", "-D"], ["/usr/bin/docker", "exec", "c", "mpirun", "-np", "2"]])
    ('openmpi-bin', 'openssh-client', 'openssh-server', 'python3-mpi4py')
    >>> packages_for([["trtllm-serve", "serve", "/m"]])
    ()
    """
    return tuple(sorted({pkg for argv in commands for word in argv for pkg in COMMAND_PACKAGES.get(word, ())}))


def double_image_packages(plan: Any) -> tuple[str, ...]:
    """Debian packages the double image needs for a plan's container commands (``docker ...``)."""
    from k2fleet.planning.render.common import DOCKER

    return packages_for(svc.argv for _, svc in plan.services() if svc.argv[:1] == [DOCKER])


def _merged(rel: str) -> str:
    """``rel`` under merged /usr (``lib/x`` → ``usr/lib/x``), as the rootfs lays it out.

    >>> _merged("lib/x86_64-linux-gnu/libc.so.6"), _merged("usr/bin/orted"), _merged("lib")
    ('usr/lib/x86_64-linux-gnu/libc.so.6', 'usr/bin/orted', 'lib')
    """
    top, _, rest = rel.partition("/")
    return f"{MERGED_USR[top]}/{rest}" if top in MERGED_USR and rest else rel


def _installed_files(rootfs: Path, name: str) -> list[str] | None:
    """Files dpkg lists for package ``name`` in ``rootfs`` (None: not installed there)."""
    for candidate in (f"{name}.list", f"{name}:amd64.list"):
        listing = rootfs / "var/lib/dpkg/info" / candidate
        if listing.is_file():
            return sorted({_merged(line.strip().lstrip("/")) for line in listing.read_text().splitlines()
                           if line.strip() not in ("", "/.")})
    return None


STAGED_RECORD = "etc/k2fleet-image-packages.json"  # in a staged rootfs: bundle + whole packages' files


def staged_rootfs(rootfs: Path, packages: Sequence[str], out_dir: Path = CACHE_DIR, write: bool = True) -> Path | None:
    """A copy of ``rootfs`` with the closure of ``packages`` from the offline bundle
    unpacked over it (``dpkg-deb -x``; packages the rootfs has are kept as they are),
    their update-alternatives links and a fresh ``ld.so.cache``; cached under ``out_dir``.
    ``write=False``: only find it (None when it is not there)."""
    key = hashlib.sha256(json.dumps([rootfs.name, sorted(packages), IMAGE_FORMAT]).encode()).hexdigest()[:16]
    staged = out_dir / f"rootfs-{key}"
    if (staged / STAGED_RECORD).is_file():
        return staged
    if not write:
        return None
    from k2fleet.control import deb_bundles as bundle

    tar_path = bundle.ensure_bundle(list(packages))
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".rootfs-{key}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run(["cp", "-a", str(rootfs), str(tmp)], check=True)
    whole: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="k2fleet-debs-", dir=out_dir) as work:
        with tarfile.open(tar_path) as tar:
            tar.extractall(work, members=[m for m in tar.getmembers() if m.name.endswith(".deb")])
        for deb in sorted(Path(work).glob("*.deb")):
            name = subprocess.run(["dpkg-deb", "-f", str(deb), "Package"], capture_output=True, text=True,
                                  check=True).stdout.strip()
            listed = _installed_files(rootfs, name)
            if listed is not None:
                if name in WHOLE_PACKAGES:
                    whole[name] = listed
                continue
            unpacked = Path(work) / "unpacked" / name
            unpacked.mkdir(parents=True)
            subprocess.run(["dpkg-deb", "-x", str(deb), str(unpacked)], check=True)
            files = []
            for path in sorted(unpacked.rglob("*")):
                if path.is_dir() and not path.is_symlink():
                    continue
                rel = _merged(path.relative_to(unpacked).as_posix())
                dest = tmp / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                if dest.is_symlink() or dest.exists():
                    dest.unlink()
                if path.is_symlink():
                    os.symlink(os.readlink(path), dest)
                else:
                    shutil.copy2(path, dest)
                files.append(rel)
            for rel, target in ALTERNATIVES.get(name, {}).items():
                (tmp / rel).unlink(missing_ok=True)
                os.symlink(target, tmp / rel)
                files.append(rel)
            if name in WHOLE_PACKAGES:
                whole[name] = sorted(files)
    subprocess.run(["chroot", str(tmp), "/sbin/ldconfig"], check=True)
    (tmp / STAGED_RECORD).write_text(json.dumps({"bundle": tar_path.name, "whole": whole}, sort_keys=True, indent=1))
    try:
        tmp.rename(staged)
    except OSError:  # another builder was first
        shutil.rmtree(tmp, ignore_errors=True)
    return staged


def staged_whole_files(staged: Path) -> list[str]:
    """The files of the :data:`WHOLE_PACKAGES` a staged rootfs records."""
    record = json.loads((staged / STAGED_RECORD).read_text())
    return sorted({rel for files in record["whole"].values() for rel in files})


# --------------------------------------------------------------------------
# deterministic tar


def _info(name: str, kind: bytes, mode: int, size: int = 0, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.linkname = kind, mode, size, link
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "root", "root"
    return info


def layer_tar(rootfs: Path, doubles: Path = DOUBLES, whole: Sequence[str] = ()) -> bytes:
    """The image's one layer: the rootfs files (``whole``: packages' files), the doubles,
    entry points, /etc basics (sshd's privilege separation user and directory when the
    image holds sshd)."""
    sshd = "usr/sbin/sshd" in whole
    entries: dict[str, tuple[bytes, int, bytes | str]] = {}  # name → (type, mode, data or link)

    def add_dirs(name: str) -> None:
        parts = name.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            entries.setdefault("/".join(parts[:i]), (tarfile.DIRTYPE, 0o755, b""))

    for rel in rootfs_files(rootfs, whole):
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
    for rel, text in {"etc/passwd": PASSWD + (SSHD_PASSWD if sshd else ""), "etc/group": GROUP,
                      "etc/k2fleet-test-double": "k2fleet engine TEST DOUBLE image (sandbox only)\n"}.items():
        add_dirs(rel)
        entries[rel] = (tarfile.REGTYPE, 0o644, text.encode())
    for rel, mode in (("tmp", 0o1777), ("root", 0o700), ("dev", 0o755), ("proc", 0o755), ("sys", 0o755),
                      *((("run", 0o755), ("run/sshd", 0o755)) if sshd else ())):
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


def image_config(ref: str, diff_id: str, entrypoint: Sequence[str] = ()) -> bytes:
    """The image config JSON (its sha256 is the image ID); labels name it a TEST DOUBLE.
    ``entrypoint``: the image's own command (the dcgm-exporter double's: the real image is run
    with no command either); none for the engine double (its units name the entry point)."""
    inner: dict[str, Any] = {"Env": list(ENV), "WorkingDir": "/",
                             "Labels": {"org.k2fleet.test-double": "true", "org.k2fleet.double-of": ref}}
    if entrypoint:
        inner["Entrypoint"] = list(entrypoint)
    what = "dcgm-exporter" if entrypoint == GPU_EXPORTER_ENTRYPOINT else "engine"
    config = {
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": inner,
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created": "1970-01-01T00:00:00Z",
                     "created_by": f"k2sandbox.double_image: {what} TEST DOUBLE standing in for {ref}"}],
    }
    return json.dumps(config, sort_keys=True, separators=(",", ":")).encode()


def docker_archive(ref: str, layer: bytes, entrypoint: Sequence[str] = ()) -> tuple[bytes, str]:
    """(``docker load``-able tar, image ID) for one image of one layer tagged ``ref``."""
    diff_hex = hashlib.sha256(layer).hexdigest()
    config = image_config(ref, f"sha256:{diff_hex}", entrypoint)
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
    import gzip  # only when an image is built

    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=6) as gz:
        gz.write(data)
    return buf.getvalue()


# --------------------------------------------------------------------------
# the cached build


def _safe_ref(ref: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", ref)


def build_double_image(ref: str, rootfs: Path, out_dir: Path = CACHE_DIR, doubles: Path = DOUBLES,
                       write: bool = True, packages: Sequence[str] = (),
                       entrypoint: Sequence[str] = ()) -> DoubleImage | None:
    """Write ``out_dir/double-<ref>-<image id>.tar.gz`` (deterministic; reused when it
    exists); ``packages``: Debian packages the image holds too (:func:`staged_rootfs`);
    ``entrypoint``: the image's command (:data:`GPU_EXPORTER_ENTRYPOINT`).
    ``write=False``: only find it (None when it is not there)."""
    whole: list[str] = []
    if packages:
        staged = staged_rootfs(rootfs, packages, out_dir, write)
        if staged is None:
            return None
        rootfs, whole = staged, staged_whole_files(staged)
    archive, image_id = docker_archive(ref, layer_tar(rootfs, doubles, whole), entrypoint)
    path = out_dir / f"double-{_safe_ref(ref)}-{image_id.split(':')[1][:16]}.tar.gz"
    if not write:
        return DoubleImage(path, ref, image_id) if path.is_file() else None
    if not path.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_bytes(gzip_bytes(archive))
        tmp.replace(path)
    return DoubleImage(path, ref, image_id)


def ensure_double_image(ref: str, out_dir: Path = CACHE_DIR, packages: Sequence[str] = (),
                        entrypoint: Sequence[str] = ()) -> DoubleImage:
    """The double image for ``ref`` (with ``packages``) from the sandbox's root filesystem (built if needed)."""
    from k2sandbox import nspawn as sandbox

    image = build_double_image(ref, sandbox.ensure_rootfs(), out_dir, packages=packages, entrypoint=entrypoint)
    assert image is not None
    return image


def cached_double_image(ref: str, out_dir: Path = CACHE_DIR, packages: Sequence[str] = (),
                        entrypoint: Sequence[str] = ()) -> DoubleImage | None:
    """The double image for ``ref`` (with ``packages``) if it was built already (reads, writes nothing)."""
    from k2sandbox import nspawn as sandbox

    rootfs = sandbox.ROOTFS_CACHE / sandbox.rootfs_key()
    if not (rootfs / "etc/os-release").exists() or not out_dir.is_dir():
        return None
    try:
        return build_double_image(ref, rootfs, out_dir, write=False, packages=packages, entrypoint=entrypoint)
    except (ImageError, OSError):  # e.g. not root (chroot): reported as not built
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k2sandbox.double_image", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_build = sub.add_parser("build", help="build the double image archive for IMAGE_REF")
    p_build.add_argument("ref")
    p_build.add_argument("--out", type=Path, default=CACHE_DIR)
    p_build.add_argument("--package", action="append", default=[], help="a Debian package the image holds too")
    args = parser.parse_args(argv)
    image = ensure_double_image(args.ref, args.out, tuple(sorted(args.package)))
    print(f"{image.path} {image.image_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
