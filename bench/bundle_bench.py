"""Benchmark ``k2fleet bundle`` on the real production inventory (not a pytest test).

Builds the bundle of ``inventories/h200.py`` (vLLM 0.33.0 in a venv on Ubuntu 22.04
hosts, so CPython 3.10 x86_64 wheels) once, from empty caches, and prints its size, file
count and time per part. Side by side in the same run, with pip's own cache off for both:

* ``bundle_vs_pip_download``: the bundle's engine wheelhouse ÷ a plain
  ``pip download vllm==0.33.0`` of the same wheels for the same interpreter and platform
  (what a user would do by hand): k2fleet's overhead (hashing, the lock, copying into DIR);
* ``rerun_vs_build``: re-running the same ``k2fleet bundle`` ÷ the first build (nothing
  changed: nothing is fetched or copied again).

Parts this machine cannot reach are built with ``--only`` part by part and reported, not
hidden: the Ubuntu archive and NVIDIA's CUDA repository (the OS packages and driver stack;
only Debian's archive and PyPI are reachable here) and the Hub (the checkpoint).

    python bench/bundle_bench.py [--workdir /var/tmp/k2fleet-bundle-bench] [--keep]

Ends with ``ratios: bundle_vs_pip_download=X rerun_vs_build=X``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INVENTORY = "inventories/h200.py"
PARTS = ("wheels", "debs", "checkpoints")


def k2fleet(*args: str, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float]:
    exe = Path(sys.executable).with_name("k2fleet")
    started = time.monotonic()
    proc = subprocess.run([str(exe), *args], cwd=ROOT, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    return proc, time.monotonic() - started


def tree(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=Path("/var/tmp/k2fleet-bundle-bench"))
    p.add_argument("--keep", action="store_true", help="keep the bundle and caches afterwards")
    args = p.parse_args()
    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = dict(os.environ, PIP_NO_CACHE_DIR="1", K2FLEET_WHEELHOUSE_CACHE=str(work / "cache/wheelhouses"))
    out, cache = work / "bundle", work / "cache"
    common = [INVENTORY, "--out", str(out), "--cache", str(cache)]

    times: dict[str, float] = {}
    for part in PARTS:
        proc, seconds = k2fleet("bundle", *common, "--only", part, env=env)
        times[part] = seconds
        status = "built" if proc.returncode == 0 else "NOT BUILT"
        print(f"{part}: {status} in {seconds:.1f}s")
        for line in (proc.stdout + proc.stderr).strip().splitlines()[-6:]:
            print(f"  {line}")
    lock = json.loads((out / "k2fleet.lock").read_text()) if (out / "k2fleet.lock").is_file() else {"artifacts": []}
    files, size = tree(out)
    print(f"bundle {out}: {files} files, {gib(size)}, {len(lock['artifacts'])} lock entries")

    # the same wheels by hand: pip download for the hosts' interpreter and platform
    wheels = json.loads((out / "k2fleet.lock").read_text())["parts"]["wheels"] if lock["artifacts"] else []
    engine = next((w for w in wheels if w["use"] == "engine"), None)
    if engine is None or "wheels" not in times:
        print("no engine wheelhouse was built; no ratios")
        return 1
    from k2fleet.wheelhouse import PLATFORMS, pip_download_argv

    plain = work / "plain"
    plain.mkdir()
    started = time.monotonic()
    for python in engine["pythons"]:
        for arch in engine["archs"]:
            subprocess.run(pip_download_argv(engine["requirements"], plain, python, PLATFORMS[arch]), check=True,
                           env=env, stdin=subprocess.DEVNULL)
    t_pip = time.monotonic() - started
    pfiles, psize = tree(plain)
    print(f"plain pip download of {' '.join(engine['requirements'])}: {pfiles} wheels, {gib(psize)}, {t_pip:.1f}s")

    proc, t_rerun = k2fleet("bundle", *common, "--only", "wheels", env=env)
    print(f"re-run (unchanged): {t_rerun:.1f}s: {proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print(f"ratios: bundle_vs_pip_download={times['wheels'] / t_pip:.3f} rerun_vs_build={t_rerun / times['wheels']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
