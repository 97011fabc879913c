"""The suite's xdist groups hold: under ``-n N --dist loadgroup`` (``./dev.sh test``: two workers) each
test module runs on one worker, in order; the :data:`tests.conftest.MACHINE_MODULES`
(what the whole machine shares) run on gw0 only, one at a time; and worker gwN drives sandbox
instance N, so the workers' fleets never meet (the inner run below uses two workers).

Found 2026-11-27: with pytest 9.2 (structured node ids) xdist 3.8's loadgroup stopped grouping
without a word (pytest-xdist issue 1386) and, with this conftest's hook running after xdist's,
no group was seen either: sandbox tests ran on both workers at once and took down each other's
fleet ("No such file or directory: '/var/lib/k2fleet-sandbox/hosts.json'")."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from k2sandbox import nspawn

ROOT = Path(__file__).resolve().parents[1]


def test_this_worker_drives_its_own_sandbox_instance() -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    print(f"sandbox instance {nspawn.INSTANCE} on {worker or 'no worker'}")
    if worker:
        assert nspawn.INSTANCE == int(worker[2:]) and os.environ[nspawn.INSTANCE_ENV] == worker[2:]
        assert nspawn.LOCK_PATH == ("/tmp/k2sb.lock" if nspawn.INSTANCE == 0 else f"/tmp/k2s{nspawn.INSTANCE}.lock")
    # no two instances share a name, a subnet, a lock or a state directory
    names = [subprocess.run([sys.executable, "-c", "from k2sandbox import nspawn as n; "
                             "print(n.PREFIX, n.BRIDGE, n.SUBNET, n.COMPANY_SUBNET, n.LOCK_PATH, n.DEFAULT_STATE_DIR, "
                             "n.OFFLINE_NS, n.host_name(1), n.veth_names(1)[0])"],
                            cwd=ROOT, capture_output=True, text=True, check=True,
                            env={**{k: v for k, v in os.environ.items() if k != "K2FLEET_SANDBOX_DIR"},
                                 nspawn.INSTANCE_ENV: str(i)}).stdout.split()
             for i in (0, 1, 2)]  # ./dev.sh test's two workers, and a third's (-n 3)
    assert names[0][:2] == ["k2sb", "k2sb0"] and names[0][2] == "10.213.0", names
    for i, j in ((0, 1), (0, 2), (1, 2)):
        assert all(a != b for a, b in zip(names[i], names[j])), names
        # neither's names start with the other's prefix (teardown deletes every netns and link so named)
        assert not any(x.startswith(names[b][0]) for a, b in ((i, j), (j, i)) for x in names[a][6:]), names


def test_the_groups_hold_and_the_machine_group_stays_on_gw0(tmp_path: Path) -> None:
    # some tests of four modules, one of them a machine module, and the instance check above, on two workers
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", "-v",
            "--basetemp", str(tmp_path / "inner"), "-m", "not sandbox",
            "-k", "offline or is_short or readme or malformed_range or machine_sources or own_sandbox_instance",
            "tests/test_nvidia_doubles.py", "tests/test_readme.py", "tests/test_relay_trust.py", "tests/test_aptroot.py",
            "tests/test_xdist_groups.py"]
    # the inner run's workers pick their own instances (this worker's would be inherited by both)
    env = {k: v for k, v in os.environ.items() if k != nspawn.INSTANCE_ENV and not k.startswith("PYTEST_XDIST")}
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env).stdout
    ran = re.findall(r"^\[(gw\d)\] .*? PASSED (tests/\S+)", out, re.M)
    fleet = [(worker, test) for worker, test in ran if "test_nvidia_doubles.py" in test]
    assert len(fleet) >= 4 and all(test.endswith("@test_nvidia_doubles") for _, test in fleet), out[-3000:]
    assert len({worker for worker, _ in fleet}) == 1, fleet
    assert any("test_readme.py" in test and test.endswith("@test_readme") for _, test in ran), out[-3000:]
    loopback = [(worker, test) for worker, test in ran if "test_relay_trust.py" in test]
    assert len(loopback) >= 2 and all(test.endswith("@test_relay_trust") for _, test in loopback), out[-3000:]
    assert len({worker for worker, _ in loopback}) == 1, loopback
    # a MACHINE_MODULES module: the machine group, on gw0 only
    machine = [(worker, test) for worker, test in ran if "test_aptroot.py" in test]
    assert len(machine) >= 1 and all(test.endswith("@machine") and worker == "gw0" for worker, test in machine), machine
    assert any("own_sandbox_instance" in test for _, test in ran), out[-3000:]
