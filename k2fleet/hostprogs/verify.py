#!/usr/bin/env python3
"""Verify a downloaded checkpoint directory against its manifest.

STANDARD LIBRARY ONLY: it runs on fleet hosts from the host archive as
``python3 k2fleet-host.pyz verify DIR [--manifest PATH] [--full] [--workers N] [--json]``.

What is checked:

* every file of the manifest is present with the manifest's size;
* every shard named by ``model.safetensors.index.json``'s ``weight_map`` is in the manifest
  (and so on disk), and every ``.safetensors`` file beside the index is named by it;
* every ``.safetensors`` header parses (8-byte little-endian length, JSON, ``data_offsets``
  inside the file, byte counts consistent with dtype/shape);
* every file's sha256 (LFS files) or git blob sha1 (small non-LFS files) matches.

Files are hashed concurrently (one thread per file, ``hashlib`` releases the GIL), ``STREAMS_PER_WORKER`` files
per hashing worker so that one file's read waits overlap another's hashing; each thread reads sequentially
(``POSIX_FADV_SEQUENTIAL``) into one reused 1 MiB buffer, so memory use is constant. When everything passes,
``DIR/.k2fleet/verified.json`` records the manifest digest and each file's size, mtime_ns, ctime_ns and inode; a
later run without ``--full`` does not re-hash a file whose stat is unchanged. A failed run removes the marker.

Manifest (``DIR/.k2fleet/manifest.json``)::

    {"repo_id": "moonshotai/Kimi-K2-Thinking",
     "revision": "<40-hex commit>",
     "files": {"config.json": {"size": 3571, "sha256": null, "git_blob_sha1": "<40 hex>"},
               "model-00001-of-000062.safetensors": {"size": 9_000_000_000, "sha256": "<64 hex>"}},
     "overlay": {...optional, ignored here...}}
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import stat as _stat
import struct
import sys
import threading
import time

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is not imported on the fact's path (every deploy's --marker-only check)
    from collections.abc import Iterator
    from typing import Any

STATE_DIR = ".k2fleet"
MANIFEST_NAME = "manifest.json"
MARKER_NAME = "verified.json"
INDEX_NAME = "model.safetensors.index.json"
# The copy-and-hash block is 1 MiB so it stays in L2 (2-core bench, cold: 512 KiB and 1 MiB beat 2 and 4 MiB).
# Read-ahead is left to the kernel (POSIX_FADV_SEQUENTIAL doubles its window): an explicit POSIX_FADV_WILLNEED
# window issued from the hashing thread allocates and submits its pages synchronously there (20% slower cold).
# With one thread per core, a core idles whenever its thread waits for the disk; STREAMS_PER_WORKER threads per
# core keep disk and cores busy (2-core bench, cold: 1, 2, 3, 4 streams per core = 1.45, 1.31, 1.19, 1.19 s for
# 3 GB; warm: all equal).
BLOCK_SIZE = 1024 * 1024
STREAMS_PER_WORKER = 3
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024
MARKER_FORMAT = 1

MISSING = "missing"
SIZE_MISMATCH = "size_mismatch"
BAD_HEADER = "bad_header"
HASH_MISMATCH = "hash_mismatch"
NOT_IN_INDEX = "not_in_index"
INDEX_UNKNOWN_SHARD = "index_unknown_shard"
BAD_INDEX = "bad_index"
BAD_MANIFEST = "bad_manifest"
CHANGED = "changed_during_verify"
UNREADABLE = "unreadable"


def is_hex(text: str, length: int) -> bool:
    """Is ``text`` ``length`` lowercase hex digits (``re.fullmatch("[0-9a-f]{N}", text)``)?

    >>> is_hex("0" * 40, 40), is_hex("A" * 40, 40), is_hex("0" * 39, 40), is_hex("0" * 39 + "\\n", 40)
    (True, False, False, False)
    """
    return len(text) == length and not text.strip("0123456789abcdef")

_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}


class Problem:
    """One thing wrong with one file (or with the manifest/index)."""

    __slots__ = ("path", "kind", "detail")

    def __init__(self, path: str, kind: str, detail: str = "") -> None:
        self.path, self.kind, self.detail = path, kind, detail

    def __repr__(self) -> str:
        return f"Problem({self.path!r}, {self.kind!r}, {self.detail!r})"

    def to_dict(self) -> dict[str, str]:
        return {"path": self.path, "kind": self.kind, "detail": self.detail}

    def line(self) -> str:
        """One human-readable line, e.g. ``FAIL hash_mismatch model-1.safetensors: ...``."""
        return f"FAIL {self.kind} {self.path}: {self.detail}".rstrip(": ")


class Report:
    """Outcome of :func:`verify`; ``ok`` is True only when ``problems`` is empty."""

    FIELDS = ("dir", "revision", "ok", "problems", "files_total", "files_hashed", "files_skipped", "bytes_total",
              "bytes_hashed", "seconds", "full", "marker_written", "warnings")

    def __init__(self, dir: str, revision: str, problems: list[Problem] | None = None, full: bool = False) -> None:
        self.dir, self.revision, self.ok, self.full = dir, revision, False, full
        self.problems: list[Problem] = list(problems or [])
        self.files_total = self.files_hashed = self.files_skipped = 0
        self.bytes_total = self.bytes_hashed = 0
        self.seconds = 0.0
        self.marker_written = False
        self.warnings: list[str] = []

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (used by ``--json``): every field of :data:`FIELDS`."""
        out = {name: getattr(self, name) for name in self.FIELDS}
        out["problems"] = [p.to_dict() for p in self.problems]
        return out

    def lines(self) -> list[str]:
        """One line per problem, then one summary line."""
        out = [p.line() for p in sorted(self.problems, key=lambda p: (p.path, p.kind))]
        out += [f"WARN {w}" for w in self.warnings]
        rate = self.bytes_hashed / self.seconds / 1e6 if self.seconds > 0 else 0.0
        summary = (
            f"{self.files_total} files, {self.bytes_total} bytes; hashed {self.files_hashed} "
            f"({self.bytes_hashed} bytes, {rate:.0f} MB/s), unchanged since last verify "
            f"{self.files_skipped}; {self.seconds:.2f}s"
        )
        if self.ok:
            out.append(f"OK revision {self.revision}: {summary}")
        else:
            out.append(f"FAILED revision {self.revision}: {len(self.problems)} problem(s); {summary}")
        return out


# --------------------------------------------------------------------------- manifest


def state_dir(root: str) -> str:
    """``ROOT/.k2fleet`` (not created)."""
    return os.path.join(root, STATE_DIR)


def load_manifest(path: str) -> dict[str, Any]:
    """Read a manifest JSON file (:func:`manifest_from_bytes`: strict UTF-8, no BOM, no
    duplicate key; ValueError otherwise).
    """
    with open(path, "rb") as f:
        return manifest_from_bytes(f.read())


def load_manifest_in(root: str) -> dict[str, Any]:
    """``ROOT/.k2fleet/manifest.json`` read without following a symlink below ``root``."""
    return manifest_from_bytes(read_beneath(root, os.path.join(STATE_DIR, MANIFEST_NAME)))


def manifest_from_bytes(raw: bytes) -> Any:
    """The manifest in ``raw`` as every k2fleet reader sees it: strict UTF-8 (no byte order mark, no UTF-16/32 —
    ``json.loads`` of bytes would guess those), one JSON value, no object with a key twice, no NaN/Infinity.
    ValueError otherwise. Digests are taken of what this returns for the bytes as stored
    (:func:`manifest_digest_of`), so two byte strings with one digest are one manifest to every reader.

    >>> manifest_from_bytes(b'{"a": 1}')
    {'a': 1}
    >>> for bad in (b'\\xef\\xbb\\xbf{}', '{}'.encode('utf-16'), b'{"a": 1, "a": 2}', b'[NaN]', b'{"a": "\\xff"}'):
    ...     try:
    ...         manifest_from_bytes(bad)
    ...     except ValueError:
    ...         pass
    ...     else:
    ...         print("accepted", bad)
    """
    raw = bytes(raw)
    if raw.startswith(b"\xef\xbb\xbf"):
        raise ValueError("the manifest starts with a byte order mark (it must be plain UTF-8)")
    text = raw.decode("utf-8", "strict")  # UnicodeDecodeError is a ValueError
    return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"the key {twice!r} appears twice in one object")
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def manifest_problems(manifest: Any) -> list[Problem]:
    """Structural problems of a manifest (empty list when it is usable).

    >>> manifest_problems({"repo_id": "a/b", "revision": "0" * 40, "files": {}})
    []
    """
    if not isinstance(manifest, dict):
        return [Problem("<manifest>", BAD_MANIFEST, "not a JSON object")]
    out: list[Problem] = []
    rev = manifest.get("revision")
    if not isinstance(rev, str) or not is_hex(rev, 40):
        out.append(Problem("<manifest>", BAD_MANIFEST, f"revision {rev!r} is not a 40-hex commit sha"))
    files = manifest.get("files")
    if not isinstance(files, dict):
        return out + [Problem("<manifest>", BAD_MANIFEST, "'files' is not an object")]
    for rel, entry in files.items():
        out += _entry_problems(rel, entry)
    for rel in files:  # a name that is a file and (a parent of) another file: no directory tree holds both
        parts = rel.split("/") if isinstance(rel, str) else []
        clash = next(("/".join(parts[:i]) for i in range(1, len(parts)) if "/".join(parts[:i]) in files), None)
        if clash is not None:
            out.append(Problem(rel, BAD_MANIFEST, f"names {clash} as a directory, and the manifest has {clash} as a file"))
    return out


def _entry_problems(rel: str, entry: Any) -> list[Problem]:
    if not _safe_relpath(rel):
        return [Problem(rel, BAD_MANIFEST, "path is absolute or escapes the directory")]
    size = entry.get("size") if isinstance(entry, dict) else None
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return [Problem(rel, BAD_MANIFEST, "entry has no integer 'size'")]
    sha256, sha1 = entry.get("sha256"), entry.get("git_blob_sha1")
    if isinstance(sha256, str) and is_hex(sha256, 64):
        return []
    if sha256 is None and isinstance(sha1, str) and is_hex(sha1, 40):
        return []
    return [Problem(rel, BAD_MANIFEST, "entry has neither a sha256 nor a git_blob_sha1")]


def plain_relpath(rel: str) -> bool:
    """A plain relative name: no absolute path, no empty, ``.`` or ``..`` part, no control
    character or backslash (a checkpoint's files, the members of an engine cache archive).

    >>> [plain_relpath(r) for r in ("a/b.json", "/etc/x", "a/../b", "./a", "a//b", "a\\tb", "a\\\\b")]
    [True, False, False, False, False, False, False]
    """
    return (isinstance(rel, str) and bool(rel) and all(p not in ("", ".", "..") for p in rel.split("/"))
            and "\\" not in rel and not any(ord(c) < 32 or ord(c) == 127 for c in rel))


def _safe_relpath(rel: str) -> bool:
    """A :func:`plain_relpath` inside the checkpoint, not under k2fleet's own ``.k2fleet/`` (its
    manifest and markers).

    >>> _safe_relpath("a/b.json"), _safe_relpath(".k2fleet/verified.json")
    (True, False)
    """
    return plain_relpath(rel) and rel.split("/")[0] != STATE_DIR


def manifest_digest_of(raw: bytes) -> str:
    """:func:`manifest_digest` of the manifest stored as ``raw``, read as every reader reads
    it (:func:`manifest_from_bytes`: ValueError for bytes it refuses). What a pin compares:
    the bytes as they are stored, never a more lenient decoding of them."""
    return manifest_digest(manifest_from_bytes(raw))


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's identity (repo_id, revision, files); ``overlay`` is excluded.
    Of a manifest read by :func:`manifest_from_bytes` (:func:`manifest_digest_of`).

    >>> len(manifest_digest({"repo_id": "a/b", "revision": "0" * 40, "files": {}}))
    64
    """
    core = {k: manifest.get(k) for k in ("repo_id", "revision", "files")}
    return hashlib.sha256(json.dumps(core, separators=(",", ":"), sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------- files beneath the root

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC


def open_dir_beneath(root: str, reldir: str, create: bool = False) -> int:
    """An fd of directory ``ROOT/reldir``, every component below ``root`` opened without following a symlink
    (``O_NOFOLLOW|O_DIRECTORY`` from the directory above): a symlinked directory inside the model directory is
    never gone through (OSError naming it). ``create``: missing directories are made (0755). ``root`` itself is
    the operator's path, taken as given. The caller closes the fd."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    done = []
    try:
        for part in reldir.split("/"):
            if part in ("", "."):
                continue
            if part == "..":
                raise OSError(22, f"{os.path.join(root, *done, part)}: '..' is not followed")
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                nfd = _open_dir_part(root, done, part, fd)
            except OSError as e:
                nfd = _open_dir_part(root, done, part, fd, e)
            os.close(fd)
            fd = nfd
            done.append(part)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_dir_part(root: str, done: list[str], part: str, fd: int, error: OSError | None = None) -> int:
    """Open one component (again), or raise an OSError that says it is a symlink."""
    if error is None:
        try:
            return os.open(part, _DIR_FLAGS, dir_fd=fd)
        except OSError as e:
            error = e
    try:
        mode = os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode
    except OSError:
        raise error from None
    where = os.path.join(root, *done, part)
    if _stat.S_ISLNK(mode):
        raise OSError(error.errno, f"{where} is a symlink: k2fleet neither reads nor writes through one "
                      "inside the model directory (remove it)") from None
    raise OSError(error.errno, f"{where} is not a directory ({error.strerror})") from None


def open_beneath(root: str, rel: str, flags: int = os.O_RDONLY, mode: int = 0o644, create_dirs: bool = False,
                 follow_last: bool = False) -> int:
    """``os.open`` of ``ROOT/rel`` without following a symlink at any component below ``root``
    (:func:`open_dir_beneath`; the last one with ``O_NOFOLLOW`` unless ``follow_last``: a read-only check of a
    huggingface cache snapshot, whose files are symlinks to its blobs)."""
    with parent_beneath(root, rel, create_dirs) as (dfd, name):
        try:
            return os.open(name, flags | (0 if follow_last else os.O_NOFOLLOW) | _CLOEXEC, mode, dir_fd=dfd)
        except OSError as e:
            if e.errno != 40:  # ELOOP: the last component is a symlink
                raise
            raise OSError(e.errno, f"{os.path.join(root, rel)} is a symlink: k2fleet neither reads nor "
                          "writes through one inside the model directory (remove it)") from None


@contextlib.contextmanager
def parent_beneath(root: str, rel: str, create: bool = False) -> Iterator[tuple[int, str]]:
    """(an fd of ``ROOT/rel``'s directory: :func:`open_dir_beneath`, ``rel``'s last component),
    the fd closed when the block ends."""
    head, _, name = rel.rpartition("/")
    dfd = open_dir_beneath(root, head, create)
    try:
        yield dfd, name
    finally:
        os.close(dfd)


def read_beneath(root: str, rel: str, limit: int = 1 << 30, follow_last: bool = False) -> bytes:
    """The bytes of ``ROOT/rel`` (:func:`open_beneath`), at most ``limit``."""
    with os.fdopen(open_beneath(root, rel, follow_last=follow_last), "rb") as f:
        return f.read(limit)


def stat_beneath(root: str, rel: str) -> dict[str, int] | None:
    """The stat record of regular file ``ROOT/rel`` reached without following a symlink
    (None: missing, a symlink, not a regular file, or behind a symlinked directory)."""
    try:
        with parent_beneath(root, rel) as (dfd, name):
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return None
    return _stat_record(st) if _stat.S_ISREG(st.st_mode) else None


def write_beneath(root: str, rel: str, data: bytes, durable: bool = True) -> None:
    """Write ``data`` to ``ROOT/rel`` atomically (temp file, fsync, rename in the same directory, fsync of it),
    no component below ``root`` followed if a symlink. ``durable=False``: no fsync (still atomic: a reader sees
    the old file or the whole new one), for a record whose loss after a crash costs only work done again."""
    with parent_beneath(root, rel, create=True) as (dfd, name):
        tmp = f".{name}.tmp.{os.getpid()}.{threading.get_ident()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | _CLOEXEC, 0o644, dir_fd=dfd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            os.unlink(tmp, dir_fd=dfd)
            raise
        if durable:
            os.fsync(dfd)


def unlink_beneath(root: str, rel: str) -> None:
    """Remove ``ROOT/rel`` (itself, never what a symlink points to); nothing if missing or
    behind a symlinked directory."""
    head, _, name = rel.rpartition("/")
    try:
        dfd = open_dir_beneath(root, head)
    except OSError:
        return
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dfd)
    finally:
        os.close(dfd)


# --------------------------------------------------------------------------- marker


def marker_path(root: str) -> str:
    """``ROOT/.k2fleet/verified.json``."""
    return os.path.join(state_dir(root), MARKER_NAME)


def _stat_record(st: os.stat_result) -> dict[str, int]:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino}


def load_marker(root: str, manifest: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per-file stat records of a marker that matches ``manifest`` ({} if none/stale)."""
    try:
        marker = json.loads(read_beneath(root, os.path.join(STATE_DIR, MARKER_NAME)))
    except (OSError, ValueError):
        return {}
    if (
        not isinstance(marker, dict)
        or marker.get("format") != MARKER_FORMAT
        or marker.get("revision") != manifest.get("revision")
        or marker.get("manifest_sha256") != manifest_digest(manifest)
        or not isinstance(marker.get("files"), dict)
    ):
        return {}
    return marker["files"]


def write_marker(root: str, manifest: dict[str, Any], stats: dict[str, dict[str, int]]) -> None:
    """Atomically write ``verified.json`` (temp file, fsync, rename, fsync dir)."""
    marker = {
        "format": MARKER_FORMAT,
        "repo_id": manifest.get("repo_id"),
        "revision": manifest["revision"],
        "manifest_sha256": manifest_digest(manifest),
        "verified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": stats,
    }
    write_beneath(root, os.path.join(STATE_DIR, MARKER_NAME), (json.dumps(marker, indent=1, sort_keys=True) + "\n").encode())


def remove_marker(root: str) -> None:
    """Delete ``verified.json`` if present (not through a symlinked ``.k2fleet``)."""
    unlink_beneath(root, os.path.join(STATE_DIR, MARKER_NAME))


def atomic_write_json(path: str, obj: Any) -> None:
    """Write JSON to ``path`` atomically and durably (:func:`write_beneath` in its directory, made if missing)."""
    directory, name = os.path.split(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    write_beneath(directory, name, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def is_verified(root: str, manifest: dict[str, Any]) -> bool:
    """True when a matching marker exists and no file's stat changed since (no hashing).

    >>> is_verified("/nonexistent", {"revision": "0" * 40, "files": {}})
    False
    """
    recorded = load_marker(root, manifest)
    if not recorded or set(recorded) != set(manifest.get("files", {})):
        return False
    # a file behind a symlink is not the one verified
    return all(stat_beneath(root, rel) == rec for rel, rec in recorded.items())


# --------------------------------------------------------------------------- checks


def safetensors_header_problem(fd: int, size: int) -> str | None:
    """Why the safetensors header of open file ``fd`` (``size`` bytes) is bad, or None.

    >>> import tempfile
    >>> with tempfile.TemporaryFile() as f:
    ...     _ = f.write(b"\\x02\\x00\\x00\\x00\\x00\\x00\\x00\\x00{}"); f.flush()
    ...     safetensors_header_problem(f.fileno(), 10) is None
    True
    """
    if size < 8:
        return f"file is {size} bytes, shorter than the 8-byte header length"
    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if n < 2 or n > min(MAX_SAFETENSORS_HEADER, size - 8):
        return f"header length {n} does not fit a {size}-byte file"
    raw = os.pread(fd, n, 8)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        return f"header is not valid JSON ({e.__class__.__name__})"
    if not isinstance(header, dict):
        return "header is not a JSON object"
    data_size = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        why = _tensor_problem(info, data_size)
        if why:
            return f"tensor {name!r}: {why}"
    return None


def _tensor_problem(info: Any, data_size: int) -> str | None:
    if not isinstance(info, dict):
        return "entry is not an object"
    offs, shape, dtype = info.get("data_offsets"), info.get("shape"), info.get("dtype")
    if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(x, int) for x in offs)):
        return "data_offsets is not [begin, end]"
    begin, end = offs
    if not 0 <= begin <= end <= data_size:
        return f"data_offsets {offs} outside the {data_size}-byte data section"
    if not (isinstance(shape, list) and all(isinstance(x, int) and x >= 0 for x in shape)):
        return "shape is not a list of non-negative integers"
    itemsize = _DTYPE_BYTES.get(dtype) if isinstance(dtype, str) else None
    if itemsize is not None and math.prod(shape) * itemsize != end - begin:
        return f"{dtype}{shape} needs {math.prod(shape) * itemsize} bytes, data_offsets give {end - begin}"
    return None


def new_hasher(entry: dict[str, Any]) -> Any:
    """The hash object a manifest entry's file is checked with (sha256, or the git blob
    sha1 with its header), fresh: feed it the file's bytes in order."""
    if entry.get("sha256"):
        return hashlib.sha256()
    h = hashlib.sha1()
    h.update(b"blob %d\0" % entry["size"])
    return h


def expected_hash(entry: dict[str, Any]) -> str:
    """The hex digest a manifest entry's file must have: its sha256, else its git blob sha1."""
    return entry.get("sha256") or entry["git_blob_sha1"]


def hash_fd(fd: int, hasher: Any, buf: bytearray) -> int:
    """Stream ``fd`` from offset 0 into ``hasher`` using ``buf``; returns bytes hashed.

    Declares the access ``POSIX_FADV_SEQUENTIAL`` (the kernel doubles its readahead window and
    keeps it ahead of the reads) and reads into ``buf`` without copying it again; the overlap of
    disk and CPU comes from the other files' threads (see ``STREAMS_PER_WORKER``).
    """
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    view = memoryview(buf)
    total = 0
    os.lseek(fd, 0, os.SEEK_SET)
    while True:
        n = os.readv(fd, [view])
        if n <= 0:
            return total
        hasher.update(view[:n])
        total += n


class _FileResult:
    __slots__ = ("rel", "problems", "stat", "hashed_bytes", "skipped")

    def __init__(self, rel: str) -> None:
        self.rel = rel
        self.problems: list[Problem] = []
        self.stat: dict[str, int] | None = None
        self.hashed_bytes = 0
        self.skipped = False


class _Verifier:
    """Per-run state: root, manifest, prior marker, per-thread buffers."""

    def __init__(self, root: str, manifest: dict[str, Any], full: bool,
                 hashed: dict[str, tuple[str, dict[str, int]]] | None = None, file_symlinks: bool = False) -> None:
        self.root, self.file_symlinks = root, file_symlinks
        self.files: dict[str, dict[str, Any]] = manifest["files"]
        self.prior = {} if full else load_marker(root, manifest)
        self.hashed = hashed or {}  # rel → (hex digest, stat record) of a hash the caller took of the file
        self._local = threading.local()

    def _buffer(self) -> bytearray:
        if not hasattr(self._local, "buf"):
            self._local.buf = bytearray(BLOCK_SIZE)
        return self._local.buf

    def check(self, rel: str) -> _FileResult:
        """Size, header and hash checks of one manifest file."""
        res = _FileResult(rel)
        try:
            fd = open_beneath(self.root, rel, follow_last=self.file_symlinks)  # never through a symlinked directory
        except FileNotFoundError:
            res.problems.append(Problem(rel, MISSING, "not on disk"))
            return res
        except OSError as e:
            res.problems.append(Problem(rel, UNREADABLE, str(e)))
            return res
        try:
            problem = self._check_open(fd, res, self.files[rel])
        except OSError as e:
            problem = Problem(rel, UNREADABLE, str(e))
        finally:
            os.close(fd)
        res.problems += [problem] if problem else []
        return res

    def _check_open(self, fd: int, res: _FileResult, entry: dict[str, Any]) -> Problem | None:
        before = _stat_record(os.fstat(fd))
        if before["size"] != entry["size"]:
            return Problem(res.rel, SIZE_MISMATCH, f"expected {entry['size']} bytes, found {before['size']}")
        if res.rel.endswith(".safetensors") and (why := safetensors_header_problem(fd, before["size"])):
            return Problem(res.rel, BAD_HEADER, why)
        if self.prior.get(res.rel) == before:
            res.stat, res.skipped = before, True
            return None
        hasher, expected = new_hasher(entry), expected_hash(entry)
        if res.rel in self.hashed:  # hashed by the caller as it was written: the same file, unchanged since?
            got, when = self.hashed[res.rel]
            if when != before:
                return Problem(res.rel, CHANGED, "file changed after it was hashed")
            res.hashed_bytes = before["size"]
        else:
            res.hashed_bytes = hash_fd(fd, hasher, self._buffer())
            got = hasher.hexdigest()
        if got != expected:
            algo = "sha256" if entry.get("sha256") else "git_blob_sha1"
            return Problem(res.rel, HASH_MISMATCH, f"{algo} expected {expected}, got {got}")
        if _stat_record(os.fstat(fd)) != before or res.hashed_bytes != before["size"]:
            return Problem(res.rel, CHANGED, "file changed while it was being hashed")
        res.stat = before
        return None


def check_one(root: str, manifest: dict[str, Any], rel: str,
              hashed: tuple[str, dict[str, int]] | None = None) -> tuple[dict[str, int] | None, list[Problem]]:
    """Every check of one manifest file, hashing it (size, safetensors header, sha256 or
    git blob sha1, unchanged while hashed): (its stat record, []) when it passes, else
    (None, problems). The checkpoint relay verifies each received file with it.

    ``hashed``: (hex digest, stat record) of a hash the caller already took of the whole
    file (:func:`new_hasher`; the relay hashes a file as it lands): compared instead of
    hashing again, provided the file's stat is still the one recorded then."""
    res = _Verifier(root, manifest, full=True, hashed={rel: hashed} if hashed else None).check(rel)
    return (res.stat, []) if res.stat is not None and not res.problems else (None, res.problems)


def index_problems(root: str, manifest: dict[str, Any], file_symlinks: bool = False) -> list[Problem]:
    """Cross-check ``model.safetensors.index.json``'s weight_map against the manifest.

    >>> index_problems("/nonexistent", {"files": {}})
    []
    """
    files: dict[str, Any] = manifest["files"]
    index_rels = [rel for rel in files if rel.rsplit("/", 1)[-1] == INDEX_NAME]
    if not index_rels and os.path.exists(os.path.join(root, INDEX_NAME)):
        index_rels = [INDEX_NAME]
    return [p for index_rel in index_rels for p in _one_index_problems(root, index_rel, files, file_symlinks)]


def _one_index_problems(root: str, index_rel: str, files: dict[str, Any], file_symlinks: bool = False) -> list[Problem]:
    prefix = index_rel[: -len(INDEX_NAME)]
    try:
        weight_map = json.loads(read_beneath(root, index_rel, follow_last=file_symlinks).decode("utf-8"))["weight_map"]
        if not isinstance(weight_map, dict):
            raise ValueError("weight_map is not an object")
    except FileNotFoundError:
        return []  # reported as missing by the per-file checks when it is in the manifest
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [Problem(index_rel, BAD_INDEX, f"cannot read weight_map ({e.__class__.__name__}: {e})")]
    named = {prefix + str(shard) for shard in weight_map.values()}
    out: list[Problem] = []
    for shard in sorted(named - set(files)):
        where = "on disk" if os.path.exists(os.path.join(root, shard)) else "not on disk either"
        out.append(Problem(shard, INDEX_UNKNOWN_SHARD, f"named by {index_rel} but not in the manifest ({where})"))
    for rel in sorted(files):
        in_dir = rel.startswith(prefix) and "/" not in rel[len(prefix):]
        if in_dir and rel.endswith(".safetensors") and rel not in named:
            out.append(Problem(rel, NOT_IN_INDEX, f"shard is not named by {index_rel}"))
    return out


def default_workers() -> int:
    """Number of hashing workers: the CPUs this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def verify(root: str, manifest: dict[str, Any], full: bool = False, workers: int | None = None,
           hashed: dict[str, tuple[str, dict[str, int]]] | None = None, file_symlinks: bool = False) -> Report:
    """Verify directory ``root`` against ``manifest``; write or remove the marker.

    With ``full=False`` a file whose size, mtime_ns, ctime_ns and inode match the marker of a previous
    successful run is not re-hashed. ``workers``: cores to keep hashing (default: all usable CPUs), each running
    ``STREAMS_PER_WORKER`` file threads so read waits overlap hashing. ``hashed``: file → (hex digest, stat
    record) of a hash the caller took of it (the download hashes each file as it is written): compared instead
    of hashing again, provided the file's stat is still the one recorded then (sizes and headers are still
    checked). No file is read through a symlinked directory inside ``root``, nor through a symlinked file unless
    ``file_symlinks`` (a huggingface cache snapshot, checked read-only: such a file is still never served by the
    relay nor passed by the stat-only gate).
    """
    t0 = time.monotonic()
    report = Report(dir=root, revision=str(manifest.get("revision")), full=full)
    report.problems = manifest_problems(manifest)
    if report.problems:
        return _finish(report, root, manifest, {}, t0)
    files: dict[str, dict[str, Any]] = manifest["files"]
    report.files_total = len(files)
    report.bytes_total = sum(int(e["size"]) for e in files.values())
    report.problems += index_problems(root, manifest, file_symlinks)
    verifier = _Verifier(root, manifest, full, hashed, file_symlinks=file_symlinks)
    order = sorted(files, key=lambda rel: -int(files[rel]["size"]))
    nthreads = max(1, min((workers or default_workers()) * STREAMS_PER_WORKER, len(order) or 1))
    from concurrent.futures import ThreadPoolExecutor  # not imported by the fact's --marker-only check

    with ThreadPoolExecutor(max_workers=nthreads, thread_name_prefix="k2verify") as pool:
        results = list(pool.map(verifier.check, order))
    stats: dict[str, dict[str, int]] = {}
    for res in results:
        report.problems += res.problems
        report.bytes_hashed += res.hashed_bytes
        report.files_hashed += 1 if res.hashed_bytes or (res.stat and not res.skipped) else 0
        report.files_skipped += 1 if res.skipped else 0
        if res.stat is not None:
            stats[res.rel] = res.stat
    return _finish(report, root, manifest, stats, t0)


def _finish(report: Report, root: str, manifest: dict[str, Any], stats: dict[str, dict[str, int]], t0: float) -> Report:
    report.ok = not report.problems
    try:
        if report.ok:
            write_marker(root, manifest, stats)
            report.marker_written = True
        else:
            remove_marker(root)
    except OSError as e:
        report.warnings.append(f"could not update {marker_path(root)}: {e}")
    report.seconds = time.monotonic() - t0
    return report


# --------------------------------------------------------------------------- CLI


def pin_problem(manifest: Any, repo: str | None, revision: str | None, digest: str | None = None) -> str | None:
    """Why ``manifest`` is not of the pinned ``repo``, ``revision`` and manifest ``digest``
    (:func:`manifest_digest`: the control machine's pin of every file's size and hash)
    (None: it is, or nothing is pinned).

    >>> pin_problem({"repo_id": "m/k", "revision": "a" * 40}, "m/k", "b" * 40)[:19]
    'manifest revision a'
    >>> pin_problem({"repo_id": "m/k", "revision": "a" * 40}, "m/k", "a" * 40) is None
    True
    >>> pin_problem({"repo_id": "m/k", "revision": "a" * 40, "files": {}}, "m/k", "a" * 40, "0" * 64)[:27]
    'manifest digest 5eaf9247171'
    """
    if not isinstance(manifest, dict):
        return "manifest is not a JSON object"
    if repo is not None and manifest.get("repo_id") != repo:
        return f"manifest repo {manifest.get('repo_id')!r} is not the pinned {repo}"
    if revision is not None and manifest.get("revision") != revision:
        return f"manifest revision {manifest.get('revision')} is not the pinned {revision}"
    if digest is not None and (got := manifest_digest(manifest)) != digest:
        return f"manifest digest {got} is not the pinned {digest} (files other than the pinned revision's)"
    return None


def _parser() -> Any:
    import argparse  # not imported by the fact's --marker-only check (nor by revisions, which reads through this module)

    ap = argparse.ArgumentParser(prog="verify.py", description="Verify a checkpoint directory against its manifest.")
    ap.add_argument("dir")
    ap.add_argument("--manifest", help="manifest path (default DIR/.k2fleet/manifest.json)")
    ap.add_argument("--full", action="store_true", help="re-hash every file, ignoring the verified marker")
    ap.add_argument("--workers", type=int, default=None, help="cores to keep hashing (default: CPU count); "
                    f"{STREAMS_PER_WORKER} files are read per worker so disk waits overlap hashing")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--marker-only", action="store_true",
                    help="read-only: exit 0 only if the verified marker matches the manifest and no file's "
                    "stat changed since; hashes nothing and never writes or removes the marker")
    ap.add_argument("--repo", help="the pinned repository: a manifest of another fails (nothing is served from it)")
    ap.add_argument("--revision", help="the pinned revision: a manifest of another fails")
    ap.add_argument("--manifest-digest", help="the pinned manifest's sha256 (the control machine's pin): any other fails")
    return ap


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code (0 ok, 1 problems)."""
    args = _parser().parse_args(argv)
    root = os.path.abspath(args.dir)
    mpath = args.manifest or os.path.join(state_dir(root), MANIFEST_NAME)
    try:
        manifest = load_manifest(mpath)
        problem = pin_problem(manifest, args.repo, args.revision, args.manifest_digest)
    except (OSError, ValueError) as e:
        manifest, problem = {"revision": "?"}, f"cannot load: {e}"
    if args.marker_only:
        return 0 if not problem and is_verified(root, manifest) else 1
    if problem:
        report = Report(dir=root, revision=str(manifest.get("revision")), problems=[Problem(mpath, BAD_MANIFEST, problem)])
        report = _finish(report, root, {}, {}, time.monotonic())
    else:
        report = verify(root, manifest, full=args.full, workers=args.workers)
    print(json.dumps(report.to_dict(), indent=1, sort_keys=True) if args.json else "\n".join(report.lines()))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
