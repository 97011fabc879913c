"""Hugging Face Hub TEST DOUBLE: a loopback-only stand-in for the Hub's HTTP API.

Import it as ``from k2sandbox.hub_double import HubDouble`` (tests and benches).

This is a test double, not a Hub. It is a threaded stdlib ``http.server`` on
``127.0.0.1:<free port>`` that serves local directories as model repos at
fixed commit shas, implementing exactly what huggingface_hub 2.4's
``HfApi.model_info``/``repo_info``, ``snapshot_download`` and
``hf_hub_download`` (plain HTTP, no Xet) call:

* ``GET /api/models/{repo}`` and ``GET /api/models/{repo}/revision/{rev}``
  (``?blobs=true`` adds ``size``/``blobId``/``lfs{sha256,size,pointerSize}`` to
  each sibling);
* ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=True`` (one page, no
  ``Link`` header);
* ``HEAD``/``GET /{repo}/resolve/{rev}/{path}`` with ``ETag`` (LFS: the quoted
  sha256, otherwise the git blob sha1), ``X-Repo-Commit``, ``X-Linked-Etag``,
  ``X-Linked-Size`` (LFS only), ``Content-Length``, ``Accept-Ranges`` and
  ``Range: bytes=N-[M]`` answered with ``206`` + ``Content-Range``;
* 404s carry ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``,
  ``EntryNotFound``) as the Hub does, so huggingface_hub raises its usual errors.

For tests and benchmarks it counts bytes served per file and logs every
request (method, path, Range, Authorization), can cut the next K GET
responses of a file after N bytes (closing the connection, as a dropped
download would), stall one after N bytes (as a hung download would, until
released) or fail them with a status, and keeps branches ("main") that
can be moved to another commit.

Example:
    >>> with HubDouble() as hub:                                  # doctest: +SKIP
    ...     sha = hub.add_commit("moonshotai/Kimi-K2-Thinking", "/tmp/ckpt")
    ...     os.environ["HF_ENDPOINT"] = hub.url
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".model", ".png", ".bin", ".pt", ".gguf")
LAST_MODIFIED = "2025-11-06T12:00:00.000Z"


@dataclass(frozen=True)
class BlobInfo:
    """What the Hub knows about one file at one commit."""

    path: str
    local: Path
    size: int
    git_blob_sha1: str
    sha256: str | None  # set for LFS files only
    pointer_size: int | None  # size of the LFS pointer file

    @property
    def blob_id(self) -> str:
        """git oid of the file in the repo (the pointer's sha1 for LFS files)."""
        return self._pointer_sha1 if self.sha256 else self.git_blob_sha1

    @property
    def _pointer_sha1(self) -> str:
        pointer = _lfs_pointer(self.sha256 or "", self.size)
        return hashlib.sha1(b"blob %d\0" % len(pointer) + pointer).hexdigest()

    @property
    def etag(self) -> str:
        """The ETag the Hub sends: sha256 for LFS files, git blob sha1 otherwise."""
        return self.sha256 or self.git_blob_sha1


@dataclass
class RequestRecord:
    """One request the double answered."""

    method: str
    path: str
    rfilename: str | None
    range: str | None
    status: int
    authorization: str | None
    sent: int = 0
    client: str = ""  # the address the request came from


@dataclass
class _Fault:
    after_bytes: int | None  # cut after this many body bytes (None: fail with status)
    status: int
    times: int
    stalled: threading.Event | None = None  # stall (not cut) after after_bytes; set once the bytes are out


@dataclass
class _Repo:
    commits: dict[str, dict[str, BlobInfo]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)


def _lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def describe_blob(root: Path, rel: str, lfs_suffixes: tuple[str, ...] = LFS_SUFFIXES) -> BlobInfo:
    """Hash one file the way the Hub reports it (git sha1; sha256 for LFS files)."""
    local = root / rel
    size = local.stat().st_size
    sha1 = hashlib.sha1(b"blob %d\0" % size)
    sha256 = hashlib.sha256()
    with open(local, "rb") as f:
        while chunk := f.read(1 << 22):
            sha1.update(chunk)
            sha256.update(chunk)
    if rel.endswith(lfs_suffixes):
        return BlobInfo(rel, local, size, sha1.hexdigest(), sha256.hexdigest(), len(_lfs_pointer(sha256.hexdigest(), size)))
    return BlobInfo(rel, local, size, sha1.hexdigest(), None, None)


class HubDouble:
    """Hugging Face Hub TEST DOUBLE serving local directories over loopback HTTP.

    Example:
        >>> hub = HubDouble().start()                             # doctest: +SKIP
        >>> sha = hub.add_commit("org/model", "/tmp/ckpt")        # doctest: +SKIP
        >>> hub.bytes_served["config.json"]                       # doctest: +SKIP
        0
        >>> hub.stop()                                            # doctest: +SKIP
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, lfs_suffixes: tuple[str, ...] = LFS_SUFFIXES) -> None:
        self.lfs_suffixes = lfs_suffixes
        self.repos: dict[str, _Repo] = {}
        self.bytes_served: Counter[str] = Counter()
        self._release = threading.Event()
        self.requests: list[RequestRecord] = []
        self._faults: dict[str, list[_Fault]] = {}
        self._lock = threading.Lock()
        handler = type("_BoundHandler", (_Handler,), {"hub": self})
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------- lifecycle
    @property
    def url(self) -> str:
        """Endpoint to use as HF_ENDPOINT, e.g. ``http://127.0.0.1:40123``."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "HubDouble":
        """Serve in a background thread."""
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub-double", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._release.set()
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "HubDouble":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----------------------------------------------------------------- content
    def add_commit(self, repo_id: str, directory: str | os.PathLike[str], sha: str | None = None, branch: str | None = "main") -> str:
        """Serve ``directory`` (read at request time, do not modify it) as a commit of ``repo_id``.

        Moves ``branch`` to the new commit; returns the commit sha.
        """
        root = Path(directory)
        blobs = {}
        for path in sorted(root.rglob("*")):
            rel = path.relative_to(root).as_posix()
            if path.is_file() and rel.split("/")[0] not in (".k2fleet", ".cache"):
                blobs[rel] = describe_blob(root, rel, self.lfs_suffixes)
        if sha is None:
            listing = json.dumps([repo_id] + [[b.path, b.etag] for b in blobs.values()]).encode()
            sha = hashlib.sha1(listing).hexdigest()
        repo = self.repos.setdefault(repo_id, _Repo())
        repo.commits[sha] = blobs
        if branch:
            repo.refs[branch] = sha
        return sha

    def load_directory(self, root: str | os.PathLike[str]) -> dict[str, list[str]]:
        """Serve every ``ROOT/<org>/<name>/<40-hex sha>/`` as a commit; ``refs.json`` beside them maps branches.

        Returns {repo_id: [shas]}.
        """
        served: dict[str, list[str]] = {}
        for commit_dir in sorted(Path(root).glob("*/*/*")):
            if commit_dir.is_dir() and len(commit_dir.name) == 40:
                repo_id = f"{commit_dir.parent.parent.name}/{commit_dir.parent.name}"
                served.setdefault(repo_id, []).append(self.add_commit(repo_id, commit_dir, commit_dir.name, None))
        for refs_file in Path(root).glob("*/*/refs.json"):
            repo_id = f"{refs_file.parent.parent.name}/{refs_file.parent.name}"
            for branch, sha in json.loads(refs_file.read_text()).items():
                self.set_branch(repo_id, branch, sha)
        return served

    def set_branch(self, repo_id: str, branch: str, sha: str) -> None:
        """Point ``branch`` of ``repo_id`` at commit ``sha`` (a moving branch)."""
        repo = self.repos[repo_id]
        if sha not in repo.commits:
            raise KeyError(sha)
        repo.refs[branch] = sha

    # ----------------------------------------------------------------- faults & counters
    def cut_next(self, rfilename: str, after_bytes: int, times: int = 1) -> None:
        """The next ``times`` GETs of ``rfilename`` send ``after_bytes`` body bytes, then drop the connection."""
        with self._lock:
            self._faults.setdefault(rfilename, []).append(_Fault(after_bytes, 0, times))

    def stall_next(self, rfilename: str, after_bytes: int) -> threading.Event:
        """The next GET of ``rfilename`` sends ``after_bytes`` body bytes, then hangs (as a
        stuck download would) until :meth:`release` or :meth:`stop`, then drops the
        connection. Returns an event set once those bytes are sent."""
        stalled = threading.Event()
        with self._lock:
            self._faults.setdefault(rfilename, []).append(_Fault(after_bytes, 0, 1, stalled))
        return stalled

    def release(self) -> None:
        """Let stalled responses end (their connections are dropped)."""
        self._release.set()

    def fail_next(self, rfilename: str, status: int = 403, times: int = 1) -> None:
        """The next ``times`` GETs of ``rfilename`` answer ``status`` with no body."""
        with self._lock:
            self._faults.setdefault(rfilename, []).append(_Fault(None, status, times))

    def clear_faults(self) -> None:
        """Forget pending cuts and failures."""
        with self._lock:
            self._faults.clear()

    def reset_counters(self) -> None:
        """Zero ``bytes_served`` and clear ``requests``."""
        with self._lock:
            self.bytes_served.clear()
            self.requests.clear()

    def requests_for(self, rfilename: str, method: str | None = None) -> list[RequestRecord]:
        """Logged requests of one repo file (optionally one method)."""
        with self._lock:
            return [r for r in self.requests if r.rfilename == rfilename and (method is None or r.method == method)]

    def _take_fault(self, rfilename: str) -> _Fault | None:
        with self._lock:
            queue = self._faults.get(rfilename)
            if not queue:
                return None
            fault = queue[0]
            fault.times -= 1
            if fault.times <= 0:
                queue.pop(0)
            return fault

    def _log(self, record: RequestRecord) -> None:
        with self._lock:
            self.requests.append(record)
            if record.rfilename is not None and record.sent:
                self.bytes_served[record.rfilename] += record.sent

    # ----------------------------------------------------------------- lookups
    def resolve(self, repo_id: str, rev: str) -> tuple[_Repo | None, str | None]:
        """(repo, commit sha) for a branch name or sha; None where unknown."""
        repo = self.repos.get(repo_id)
        if repo is None:
            return None, None
        if rev in repo.commits:
            return repo, rev
        return repo, repo.refs.get(rev)

    def model_info_json(self, repo_id: str, sha: str, blobs: bool) -> dict[str, Any]:
        """Body of ``/api/models/{repo}/revision/{rev}``."""
        siblings = []
        for b in self.repos[repo_id].commits[sha].values():
            sib: dict[str, Any] = {"rfilename": b.path}
            if blobs:
                sib.update(size=b.size, blobId=b.blob_id)
                if b.sha256:
                    sib["lfs"] = {"sha256": b.sha256, "size": b.size, "pointerSize": b.pointer_size}
            siblings.append(sib)
        return {
            "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
            "id": repo_id,
            "modelId": repo_id,
            "author": repo_id.split("/")[0],
            "sha": sha,
            "lastModified": LAST_MODIFIED,
            "createdAt": LAST_MODIFIED,
            "private": False,
            "gated": False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": ["safetensors", "kimi_k2", "test-double"],
            "library_name": "transformers",
            "siblings": siblings,
        }

    def tree_json(self, repo_id: str, sha: str, prefix: str, recursive: bool) -> list[dict[str, Any]]:
        """Body of ``/api/models/{repo}/tree/{rev}/{prefix}``."""
        base = prefix.strip("/") + "/" if prefix.strip("/") else ""
        entries: dict[str, dict[str, Any]] = {}
        for b in self.repos[repo_id].commits[sha].values():
            if not b.path.startswith(base):
                continue
            rest = b.path[len(base):].split("/")
            for depth in range(1, len(rest)):
                folder = base + "/".join(rest[:depth])
                if depth == 1 or recursive:
                    oid = hashlib.sha1(folder.encode()).hexdigest()
                    entries.setdefault(folder, {"type": "directory", "oid": oid, "size": 0, "path": folder})
            if len(rest) == 1 or recursive:
                entry: dict[str, Any] = {"type": "file", "oid": b.blob_id, "size": b.size, "path": b.path}
                if b.sha256:
                    entry["lfs"] = {"oid": b.sha256, "size": b.size, "pointerSize": b.pointer_size}
                entries[b.path] = entry
        return list(entries.values())


class _Handler(BaseHTTPRequestHandler):
    """Routes requests of the Hub API subset huggingface_hub uses."""

    hub: HubDouble
    protocol_version = "HTTP/1.1"
    server_version = "HubDouble/1.0"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def do_HEAD(self) -> None:  # noqa: N802 - stdlib naming
        self._dispatch(head=True)

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        self._dispatch(head=False)

    # ----------------------------------------------------------------- routing
    def _dispatch(self, head: bool) -> None:
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.split("/")[1:]]
        query = parse_qs(url.query)
        if len(parts) >= 4 and parts[0] == "api" and parts[1] == "models":
            self._api(parts[2] + "/" + parts[3], parts[4:], query, head)
        elif len(parts) >= 5 and parts[2] == "resolve":
            self._resolve(parts[0] + "/" + parts[1], parts[3], "/".join(parts[4:]), head)
        else:
            self._error(404, "RepoNotFound", "unknown route")

    def _api(self, repo_id: str, rest: list[str], query: dict[str, list[str]], head: bool) -> None:
        kind = rest[0] if rest else "revision"
        rev = rest[1] if len(rest) > 1 else "main"
        repo, sha = self.hub.resolve(repo_id, rev)
        if repo is None:
            return self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        if kind == "revision":
            blobs = query.get("blobs", ["false"])[0].lower() == "true"
            return self._json(self.hub.model_info_json(repo_id, sha, blobs), head)
        if kind == "tree":
            recursive = query.get("recursive", ["false"])[0].lower() == "true"
            return self._json(self.hub.tree_json(repo_id, sha, "/".join(rest[2:]), recursive), head)
        self._error(404, "RepoNotFound", "unknown api route")

    def _resolve(self, repo_id: str, rev: str, rfilename: str, head: bool) -> None:
        repo, sha = self.hub.resolve(repo_id, rev)
        if repo is None:
            return self._error(404, "RepoNotFound", f"Repository {repo_id} not found", rfilename)
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", rfilename)
        blob = repo.commits[sha].get(rfilename)
        if blob is None:
            return self._error(404, "EntryNotFound", f"{rfilename} does not exist", rfilename, sha)
        fault = None if head else self.hub._take_fault(rfilename)
        if fault is not None and fault.after_bytes is None:
            return self._error(fault.status, "Forbidden", "injected failure", rfilename, sha)
        self._send_blob(blob, sha, head, fault)

    # ----------------------------------------------------------------- responses
    def _record(self, status: int, rfilename: str | None = None, sent: int = 0) -> None:
        self.hub._log(
            RequestRecord(
                self.command, urlsplit(self.path).path, rfilename, self.headers.get("Range"), status,
                self.headers.get("Authorization"), sent, self.client_address[0],
            )
        )

    def _json(self, obj: Any, head: bool) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)
        self._record(200)

    def _error(self, status: int, code: str, message: str, rfilename: str | None = None, sha: str | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if sha:
            self.send_header("X-Repo-Commit", sha)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self._record(status, rfilename)

    def _byte_range(self, size: int) -> tuple[int, int] | None:
        """(start, end inclusive) from a ``Range: bytes=N-[M]`` header; None if no/invalid range."""
        header = self.headers.get("Range")
        if not header or not header.startswith("bytes=") or "," in header:
            return None
        start_s, _, end_s = header[len("bytes="):].partition("-")
        if not start_s.isdigit():
            return None
        start = int(start_s)
        end = min(int(end_s), size - 1) if end_s.isdigit() else size - 1
        return (start, end)

    def _send_blob(self, blob: BlobInfo, sha: str, head: bool, fault: _Fault | None) -> None:
        size = blob.size
        rng = self._byte_range(size)
        if rng is not None and rng[0] >= size:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return self._record(416, blob.path)
        start, end = rng if rng is not None else (0, size - 1)
        length = max(0, end - start + 1)
        status = 206 if rng is not None else 200
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{blob.etag}"')
        self.send_header("X-Repo-Commit", sha)
        if blob.sha256:
            self.send_header("X-Linked-Etag", f'"{blob.sha256}"')
            self.send_header("X-Linked-Size", str(size))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if head:
            return self._record(status, blob.path)
        count = length if fault is None else min(length, fault.after_bytes or 0)
        sent = self._sendfile(blob.local, start, count)
        self._record(status, blob.path, sent)
        if fault is not None and fault.stalled is not None:
            self.wfile.flush()
            fault.stalled.set()
            self.hub._release.wait(timeout=300)
        if fault is not None and count < length:
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _sendfile(self, path: Path, offset: int, count: int) -> int:
        if count <= 0:
            return 0
        with open(path, "rb") as f:
            try:
                return self.connection.sendfile(f, offset, count)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True
                return 0
