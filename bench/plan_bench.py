"""Plan benchmark: validate + plan generated inventories offline, and `k2fleet plan --json`
(with every host's desired state) of a 1,024-host one.

    python bench/plan_bench.py           # 64 nodes in-process; 64 and 1,024 nodes through the CLI
    python bench/plan_bench.py --short   # the suite's run: 64 and 128 nodes

Each inventory is a vLLM DP+EP fleet (instances of 64 single-GPU-rank nodes, DP64 EP64)
written to a temp dir as a plain pyinfra inventory. In-process: validate + plan through
pyinfra's inventory loader, the first (cold) of three runs. CLI: ``k2fleet plan --json
INV`` as a user runs it (interpreter start, imports, validation, plan, every host's desired
state, the JSON on stdout), cold, best of two. Goals: 64 nodes in-process < 5 s; 1,024
nodes through the CLI < 3 s. Last line: ``ratios: plan_64_nodes_seconds=…
plan_1024_nodes_seconds=… per_host_1024_vs_64=…`` (the last: seconds per host at 1,024
over seconds per host at 64 through the CLI; ≤ 1 means nothing grows faster than the fleet).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k2fleet.cli import load_plan  # noqa: E402

DATA = {
    "k2_model": "moonshotai/Kimi-K2-Instruct",
    "k2_revision": "fd1984e2b7a3350dbf7305fe73a4ede25c14de50",
    "k2_engine": "vllm",
    "k2_gpu": "h200",
    "k2_tp": 1,
    "k2_dp": 64,
    "k2_ep": 64,
}


def write_inventory(directory: Path, nodes: int, data: dict = DATA) -> Path:
    """``directory/fleet.py`` (``nodes`` hosts) + ``group_data/fleet.py`` (data): a plain pyinfra inventory."""
    hosts = [(f"gpu-{i:04d}", {"ssh_hostname": f"10.{i // 250}.{i % 250}.1", "k2_nic": "ens10f0np0"})
             for i in range(nodes)]
    (directory / "group_data").mkdir(parents=True, exist_ok=True)
    (directory / "fleet.py").write_text(f"nodes = {hosts!r}\n")
    (directory / "group_data" / "fleet.py").write_text("".join(f"{k} = {v!r}\n" for k, v in data.items()))
    return directory / "fleet.py"


def cli_plan_seconds(inventory: Path, nodes: int) -> float:
    """Best of two ``k2fleet plan --json`` runs; checks the document holds every host's desired state."""
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "k2fleet.cli", "plan", str(inventory), "--json"], cwd=ROOT,
                             capture_output=True, text=True, stdin=subprocess.DEVNULL)
        best = min(best, time.perf_counter() - start)
        if out.returncode:
            raise SystemExit(f"k2fleet plan --json failed: {out.stderr[-2000:]}")
    hosts = json.loads(out.stdout)["hosts"]
    assert len(hosts) == nodes and all(h["desired"]["files"] for h in hosts.values()), "plan --json lacks desired state"
    print(f"k2fleet plan --json, {nodes} nodes: {best:.3f}s ({len(out.stdout) / 2**20:.1f} MiB of JSON)")
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", action="store_true", help="64 and 128 nodes (the test suite's run)")
    args = ap.parse_args(argv)
    big = 128 if args.short else 1024
    with tempfile.TemporaryDirectory() as tmp:
        small_inv = write_inventory(Path(tmp) / "64", 64)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            _, plan = load_plan(small_inv)
            times.append(time.perf_counter() - start)
        services = sum(len(h.services) for h in plan.hosts.values())
        print(f"in-process, 64 nodes: hosts={len(plan.hosts)} services={services} runs={[round(t, 3) for t in times]}")
        small = cli_plan_seconds(small_inv, 64)
        large = cli_plan_seconds(write_inventory(Path(tmp) / str(big), big), big)
    print(f"ratios: plan_64_nodes_seconds={times[0]:.3f} plan_{big}_nodes_seconds={large:.3f} "
          f"per_host_{big}_vs_64={(large / big) / (small / 64):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
