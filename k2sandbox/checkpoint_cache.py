"""The sandbox fleet's checkpoint: synthetic, with Kimi-K2-Thinking's real layout
(62 shards, index, config with model_type kimi_k2, tokenizer files) and a manifest,
in a control-machine directory the sandbox inventory serves from (``control:``).

    python -m k2sandbox.checkpoint_cache      # make it (idempotent), print its path
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path

from k2fleet.control.cache_dirs import build_once
from k2sandbox.synthetic_checkpoint import make_checkpoint, make_gguf_files, manifest_for

SANDBOX_MODEL = "k2fleet-test/Kimi-K2-Thinking-synthetic"
SANDBOX_REVISION = "5a4db0c5e1f3f1d0d1b5e8f7a6c3b2a1908f7e6d"  # fixed: the generator is deterministic
SHARDS, SHARD_BYTES = 62, 64 * 1024
CHECKPOINTS = Path("/var/cache/k2fleet/sandbox-checkpoints")
REHEARSAL_CACHE = Path("/var/cache/k2fleet/rehearsal-checkpoints")  # `k2fleet rehearse`'s, per model and revision
REHEARSAL_SHARD_BYTES = 16 * 1024
GGUF_SPLITS = 3  # synthetic GGUF split files per repository


def synthetic_checkpoint_dir(base: Path, num_shards: int = SHARDS, shard_bytes: int = SHARD_BYTES,
                             style: str = "thinking") -> Path:
    """Where :func:`ensure_synthetic_checkpoint` builds the checkpoint asked for at ``base``:
    ``base``'s name followed by its shape, so that each shard count, shard size and naming
    gets its own directory (a small run never reuses, or ships, a large one built there before).

    >>> synthetic_checkpoint_dir(Path("/c/rev"), 8, 1 << 20)
    PosixPath('/c/rev-8x1048576-thinking')
    """
    return base.with_name(f"{base.name}-{num_shards}x{shard_bytes}-{style}")


def sandbox_checkpoint_dir(revision: str = SANDBOX_REVISION) -> Path:
    """Where the sandbox checkpoint (at ``revision``) lives on the control machine (fixed:
    the sandbox inventories name it, and they read no environment).

    >>> sandbox_checkpoint_dir().parent.name
    'k2fleet-test--Kimi-K2-Thinking-synthetic'
    """
    return synthetic_checkpoint_dir(_sandbox_base(revision))


def _sandbox_base(revision: str = SANDBOX_REVISION) -> Path:
    return CHECKPOINTS / SANDBOX_MODEL.replace("/", "--") / revision


def _build_once(root: Path, repo: str, revision: str, make: Callable[[Path], list]) -> Path:
    """``make(dir)`` the files (a list :func:`manifest_for` takes) and
    their manifest at ``root`` once (built beside it, renamed into place, under the lock beside
    it: the suite's two sandbox instances may ask at once); return ``root``."""
    def build(tmp: Path) -> None:
        files = make(tmp)
        (tmp / ".k2fleet").mkdir(exist_ok=True)
        (tmp / ".k2fleet" / "manifest.json").write_text(json.dumps(manifest_for(files, repo, revision), indent=1))

    return build_once(root, ".k2fleet/manifest.json", build)


def ensure_synthetic_checkpoint(base: Path, model: str, revision: str, num_shards: int = SHARDS,
                                shard_bytes: int = SHARD_BYTES, style: str = "thinking", seed: int = 0) -> Path:
    """Create a synthetic checkpoint of ``model``@``revision`` (``num_shards`` shards of
    ``shard_bytes``, ``style`` naming) and its manifest once, in the directory
    :func:`synthetic_checkpoint_dir` keys by those parameters beside ``base`` (built beside it,
    renamed into place); return that directory. ``seed``: its shard bytes
    (:func:`~k2sandbox.synthetic_checkpoint.make_checkpoint`).

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     small = ensure_synthetic_checkpoint(Path(tmp) / "src", "t/K2", "a" * 40, num_shards=2, shard_bytes=4096)
    ...     large = ensure_synthetic_checkpoint(Path(tmp) / "src", "t/K2", "a" * 40, num_shards=2, shard_bytes=8192)
    ...     small.name, large.name, (large / "model-00001-of-000002.safetensors").stat().st_size > 8192
    ('src-2x4096-thinking', 'src-2x8192-thinking', True)
    """
    root = synthetic_checkpoint_dir(base, num_shards, shard_bytes, style)
    return _build_once(root, model, revision,
                       lambda tmp: make_checkpoint(tmp, num_shards=num_shards, shard_bytes=shard_bytes, style=style,
                                                           seed=seed))


def ensure_synthetic_gguf(root: Path, repo: str, revision: str, names: list[str], file_bytes: int = SHARD_BYTES) -> Path:
    """Create synthetic GGUF files ``names`` of ``repo``@``revision`` and their manifest at
    ``root`` once (built beside it, renamed into place); return ``root``."""
    return _build_once(root, repo, revision, lambda tmp: make_gguf_files(tmp, names, file_bytes))


def revision_seed(revision: str) -> int:
    """The shard bytes' seed of a sandbox checkpoint revision: 0 for the sandbox inventories'
    own, else from the revision itself (another revision holds other bytes).

    >>> revision_seed(SANDBOX_REVISION), revision_seed("00000000000000000000000000000000000000ff")
    (0, 256)
    """
    return 0 if revision == SANDBOX_REVISION else 1 + int(revision[-6:], 16)


def ensure_sandbox_checkpoint(revision: str = SANDBOX_REVISION) -> Path:
    """Create the sandbox inventories' synthetic checkpoint at ``revision`` (default: theirs)
    once; return its directory (:func:`sandbox_checkpoint_dir`: a ``control:`` source for
    ``k2_revision: REVISION``). Another revision has the same layout and other shard bytes."""
    root = ensure_synthetic_checkpoint(_sandbox_base(revision), SANDBOX_MODEL, revision, seed=revision_seed(revision))
    assert root == sandbox_checkpoint_dir(revision), (root, sandbox_checkpoint_dir(revision))
    return root


if __name__ == "__main__":
    print(ensure_sandbox_checkpoint())


# the synthetic checkpoint for a rehearsed inventory's own model/revision


def checkpoint_style(model: str) -> tuple[int, str]:
    """(shards, naming style) of a synthetic checkpoint shaped like ``model``'s: the catalog's
    layout (``Checkpoint.shards``/``shard_style``) when it records one; otherwise, for a model
    whose real shard naming k2fleet's sources do not give (K2-Instruct-0905, K2.5, K2.6, K3) or
    one it does not know, by name: ``instruct`` in it → K2-Instruct's, else K2-Thinking's — a
    stand-in layout, not the model's own.

    >>> checkpoint_style("moonshotai/Kimi-K2-Instruct")
    (61, 'instruct')
    >>> checkpoint_style("moonshotai/Kimi-K2-Thinking")
    (62, 'thinking')
    >>> checkpoint_style("moonshotai/Kimi-K3")
    (62, 'thinking')
    """
    from k2fleet.planning.catalog import CHECKPOINTS

    known = CHECKPOINTS.get(model)
    if known is not None and known.shards and known.shard_style:
        return known.shards, known.shard_style
    if "instruct" in model.lower():
        return 61, "instruct"
    return 62, "thinking"


def rehearsal_checkpoint(model: str, revision: str, cache: Path = REHEARSAL_CACHE) -> tuple[Path, int]:
    """Make (once, cached) a synthetic checkpoint for ``model``@``revision`` with its
    manifest on the control machine, shaped like the model's (:func:`checkpoint_style`); return
    (directory, total bytes of its files)."""
    shards, style = checkpoint_style(model)
    root = ensure_synthetic_checkpoint(cache / model.replace("/", "--") / revision, model, revision,
                                       num_shards=shards, shard_bytes=REHEARSAL_SHARD_BYTES, style=style)
    manifest = root / ".k2fleet" / "manifest.json"
    size = sum(entry["size"] for entry in json.loads(manifest.read_text())["files"].values())
    return root, size


def _concrete(glob: str) -> str:
    """One name matching fnmatch ``glob`` (no ``*`` left: callers place theirs first)."""
    glob = re.sub(r"\[!([^\]]*)\]", "_", glob)
    glob = re.sub(r"\[([^\]])[^\]]*\]", r"\1", glob)
    return glob.replace("*", "synthetic").replace("?", "x")


def gguf_file_names(pattern: str | None, repo: str, splits: int = GGUF_SPLITS) -> list[str] | None:
    """Synthetic GGUF split names (``STEM-00001-of-00003.gguf``) matching ``pattern``
    (``k2_gguf_pattern``; None: the repository root), or None if no ``.gguf`` name can.

    >>> gguf_file_names("UD-Q3_K_XL/*", "unsloth/Kimi-K2-Instruct-GGUF")[0]
    'UD-Q3_K_XL/Kimi-K2-Instruct-UD-Q3_K_XL-00001-of-00003.gguf'
    >>> gguf_file_names("Q4_K_M/*.gguf", "org/K2-GGUF", 2)
    ['Q4_K_M/K2-Q4_K_M-00001-of-00002.gguf', 'Q4_K_M/K2-Q4_K_M-00002-of-00002.gguf']
    >>> gguf_file_names("*.safetensors", "org/K2-GGUF") is None
    True
    """
    parts = (pattern or "*").split("/")
    dirs = [_concrete(p) for p in parts[:-1]]
    last = parts[-1]
    stem = "-".join([repo.rsplit("/", 1)[-1].removesuffix("-GGUF"), *dirs[-1:]])
    names = []
    for i in range(1, splits + 1):
        base = f"{stem}-{i:05d}-of-{splits:05d}"
        name = _concrete(last.replace("*", base + (".gguf" if last.endswith("*") else ""), 1))
        names.append("/".join([*dirs, name]))
        if "*" not in last:
            break
    if not all(n.endswith(".gguf") and fnmatch.fnmatch(n, pattern or "*") for n in names):
        return None
    return names


def rehearsal_gguf(repo: str, revision: str, pattern: str | None, cache: Path = REHEARSAL_CACHE) -> Path:
    """Make (once, cached) synthetic GGUF files of ``repo``@``revision`` matching
    ``pattern`` with their manifest on the control machine; return the directory."""
    names = gguf_file_names(pattern, repo)
    assert names is not None  # unsupported() refuses such a pattern before anything is made
    key = hashlib.sha256(json.dumps(names).encode()).hexdigest()[:12]
    return ensure_synthetic_gguf(cache / repo.replace("/", "--") / f"{revision}-{key}", repo, revision, names, REHEARSAL_SHARD_BYTES)
