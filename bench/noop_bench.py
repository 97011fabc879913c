"""No-op re-run of the whole deploy on 3 sandbox hosts vs pyinfra's floor.

    python bench/noop_bench.py        # needs root; brings the sandbox up, leaves it up

Floor: ``pyinfra -y inventories/sandbox.py fact server.Hostname`` — connect to every
host and gather one fact, through the same CLI. Measured side by side, alternating,
after one full deploy: ``pyinfra -y inventories/sandbox.py deploys/kimi.py`` with
nothing to do. Last line: ``ratios: noop_rerun_vs_floor=…`` (goal ≤ 2).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k2sandbox import nspawn as sandbox  # noqa: E402
from k2sandbox.checkpoint_cache import ensure_sandbox_checkpoint  # noqa: E402
from k2sandbox.harness import DEPLOY_FILE, INVENTORY, tool  # noqa: E402

ROUNDS = 5


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    elapsed = time.perf_counter() - start
    if out.returncode:
        raise SystemExit(f"{' '.join(argv)} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return elapsed


def main() -> None:
    with sandbox.hold_sandbox_lock():
        sandbox.up(3)
        ensure_sandbox_checkpoint()
        deploy = [tool("pyinfra"), "-y", INVENTORY, DEPLOY_FILE]
        floor = [tool("pyinfra"), "-y", INVENTORY, "fact", "server.Hostname"]
        first = timed(deploy)
        print(f"first deploy (or catch-up): {first:.2f}s")
        floors, noops = [], []
        for _ in range(ROUNDS):
            floors.append(timed(floor))
            noops.append(timed(deploy))
    f, n = statistics.median(floors), statistics.median(noops)
    print(f"floor (connect + 1 fact, 3 hosts): median {f:.2f}s {[round(x, 2) for x in floors]}")
    print(f"no-op re-run of deploys/kimi.py:   median {n:.2f}s {[round(x, 2) for x in noops]}")
    print(f"ratios: noop_rerun_vs_floor={n / f:.2f}")


if __name__ == "__main__":
    main()
