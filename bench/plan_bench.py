"""Plan benchmark: validate + plan a generated 64-node inventory, offline.

    python bench/plan_bench.py

Generates a 64-node vLLM DP+EP inventory (8 instances of 8 nodes, DP64 EP64 each) in a
temp dir, loads it through pyinfra's inventory loader, validates and plans it, and
prints the first (cold: file compiled, nothing cached) of three runs. Goal: under 5 s. Last line: ``plan_64_nodes_seconds=…``.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k2fleet.cli import load_plan  # noqa: E402

NODES = 64
DATA = {
    "k2_model": "moonshotai/Kimi-K2-Instruct",
    "k2_revision": "fd1984e2b7a3350dbf7305fe73a4ede25c14de50",
    "k2_engine": "vllm",
    "k2_gpu": "h200",
    "k2_tp": 1,
    "k2_dp": 64,
    "k2_ep": 64,
}


def write_inventory(directory: Path, hosts: list[tuple[str, dict]], data: dict) -> Path:
    """``directory/fleet.py`` (hosts) + ``group_data/fleet.py`` (data): a plain pyinfra inventory."""
    (directory / "group_data").mkdir(parents=True, exist_ok=True)
    (directory / "fleet.py").write_text(f"nodes = {hosts!r}\n")
    (directory / "group_data" / "fleet.py").write_text("".join(f"{k} = {v!r}\n" for k, v in data.items()))
    return directory / "fleet.py"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        hosts = [(f"gpu-{i:02d}", {"ssh_hostname": f"192.0.2.{i + 1}", "k2_nic": "ens10f0np0"}) for i in range(NODES)]
        inv = write_inventory(Path(tmp), hosts, DATA)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            _, plan = load_plan(inv)
            times.append(time.perf_counter() - start)
        services = sum(len(h.services) for h in plan.hosts.values())
        print(f"hosts={len(plan.hosts)} services={services} runs={[round(t, 3) for t in times]}")
        print(f"plan_64_nodes_seconds={times[0]:.3f}")


if __name__ == "__main__":
    main()
