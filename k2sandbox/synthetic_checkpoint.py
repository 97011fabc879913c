"""Synthetic Kimi-K2-style checkpoint with the real layout (for tests and benches).

Writes ``num_shards`` safetensors shards named like Kimi-K2-Thinking
(``model-00001-of-000062.safetensors``) or Kimi-K2-Instruct
(``model-1-of-61.safetensors``) with valid headers and tensor data, a
``model.safetensors.index.json`` whose weight_map covers every shard, a
``config.json`` (model_type ``kimi_k2``, compressed-tensors int4
pack-quantized group 32) and the tokenizer/generation files. No real weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LFS_SUFFIXES = (".safetensors", ".model", ".png", ".bin")

CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "model_type": "kimi_k2",
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "n_routed_experts": 384,
    "num_experts_per_tok": 8,
    "vocab_size": 163840,
    "max_position_embeddings": 262144,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "config_groups": {
            "group_0": {
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "actorder": None,
                    "block_structure": None,
                    "dynamic": False,
                    "group_size": 32,
                    "num_bits": 4,
                    "observer": "minmax",
                    "observer_kwargs": {},
                    "strategy": "group",
                    "symmetric": True,
                    "type": "int",
                },
            }
        },
        "format": "pack-quantized",
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    },
}

SMALL_FILES: dict[str, str] = {
    "generation_config.json": json.dumps({"max_length": 262144, "eos_token_id": 163586}, indent=2) + "\n",
    "tokenizer_config.json": json.dumps(
        {"tokenizer_class": "TikTokenTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}},
        indent=2,
    )
    + "\n",
    "tokenization_kimi.py": '"""Synthetic stand-in for the Kimi tokenizer module."""\n\nclass TikTokenTokenizer:\n    pass\n',
    "chat_template.jinja": "{% for m in messages %}<|im_{{ m.role }}|>{{ m.content }}<|im_end|>{% endfor %}\n",
    "configuration_deepseek.py": '"""Synthetic stand-in."""\n',
    "README.md": "# Synthetic Kimi-K2 checkpoint (test data, no real weights)\n",
}


@dataclass
class SynthFile:
    """One file of the synthetic checkpoint, with what a manifest needs."""

    path: str
    size: int
    sha256: str
    git_blob_sha1: str
    lfs: bool


def shard_name(i: int, total: int, style: str = "thinking") -> str:
    """Shard file name in the Kimi-K2-Thinking (padded) or -Instruct (plain) style.

    Example:
        >>> shard_name(1, 62)
        'model-00001-of-000062.safetensors'
        >>> shard_name(1, 61, "instruct")
        'model-1-of-61.safetensors'
    """
    if style == "instruct":
        return f"model-{i}-of-{total}.safetensors"
    return f"model-{i:05d}-of-{total:06d}.safetensors"


def safetensors_header(tensors: list[tuple[str, str, list[int], int]]) -> bytes:
    """Header bytes (length prefix + padded JSON) for (name, dtype, shape, nbytes) tensors.

    Example:
        >>> h = safetensors_header([("w", "U8", [4], 4)])
        >>> int.from_bytes(h[:8], "little") == len(h) - 8
        True
    """
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        meta[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _shard_tensors(layer: int, data_bytes: int) -> list[tuple[str, str, list[int], int]]:
    """Three tensors of one quantized expert; the packed weight takes what's left."""
    scale_cols = 8
    rows = max(1, data_bytes // (4 * 64 + 2 * scale_cols + 4))
    packed_cols = max(1, (data_bytes - rows * 2 * scale_cols - 8) // (4 * rows))
    p = f"model.layers.{layer}.mlp.experts.0.down_proj"
    return [
        (f"{p}.weight_packed", "I32", [rows, packed_cols], rows * packed_cols * 4),
        (f"{p}.weight_scale", "BF16", [rows, scale_cols], rows * scale_cols * 2),
        (f"{p}.weight_shape", "I32", [2], 8),
    ]


def _write_data(f: Any, nbytes: int, seed: int) -> None:
    """Write ``nbytes`` of pseudo-random, per-shard-distinct data quickly."""
    block = hashlib.shake_256(seed.to_bytes(8, "little")).digest(1 << 20)
    counter = 0
    while nbytes > 0:
        chunk = bytearray(block[: min(len(block), nbytes)])
        chunk[:16] = (seed.to_bytes(8, "little") + counter.to_bytes(8, "little"))[: len(chunk[:16])]
        f.write(chunk)
        nbytes -= len(chunk)
        counter += 1


def write_shard(path: Path, layer: int, data_bytes: int, seed: int = 0) -> list[str]:
    """Write one valid safetensors shard; returns its tensor names. ``seed`` varies its data
    (another revision's shard: same layout, other bytes)."""
    tensors = _shard_tensors(layer, data_bytes)
    with open(path, "wb") as f:
        f.write(safetensors_header(tensors))
        _write_data(f, sum(t[3] for t in tensors), seed=layer + 1 + (seed << 16))
    return [t[0] for t in tensors]


def make_checkpoint(
    root: str | os.PathLike[str],
    num_shards: int = 62,
    shard_bytes: int = 64 * 1024,
    style: str = "thinking",
    seed: int = 0,
) -> list[SynthFile]:
    """Create a synthetic checkpoint under ``root``; returns its files (manifest-worthy).
    ``seed``: other shard bytes for the same layout (0: the sandbox revision's own).

    Example:
        >>> files = make_checkpoint("/tmp/k2synth", num_shards=62, shard_bytes=4096)  # doctest: +SKIP
        >>> files[0].path  # doctest: +SKIP
        '.gitattributes'
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(1, num_shards + 1):
        name = shard_name(i, num_shards, style)
        for tensor in write_shard(root / name, i - 1, shard_bytes, seed):
            weight_map[tensor] = name
        total += (root / name).stat().st_size
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    texts = dict(SMALL_FILES)
    texts["model.safetensors.index.json"] = json.dumps(index, indent=2) + "\n"
    texts["config.json"] = json.dumps(CONFIG, indent=2) + "\n"
    texts[".gitattributes"] = "".join(f"*{s} filter=lfs diff=lfs merge=lfs -text\n" for s in LFS_SUFFIXES)
    for rel, text in texts.items():
        (root / rel).write_text(text, encoding="utf-8")
    (root / "tiktoken.model").write_bytes(hashlib.shake_256(b"tiktoken").digest(64 * 1024))
    return describe_dir(root)


GGUF_STRING = 8  # gguf_metadata_value_type: string
GGUF_UINT16 = 2


def _gguf_str(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def gguf_header(kv: dict[str, str | int]) -> bytes:
    """A GGUF v3 header with no tensors and the metadata ``kv`` (strings and uint16s).

    Example:
        >>> h = gguf_header({"general.architecture": "deepseek2"})
        >>> h[:4], struct.unpack("<IQQ", h[4:24])
        (b'GGUF', (3, 0, 1))
    """
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv))
    for key, value in kv.items():
        if isinstance(value, int):
            out += _gguf_str(key) + struct.pack("<IH", GGUF_UINT16, value)
        else:
            out += _gguf_str(key) + struct.pack("<I", GGUF_STRING) + _gguf_str(value)
    return out


def make_gguf_files(root: str | os.PathLike[str], names: list[str], data_bytes: int = 16 * 1024) -> list[SynthFile]:
    """Write synthetic GGUF split files ``names`` (paths under ``root``): a valid v3 header
    (architecture deepseek2, split number/count) and ``data_bytes`` of pseudo-random data
    each, no real tensors; returns every file under ``root`` (manifest-worthy)."""
    root = Path(root)
    for i, rel in enumerate(names):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        header = gguf_header({"general.architecture": "deepseek2", "general.name": "k2fleet synthetic GGUF",
                              "split.no": i, "split.count": len(names)})
        with open(path, "wb") as f:
            f.write(header)
            _write_data(f, data_bytes, seed=1000 + i)
    return describe_dir(root)


def describe_dir(root: str | os.PathLike[str]) -> list[SynthFile]:
    """Hash every regular file under ``root`` (skipping ``.k2fleet``/``.cache``)."""
    root = Path(root)
    out: list[SynthFile] = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if not path.is_file() or rel.split("/")[0] in (".k2fleet", ".cache"):
            continue
        out.append(describe_file(root, rel))
    return out


def describe_file(root: Path, rel: str) -> SynthFile:
    """Size, sha256, git blob sha1 and LFS flag of one file."""
    data_sha256 = hashlib.sha256()
    blob_sha1 = hashlib.sha1()
    size = (root / rel).stat().st_size
    blob_sha1.update(b"blob %d\0" % size)
    with open(root / rel, "rb") as f:
        while chunk := f.read(1 << 20):
            data_sha256.update(chunk)
            blob_sha1.update(chunk)
    return SynthFile(rel, size, data_sha256.hexdigest(), blob_sha1.hexdigest(), rel.endswith((*LFS_SUFFIXES, ".gguf")))


def manifest_for(files: list[SynthFile], repo_id: str, revision: str) -> dict[str, Any]:
    """A k2fleet manifest for ``files`` (what the Hub would report).

    Example:
        >>> manifest_for([], "moonshotai/Kimi-K2-Thinking", "0" * 40)["files"]
        {}
    """
    entries: dict[str, dict[str, Any]] = {}
    for f in files:
        if f.lfs:
            entries[f.path] = {"size": f.size, "sha256": f.sha256}
        else:
            entries[f.path] = {"size": f.size, "sha256": None, "git_blob_sha1": f.git_blob_sha1}
    return {"repo_id": repo_id, "revision": revision, "files": entries}
