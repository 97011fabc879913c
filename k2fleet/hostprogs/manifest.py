"""Build k2fleet checkpoint manifests from the Hugging Face Hub or from a local directory.

A manifest pins a repo to one 40-hex commit and lists every file with its size and sha256 (LFS files) or git
blob sha1 (small non-LFS files); see :mod:`k2fleet.hostprogs.verify` for the format. k2fleet never serves a
checkpoint that was not verified against one.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
from pathlib import Path
from typing import Any

from k2fleet.hostprogs.verify import (MANIFEST_NAME, atomic_write_json, is_hex, load_manifest, manifest_problems,
                                      state_dir)

log = logging.getLogger(__name__)

class UnpinnedRevisionError(ValueError):
    """The revision is a branch/tag (or unknown), not a 40-hex commit sha."""


def is_commit_sha(revision: str | None) -> bool:
    """True for a full 40-hex lowercase commit sha.

    >>> is_commit_sha("main"), is_commit_sha("a" * 40)
    (False, True)
    """
    return isinstance(revision, str) and is_hex(revision, 40)


def hub_endpoint(endpoint: str | None = None) -> str | None:
    """``endpoint`` or env ``HF_ENDPOINT`` (None: huggingface_hub's default).

    >>> hub_endpoint("http://127.0.0.1:8080/")
    'http://127.0.0.1:8080'
    """
    value = endpoint or os.environ.get("HF_ENDPOINT")
    return value.rstrip("/") if value else None


def build_manifest(repo_id: str, revision: str, *, endpoint: str | None = None, token: str | None = None,
                   allow_patterns: list[str] | None = None, resolve: bool = False) -> dict[str, Any]:
    """Manifest of ``repo_id`` at a pinned commit, from the Hub's file metadata.

    A branch or tag is refused (:class:`UnpinnedRevisionError`, whose message names the commit it currently
    points at) unless ``resolve=True``, in which case it is resolved to ``info.sha``, logged, and recorded as
    ``resolved_from`` — the deploy must still pin the returned revision.
    """
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub_endpoint(endpoint), token=token)
    info = api.model_info(repo_id, revision=revision, files_metadata=True)
    if not is_commit_sha(info.sha):
        raise UnpinnedRevisionError(f"the Hub returned no commit sha for {repo_id}@{revision}")
    manifest: dict[str, Any] = {"repo_id": repo_id, "revision": info.sha}
    if not is_commit_sha(revision):
        if not resolve:
            raise UnpinnedRevisionError(f"revision {revision!r} of {repo_id} is not a commit sha; it currently points "
                                        f"at {info.sha}. Pin that sha (or pass resolve=True to record it explicitly).")
        log.warning("resolved %s@%s to commit %s; pin this sha in the deploy", repo_id, revision, info.sha)
        manifest["resolved_from"] = revision
    elif info.sha != revision:
        raise UnpinnedRevisionError(f"asked for {revision} but the Hub answered for commit {info.sha}")
    manifest["files"] = _files_from_siblings(info.siblings or [], allow_patterns)
    _raise_on_problems(manifest)
    return manifest


def _files_from_siblings(siblings: list[Any], allow_patterns: list[str] | None) -> dict[str, dict[str, Any]]:
    files: dict[str, dict[str, Any]] = {}
    for sib in siblings:
        if not matches(sib.rfilename, allow_patterns):
            continue
        if sib.lfs is not None:
            files[sib.rfilename] = {"size": int(sib.lfs.size), "sha256": sib.lfs.sha256}
        else:
            if sib.size is None or sib.blob_id is None:
                raise ValueError(f"no size/blob id for {sib.rfilename}: call model_info with files_metadata=True")
            files[sib.rfilename] = {"size": int(sib.size), "sha256": None, "git_blob_sha1": sib.blob_id}
    return dict(sorted(files.items()))


def matches(path: str, patterns: list[str] | None) -> bool:
    """Whether ``path`` matches any fnmatch pattern (all paths match ``None``).

    >>> matches("model-1-of-61.safetensors", ["*.safetensors"])
    True
    """
    return patterns is None or any(fnmatch.fnmatch(path, p) for p in patterns)


def _raise_on_problems(manifest: dict[str, Any]) -> None:
    problems = manifest_problems(manifest)
    if problems:
        raise ValueError("invalid manifest: " + "; ".join(p.line() for p in problems))


def manifest_path(root: str | os.PathLike[str]) -> Path:
    """``ROOT/.k2fleet/manifest.json``."""
    return Path(state_dir(str(root))) / MANIFEST_NAME


def save_manifest(root: str | os.PathLike[str], manifest: dict[str, Any]) -> Path:
    """Validate and atomically write ``manifest`` to ``ROOT/.k2fleet/manifest.json``."""
    _raise_on_problems(manifest)
    atomic_write_json(str(path := manifest_path(root)), manifest)
    return path


def manifest_from_dir(root: str | os.PathLike[str], repo_id: str | None = None) -> dict[str, Any]:
    """Manifest for an air-gapped directory, without contacting any Hub.

    Sources, in order: ``ROOT/.k2fleet/manifest.json``; a huggingface_hub ``local_dir`` download (its
    ``.cache/huggingface/trees/<sha>.json`` listing, written from the Hub's answer); an hf cache layout
    (``models--org--name`` with ``snapshots/<sha>`` whose symlinks point at ``blobs/<etag>``, or that snapshot
    directory itself).
    """
    root = Path(root)
    own = manifest_path(root)
    if own.is_file():
        manifest = load_manifest(str(own))
    elif (root / ".cache" / "huggingface" / "trees").is_dir():
        manifest = _from_local_dir_tree_cache(root, repo_id)
    else:
        manifest = _from_hf_cache(root, repo_id)
    _raise_on_problems(manifest)
    return manifest


def _from_local_dir_tree_cache(root: Path, repo_id: str | None) -> dict[str, Any]:
    trees = sorted((root / ".cache" / "huggingface" / "trees").glob("*.json"))
    listings = [t for t in trees if is_commit_sha(t.stem)]
    if len(listings) != 1:
        raise ValueError(f"{root}: expected exactly one cached tree listing, found {len(listings)}")
    data = json.loads(listings[0].read_text(encoding="utf-8"))
    files: dict[str, dict[str, Any]] = {}
    for rel, entry in data["files"].items():
        if entry.get("lfs_sha256"):
            files[rel] = {"size": int(entry["lfs_size"]), "sha256": entry["lfs_sha256"]}
        else:
            files[rel] = {"size": int(entry["size"]), "sha256": None, "git_blob_sha1": entry["blob_id"]}
    return {"repo_id": repo_id, "revision": listings[0].stem, "files": dict(sorted(files.items()))}


def _from_hf_cache(root: Path, repo_id: str | None) -> dict[str, Any]:
    snapshot = _find_snapshot(root)
    repo_folder = snapshot.parent.parent
    if repo_id is None and repo_folder.name.startswith("models--"):
        repo_id = repo_folder.name[len("models--"):].replace("--", "/")
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(snapshot.rglob("*")):
        rel = path.relative_to(snapshot).as_posix()
        if not path.is_file() or rel.split("/")[0] in (".k2fleet", ".cache"):
            continue
        etag = os.path.basename(os.path.realpath(path))
        size = path.stat().st_size
        if is_hex(etag, 64):
            files[rel] = {"size": size, "sha256": etag}
        elif is_hex(etag, 40):
            files[rel] = {"size": size, "sha256": None, "git_blob_sha1": etag}
        else:
            raise ValueError(f"{path}: not a symlink to an hf cache blob, cannot tell its hash")
    return {"repo_id": repo_id, "revision": snapshot.name, "files": files}


def _find_snapshot(root: Path) -> Path:
    if root.parent.name == "snapshots" and is_commit_sha(root.name):
        return root
    snapshots = [p for p in (root / "snapshots").glob("*") if p.is_dir() and is_commit_sha(p.name)]
    if len(snapshots) != 1:
        raise ValueError(f"{root}: no .k2fleet/manifest.json, no local_dir tree listing, and {len(snapshots)} hf cache "
                         "snapshots (need exactly one)")
    return snapshots[0]


def read_token(token_file: str | os.PathLike[str] | None = None) -> str | None:
    """Hub token from ``token_file`` if given, else env ``HF_TOKEN``, else None. Never log it."""
    if token_file:
        token = Path(token_file).read_text(encoding="utf-8").strip()
        if not token:
            raise ValueError(f"token file {token_file} is empty")
        return token
    return os.environ.get("HF_TOKEN") or None


def main(argv: list[str] | None = None) -> int:
    """``python -m k2fleet.hostprogs.manifest REPO --revision SHA [--out PATH] [--resolve]``."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m k2fleet.hostprogs.manifest")
    ap.add_argument("repo_id")
    ap.add_argument("--revision", required=True)
    ap.add_argument("--resolve", action="store_true", help="accept a branch/tag and record the commit it points at")
    ap.add_argument("--token-file", help="file holding the Hub token (default: env HF_TOKEN)")
    ap.add_argument("--out", help="write here instead of stdout")
    args = ap.parse_args(argv)
    try:
        manifest = build_manifest(args.repo_id, args.revision, token=read_token(args.token_file), resolve=args.resolve)
    except UnpinnedRevisionError as e:
        print(f"error: {e}")
        return 1
    if args.out:
        atomic_write_json(args.out, manifest)
        print(f"wrote {args.out}: {args.repo_id}@{manifest['revision']}, {len(manifest['files'])} files")
    else:
        print(json.dumps(manifest, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
