"""No-op re-run of the whole deploy on N sandbox hosts vs pyinfra's floor.

    python bench/noop_bench.py [--hosts 3] [--rounds 5]   # root; brings the sandbox up, leaves it up
    python bench/noop_bench.py --short                    # the suite's run: 2 hosts, 1 round

Hosts boot bare with the sandbox inventories' simulated GPUs (h200). Floor: ``pyinfra -y
inventories/sandbox.py fact server.Hostname`` — connect to every host and gather one fact,
through the same CLI. Measured side by side, alternating, after one full deploy:
``pyinfra -y inventories/sandbox.py deploys/kimi.py`` with nothing to do (which must report
0 changes). Also printed: the first deploy's time per stage (from pyinfra's own log, each
line timestamped as it arrives: start-up, connect, facts and planning up to "Beginning
operation run", then each role's operations), so what grows with the fleet is visible. Last line:
``ratios: noop_rerun_vs_floor=… control_cpu_s_per_host=… probe_wall_s=…`` (goal for the ratio:
≤ 1.3 on 3 hosts, ≤ 1.5 on 16): beside the ratio, the control machine's CPU seconds per host
of a no-op re-run (pyinfra and its SSH clients, ``getrusage`` of this bench's children; the
sandbox hosts' processes are not among them) and one host's probe wall time (below).

Before it, the HostState probe's cost on one host, where the no-op's extra time goes on hosts
that share this machine's cores: the fact's own shell command (as the deploy sends it) run
``--probe-runs`` times on the first host under a small Python that reads its children's
``getrusage`` — wall and CPU seconds per probe, side by side with the floor fact's command
(``uname -n``) measured the same way.
"""

from __future__ import annotations

import argparse
import re
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k2sandbox import nspawn  # noqa: E402
from k2sandbox.checkpoint_cache import ensure_sandbox_checkpoint  # noqa: E402
from k2sandbox.harness import DEPLOY_FILE, INVENTORY, tool  # noqa: E402
from k2sandbox.pyinfra_cli import DeployResult  # noqa: E402

GPUS = "h200"  # the sandbox inventories' k2_gpu


def children_cpu() -> float:
    """CPU seconds (user + system) of this process's finished children."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def timed(argv: list[str]) -> tuple[float, DeployResult, float]:
    """(wall seconds, result, CPU seconds of the control machine's side: ``argv`` and its children)."""
    cpu, start = children_cpu(), time.perf_counter()
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    elapsed = time.perf_counter() - start
    if out.returncode:
        raise SystemExit(f"{' '.join(argv)} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return elapsed, DeployResult(argv, out.returncode, out.stdout, out.stderr), children_cpu() - cpu


ANSI = re.compile(r"\x1b\[[0-9;]*m")
STARTING = re.compile(r"--> Starting (?:[\w ,]+ )?operation: (.+)$")
PLANNED = "--> Beginning operation run"


def staged(argv: list[str]) -> tuple[float, dict[str, float]]:
    """Run ``argv`` (a pyinfra deploy) and time it by stage from its log as it arrives:
    everything before the operation run, then each role (the deploy name before `` | ``)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    stages: dict[str, float] = {}
    current, since = "start-up, connect, facts, planning", start
    assert proc.stderr is not None
    for raw in proc.stderr:
        line = ANSI.sub("", raw).strip()
        found = STARTING.search(line)
        if found or PLANNED in line:
            now = time.perf_counter()
            stages[current] = stages.get(current, 0.0) + now - since
            current = found.group(1).split(" | ", 1)[0] if found else "(operations)"
            since = now
    proc.wait()
    end = time.perf_counter()
    stages[current] = stages.get(current, 0.0) + end - since
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed (exit {proc.returncode})")
    return end - start, stages


PROBE_TIMER = """import resource, subprocess, sys, time
cmd, runs = sys.stdin.read(), int(sys.argv[1])
for label, argv in (("probe", ["sh", "-c", cmd]), ("floor", ["sh", "-c", "uname -n"])):
    wall, cpu = [], []
    for _ in range(runs):
        r0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        out = subprocess.run(argv, capture_output=True, text=True)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        assert out.returncode == 0, out.stderr[-500:]
        wall.append(time.perf_counter() - t0)
        cpu.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
    wall.sort(); cpu.sort()
    print(label, round(wall[len(wall) // 2], 4), round(cpu[len(cpu) // 2], 4))
"""


def probe_cost(runs: int) -> dict[str, tuple[float, float]]:
    """(median wall s, median CPU s) of the HostState fact's command and of the floor's
    ``uname -n`` on the first sandbox host, each run ``runs`` times there."""
    from k2fleet.cli import load_plan
    from k2fleet.control.artifacts import read_control_artifacts
    from k2fleet.deploy.facts import probe_command
    from k2fleet.planning.desired import desired_state

    from k2fleet.control.checkpoint_copy import manifest_pins

    dep, plan = load_plan(str(ROOT / INVENTORY))
    dep = dep.pinned(manifest_pins(dep, fetch=False))
    desired = desired_state(dep, plan, read_control_artifacts(dep, plan))
    first = nspawn.load_hosts()[0]
    command = probe_command(desired[first.name].fact_query(dep.s.model_dir))
    timer = nspawn.ssh_command(first, f"python3 -c {shlex.quote(PROBE_TIMER)} {runs}")
    out = subprocess.run(timer, input=command, capture_output=True, text=True, timeout=300)
    if out.returncode:
        raise SystemExit(f"probe timing failed on {first.name}: {out.stderr[-2000:]}")
    return {label: (float(wall), float(cpu)) for label, wall, cpu in (line.split() for line in out.stdout.splitlines())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--probe-runs", type=int, default=20, help="runs of the HostState probe timed on one host")
    ap.add_argument("--short", action="store_true", help="2 hosts, 1 round (the test suite's run)")
    args = ap.parse_args(argv)
    hosts, rounds = (2, 1) if args.short else (args.hosts, args.rounds)
    # both sides run with their bytecode: pyinfra's (pip compiled it) and k2fleet's (an editable
    # checkout gets none from pip; ./dev.sh compiles it, and so does this, in case)
    subprocess.run([sys.executable, "-m", "compileall", "-q", "k2fleet", "k2sandbox"], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    with nspawn.hold_sandbox_lock():
        nspawn.up(hosts, hardware=nspawn.parse_gpus(GPUS))
        ensure_sandbox_checkpoint()
        deploy = [tool("pyinfra"), "-y", "--json", INVENTORY, DEPLOY_FILE]
        floor = [tool("pyinfra"), "-y", INVENTORY, "fact", "server.Hostname"]
        first, stages = staged(deploy)
        print(f"first deploy (or catch-up), {hosts} hosts: {first:.2f}s")
        for stage, seconds in stages.items():
            print(f"  {seconds:7.2f}s  {stage}")
        floors, noops, floor_cpu, noop_cpu = [], [], [], []
        for _ in range(rounds):
            took, _, cpu = timed(floor)
            floors.append(took)
            floor_cpu.append(cpu)
            took, result, cpu = timed(deploy)
            if result.changed:
                raise SystemExit(f"the re-run changed {result.changed} (operation, host) pairs: not a no-op")
            noops.append(took)
            noop_cpu.append(cpu)
        cost = probe_cost(3 if args.short else args.probe_runs)
    f, n = statistics.median(floors), statistics.median(noops)
    print(f"floor (connect + 1 fact, {hosts} hosts): median {f:.2f}s {[round(x, 2) for x in floors]}")
    print(f"no-op re-run of deploys/kimi.py:   median {n:.2f}s {[round(x, 2) for x in noops]}")
    cpu_floor, cpu_noop = statistics.median(floor_cpu) / hosts, statistics.median(noop_cpu) / hosts
    print(f"control machine's CPU per host: floor {cpu_floor:.3f} s, no-op re-run {cpu_noop:.3f} s")
    for label, (wall, cpu) in cost.items():
        what = "HostState probe" if label == "probe" else "floor fact (uname -n)"
        print(f"{what} on one host: median {wall * 1000:.0f} ms wall, {cpu * 1000:.0f} ms CPU")
    print(f"ratios: noop_rerun_vs_floor={n / f:.2f} control_cpu_s_per_host={cpu_noop:.3f} "
          f"probe_wall_s={cost['probe'][0]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
