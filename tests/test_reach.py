"""``k2fleet-host.pyz reach`` on loopback (the host program of the reachability check,
:mod:`k2fleet.planning.reach_plan`): the shipped archive run as a host runs it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k2fleet.planning.host_archive import archive_bytes


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("reach") / "k2fleet-host.pyz"
    path.write_bytes(archive_bytes())
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reach(archive: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-I", str(archive), "reach", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_a_peer_opens_the_ports_a_listener_holds_and_a_closed_one_is_one_line(archive: Path) -> None:
    held, taken, closed = free_port(), free_port(), free_port()
    owner = socket.socket()
    owner.bind(("127.0.0.1", taken))
    owner.listen(1)  # a running engine's port: the listener leaves it to its owner
    listener = subprocess.Popen([sys.executable, "-I", str(archive), "reach", "listen", "--bind", "127.0.0.1",
                                 "--ports", f"{held},{taken}", "--seconds", "20"], stdout=subprocess.PIPE, text=True)
    try:
        ok = reach(archive, "probe", "--host", "n1", "--targets", f"127.0.0.1:{held},127.0.0.1:{taken}",
                   "--timeout", "10")
        assert ok.returncode == 0 and ok.stdout == "", ok.stdout + ok.stderr
        started = time.monotonic()
        bad = reach(archive, "probe", "--host", "n1", "--targets", f"127.0.0.1:{held},127.0.0.1:{closed}",
                    "--timeout", "2")
        assert bad.returncode == 1, bad.stdout
        lines = bad.stdout.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"reach: n1 cannot open 127.0.0.1:{closed} (Connection refused)"), lines
        assert "let the fleet's hosts reach each other on this port" in lines[0]
        assert 2 <= time.monotonic() - started < 15  # it kept trying for its timeout, and no longer
    finally:
        listener.terminate()
        out, _ = listener.communicate(timeout=10)
        owner.close()
    assert f"127.0.0.1:{taken} is in use already" in out


def test_a_listener_on_an_address_the_host_does_not_have_fails(archive: Path) -> None:
    done = reach(archive, "listen", "--bind", "192.0.2.77", "--ports", str(free_port()), "--seconds", "1")
    assert done.returncode == 1 and "is 192.0.2.77 this host's fleet address?" in done.stdout, done.stdout


@pytest.mark.parametrize("args", [("listen", "--bind", "127.0.0.1", "--ports", "0"),
                                  ("listen", "--bind", "127.0.0.1", "--ports", ",".join(["1"] * 65)),
                                  ("probe", "--host", "n1", "--targets", "127.0.0.1"),
                                  ("probe", "--host", "n1", "--targets", "127.0.0.1:70000")])
def test_bad_arguments_are_refused(archive: Path, args: tuple[str, ...]) -> None:
    done = reach(archive, *args)
    assert done.returncode == 2 and done.stderr.startswith("reach: "), done.stderr


def test_a_port_that_drops_connections_is_given_up_after_three_timed_out_attempts(archive: Path) -> None:
    """A port whose SYNs go unanswered (here: a listener whose accept queue is full, so the
    kernel drops further SYNs, as a firewall's drop rule does) times out attempt after attempt:
    the probe names it after three such attempts (~6 s) instead of its whole ``--timeout``,
    while a refused port (a listener not up yet) is retried until then (the test above)."""
    port = free_port()
    full = socket.socket()
    full.bind(("127.0.0.1", port))
    full.listen(0)  # never accepted: the queue fills and further SYNs are dropped
    queued = []
    try:
        for _ in range(8):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", port))
            queued.append(c)
        time.sleep(0.3)
        started = time.monotonic()
        out = reach(archive, "probe", "--host", "n1", "--targets", f"127.0.0.1:{port}", "--timeout", "30")
        took = time.monotonic() - started
        assert out.returncode == 1, out.stdout
        assert out.stdout.startswith(f"reach: n1 cannot open 127.0.0.1:{port} (timed out) 3 times in a row: "), out.stdout
        assert 5.5 <= took < 12, took
    finally:
        for c in queued:
            c.close()
        full.close()
