"""The sandbox fleet's checkpoint: synthetic, with Kimi-K2-Thinking's real layout
(62 shards, index, config with model_type kimi_k2, tokenizer files) and a manifest,
in a control-machine directory the sandbox inventory serves from (``control:``).

    python -m k2fleet.synthetic      # make it (idempotent), print its path
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from k2fleet.synthetic_checkpoint import make_checkpoint, make_gguf_files, manifest_for

SANDBOX_MODEL = "k2fleet-test/Kimi-K2-Thinking-synthetic"
SANDBOX_REVISION = "5a4db0c5e1f3f1d0d1b5e8f7a6c3b2a1908f7e6d"  # fixed: the generator is deterministic
SHARDS, SHARD_BYTES = 62, 64 * 1024
CHECKPOINTS = Path("/var/cache/k2fleet/sandbox-checkpoints")


def sandbox_checkpoint_dir() -> Path:
    """Where the sandbox checkpoint lives on the control machine (fixed: the sandbox
    inventories name it, and they read no environment).

    >>> sandbox_checkpoint_dir().parent.name
    'k2fleet-test--Kimi-K2-Thinking-synthetic'
    """
    return CHECKPOINTS / SANDBOX_MODEL.replace("/", "--") / SANDBOX_REVISION


def _build_once(root: Path, repo: str, revision: str, make: Callable[[Path], list]) -> Path:
    """``make(dir)`` the files (a list :func:`manifest_for` takes) and
    their manifest at ``root`` once (built beside it, renamed into place); return ``root``."""
    if (root / ".k2fleet" / "manifest.json").exists():
        return root
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    files = make(tmp)
    (tmp / ".k2fleet").mkdir(exist_ok=True)
    (tmp / ".k2fleet" / "manifest.json").write_text(json.dumps(manifest_for(files, repo, revision), indent=1))
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return root


def ensure_synthetic_checkpoint(root: Path, model: str, revision: str, num_shards: int = SHARDS,
                                shard_bytes: int = SHARD_BYTES, style: str = "thinking") -> Path:
    """Create a synthetic checkpoint of ``model``@``revision`` and its manifest at
    ``root`` once (built beside it, renamed into place); return ``root``."""
    return _build_once(root, model, revision,
                       lambda tmp: make_checkpoint(tmp, num_shards=num_shards, shard_bytes=shard_bytes, style=style))


def ensure_synthetic_gguf(root: Path, repo: str, revision: str, names: list[str], file_bytes: int = SHARD_BYTES) -> Path:
    """Create synthetic GGUF files ``names`` of ``repo``@``revision`` and their manifest at
    ``root`` once (built beside it, renamed into place); return ``root``."""
    return _build_once(root, repo, revision, lambda tmp: make_gguf_files(tmp, names, file_bytes))


def ensure_sandbox_checkpoint() -> Path:
    """Create the sandbox inventories' synthetic checkpoint once; return its directory."""
    return ensure_synthetic_checkpoint(sandbox_checkpoint_dir(), SANDBOX_MODEL, SANDBOX_REVISION)


if __name__ == "__main__":
    print(ensure_sandbox_checkpoint())
