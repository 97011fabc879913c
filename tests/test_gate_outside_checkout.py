"""``pyinfra INVENTORY /path/to/k2fleet/deploys/kimi.py`` started outside the checkout (so
k2fleet's ``config.py`` is never read): a group-data file that raises, one that holds a bare
list, and a bad value each end the run with the one line ``k2fleet validate`` prints, exit
2, no traceback, and no connection attempted (``connect()`` system calls recorded with
strace when it is there; pyinfra's "Connecting to hosts" step in any case).

The gate gets there through k2fleet's ``pyinfra.connectors`` entry point
(:mod:`k2fleet.deploy.pyinfra_entry`). The test does not rely on the environment's
installed metadata (an editable install made before the entry point was declared lacks it):
it puts a distribution on ``PYTHONPATH`` whose ``entry_points.txt`` holds exactly the
``pyinfra.connectors`` entries ``pyproject.toml`` declares.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.inventory_factory import write_inventory

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploys" / "kimi.py"


@pytest.fixture(scope="module")
def entry_point_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding a distribution with pyproject's ``pyinfra.connectors`` entry points."""
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["pyinfra.connectors"]
    assert declared == {"k2fleet": "k2fleet.deploy.pyinfra_entry:K2fleetGate"}
    root = tmp_path_factory.mktemp("entry")
    info = root / "k2fleet_gate_entry-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: k2fleet-gate-entry\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[pyinfra.connectors]\n"
                                           + "".join(f"{k} = {v}\n" for k, v in declared.items()))
    return root


@pytest.fixture()
def closed_port() -> Iterator[int]:
    """A loopback port bound by this test and never listened on: nobody accepts there."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def fleet(tmp_path: Path, port: int, group_py: str = "") -> Path:
    inv = write_inventory(tmp_path / "inv", hosts=[("node-0", {"ssh_hostname": "127.0.0.1", "ssh_port": port,
                                                               "ssh_connect_timeout": 3})])
    if group_py:
        group = inv.parent / "group_data" / inv.name
        group.write_text(group.read_text() + group_py)
    return inv


def pyinfra_outside(inv: Path, entry: Path, cwd: Path, port: int) -> tuple[subprocess.CompletedProcess[str], int]:
    """pyinfra from ``cwd`` (not the checkout); (its result, connect() calls to ``port``; -1 without strace)."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO), str(entry)]),
                        "K2FLEET_STATE_DIR": str(cwd / "state")}
    argv = [sys.executable, "-m", "pyinfra", "-y", str(inv), str(DEPLOY)]
    trace = cwd / "connect.trace"
    strace = shutil.which("strace")
    if strace:
        argv = [strace, "-f", "-qq", "-e", "trace=connect", "-o", str(trace), *argv]
    out = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, cwd=cwd, env=env,
                         timeout=180)
    calls = -1
    if strace and trace.exists():
        calls = sum(f"htons({port})" in line for line in trace.read_text().splitlines())
    return out, calls


def validate_line(inv: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "k2fleet.cli", "validate", str(inv)], capture_output=True,
                         text=True, stdin=subprocess.DEVNULL, cwd=REPO, timeout=120)
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()
    return line


@pytest.mark.parametrize("group_py, says", [
    ('raise RuntimeError("boom in group data")\n', "group_data/fleet.py raised RuntimeError: boom in group data"),
    ("['k2_port', 9000]\n", "group_data/fleet.py holds a bare list"),
    ("k2_tp = 'eight'\n", "k2_tp: Input should be a valid integer"),
], ids=["raises", "bare-list", "bad-value"])
def test_pyinfra_outside_the_checkout_refuses_in_one_line_before_connecting(
        tmp_path: Path, entry_point_path: Path, closed_port: int, group_py: str, says: str) -> None:
    inv = fleet(tmp_path, closed_port, group_py)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    out, connects = pyinfra_outside(inv, entry_point_path, cwd, closed_port)
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-3000:]
    assert "Traceback" not in text and "Connecting to hosts" not in text, text[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [out.stderr.strip().splitlines()[-1]], out.stderr  # one line, and the run's last
    assert errors == [validate_line(inv)] and says in errors[0], (errors, says)
    assert connects in (0, -1), connects  # not even attempted
    assert not (cwd / "state").exists()


def test_a_valid_inventory_outside_the_checkout_goes_on_to_connect(tmp_path: Path, entry_point_path: Path,
                                                                 closed_port: int) -> None:
    """The control: the same run with a valid inventory passes the gate and tries the port
    (refused: nobody listens), so the counts above are not vacuous."""
    inv = fleet(tmp_path, closed_port)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    out, connects = pyinfra_outside(inv, entry_point_path, cwd, closed_port)
    text = out.stdout + out.stderr
    assert not [line for line in out.stderr.splitlines() if line.startswith("error:")], text[-3000:]
    assert "Connecting to hosts" in text and out.returncode != 0, text[-3000:]
    assert connects > 0 or not shutil.which("strace"), connects


def test_other_pyinfra_runs_are_left_alone(tmp_path: Path, entry_point_path: Path, closed_port: int) -> None:
    """A pyinfra run that does not deploy k2fleet (here ``exec``) is not gated: pyinfra's own
    handling of the group-data file that raises (its traceback, exit 1) is unchanged."""
    inv = fleet(tmp_path, closed_port, 'raise RuntimeError("boom in group data")\n')
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO), str(entry_point_path)])}
    out = subprocess.run([sys.executable, "-m", "pyinfra", "-y", str(inv), "exec", "--", "true"], capture_output=True,
                         text=True, stdin=subprocess.DEVNULL, cwd=tmp_path, env=env, timeout=120)
    assert out.returncode == 1 and "Traceback" in out.stderr and "error:" not in out.stderr, out.stderr[-2000:]


def test_only_k2fleets_own_deploy_arms_the_gate(tmp_path: Path) -> None:
    """The entry point arms the gate for k2fleet's deploy (it runs fleet_run) and for no other
    deploy that merely uses k2fleet's operations on an inventory of its own (such as
    tests/test_sudo_uploads.py's)."""
    from k2fleet.deploy.pyinfra_entry import names_k2fleet_deploy

    borrowed = tmp_path / "borrowed.py"
    borrowed.write_text("from k2fleet.deploy.operations import synced_files\nimport k2fleet.planning.desired\n")
    composed = tmp_path / "composed.py"
    composed.write_text("from k2fleet.deploy import fleet_run\n")
    assert names_k2fleet_deploy([str(REPO / "deploys" / "kimi.py")])
    assert names_k2fleet_deploy([str(composed)])
    assert not names_k2fleet_deploy([str(borrowed)])
