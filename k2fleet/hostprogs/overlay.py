"""model_type fallback overlay: serve a verified checkpoint under another ``model_type``.

Some serving stacks do not know ``kimi_k2`` but load the same weights as ``deepseek_v3``. Rather than editing
the verified ``config.json``, k2fleet builds an overlay directory: a symlink to every verified file except
``config.json``, plus a rewritten copy of ``config.json``. The verified directory is never written to (other
than by verify's own marker).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from k2fleet.hostprogs.verify import atomic_write_json, is_verified, load_manifest

CONFIG = "config.json"
DEFAULT_MODEL_TYPE_MAP = {"kimi_k2": "deepseek_v3"}


class NotVerifiedError(RuntimeError):
    """The source directory has no valid verified marker for this manifest."""


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def make_overlay(verified_dir: str | os.PathLike[str], overlay_dir: str | os.PathLike[str], manifest: dict[str, Any],
                 model_type: str | None = None) -> dict[str, Any]:
    """Build ``overlay_dir`` over ``verified_dir``; returns the record for ``manifest["overlay"]``.

    ``model_type`` defaults to the mapping of the source's model_type (``kimi_k2`` → ``deepseek_v3``). The
    overlay directory is rebuilt from scratch; it must not be the verified directory.
    """
    src = Path(verified_dir).resolve()
    dst = Path(overlay_dir).resolve()
    if dst == src or src in dst.parents or dst in src.parents:
        raise ValueError("the overlay directory must be outside the verified directory (and not contain it)")
    if CONFIG not in manifest["files"]:
        raise ValueError("the manifest has no config.json to rewrite")
    if not is_verified(str(src), manifest):
        raise NotVerifiedError(f"{src} is not verified against this manifest: run verify first")
    source_config = json.loads((src / CONFIG).read_text(encoding="utf-8"))
    source_type = source_config.get("model_type")
    target_type = model_type or DEFAULT_MODEL_TYPE_MAP.get(str(source_type))
    if not target_type:
        raise ValueError(f"no fallback model_type known for {source_type!r}; pass model_type=")
    if dst.is_symlink() or dst.is_file():
        raise ValueError(f"{dst} exists and is not a directory")
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    links = [rel for rel in sorted(manifest["files"]) if rel != CONFIG]
    for rel in links:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(src / rel, dst / rel)
    atomic_write_json(str(dst / CONFIG), {**source_config, "model_type": target_type})  # nothing else changes
    return {"dir": str(dst), "source_dir": str(src), "source_model_type": source_type, "model_type": target_type,
            "source_config_sha256": _sha256_file(src / CONFIG), "config_sha256": _sha256_file(dst / CONFIG),
            "links": len(links)}


def overlay_problems(record: dict[str, Any], manifest: dict[str, Any]) -> list[str]:
    """What is wrong with an existing overlay (empty when it still matches ``record``)."""
    dst, src = Path(record["dir"]), Path(record["source_dir"])
    out: list[str] = []
    cfg = dst / CONFIG
    if not cfg.is_file() or cfg.is_symlink() or _sha256_file(cfg) != record["config_sha256"]:
        out.append(f"{cfg}: missing or not the recorded rewrite")
    for rel in (r for r in manifest["files"] if r != CONFIG):
        link = dst / rel
        if not link.is_symlink() or os.readlink(link) != str(src / rel):
            out.append(f"{link}: not a symlink to {src / rel}")
    return out


def main(argv: list[str] | None = None) -> int:
    """``overlay.py VERIFIED_DIR OVERLAY_DIR [--model-type T]``: build the overlay and
    record it in the manifest (``VERIFIED_DIR/.k2fleet/manifest.json``, key ``overlay``;
    the manifest digest that the verified marker pins excludes that key)."""
    ap = argparse.ArgumentParser(prog="overlay.py", description="model_type fallback overlay")
    ap.add_argument("verified_dir")
    ap.add_argument("overlay_dir")
    ap.add_argument("--model-type", default=None)
    args = ap.parse_args(argv)
    manifest_file = Path(args.verified_dir) / ".k2fleet" / "manifest.json"
    manifest = load_manifest(str(manifest_file))
    try:
        record = make_overlay(args.verified_dir, args.overlay_dir, manifest, args.model_type)
    except (NotVerifiedError, ValueError) as exc:
        print(f"overlay.py: {exc}")
        return 1
    manifest["overlay"] = record
    atomic_write_json(str(manifest_file), manifest)
    print(f"overlay {record['dir']}: model_type {record['source_model_type']} -> {record['model_type']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
