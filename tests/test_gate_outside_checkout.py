"""``pyinfra INVENTORY /path/to/k2fleet/deploys/kimi.py`` started outside the checkout (so
k2fleet's ``config.py`` is never read): a group-data file that raises, one that holds a bare
list, and a bad value each end the run with the one line ``k2fleet validate`` prints, exit
2, no traceback, and no connection made: the inventory's host is a loopback port this test
listens on itself, counting every TCP connection that reaches it (and pyinfra's "Connecting
to hosts" step must not be printed). The control run with a valid inventory is counted
connecting to that port, so a zero is not vacuous.

The gate gets there through k2fleet's ``pyinfra.connectors`` entry point
(:mod:`k2fleet.deploy.pyinfra_entry`). The test does not rely on the environment's
installed metadata (an editable install made before the entry point was declared lacks it):
it puts a distribution on ``PYTHONPATH`` whose ``entry_points.txt`` holds exactly the
``pyinfra.connectors`` entries ``pyproject.toml`` declares.
"""

from __future__ import annotations

import os
import socket
import threading
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


class CountingPort:
    """A loopback port this test listens on: every TCP connection that reaches it is accepted,
    counted and closed at once (an SSH client then fails on the missing banner)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:  # the timeout: look at the stop flag again
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.fixture()
def counting_port() -> Iterator[CountingPort]:
    port = CountingPort()
    try:
        yield port
    finally:
        port.close()


def fleet(tmp_path: Path, port: int, group_py: str = "") -> Path:
    inv = write_inventory(tmp_path / "inv", hosts=[("node-0", {"ssh_hostname": "127.0.0.1", "ssh_port": port,
                                                               "ssh_connect_timeout": 3})])
    if group_py:
        group = inv.parent / "group_data" / inv.name
        group.write_text(group.read_text() + group_py)
    return inv


def pyinfra_outside(inv: Path, entry: Path, cwd: Path, port: CountingPort) -> tuple[subprocess.CompletedProcess[str], int]:
    """pyinfra from ``cwd`` (not the checkout); (its result, TCP connections that reached ``port``)."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO), str(entry)]),
                        "K2FLEET_STATE_DIR": str(cwd / "state")}
    argv = [sys.executable, "-m", "pyinfra", "-y", str(inv), str(DEPLOY)]
    before = port.connections
    out = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, cwd=cwd, env=env,
                         timeout=180)
    return out, port.connections - before


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
        tmp_path: Path, entry_point_path: Path, counting_port: CountingPort, group_py: str, says: str) -> None:
    inv = fleet(tmp_path, counting_port.port, group_py)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    out, connects = pyinfra_outside(inv, entry_point_path, cwd, counting_port)
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-3000:]
    assert "Traceback" not in text and "Connecting to hosts" not in text, text[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [out.stderr.strip().splitlines()[-1]], out.stderr  # one line, and the run's last
    assert errors == [validate_line(inv)] and says in errors[0], (errors, says)
    assert connects == 0, connects  # not even attempted
    assert not (cwd / "state").exists()


def test_a_valid_inventory_outside_the_checkout_goes_on_to_connect(tmp_path: Path, entry_point_path: Path,
                                                                 counting_port: CountingPort) -> None:
    """The control: the same run with a valid inventory passes the gate and connects to the
    port (which closes at once: no SSH banner, the run fails), so the zeros above are not vacuous."""
    inv = fleet(tmp_path, counting_port.port)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    out, connects = pyinfra_outside(inv, entry_point_path, cwd, counting_port)
    text = out.stdout + out.stderr
    assert not [line for line in out.stderr.splitlines() if line.startswith("error:")], text[-3000:]
    assert "Connecting to hosts" in text and out.returncode != 0, text[-3000:]
    assert connects > 0, connects


def test_other_pyinfra_runs_are_left_alone(tmp_path: Path, entry_point_path: Path, counting_port: CountingPort) -> None:
    """A pyinfra run that does not deploy k2fleet (here ``exec``) is not gated: pyinfra's own
    handling of the group-data file that raises (its traceback, exit 1) is unchanged."""
    inv = fleet(tmp_path, counting_port.port, 'raise RuntimeError("boom in group data")\n')
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
