"""KTransformers: the legacy 0.3.2 server (``python -m ktransformers.server.main``) and the
sglang-kt form (0.7.2: ``python -m sglang.launch_server --kt-*``), planned, run as engine
TEST DOUBLES on loopback, and rehearsed on the sandbox fleet (GGUF weights delivered and
verified like the checkpoint).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from k2fleet.deploy.gate import check_hosts
from k2fleet.inventory.loader import inventory_host_data, parse_data_overrides
from k2sandbox.rehearse import gguf_file_names
from k2sandbox.synthetic_checkpoint import make_gguf_files
from k2sandbox.harness import ROOT, tool
from k2fleet.planning.units import unit_file

DOUBLES = ROOT / "k2sandbox" / "files" / "doubles"
FLAGS = ROOT / "k2fleet" / "planning" / "data" / "engine_flags"
HEALTH_PY = ROOT / "k2fleet" / "hostprogs" / "health.py"
INVENTORY = "inventories/ktransformers.py"
RULES = DOUBLES / "ktransformers/optimize/optimize_rules/DeepSeek-V3-Chat-fp8-linear-ggml-experts-serve-amx.yaml"
SGLANG_KT = ("k2_engine_version=0.7.2",)

sys.path.insert(0, str(DOUBLES))
from k2fleet_doubles import ktransformers_legacy, sglang  # noqa: E402

sys.path.remove(str(DOUBLES))


def table(version: str) -> set[str]:
    return set(json.loads((FLAGS / f"ktransformers-{version}.json").read_text())["flags"])


def option_strings(parser) -> set[str]:  # noqa: ANN001 - argparse parser
    return {o for action in parser._actions for o in action.option_strings}


def plan(*data: str):  # noqa: ANN201
    overrides = parse_data_overrides(list(data))
    return check_hosts(INVENTORY, inventory_host_data(ROOT / INVENTORY, overrides))


# ---------------------------------------------------------------- the doubles' flags


def test_legacy_double_parses_exactly_the_real_servers_flags() -> None:
    assert option_strings(ktransformers_legacy.build_parser()) == table("0.3.2")


def test_sglang_double_accepts_exactly_sglang_kt_0_7_2s_kt_flags() -> None:
    mine = {o for o in option_strings(sglang.build_parser()) if "kt-" in o}
    assert mine == {f for f in table("0.7.2") if "kt-" in f}


def test_rendered_argv_of_both_forms_parses_in_the_doubles() -> None:
    _, legacy = plan()
    svc = next(s for _, s in legacy.services())
    assert svc.argv[1:3] == ["-m", "ktransformers.server.main"]
    args = ktransformers_legacy.build_parser().parse_args(svc.argv[3:])
    assert args.model_name == "moonshotai/Kimi-K2-Instruct" and args.cache_lens == 30000
    assert args.gguf_path == "/srv/k2fleet/models/unsloth--Kimi-K2-Instruct-GGUF/dc35109e1b6ecf981f1d30d57c117b9a58c0b31b"
    assert args.optimize_config_path.endswith("/src/ktransformers/" + str(RULES.relative_to(DOUBLES)))

    _, kt = plan(*SGLANG_KT)
    svc = next(s for _, s in kt.services())
    assert svc.argv[1:3] == ["-m", "sglang.launch_server"]
    args = sglang.build_parser().parse_args(svc.argv[3:])
    assert (args.kt_method, args.kt_cpuinfer, args.kt_threadpool_count, args.kt_num_gpu_experts) == ("LLAMAFILE", 64, 2, 0)
    assert args.kt_weight_path.endswith("unsloth--Kimi-K2-Instruct-GGUF/dc35109e1b6ecf981f1d30d57c117b9a58c0b31b")


def test_plan_gates_on_the_gguf_weights_and_the_legacy_ready_route() -> None:
    dep, legacy = plan()
    host = legacy.hosts["kt-0"]
    svc = host.services[0]
    assert svc.health.path == "/v1/models"  # the legacy server has no /health
    pre = [line for line in unit_file(dep, svc).splitlines()
           if line.startswith("ExecStartPre=") and " verify " in line]  # the two weight gates (not the cache dir's)
    assert len(pre) == 2 and pre[1].endswith(dep.gguf_path)
    sets = {ws.check: ws for ws in dep.weight_sets}
    assert sets["gguf-verified"].patterns == ("UD-Q3_K_XL/*",) and sets["gguf-verified"].path == dep.gguf_path
    dep7, kt = plan(*SGLANG_KT)
    assert [ws.check for ws in dep7.weight_sets] == ["checkpoint-verified", "gguf-verified"]
    assert kt.hosts["kt-0"].services[0].health.path == "/health"  # sglang-kt has one


def test_sandbox_gate_checks_the_sglang_kt_world_and_the_legacy_ready_route() -> None:
    from k2fleet.planning.desired import ControlArtifacts, desired_state

    sandbox_data = ("k2_simulated_gpus=True", "k2_engine_doubles=True")
    dep, legacy = plan(*sandbox_data)
    gate = desired_state(dep, legacy, ControlArtifacts())["kt-0"].health_argv
    assert gate[gate.index("--ready-path") + 1] == "/v1/models" and "--expect-world" not in gate
    dep, kt = plan(*SGLANG_KT, *sandbox_data)
    gate = desired_state(dep, kt, ControlArtifacts())["kt-0"].health_argv
    assert json.loads(gate[gate.index("--expect-world") + 1]) == {"members": [], "tp_size": 1} and "--ready-path" not in gate


def test_gguf_pattern_names() -> None:
    assert gguf_file_names("UD-Q3_K_XL/*", "unsloth/Kimi-K2-Instruct-GGUF") == [
        f"UD-Q3_K_XL/Kimi-K2-Instruct-UD-Q3_K_XL-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert gguf_file_names("Q?_K_[MS]/*-00001-of-*.gguf", "o/K2-GGUF", 1) == ["Qx_K_M/K2-Qx_K_M-00001-of-00001-00001-of-synthetic.gguf"]
    assert gguf_file_names("weights/model.bin", "o/K2-GGUF") is None


def test_gguf_weight_set_is_fetched_by_pattern_only_and_verified(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control copy of a GGUF repo (Hub source, k2_gguf_pattern) through the real
    huggingface_hub client against the Hub TEST DOUBLE: only the matching files cross."""
    from k2fleet.control.checkpoint_copy import prepare_control_copy
    from k2sandbox.hub_double import HubDouble

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    repo_dir = tmp_path / "repo"
    wanted = gguf_file_names("UD-Q3_K_XL/*", "unsloth/Kimi-K2-Instruct-GGUF")
    other = gguf_file_names("Q8_0/*", "unsloth/Kimi-K2-Instruct-GGUF")
    make_gguf_files(repo_dir, wanted + other, 4096)
    (repo_dir / "README.md").write_text("GGUF test repo\n")
    with HubDouble() as hub:
        sha = hub.add_commit("unsloth/Kimi-K2-Instruct-GGUF", repo_dir)
        root = tmp_path / "cache" / "gguf"
        record = prepare_control_copy("unsloth/Kimi-K2-Instruct-GGUF", sha, str(root), hub=True,
                                      endpoint=hub.url, patterns=["UD-Q3_K_XL/*"])
        served = {name for name, count in hub.bytes_served.items() if count}
    assert record["files"] == 3 and record["action"] == "download"
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*.gguf")) == wanted
    assert served == set(wanted)  # the other quantization's files never left the Hub
    manifest = json.loads((root / ".k2fleet" / "manifest.json").read_text())
    assert sorted(manifest["files"]) == wanted


# ---------------------------------------------------------------- the legacy double on loopback


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("K2FLEET_DOUBLE_")}
    return dict(out, PYTHONPATH=str(DOUBLES), PYTHONUNBUFFERED="1")


def legacy(*args: str) -> list[str]:
    return [sys.executable, "-m", "ktransformers.server.main", *args]


@pytest.fixture
def weights(tmp_path: Path) -> tuple[str, str]:
    model = tmp_path / "Kimi-K2-Instruct"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}))
    gguf = tmp_path / "gguf"
    make_gguf_files(gguf, gguf_file_names("UD-Q3_K_XL/*", "unsloth/Kimi-K2-Instruct-GGUF"), 4096)
    return str(model), str(gguf)


def request(url: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def wait_listening(url: str, proc: subprocess.Popen, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"{url} never answered")


def health_gate(port: int, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HEALTH_PY), "--base", f"http://127.0.0.1:{port}", "--model",
                           "moonshotai/Kimi-K2-Instruct", "--unit", "k2-ktransformers.service", "--timeout", "4",
                           *extra], capture_output=True, text=True, timeout=60)


def test_legacy_double_serves_the_real_servers_routes(weights: tuple[str, str]) -> None:
    model, gguf = weights
    port = free_port()
    proc = subprocess.Popen(legacy("--model_path", model, "--model_name", "moonshotai/Kimi-K2-Instruct",
                                   "--gguf_path", gguf, "--cache_lens", "30000", "--port", str(port),
                                   "--host", "127.0.0.1", "--optimize_config_path", str(RULES)),
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_listening(f"{base}/v1/models", proc)
        assert request(f"{base}/health")[0] == 404
        status, models = request(f"{base}/v1/models")
        entry = models["data"][0]
        assert status == 200 and entry["id"] == entry["name"] == "moonshotai/Kimi-K2-Instruct"
        assert entry["metadata"]["gguf_files"] == 3 and entry["metadata"]["cache_lens"] == 30000
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        status, answer = request(f"{base}/v1/chat/completions", dict(chat, model="anything"))  # not checked
        assert status == 200 and answer["choices"][0]["message"]["content"]
        # k2fleet's gate: the default /health route never passes; the planned ready route does
        default = health_gate(port)
        assert default.returncode == 1 and "/health answered 404" in default.stderr
        ready = health_gate(port, "--ready-path", "/v1/models")
        assert ready.returncode == 0, ready.stderr
    finally:
        proc.terminate()
        proc.wait(10)


def test_legacy_double_refuses_what_the_real_server_refuses(weights: tuple[str, str], tmp_path: Path) -> None:
    model, gguf = weights

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(legacy(*args, "--port", str(free_port())), env=env(), capture_output=True,
                              text=True, timeout=30)

    unknown = run("--model_path", model, "--gguf_path", gguf, "--tp-size", "1")
    assert unknown.returncode == 2 and "unrecognized arguments: --tp-size" in unknown.stderr
    missing = run("--model_path", model, "--gguf_path", str(tmp_path / "nope"))
    assert missing.returncode == 1 and "GGUF dir not found" in missing.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "Cannot find any .gguf files" in run("--model_path", model, "--gguf_path", str(empty)).stderr
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.gguf").write_bytes(b"\0" * 64)
    assert "not a GGUF file" in run("--model_path", model, "--gguf_path", str(bad)).stderr
    rules = run("--model_path", model, "--gguf_path", gguf, "--optimize_config_path", str(tmp_path / "r.yaml"))
    assert rules.returncode == 1 and "No such file" in rules.stderr
    assert "no config.json" in run("--model_path", str(tmp_path), "--gguf_path", gguf).stderr


def test_sglang_double_with_llamafile_needs_gguf_weights_and_reports_kt(weights: tuple[str, str], tmp_path: Path) -> None:
    model, gguf = weights
    base = ["--model-path", model, "--host", "127.0.0.1", "--kt-method", "LLAMAFILE", "--kt-cpuinfer", "64"]
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = subprocess.run([sys.executable, "-m", "sglang.launch_server", *base, "--port", str(free_port()),
                              "--kt-weight-path", str(empty)], env=env(), capture_output=True, text=True, timeout=30)
    assert refused.returncode == 1 and "Cannot find any .gguf files" in refused.stderr
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", *base, "--port", str(port),
                             "--kt-weight-path", gguf], env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        wait_listening(f"http://127.0.0.1:{port}/health", proc)
        kt = request(f"http://127.0.0.1:{port}/v1/models")[1]["data"][0]["metadata"]["ktransformers"]
        assert kt["weight_path"] == gguf and kt["method"] == "LLAMAFILE" and kt["cpuinfer"] == 64
    finally:
        proc.terminate()
        proc.wait(10)


# ---------------------------------------------------------------- rehearsals on the sandbox fleet

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox fleet needs root")


def rehearse(*data: str) -> tuple[subprocess.CompletedProcess, float]:
    """``k2fleet rehearse INVENTORY [--data ...]`` through the CLI (it takes the sandbox lock
    itself and leaves the sandbox down). A healthy endpoint is proof the GGUF files arrived
    verified at the planned path: both doubles exit 1 without them (tests above)."""
    args = [a for item in data for a in ("--data", item)]
    started = time.monotonic()
    proc = subprocess.run([tool("k2fleet"), "rehearse", INVENTORY, *args], cwd=ROOT, capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=900)
    return proc, time.monotonic() - started


@pytest.mark.sandbox
@needs_root
def test_rehearse_ktransformers_legacy_server() -> None:
    proc, seconds = rehearse()
    print(f"rehearse {INVENTORY}: {seconds:.0f}s")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "deploying (ktransformers 0.3.2," in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == f"rehearsal {INVENTORY}: 1/1 endpoints healthy, re-run 0 changes"


@pytest.mark.sandbox
@needs_root
def test_rehearse_ktransformers_sglang_kt() -> None:
    proc, seconds = rehearse(*SGLANG_KT)
    print(f"rehearse {INVENTORY} --data {SGLANG_KT[0]}: {seconds:.0f}s")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "deploying (ktransformers 0.7.2," in proc.stdout  # the gate also checked tp_size the double reports
    assert proc.stdout.strip().splitlines()[-1] == f"rehearsal {INVENTORY}: 1/1 endpoints healthy, re-run 0 changes"
