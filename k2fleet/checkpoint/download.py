"""Download a checkpoint at a pinned commit with huggingface_hub, verify it, repair bad files.

The token comes from a file (``--token-file``) or env ``HF_TOKEN`` and is
never printed or put on a command line; the endpoint comes from env
``HF_ENDPOINT`` (default: the Hub).

Resumption, as huggingface_hub 2.4 actually behaves (read from its
``file_download.py``):

* Within one run, a connection dropped mid-file is retried by ``http_get``
  with ``Range: bytes=N-`` from the last whole 10 MiB chunk it had written
  (up to 5 retries without progress, 1 s apart).
* Across runs, a partial file is *not* resumed: each download goes to a
  process-unique ``.cache/huggingface/download/<hash>.<etag>.<uuid>.incomplete``
  that is deleted when the download fails (a killed process leaves it as an
  orphan, which :func:`download` removes). Finished files are kept and are not
  fetched again: a re-run only fetches what is missing.
* A present file whose ``.metadata`` names the pinned commit is trusted
  without any check — which is why every download is followed by
  :func:`k2fleet.checkpoint.verify.verify`, and :func:`repair` deletes a bad
  file (and its metadata) before fetching it again.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

from k2fleet.checkpoint.manifest import build_manifest, is_commit_sha, manifest_path, save_manifest
from k2fleet.checkpoint.verify import (
    BAD_HEADER,
    CHANGED,
    HASH_MISMATCH,
    MISSING,
    SIZE_MISMATCH,
    Report,
    load_manifest,
    remove_marker,
    state_dir,
    verify,
)

log = logging.getLogger(__name__)

REPAIRABLE = {MISSING, SIZE_MISMATCH, HASH_MISMATCH, BAD_HEADER, CHANGED}


def read_token(token_file: str | os.PathLike[str] | None = None) -> str | None:
    """Hub token from ``token_file`` if given, else env ``HF_TOKEN``, else None. Never log it.

    Example:
        >>> read_token("/run/secrets/hf_token")  # doctest: +SKIP
        'hf_...'
    """
    if token_file:
        token = Path(token_file).read_text(encoding="utf-8").strip()
        if not token:
            raise ValueError(f"token file {token_file} is empty")
        return token
    return os.environ.get("HF_TOKEN") or None


def hub_endpoint(endpoint: str | None = None) -> str | None:
    """``endpoint`` or env ``HF_ENDPOINT`` (None: huggingface_hub's default).

    Example:
        >>> hub_endpoint("http://127.0.0.1:8080/")
        'http://127.0.0.1:8080'
    """
    value = endpoint or os.environ.get("HF_ENDPOINT")
    return value.rstrip("/") if value else None


def _require_commit(revision: str) -> None:
    if not is_commit_sha(revision):
        raise ValueError(f"refusing to download revision {revision!r}: pin a 40-hex commit sha")


@contextlib.contextmanager
def download_lock(local_dir: str | os.PathLike[str]) -> Iterator[None]:
    """Exclusive ``flock`` on ``DIR/.k2fleet/download.lock`` for the duration of the block."""
    lock_dir = Path(state_dir(str(local_dir)))
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / "download.lock", "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def remove_orphaned_partials(local_dir: str | os.PathLike[str]) -> list[Path]:
    """Delete ``*.incomplete`` files a killed download left (call while holding the lock)."""
    base = Path(local_dir) / ".cache" / "huggingface" / "download"
    removed = sorted(base.rglob("*.incomplete")) if base.is_dir() else []
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


def download(
    repo_id: str,
    revision: str,
    local_dir: str | os.PathLike[str],
    *,
    token: str | None = None,
    endpoint: str | None = None,
    allow_patterns: list[str] | None = None,
    max_workers: int = 8,
) -> Path:
    """Fetch ``repo_id`` at commit ``revision`` into ``local_dir`` (only missing files are fetched).

    Example:
        >>> download("moonshotai/Kimi-K2-Thinking", "6126...", "/models/k2",
        ...          token=read_token(), max_workers=16)  # doctest: +SKIP
        PosixPath('/models/k2')
    """
    from huggingface_hub import snapshot_download

    _require_commit(revision)
    Path(local_dir).mkdir(parents=True, exist_ok=True)
    with download_lock(local_dir):
        remove_orphaned_partials(local_dir)
        path = snapshot_download(
            repo_id,
            revision=revision,
            local_dir=str(local_dir),
            allow_patterns=allow_patterns,
            max_workers=max_workers,
            token=token,
            endpoint=hub_endpoint(endpoint),
        )
    return Path(path)


def fetch_files(
    repo_id: str,
    revision: str,
    local_dir: str | os.PathLike[str],
    files: list[str],
    *,
    token: str | None = None,
    endpoint: str | None = None,
    max_workers: int = 4,
) -> None:
    """``hf_hub_download`` each of ``files`` at ``revision`` into ``local_dir`` (in parallel)."""
    from huggingface_hub import hf_hub_download

    _require_commit(revision)

    def one(rel: str) -> str:
        return hf_hub_download(
            repo_id, rel, revision=revision, local_dir=str(local_dir), token=token, endpoint=hub_endpoint(endpoint)
        )

    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(files) or 1))) as pool:
        list(pool.map(one, files))


def _forget_local_copy(local_dir: Path, rel: str) -> None:
    """Delete a file and huggingface_hub's ``.metadata`` for it, so it is fetched again."""
    (local_dir / rel).unlink(missing_ok=True)
    meta = local_dir / ".cache" / "huggingface" / "download" / f"{rel}.metadata"
    meta.unlink(missing_ok=True)


def repair(
    local_dir: str | os.PathLike[str],
    manifest: dict[str, Any],
    bad_files: list[str],
    *,
    token: str | None = None,
    endpoint: str | None = None,
    max_workers: int = 4,
) -> list[str]:
    """Delete and re-fetch only ``bad_files`` at the manifest's revision; returns them.

    The verified marker is removed first; run :func:`verify` afterwards.

    Example:
        >>> r = verify("/models/k2", m)                                         # doctest: +SKIP
        >>> repair("/models/k2", m, sorted({p.path for p in r.problems}))        # doctest: +SKIP
        ['model-00007-of-000062.safetensors']
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
        fetch_files(
            manifest["repo_id"], manifest["revision"], root, files,
            token=token, endpoint=endpoint, max_workers=max_workers,
        )
    return files


def repairable_files(report: Report) -> list[str]:
    """Files whose problems a re-download can fix (missing, size, hash, header)."""
    return sorted({p.path for p in report.problems if p.kind in REPAIRABLE})


def ensure_manifest(
    repo_id: str, revision: str, local_dir: str | os.PathLike[str], *, token: str | None, endpoint: str | None
) -> dict[str, Any]:
    """The directory's manifest if it pins this repo and revision, else a fresh one from the Hub (saved)."""
    _require_commit(revision)
    path = manifest_path(local_dir)
    if path.is_file():
        existing = load_manifest(str(path))
        if existing.get("repo_id") == repo_id and existing.get("revision") == revision:
            return existing
    manifest = build_manifest(repo_id, revision, endpoint=hub_endpoint(endpoint), token=token)
    save_manifest(local_dir, manifest)
    return manifest


def fetch_and_verify(
    repo_id: str,
    revision: str,
    local_dir: str | os.PathLike[str],
    *,
    token: str | None = None,
    endpoint: str | None = None,
    only: list[str] | None = None,
    max_workers: int = 8,
) -> Report:
    """Manifest → download (or re-fetch ``only``) → verify → repair bad files once → verify.

    Example:
        >>> fetch_and_verify("moonshotai/Kimi-K2-Thinking", "6126...", "/models/k2").ok  # doctest: +SKIP
        True
    """
    manifest = ensure_manifest(repo_id, revision, local_dir, token=token, endpoint=endpoint)
    if only:
        repair(local_dir, manifest, only, token=token, endpoint=endpoint, max_workers=max_workers)
    else:
        download(
            repo_id, revision, local_dir, token=token, endpoint=endpoint,
            allow_patterns=sorted(manifest["files"]), max_workers=max_workers,
        )
    report = verify(str(local_dir), manifest)
    bad = repairable_files(report)
    if bad and len(bad) == len({p.path for p in report.problems}):
        log.warning("re-fetching %d bad file(s): %s", len(bad), ", ".join(bad))
        repair(local_dir, manifest, bad, token=token, endpoint=endpoint, max_workers=max_workers)
        report = verify(str(local_dir), manifest)
    return report


def main(argv: list[str] | None = None) -> int:
    """``python -m k2fleet.checkpoint.download REPO --revision SHA --dir D [--token-file F] [--only FILE...]``."""
    ap = argparse.ArgumentParser(prog="python -m k2fleet.checkpoint.download")
    ap.add_argument("repo_id")
    ap.add_argument("--revision", required=True, help="40-hex commit sha (branches and tags are refused)")
    ap.add_argument("--dir", required=True, help="local directory to download into")
    ap.add_argument("--token-file", help="file holding the Hub token (default: env HF_TOKEN)")
    ap.add_argument("--only", nargs="+", metavar="FILE", help="delete and re-fetch only these files")
    ap.add_argument("--max-workers", type=int, default=8)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not is_commit_sha(args.revision):
        print(f"error: revision {args.revision!r} is not a 40-hex commit sha; pin one", file=sys.stderr)
        return 2
    report = fetch_and_verify(
        args.repo_id, args.revision, args.dir,
        token=read_token(args.token_file), only=args.only, max_workers=args.max_workers,
    )
    for line in report.lines():
        print(line)
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
