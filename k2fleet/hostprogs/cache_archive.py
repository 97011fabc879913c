#!/usr/bin/env python3
"""An engine's warmed compile/JIT cache as one archive: packed by ``k2fleet bundle
--engine-cache SRC``, unpacked on a host by the deploy (``k2_bundle``).

STANDARD LIBRARY ONLY: the unpack runs on fleet hosts from the host archive as
``python3 k2fleet-host.pyz cache_archive unpack ARCHIVE SHA256 DEST``; the control machine
imports :func:`pack` from here, so both sides hold one set of rules:

- members are regular files and directories only, named by relative POSIX paths with no
  ``..``, ``.`` or empty component, no backslash or control character; a link (symbolic or
  hard), device, FIFO or socket is refused, on either side;
- at most :data:`MAX_MEMBERS` members, :data:`MAX_FILE_BYTES` per file and
  :data:`MAX_TOTAL_BYTES` in all (file contents);
- :func:`pack` is deterministic: members sorted, every mtime 0, owner ``root:root``
  (0/0), directories 0700, files 0700 when the source had an execute bit and 0600
  otherwise, gzip without name or time — the same tree gives the same bytes whatever its
  times, owners or modes; it never follows a link (a link in SRC is refused, by name);
- :func:`unpack` reads ARCHIVE through one descriptor opened without following a link,
  checks its sha256 against SHA256 before reading any member (a mismatch: exit 1, nothing
  written), extracts into a fresh root-only directory beside DEST and moves it into
  place only when DEST is absent or empty: a host's own cache is never written over
  (exit 0, "kept"). The extracted tree is owned by the unpacking user (root), modes as
  above, whatever the archive's headers say.

Exit codes of ``unpack``: 0 unpacked, or DEST kept as it was; 1 refused (digest mismatch,
a hostile or oversize member, DEST or its parent not a directory of its own); 2 usage.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import stat
import sys
import tarfile
import tempfile
import zlib

from k2fleet.hostprogs.verify import hash_fd, plain_relpath

MAX_MEMBERS = 200_000
MAX_FILE_BYTES = 2 * 2**30  # one file (a compiled kernel library is megabytes)
MAX_TOTAL_BYTES = 8 * 2**30  # every file's content (the bundle's archive is read into the deploy's memory)
DIR_MODE, FILE_MODE, EXEC_MODE = 0o700, 0o600, 0o700
CHUNK = 1 << 20


class CacheArchiveError(ValueError):
    """An archive or source tree that breaks the rules above; the message names the member."""


def check_name(name: str) -> str:
    """``name`` if it is a safe relative member name (CacheArchiveError otherwise).

    >>> check_name("triton/ab/kernel.so")
    'triton/ab/kernel.so'
    >>> for bad in ("../x", "/etc/passwd", "a//b"):
    ...     try:
    ...         check_name(bad)
    ...     except CacheArchiveError as exc:
    ...         print(str(exc)[:30])
    member '../x': not a plain rel
    member '/etc/passwd': not a pl
    member 'a//b': not a plain rel
    """
    if not plain_relpath(name):
        raise CacheArchiveError(f"member {name!r}: not a plain relative path (absolute, '..', '.', an empty part, "
                                "a backslash or a control character)")
    return name


def _file_mode(mode: int) -> int:
    return EXEC_MODE if mode & 0o111 else FILE_MODE


def _info(name: str, kind: bytes, mode: int, size: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.mtime = kind, mode, size, 0
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _walk(src: str, rel: str, out: list[tuple[str, os.stat_result]]) -> None:
    """Every entry below ``src/rel``, sorted, by lstat (a link is reported, never followed)."""
    with os.scandir(os.path.join(src, rel) if rel else src) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        name = f"{rel}/{entry.name}" if rel else entry.name
        st = entry.stat(follow_symlinks=False)
        out.append((name, st))
        if stat.S_ISDIR(st.st_mode):
            _walk(src, name, out)


def pack(src: str, out, allowed_top: frozenset[str] | None = None, max_members: int = MAX_MEMBERS,
         max_file: int = MAX_FILE_BYTES, max_total: int = MAX_TOTAL_BYTES) -> tuple[int, int]:
    """Write ``src``'s tree to the binary file ``out`` as a deterministic tar.gz (see the module
    doc); ``allowed_top``: the names its top-level entries must be among (None: any). Returns
    (files, bytes of their contents). CacheArchiveError naming the first entry that breaks a
    rule; nothing is followed, so a link anywhere in ``src`` is refused, not read."""
    st = os.lstat(src)
    if not stat.S_ISDIR(st.st_mode):
        raise CacheArchiveError(f"{src}: not a directory of its own (a symlink or a file?)")
    entries: list[tuple[str, os.stat_result]] = []
    _walk(src, "", entries)
    if not entries:
        raise CacheArchiveError(f"{src}: empty; give the directory a warmed engine filled")
    if len(entries) > max_members:
        raise CacheArchiveError(f"{src}: {len(entries)} entries, more than the {max_members} allowed")
    if allowed_top is not None:
        extra = sorted({name.split("/", 1)[0] for name, _ in entries} - allowed_top)
        if extra:
            raise CacheArchiveError(f"{src}: {', '.join(extra)} is not a cache the engine is pointed at (expected "
                                    f"among {', '.join(sorted(allowed_top))}); give the engine's own cache directory")
    total = files = 0
    for name, est in entries:
        check_name(name)
        if stat.S_ISLNK(est.st_mode):
            raise CacheArchiveError(f"{src}/{name}: a symbolic link; links are not followed or archived")
        if stat.S_ISDIR(est.st_mode):
            continue
        if not stat.S_ISREG(est.st_mode):
            raise CacheArchiveError(f"{src}/{name}: not a regular file or directory")
        if est.st_size > max_file:
            raise CacheArchiveError(f"{src}/{name}: {est.st_size} bytes, more than the {max_file} allowed per file")
        total, files = total + est.st_size, files + 1
        if total > max_total:
            raise CacheArchiveError(f"{src}: more than the {max_total} bytes allowed in all (at {name})")
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=6) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, est in entries:
            if stat.S_ISDIR(est.st_mode):
                tar.addfile(_info(name, tarfile.DIRTYPE, DIR_MODE))
                continue
            fd = os.open(os.path.join(src, name), os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
            with os.fdopen(fd, "rb") as fh:
                now = os.fstat(fh.fileno())
                if not stat.S_ISREG(now.st_mode) or now.st_size != est.st_size:
                    raise CacheArchiveError(f"{src}/{name}: changed while it was archived; stop the engine writing it")
                tar.addfile(_info(name, tarfile.REGTYPE, _file_mode(est.st_mode), est.st_size), fh)
    return files, total


def _own_dir(path: str, create: bool) -> bool:
    """``path`` is a real directory (not a link), root-only (made 0700 when ``create`` and
    absent); False when absent and not made. CacheArchiveError when it is something else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not create:
            return False
        os.makedirs(path, DIR_MODE, exist_ok=True)
        st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise CacheArchiveError(f"{path}: not a directory of its own (a symlink or a file?); refusing to unpack there")
    if st.st_uid != os.geteuid():
        raise CacheArchiveError(f"{path}: owned by uid {st.st_uid}, not this user ({os.geteuid()}); refusing")
    os.chmod(path, DIR_MODE)
    return True


def _extract(tar: tarfile.TarFile, into: str, max_members: int, max_file: int, max_total: int) -> tuple[int, int]:
    """Every member of ``tar`` into the fresh directory ``into``; (files, bytes)."""
    files = total = count = 0
    made = {""}
    for member in tar:
        count += 1
        if count > max_members:
            raise CacheArchiveError(f"more than {max_members} members")
        name = check_name(member.name.rstrip("/") if member.isdir() else member.name)
        try:
            files, total = _extract_one(tar, member, name, into, made, files, total, max_file, max_total)
        except OSError as exc:  # a name given twice, a file where a directory goes, a full disk
            raise CacheArchiveError(f"member {name!r}: {exc.strerror or exc}") from None
    return files, total


def _extract_one(tar: tarfile.TarFile, member: tarfile.TarInfo, name: str, into: str, made: set[str], files: int,
                 total: int, max_file: int, max_total: int) -> tuple[int, int]:
    """One member (a directory or a regular file; anything else refused); (files, bytes) so far."""
    if not member.isdir() and not member.isreg():
        what = "a symbolic link" if member.issym() else "a hard link" if member.islnk() else "not a regular file"
        raise CacheArchiveError(f"member {name!r}: {what}; refused")
    parent = name.rsplit("/", 1)[0] if "/" in name else ""
    if parent not in made:
        os.makedirs(os.path.join(into, parent), DIR_MODE, exist_ok=True)
        made.update("/".join(parent.split("/")[:i]) for i in range(1, parent.count("/") + 2))
    path = os.path.join(into, name)
    if member.isdir():
        if name not in made:
            os.mkdir(path, DIR_MODE)
            made.add(name)
        return files, total
    if member.size > max_file:
        raise CacheArchiveError(f"member {name!r}: {member.size} bytes, more than the {max_file} allowed per file")
    total += member.size
    if total > max_total:
        raise CacheArchiveError(f"more than the {max_total} bytes allowed in all (at member {name!r})")
    src = tar.extractfile(member)
    assert src is not None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                 _file_mode(member.mode))
    with os.fdopen(fd, "wb") as dst:
        shutil.copyfileobj(src, dst, CHUNK)
    return files + 1, total


def unpack(archive: str, sha256: str, dest: str, max_members: int = MAX_MEMBERS, max_file: int = MAX_FILE_BYTES,
           max_total: int = MAX_TOTAL_BYTES) -> str:
    """Unpack ``archive`` into ``dest`` when ``dest`` is absent or empty (see the module doc);
    the line to print. CacheArchiveError naming what was refused (nothing left behind)."""
    dest = os.path.normpath(dest)
    parent = os.path.dirname(dest)
    fd = os.open(archive, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise CacheArchiveError(f"{archive}: not a regular file")
        digest = hashlib.sha256()
        hash_fd(fh.fileno(), digest, bytearray(CHUNK))
        got = digest.hexdigest()
        if got != sha256:
            raise CacheArchiveError(f"{archive}: sha256 {got[:16]}… is not the bundle lock's {sha256[:16]}…: "
                                    "altered or corrupted; refusing to unpack it")
        if _own_dir(dest, create=False) and os.listdir(dest):
            return f"{dest}: kept the host's own cache (not empty); the bundle's is not unpacked over it"
        _own_dir(parent, create=True)
        fh.seek(0)
        staging = tempfile.mkdtemp(prefix=".unpack-", dir=parent)  # 0700, this user's
        try:
            try:
                with tarfile.open(fileobj=fh, mode="r:gz") as tar:
                    files, total = _extract(tar, staging, max_members, max_file, max_total)
            except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
                raise CacheArchiveError(f"{archive}: not a readable tar.gz ({exc})") from None
            if _own_dir(dest, create=False):
                if os.listdir(dest):  # the engine wrote its own meanwhile
                    return f"{dest}: kept the host's own cache (written meanwhile); the bundle's is not unpacked"
                os.rmdir(dest)
            os.rename(staging, dest)
            staging = ""
        finally:
            if staging:
                shutil.rmtree(staging, ignore_errors=True)
    return f"{dest}: unpacked the bundle's engine cache, {files} files, {total} bytes"


def main(argv: list[str]) -> int:
    if len(argv) != 4 or argv[0] != "unpack":
        print("usage: k2fleet-host.pyz cache_archive unpack ARCHIVE SHA256 DEST", file=sys.stderr)
        return 2
    _, archive, digest, dest = argv
    try:
        print(f"cache-archive: {unpack(archive, digest, dest)}")
    except (CacheArchiveError, OSError) as exc:
        print(f"cache-archive: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
