"""Benchmark ``k2fleet bundle`` (not a pytest test).

1. The real production bundle of ``inventories/h200.py`` (vLLM 0.33.0 in a venv on
   Ubuntu 22.04 hosts: CPython 3.11 x86_64 wheels; the Ubuntu archive, NVIDIA's CUDA
   repository and the Hub checkpoint), built once from empty caches part by part
   (``--only``), each part's size, file count and time printed, or why it could not be
   built from this machine. Here only Debian's archive and a PyPI snapshot are reachable:
   the snapshot lacks vLLM 0.33.0's dependencies (e.g. certifi>=2026.10.19), the Ubuntu
   archive, NVIDIA's repository and the Hub are unreachable, so this part reports them.
2. Measured side by side, on what this machine can fetch: the rehearsal bundle of
   ``inventories/h800-pp.py`` (Debian 12 packages and the TEST DOUBLE driver stack, the
   real Ray 2.60.0 wheelhouse plus the engine double wheel, the synthetic checkpoint),
   from empty caches, with pip's own cache off:

   * ``wheels_vs_pip_download``: the bundle's wheels part ÷ a plain ``pip download`` of the
     same requirements for the same interpreter and platform (what a user does by hand):
     k2fleet's overhead (hashing, the lock, copying into the bundle);
   * ``rerun_vs_build``: re-running the unchanged ``k2fleet bundle`` ÷ its first build.

    python bench/bundle_bench.py [--workdir /var/tmp/k2fleet-bundle-bench] [--keep]

Ends with ``ratios: wheels_vs_pip_download=X rerun_vs_build=X``.
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


def build_parts(inventory: str, out: Path, cache: Path, env: dict[str, str], *extra: str) -> dict[str, float]:
    """Build each part of ``inventory``'s bundle in turn; print what was built or why not."""
    times = {}
    for part in PARTS:
        proc, seconds = k2fleet("bundle", inventory, "--out", str(out), "--cache", str(cache), "--only", part, *extra,
                                env=env)
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        if proc.returncode == 0:
            times[part] = seconds
            print(f"  {part}: built in {seconds:.1f}s: {lines[-2] if len(lines) > 1 else ''}")
        else:
            why = next((line for marker in ("ERROR:", "Error:", "E: ", "k2fleet bundle:")
                        for line in lines if marker in line), lines[-1] if lines else "")
            print(f"  {part}: NOT BUILT ({seconds:.1f}s): {why.strip()[:300]}")
    files, size = tree(out)
    print(f"  bundle {out}: {files} files, {gib(size)}")
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=Path("/var/tmp/k2fleet-bundle-bench"))
    p.add_argument("--keep", action="store_true", help="keep the bundles and caches afterwards")
    p.add_argument("--short", action="store_true",
                   help="the test suite's run: the rehearsal bundle only, built once (its parts), then re-run whole")
    args = p.parse_args()
    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = dict(os.environ, PIP_NO_CACHE_DIR="1")
    if not Path("/usr/share/keyrings/ubuntu-archive-keyring.gpg").is_file():  # ./dev.sh installs it where Debian has it
        print("no ubuntu-keyring here (not in this Debian release's archive): the Ubuntu archive cannot be tried")

    if not args.short:
        print(f"1. the production bundle of {INVENTORY}, from empty caches:")
        build_parts(INVENTORY, work / "production", work / "cache-production", env)

    rehearsal = "inventories/h800-pp.py"
    out, cache = work / "rehearsal", work / "cache-rehearsal"
    print(f"2. the rehearsal bundle of {rehearsal}, from empty caches:")
    times = build_parts(rehearsal, out, cache, env, "--rehearsal")
    if "wheels" not in times:
        print("the wheels part could not be built; no ratios")
        return 1
    if args.short:  # the parts above started from empty caches too: their sum is the build, re-run whole on them
        whole, whole_cache, t_build = out, cache, sum(times.values())
        print(f"  the parts from empty caches: {t_build:.1f}s (--short: no second whole build)")
    else:
        whole, whole_cache = work / "whole", work / "cache-whole"
        proc, t_build = k2fleet("bundle", rehearsal, "--rehearsal", "--out", str(whole), "--cache", str(whole_cache),
                                env=env)
        print(f"  whole bundle in one run, from empty caches: {t_build:.1f}s: {proc.stdout.strip().splitlines()[-1]}")
    proc, t_rerun = k2fleet("bundle", rehearsal, "--rehearsal", "--out", str(whole), "--cache", str(whole_cache), env=env)
    print(f"  re-run, unchanged: {t_rerun:.1f}s: {proc.stdout.strip().splitlines()[-1]}")

    lock = json.loads((out / "k2fleet.lock").read_text())
    engine = next(w for w in lock["parts"]["wheels"] if w["use"] == "engine")
    fetched = [r for r in engine["requirements"] if not r.startswith("k2fleet-engine-doubles==")]
    from k2fleet.control.wheelhouse import PLATFORMS, pip_download_argv

    plain = work / "plain"
    plain.mkdir()
    started = time.monotonic()
    for python in engine["pythons"]:
        for arch in engine["archs"]:
            subprocess.run(pip_download_argv(fetched, plain, python, PLATFORMS[arch]), check=True, env=env,
                           stdin=subprocess.DEVNULL, capture_output=True)
    t_pip = time.monotonic() - started
    pfiles, psize = tree(plain)
    print(f"  plain pip download of {' '.join(fetched)}: {pfiles} wheels, {gib(psize)}, {t_pip:.1f}s "
          f"(the bundle's wheels part: {times['wheels']:.1f}s)")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print(f"ratios: wheels_vs_pip_download={times['wheels'] / t_pip:.3f} rerun_vs_build={t_rerun / t_build:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
