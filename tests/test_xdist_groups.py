"""The suite's two xdist streams hold: under ``-n 2 --dist loadgroup`` (``./dev.sh test``) every
test of the "serial" group (sandbox, real-engine and :data:`tests.conftest.SERIAL_MODULES` tests)
runs on one worker, one at a time, with the rest beside it.

Found 2026-11-27: with pytest 9.2 (structured node ids) xdist 3.8's loadgroup stopped grouping
without a word (pytest-xdist issue 1386) and, with this conftest's hook running after xdist's,
no group was seen either: sandbox tests ran on both workers at once and took down each other's
fleet ("No such file or directory: '/var/lib/k2fleet-sandbox/hosts.json'")."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_serial_group_runs_on_one_worker(tmp_path: Path) -> None:
    # a module of the serial group (its offline tests), one of the rest and one LOOPBACK_MODULES module, on two workers
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", "-v",
            "--basetemp", str(tmp_path / "inner"), "-m", "not sandbox",
            "-k", "offline or is_short or readme or malformed_range",
            "tests/test_nvidia_doubles.py", "tests/test_readme.py", "tests/test_relay_trust.py"]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600).stdout
    ran = re.findall(r"^\[(gw\d)\] .*? PASSED (tests/\S+)", out, re.M)
    serial = [(worker, test) for worker, test in ran if "test_nvidia_doubles.py" in test]
    assert len(serial) >= 4 and all(test.endswith("@serial") for _, test in serial), out[-3000:]
    assert len({worker for worker, _ in serial}) == 1, serial
    assert any("test_readme.py" in test and not test.endswith("@serial") for _, test in ran), out[-3000:]
    # a LOOPBACK_MODULES module: its own group (one worker, its module fixtures built once), not the serial one
    loopback = [(worker, test) for worker, test in ran if "test_relay_trust.py" in test]
    assert len(loopback) >= 2 and all(test.endswith("@test_relay_trust") for _, test in loopback), out[-3000:]
    assert len({worker for worker, _ in loopback}) == 1, loopback
