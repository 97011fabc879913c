"""Download a checkpoint at a pinned commit with huggingface_hub, verify it, repair bad files.

The token comes from a file (``--token-file``) or env ``HF_TOKEN`` and is never printed or put on
a command line; the endpoint comes from env ``HF_ENDPOINT`` (default: the Hub).

Resumption. huggingface_hub 2.4 resumes a dropped connection only within one call: each download goes to a
process-unique ``<hash>.<etag>.<uuid>.incomplete`` that is deleted on failure, so a killed or rebooted download
starts that file from zero again (read from its ``file_download.py``). k2fleet therefore fetches each file
itself with huggingface_hub's own pieces — :func:`hf_hub_url`, :func:`get_hf_file_metadata` (commit, ETag, size,
redirect), its auth headers, HTTP client and error mapping — into a *stable* partial file
``DIR/.k2fleet/partial/<file>.<etag>.part``, appended as bytes arrive. A later run (after a kill, a reboot, a
lost connection) sends ``Range: bytes=<partial size>-`` and only the missing tail crosses the network; a file
already in place is not fetched again. When the Hub marks a file as Xet-stored and ``hf_xet`` is installed, the
file goes through ``hf_hub_download`` instead (the fast path, which keeps its own chunk cache across runs).

Nothing is trusted because it was downloaded: each file is checked against the manifest as soon
as it is in place (size, header, and the hash taken as its bytes were written; fetched once more
at once if it fails), every download ends with :func:`k2fleet.hostprogs.verify.verify` (which
hashes nothing twice), and :func:`repair` deletes a bad file before fetching it again.

Pipelined (``--publish``, the fetcher host's download): the download feeds the checkpoint relay serving the same
directory (:mod:`k2fleet.hostprogs.relay`) file by file, in the order receivers take them: each file is served
the moment it passed its check, and while the download runs its heartbeat tells receivers to wait for the rest,
so the fleet holds the checkpoint about when the download ends (:class:`Landing`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from k2fleet.hostprogs import locks, relay
from k2fleet.hostprogs.manifest import build_manifest, hub_endpoint, is_commit_sha, manifest_path, read_token, save_manifest
from k2fleet.hostprogs.verify import (BAD_HEADER, CHANGED, HASH_MISMATCH, MISSING, SIZE_MISMATCH, Report, check_one,
                                      expected_hash, hash_fd, load_manifest, manifest_digest, new_hasher, pin_problem,
                                      remove_marker, stat_beneath, state_dir, verify)

log = logging.getLogger(__name__)

REPAIRABLE = {MISSING, SIZE_MISMATCH, HASH_MISMATCH, BAD_HEADER, CHANGED}


def _require_commit(revision: str) -> None:
    if not is_commit_sha(revision):
        raise ValueError(f"refusing to download revision {revision!r}: pin a 40-hex commit sha")


def download_lock(local_dir: str | os.PathLike[str]) -> contextlib.AbstractContextManager[None]:
    """Exclusive lock on ``DIR/.k2fleet/download.lock`` for the duration of the block: a polled
    ``flock`` (:func:`k2fleet.hostprogs.locks.exclusive`), so a second download of the same directory
    in another greenlet of pyinfra's process waits without blocking the holder."""
    return locks.exclusive(Path(state_dir(str(local_dir))) / "download.lock")


def remove_orphaned_partials(local_dir: str | os.PathLike[str]) -> None:
    """Delete ``*.incomplete`` files a killed ``hf_hub_download`` left (call while holding the lock):
    huggingface_hub never reuses them (their names are process-unique); k2fleet's own resumable
    ``.part`` files are kept."""
    base = Path(local_dir) / ".cache" / "huggingface" / "download"
    for path in sorted(base.rglob("*.incomplete")) if base.is_dir() else []:
        path.unlink(missing_ok=True)


PARTIAL_DIR = "partial"
_STREAM_CHUNK = 1 << 20  # bytes written per write(); the partial file grows as bytes arrive
_RETRIES_WITHOUT_PROGRESS = 5


def partial_path(local_dir: str | os.PathLike[str], rel: str, etag: str) -> Path:
    """Stable partial-download path of ``rel`` for content ``etag`` (same name on every run).

    >>> str(partial_path("/m/k2", "model-00001-of-000062.safetensors", '"ab12"'))
    '/m/k2/.k2fleet/partial/model-00001-of-000062.safetensors.ab12.part'
    """
    tag = "".join(c for c in etag if c.isalnum())[:64] or "noetag"
    return Path(state_dir(str(local_dir))) / PARTIAL_DIR / f"{rel}.{tag}.part"


def _transient_errors() -> tuple[type[BaseException], ...]:
    try:
        import httpx2 as httpx  # huggingface_hub 2.x
    except ImportError:  # pragma: no cover - huggingface_hub 1.x
        import httpx  # type: ignore[no-redef]
    return (httpx.TransportError,)


class _PartHash:
    """The hash of a partial file's bytes, kept in step as bytes are appended (``hasher``:
    a fresh :func:`k2fleet.hostprogs.verify.new_hasher`; None: nothing hashed). A prefix
    left by an earlier run is hashed from the file once."""

    def __init__(self, hasher: Any) -> None:
        self.fresh, self.hasher, self.upto = hasher, None, 0

    def follow(self, part: Path, have: int) -> None:
        """Make the hash cover exactly the first ``have`` bytes of ``part``."""
        if self.fresh is None or (self.hasher is not None and self.upto == have):
            return
        self.hasher, self.upto = self.fresh.copy(), 0
        if have:
            with open(part, "rb") as f:
                self.upto = hash_fd(f.fileno(), self.hasher, bytearray(_STREAM_CHUNK * 8))

    def restart(self) -> None:
        if self.fresh is not None:
            self.hasher, self.upto = self.fresh.copy(), 0

    def update(self, chunk: bytes) -> None:
        if self.hasher is not None:
            self.hasher.update(chunk)
            self.upto += len(chunk)

    def hexdigest(self, size: int) -> str | None:
        return self.hasher.hexdigest() if self.hasher is not None and self.upto == size else None


def _stream_into(url: str, part: Path, size: int | None, headers: dict[str, str], hashing: _PartHash) -> int:
    """Append ``url``'s bytes to ``part`` from its current size on; returns bytes received.

    ``Range: bytes=N-`` when ``part`` holds N bytes; a 200 answer (Range ignored) restarts
    the file, a 416 (partial longer than the file) discards it. A dropped connection is
    retried from the new end, up to 5 times in a row without progress. ``hashing``: kept
    in step with the partial file's bytes (so the file is not read again to be checked).
    """
    from huggingface_hub.utils import hf_raise_for_status, http_stream_backoff

    received, stalls = 0, 0
    while True:
        have = part.stat().st_size if part.exists() else 0
        if size is not None and have > size:
            part.unlink()
            have = 0
        hashing.follow(part, have)
        if size is not None and have == size:
            return received
        request = dict(headers)
        if have:
            request["Range"] = f"bytes={have}-"
        try:
            with http_stream_backoff("GET", url, headers=request, retry_on_exceptions=(),
                                     retry_on_status_codes=(408, 429, 500, 502, 503, 504)) as response:
                if response.status_code == 416:
                    part.unlink(missing_ok=True)
                    stalls += 1
                    if stalls > _RETRIES_WITHOUT_PROGRESS:
                        raise OSError(f"{url}: the server refuses every byte range")
                    continue
                hf_raise_for_status(response)
                mode = "ab" if have and response.status_code == 206 else "wb"
                if mode == "wb":
                    hashing.restart()
                with open(part, mode, buffering=0) as f:
                    for chunk in response.iter_bytes():
                        f.write(chunk)
                        hashing.update(chunk)
                        received += len(chunk)
                        stalls = 0
        except _transient_errors() as exc:
            stalls += 1
            if stalls > _RETRIES_WITHOUT_PROGRESS:
                raise
            log.warning("%s: %s; resuming from byte %d", url, exc, part.stat().st_size if part.exists() else 0)
            time.sleep(1)
            continue
        got = part.stat().st_size
        if size is None or got == size:
            return received
        if got > size:
            part.unlink()
            raise OSError(f"{url}: received {got} bytes, the Hub said {size}")
        stalls += 1  # a short body without an error: ask for the rest
        if stalls > _RETRIES_WITHOUT_PROGRESS:
            raise OSError(f"{url}: stuck at {got} of {size} bytes")


def fetch_file(repo_id: str, revision: str, local_dir: str | os.PathLike[str], rel: str, *, token: str | None = None,
               endpoint: str | None = None, entry: dict[str, Any] | None = None) -> dict[str, Any]:
    """Fetch ``rel`` at commit ``revision`` into ``local_dir/rel``, resuming a partial file.

    Returns ``{"path", "resumed_from", "received", "via", "digest"}``; ``via`` is ``http``
    or ``xet``; ``digest``: with the manifest's ``entry``, the hash :func:`verify.new_hasher`
    took of the bytes as they were written (http only; None: not hashed)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.utils import build_hf_headers
    from huggingface_hub.utils._runtime import is_xet_available

    _require_commit(revision)
    endpoint = hub_endpoint(endpoint)
    root = Path(local_dir)
    url = hf_hub_url(repo_id, rel, revision=revision, endpoint=endpoint)
    meta = get_hf_file_metadata(url, token=token, endpoint=endpoint)
    if meta.commit_hash and meta.commit_hash != revision:
        raise RuntimeError(f"{rel}: the Hub answered for commit {meta.commit_hash}, not the pinned {revision}")
    if meta.xet_file_data is not None and is_xet_available():
        hf_hub_download(repo_id, rel, revision=revision, local_dir=str(root), token=token, endpoint=endpoint)
        return {"path": rel, "resumed_from": 0, "received": meta.size, "via": "xet", "digest": None}
    headers = build_hf_headers(token=token)
    if urlsplit(meta.location)[:2] != urlsplit(url)[:2]:
        headers.pop("authorization", None)  # a signed CDN URL: the token stays with the Hub
    part = partial_path(root, rel, meta.etag or "")
    part.parent.mkdir(parents=True, exist_ok=True)
    resumed_from = part.stat().st_size if part.exists() else 0
    hashing = _PartHash(new_hasher(entry) if entry is not None else None)
    received = _stream_into(meta.location, part, meta.size, headers, hashing)
    digest = hashing.hexdigest(part.stat().st_size)
    dest = root / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(part, dest)
    if resumed_from:
        log.info("%s: resumed at byte %d, received %d", rel, resumed_from, received)
    return {"path": rel, "resumed_from": resumed_from, "received": received, "via": "http", "digest": digest}


class Landing:
    """Each file checked the moment it is in place (:func:`verify.check_one`: size, safetensors header, the hash
    taken as its bytes were written), so the final :func:`verify` hashes nothing twice (``hashed``) and a file
    whose bytes do not match is fetched again at once.

    ``publish``: the download feeds this host's checkpoint relay (``relay serve`` on the same directory) file by
    file, so receivers start while it runs — each file that passes is recorded where the relay looks
    (:func:`relay.write_mark`: served from then on, never before), and while the download runs its heartbeat
    (``relay-fetching``) tells receivers that the files not verified yet are coming (they wait, not fail).
    Nothing is served on an old record: :meth:`begin` drops every relay record and the verified marker, and
    files already in place are hashed again before they are served (:meth:`keep`)."""

    def __init__(self, root: str | os.PathLike[str], publish: bool = False) -> None:
        self.root, self.publish = str(root), publish
        self.manifest: dict[str, Any] = {"files": {}}
        self.hashed: dict[str, tuple[str, dict[str, int]]] = {}
        self._stop_beat: Any = None

    def start_heartbeat(self) -> None:
        """(publish) Receivers asking this host's relay from now on wait for what is missing."""
        if self.publish and self._stop_beat is None:
            os.makedirs(state_dir(self.root), exist_ok=True)
            self._stop_beat = relay.heartbeat(self.root)

    def begin(self, manifest: dict[str, Any]) -> None:
        """The pinned manifest is known: (publish) every older record goes."""
        self.manifest = manifest
        if self.publish:
            relay.drop_marks(self.root, manifest)

    def end(self) -> None:
        if self._stop_beat is not None:
            self._stop_beat()
            self._stop_beat = None

    def entry(self, rel: str) -> dict[str, Any] | None:
        return self.manifest["files"].get(rel)

    def check(self, rel: str, digest: str | None = None) -> bool:
        """Check ``rel`` in place (with ``digest``, the hash taken as it was written: not read
        again); when it passes, record it (and, publishing, serve it)."""
        entry = self.entry(rel)
        now = stat_beneath(self.root, rel)
        if now is None:
            return False
        stat, _ = check_one(self.root, self.manifest, rel, (digest, now) if digest else None)
        if stat is None or entry is None:
            self.hashed.pop(rel, None)
            return False
        self.hashed[rel] = (expected_hash(entry), stat)
        if self.publish:
            relay.write_mark(self.root, rel, entry, stat)
        return True

    def keep(self, rel: str) -> bool:
        """(publish) ``rel`` already in place and hashing right: kept (and served)."""
        return self.publish and os.path.isfile(os.path.join(self.root, rel)) and self.check(rel)


def fetch_files(repo_id: str, revision: str, local_dir: str | os.PathLike[str], files: list[str], *,
                token: str | None = None, endpoint: str | None = None, max_workers: int = 8,
                landing: Landing | None = None) -> list[dict[str, Any]]:
    """:func:`fetch_file` each of ``files`` in parallel, in that order; every file is attempted, then the first
    error (if any) is raised. Call while holding :func:`download_lock`. With ``landing``, each file is checked
    as soon as it is in place (fetched once more at once when it does not pass; the final :func:`verify` reports
    it if it still does not), and (publishing) a file already in place that hashes right is kept."""
    _require_commit(revision)
    errors: list[BaseException] = []
    done: list[dict[str, Any]] = []

    def fetch_checked(rel: str) -> dict[str, Any]:
        if landing is not None and landing.keep(rel):
            return {"path": rel, "resumed_from": 0, "received": 0, "via": "kept", "digest": None}
        entry = landing.entry(rel) if landing is not None else None
        result = fetch_file(repo_id, revision, local_dir, rel, token=token, endpoint=endpoint, entry=entry)
        if landing is not None and not landing.check(rel, result["digest"]):
            log.warning("%s: its bytes do not match the manifest; fetching it again", rel)
            _forget_local_copy(Path(local_dir), rel)
            result = fetch_file(repo_id, revision, local_dir, rel, token=token, endpoint=endpoint, entry=entry)
            landing.check(rel, result["digest"])
        return result

    def one(rel: str) -> dict[str, Any] | None:
        try:
            result = fetch_checked(rel)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the other files
            log.error("%s: %s", rel, exc)
            errors.append(exc)
            return None
        done.append(result)
        log.info("fetched %s (%d/%d files, %d bytes received so far)", rel, len(done), len(files),
                 sum(r["received"] or 0 for r in done))
        return result

    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(files) or 1))) as pool:
        results = [r for r in pool.map(one, files) if r is not None]
    if errors:
        raise errors[0]
    return results


def download(repo_id: str, revision: str, local_dir: str | os.PathLike[str], files: dict[str, Any], *,
             token: str | None = None, endpoint: str | None = None, max_workers: int = 8,
             landing: Landing | None = None) -> list[dict[str, Any]]:
    """Fetch the manifest's ``files`` of ``repo_id`` at commit ``revision`` that are not in ``local_dir`` yet
    (largest first); partial files from an earlier run are resumed. With a publishing ``landing``
    (:class:`Landing`): every file, in name order (the order receivers take them in), those in place hashed and
    kept when right, each checked and served as soon as it is in place."""
    _require_commit(revision)
    root = Path(local_dir)
    root.mkdir(parents=True, exist_ok=True)
    with download_lock(root):
        remove_orphaned_partials(root)
        missing = sorted((rel for rel in files if not (root / rel).is_file()),
                         key=lambda rel: (-int(files[rel].get("size") or 0), rel))
        _check_free_space(root, sum(int(files[rel].get("size") or 0) for rel in missing))
        todo = sorted(files) if landing is not None and landing.publish else missing
        results = fetch_files(repo_id, revision, root, todo, token=token, endpoint=endpoint, max_workers=max_workers,
                              landing=landing)
        shutil.rmtree(Path(state_dir(str(root))) / PARTIAL_DIR, ignore_errors=True)  # every wanted file is in place
    return results


def _check_free_space(root: Path, needed: int) -> None:
    part_dir = Path(state_dir(str(root))) / PARTIAL_DIR
    have = sum(p.stat().st_size for p in part_dir.rglob("*.part")) if part_dir.is_dir() else 0
    free = shutil.disk_usage(root).free
    if needed - have > free:
        raise OSError(f"{root}: {needed - have} bytes still to download but only {free} free")


def _forget_local_copy(local_dir: Path, rel: str) -> None:
    """Delete a file and huggingface_hub's ``.metadata`` for it, so it is fetched again."""
    (local_dir / rel).unlink(missing_ok=True)
    (local_dir / ".cache" / "huggingface" / "download" / f"{rel}.metadata").unlink(missing_ok=True)


def repair(local_dir: str | os.PathLike[str], manifest: dict[str, Any], bad_files: list[str], *,
           token: str | None = None, endpoint: str | None = None, max_workers: int = 4,
           landing: Landing | None = None) -> list[str]:
    """Delete and re-fetch only ``bad_files`` at the manifest's revision; returns them.

    The verified marker is removed first; run :func:`verify` afterwards.
    """
    unknown = sorted(set(bad_files) - set(manifest["files"]))
    if unknown:
        raise ValueError(f"not in the manifest, cannot repair: {', '.join(unknown)}")
    root = Path(local_dir)
    files = sorted(set(bad_files))
    with download_lock(root):
        remove_marker(str(root))
        remove_orphaned_partials(root)
        for rel in files:
            _forget_local_copy(root, rel)
        fetch_files(manifest["repo_id"], manifest["revision"], root, files, token=token, endpoint=endpoint,
                    max_workers=max_workers, landing=landing)
    return files


def repairable_files(report: Report) -> list[str]:
    """Files whose problems a re-download can fix (missing, size, hash, header)."""
    return sorted({p.path for p in report.problems if p.kind in REPAIRABLE})


class PinMismatch(ValueError):
    """The Hub's manifest for the pinned revision is not the one the control machine pinned."""


def ensure_manifest(repo_id: str, revision: str, local_dir: str | os.PathLike[str], *, token: str | None,
                    endpoint: str | None, allow_patterns: list[str] | None = None,
                    digest: str | None = None) -> dict[str, Any]:
    """The directory's manifest if it pins this repo and revision (and, given ``digest``, has that
    :func:`~k2fleet.hostprogs.verify.manifest_digest`), else a fresh one from the Hub (saved), of the files
    matching ``allow_patterns`` (None: all). A fresh one of another digest than ``digest`` raises
    :class:`PinMismatch` before it is saved (nothing is fetched for it)."""
    _require_commit(revision)
    path = manifest_path(local_dir)
    if path.is_file():
        try:
            existing = load_manifest(str(path))
        except (OSError, ValueError):
            existing = {}
        if not pin_problem(existing, repo_id, revision, digest):
            return existing
    manifest = build_manifest(repo_id, revision, endpoint=hub_endpoint(endpoint), token=token,
                              allow_patterns=allow_patterns)
    if digest is not None and (got := manifest_digest(manifest)) != digest:
        raise PinMismatch(f"the Hub's manifest of {repo_id}@{revision} has digest {got}, not the control machine's "
                          f"pin {digest}: refusing it (nothing downloaded)")
    save_manifest(local_dir, manifest)
    return manifest


def fetch_and_verify(repo_id: str, revision: str, local_dir: str | os.PathLike[str], *, token: str | None = None,
                     endpoint: str | None = None, only: list[str] | None = None, max_workers: int = 8,
                     allow_patterns: list[str] | None = None, digest: str | None = None,
                     publish: bool = False) -> Report:
    """Manifest → download (or re-fetch ``only``) → verify → repair bad files once → verify. ``digest``: the
    control machine's pin of the manifest (:func:`ensure_manifest`). Each file is checked as soon as it is in
    place (:class:`Landing`), so the final verify hashes nothing twice. ``publish``: feed this host's checkpoint
    relay file by file while downloading (:class:`Landing`).
    """
    landing = Landing(local_dir, publish)
    try:
        landing.start_heartbeat()  # before the manifest appears: receivers wait for the files
        manifest = ensure_manifest(repo_id, revision, local_dir, token=token, endpoint=endpoint,
                                   allow_patterns=allow_patterns, digest=digest)
        landing.begin(manifest)
        if only:
            repair(local_dir, manifest, only, token=token, endpoint=endpoint, max_workers=max_workers, landing=landing)
        else:
            download(repo_id, revision, local_dir, manifest["files"], token=token, endpoint=endpoint,
                     max_workers=max_workers, landing=landing)
        report = verify(str(local_dir), manifest, hashed=landing.hashed)
        bad = repairable_files(report)
        if bad and len(bad) == len({p.path for p in report.problems}):
            log.warning("re-fetching %d bad file(s): %s", len(bad), ", ".join(bad))
            repair(local_dir, manifest, bad, token=token, endpoint=endpoint, max_workers=max_workers, landing=landing)
            report = verify(str(local_dir), manifest, hashed=landing.hashed)
    finally:
        landing.end()
    return report


def main(argv: list[str] | None = None) -> int:
    """``python -m k2fleet.hostprogs.download REPO --revision SHA --dir D [--token-file F] [--only FILE...]
    [--pattern GLOB...] [--max-workers N] [--publish] [--manifest-digest D]``."""
    ap = argparse.ArgumentParser(prog="python -m k2fleet.hostprogs.download")
    ap.add_argument("repo_id")
    ap.add_argument("--revision", required=True, help="40-hex commit sha (branches and tags are refused)")
    ap.add_argument("--dir", required=True, help="local directory to download into")
    ap.add_argument("--token-file", help="file holding the Hub token (default: env HF_TOKEN)")
    ap.add_argument("--only", nargs="+", metavar="FILE", help="delete and re-fetch only these files")
    ap.add_argument("--max-workers", type=int, default=8)
    ap.add_argument("--pattern", nargs="+", metavar="GLOB", help="only the repository files matching these globs")
    ap.add_argument("--manifest-digest", help="the control machine's pin of the manifest: the Hub's must have it")
    ap.add_argument("--publish", action="store_true",
                    help="feed this host's checkpoint relay (relay serve on --dir) each file as soon as it is verified")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not is_commit_sha(args.revision):
        print(f"error: revision {args.revision!r} is not a 40-hex commit sha; pin one", file=sys.stderr)
        return 2
    try:
        report = fetch_and_verify(args.repo_id, args.revision, args.dir, token=read_token(args.token_file),
                                  only=args.only, max_workers=args.max_workers, allow_patterns=args.pattern,
                                  digest=args.manifest_digest, publish=args.publish)
    except PinMismatch as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("\n".join(report.lines()))
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
