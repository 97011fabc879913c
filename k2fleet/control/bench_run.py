"""``k2fleet bench`` and ``k2fleet eval``: run the engine's benchmark client and lm-eval from the
control machine against a fleet's endpoints (issue #23). Both clients must be installed where
they run (``--client``); the endpoint API key (``k2_api_key_file``) reaches them in their
environment (``OPENAI_API_KEY``), never in argv; lm-eval runs offline on a local GSM8K file.
Under ``k2_tls_cert_file`` the endpoints are ``https://`` and the clients trust
``k2_tls_ca_file`` alone (``SSL_CERT_FILE``: OpenSSL's default CA file, which aiohttp and
Python's ``ssl`` read; ``REQUESTS_CA_BUNDLE`` for requests), the host's IP checked against the
certificate as they call it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from k2fleet.control import ControlError
from k2fleet.control import bench_report as report
from k2fleet.planning import api_front, engines
from k2fleet.planning import bench_plan as bp
from k2fleet.planning.deployment import Deployment
from k2fleet.planning.processes import Plan
from k2fleet.planning.quoting import shell_line

LOG_TAIL = 3000
EVAL_LOG_READ = 1 << 20  # bytes of the eval log read for lm-eval's table at its end


# How each engine's bench client writes one point (Engine.bench_format): vLLM's ``bench serve`` one JSON
# document, SGLang's ``bench_serving`` JSON lines (the last is this run's).
POINT_READERS: dict[str, Callable[[Path, str, int, int], report.Point]] = {
    "vllm-bench-serve-json": lambda result, label, c, n: report.vllm_point(report.read_json_capped(result), label, c, result),
    "sglang-bench-serving-jsonl": lambda result, label, c, n: report.sglang_point(report.read_last_json_line(result), label,
                                                                                  c, n, result),
}

CA_ENV = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE")  # the CA file the clients' TLS verifies against
CA_CLEARED = ("SSL_CERT_DIR", "CURL_CA_BUNDLE")  # no other trust store beside it


def _client_env(key: bytes | None, offline: bool = False, ca_file: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != bp.KEY_ENV}
    if key is not None:
        env[bp.KEY_ENV] = key.decode("ascii").strip()
    if ca_file is not None:
        for name in CA_CLEARED:
            env.pop(name, None)
        env.update({name: ca_file for name in CA_ENV})
    if offline:
        env.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    return env


def _resolve_client(client: str | None, default: str, what: str) -> str:
    name = client or default
    found = name if os.sep in name else shutil.which(name)
    if not found or not os.access(found, os.X_OK):
        raise ControlError(f"{what}: {name} not found on this machine; install it here and pass --client PATH")
    return found


def _run(argv: list[str], env: dict[str, str], log: Path, timeout: float | None) -> int:
    with open(log, "ab") as out:
        out.write(f"$ {shell_line(argv)}\n".encode())
        out.flush()
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            out.write(f"k2fleet: stopped after {timeout} s\n".encode())
            return -9
        except BaseException:  # Ctrl-C (its own session does not get it) or anything else: never leave it running
            _stop(proc)
            raise


def _stop(proc: subprocess.Popen) -> None:
    """Kill the client's whole session (the client and its workers) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended in between
        pass
    proc.wait()


def _read_end(log: Path, size: int = LOG_TAIL) -> str:
    """The last ``size`` bytes of ``log`` at most (a log reused across runs only grows)."""
    with open(log, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - size))
        return f.read(size).decode(errors="replace")


def _tail(log: Path) -> str:
    return _read_end(log)


def _check_endpoint(base: str, key: bytes | None) -> None:
    """Before the client gets the key: an endpoint served on this machine (the control machine
    is a fleet host) must be root's listener, not another local user's (ControlError naming
    the port and its owner); one elsewhere, or one that does not answer, is the client's to meet."""
    if key is None:
        return
    from k2fleet.hostprogs import health

    try:
        health.check_listener(base)
    except health.Impostor as exc:
        raise ControlError(f"{base}: {exc}") from None
    except (OSError, ValueError):
        pass


def run_bench(dep: Deployment, plan: Plan, key: bytes | None, out: Path, concurrency: tuple[int, ...],
              num_prompts: int | None, input_len: int, output_len: int, client: str | None, tokenizer: str | None,
              replicas: bool = False, timeout: float | None = None,
              say: Callable[[str], None] = print) -> tuple[list[report.Point], dict]:
    """Every (endpoint, concurrency) point in turn; result JSONs, ``bench.log``, ``bench.json``,
    ``bench.txt`` and ``bench.png`` in ``out``."""
    if plan.engine not in bp.BENCH_ENGINES:
        raise ControlError(f"bench: engine {plan.engine}: {bp.NOT_WIRED}")
    engine = engines.get(plan.engine)
    exe = _resolve_client(client, str(engine.bench_client), "bench")
    eps = bp.endpoints(plan, replicas, api_front.scheme(dep))
    model = dep.api_model_name
    tok = tokenizer or dep.s.model
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "results"
    raw.mkdir(exist_ok=True)
    log = out / "bench.log"
    env = _client_env(key, ca_file=dep.s.tls_ca_file)
    points: list[report.Point] = []
    for ep in eps:
        for c in concurrency:
            n = bp.prompts_for(c, num_prompts)
            argv = bp.bench_argv(plan.engine, exe, ep, model, tok, c, n, input_len, output_len, raw)
            result = raw / bp.result_filename(ep.label, c, plan.engine)
            result.unlink(missing_ok=True)
            t = time.monotonic()
            _check_endpoint(ep.base, key)
            rc = _run(argv, env, log, timeout)
            if rc != 0 or not result.is_file():
                raise ControlError(f"bench: {ep.label} ({ep.base}) at concurrency {c}: the client exited {rc}"
                                   f" (log {log}):\n{_tail(log)}")
            try:
                p = POINT_READERS[str(engine.bench_format)](result, ep.label, c, n)
            except report.ReportError as exc:
                raise ControlError(f"bench: {exc}") from None
            points.append(p)
            say(f"{ep.label} c={c}: {p.completed}/{n} ok, {p.output_throughput:.1f} out tok/s, "
                f"TTFT {p.mean_ttft_ms:.1f} ms, TPOT {p.mean_tpot_ms:.1f} ms ({time.monotonic() - t:.0f} s)")
    meta = {"source": plan.source, "engine": plan.engine, "engine_version": plan.engine_version, "model": model,
            "tokenizer": tok, "input_len": input_len, "output_len": output_len, "concurrency": list(concurrency),
            "endpoints": {e.label: e.base for e in eps}}
    doc = report.report_document(points, meta)
    (out / "bench.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "bench.txt").write_text(report.format_table(points))
    try:
        report.write_plot(points, out / "bench.png", f"{model} ({plan.engine} {plan.engine_version} planned), "
                          f"random {input_len} in / {output_len} out")
    except ImportError:
        say("note: no bench.png: matplotlib is not installed here (pip install 'k2fleet[bench]')")
    return points, doc


def run_eval(dep: Deployment, plan: Plan, key: bytes | None, dataset: Path, fewshot: Path | None, out: Path,
             limit: int | None, client: str | None, expect: float, num_concurrent: int, max_gen_toks: int,
             timeout: float | None = None, say: Callable[[str], None] = print) -> tuple[bool, report.Score]:
    """lm-eval local-completions GSM8K 5-shot on ``dataset`` (offline) against the plan's endpoint."""
    for f in (dataset, fewshot):
        if f is not None and not f.is_file():
            raise ControlError(f"eval: {f}: no such file (a GSM8K-format JSONL: question, answer)")
    exe = _resolve_client(client, "lm-eval", "eval")
    ep = bp.endpoints(plan, scheme=api_front.scheme(dep))[0]
    out.mkdir(parents=True, exist_ok=True)
    tasks = out / "tasks"
    tasks.mkdir(exist_ok=True)
    (tasks / f"{bp.GSM8K_TASK}.yaml").write_text(bp.gsm8k_task_yaml(dataset.resolve(), fewshot and fewshot.resolve()))
    results = out / "lm-eval"
    argv = bp.eval_argv(exe, ep.base, dep.api_model_name, tasks, results, limit, num_concurrent, max_gen_toks)
    log = out / "eval.log"
    started = time.time()
    _check_endpoint(ep.base, key)
    rc = _run(argv, _client_env(key, offline=True, ca_file=dep.s.tls_ca_file), log, timeout)
    found = sorted((p for p in results.rglob("results_*.json") if p.stat().st_mtime >= started - 1),
                   key=lambda p: p.stat().st_mtime)
    if rc != 0 or not found:
        raise ControlError(f"eval: lm-eval exited {rc} (log {log}):\n{_tail(log)}")
    try:
        score = report.gsm8k_score(report.read_json_capped(found[-1]), bp.GSM8K_TASK)
    except report.ReportError as exc:
        raise ControlError(f"eval: {found[-1]}: {exc}") from None
    for line in _read_end(log, EVAL_LOG_READ).splitlines():  # lm-eval's own table rows (at its end)
        if line.startswith("|"):
            say(line)
    ok, line = report.verdict(score, expect)
    say(line)
    return ok, score
