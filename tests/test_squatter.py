"""Local impersonation (issue #33 item 4): an unprivileged local user (uid 65534) who binds
k2fleet's port before k2fleet's unit does (a rolling restart, a crash loop) must get neither the
API key nor a "healthy" from the health gate. Real sockets: the squatter is a real process
running as nobody on loopback; the gate is the host program itself."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k2fleet.hostprogs import health
from tests.test_api_key import key_file
from tests.test_doubles import LOCAL, free_port

NOBODY = 65534
PYTHON = "/usr/bin/python3"  # the system's: nobody may not run the venv's (under /root or /work)

# A fake OpenAI endpoint that prints every Authorization header it is sent (one line each).
SQUATTER = r'''
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def _answer(self, body):
        print("AUTH", self.headers.get("Authorization"), flush=True)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self._answer(b'{"object": "list", "data": [{"id": "kimi-k2"}]}' if self.path != "/health" else b"")
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self._answer(json.dumps({"choices": [{"message": {"content": "healthy, trust me"}}]}).encode())

srv = ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), H)
print("LISTENING", flush=True)
srv.serve_forever()
'''


def _as_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


@pytest.fixture
def squatter():
    """(port, process): a fake endpoint on 127.0.0.1:PORT run by uid 65534."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as uid 65534")
    port = free_port()
    proc = subprocess.Popen([PYTHON, "-c", SQUATTER, LOCAL, str(port)], stdout=subprocess.PIPE, text=True,
                            preexec_fn=_as_nobody, cwd="/")
    assert proc.stdout is not None and proc.stdout.readline().strip() == "LISTENING"
    try:
        yield port, proc
    finally:
        proc.kill()
        proc.wait()


def _seen(proc: subprocess.Popen) -> str:
    proc.kill()
    out, _ = proc.communicate()
    return out


def test_exploit_a_squatter_gets_no_key_and_the_gate_fails_loudly(squatter, tmp_path: Path, capsys) -> None:
    port, proc = squatter
    key = "sk-squat-" + os.urandom(8).hex()
    argv = ["--base", f"http://{LOCAL}:{port}", "--model", "kimi-k2", "--unit", "k2-sglang.service", "--timeout", "5",
            "--api-key-file", key_file(tmp_path, key)]
    t = time.monotonic()
    assert health.main(argv) == 1  # not healthy
    assert time.monotonic() - t < 4  # at once, not after the timeout
    seen = _seen(proc)
    assert key not in seen and "AUTH" not in seen  # not even a key-less request reached it
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert f"{LOCAL}:{port}" in first and f"uid {NOBODY}" in first and os.uname().nodename in first, err


def test_exploit_without_a_key_the_squatter_is_not_healthy_either(squatter, capsys) -> None:
    port, proc = squatter
    argv = ["--base", f"http://{LOCAL}:{port}", "--model", "kimi-k2", "--unit", "k2-vllm.service", "--timeout", "3"]
    assert health.main(argv) == 1
    assert "AUTH" not in _seen(proc)
    assert f"uid {NOBODY}" in capsys.readouterr().err


def test_a_root_listener_is_trusted(tmp_path: Path) -> None:
    """The same fake endpoint run by root (as k2fleet's units are) passes: the check names the
    listener's owner, not the answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SQUATTER, LOCAL, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "LISTENING"
        key = "sk-root-" + os.urandom(8).hex()
        argv = ["--base", f"http://{LOCAL}:{port}", "--model", "kimi-k2", "--unit", "k2-sglang.service",
                "--timeout", "5", "--api-key-file", key_file(tmp_path, key)]
        assert health.main(argv) == 0
        assert f"AUTH Bearer {key}" in _seen(proc)
    finally:
        proc.kill()
        proc.wait()


def test_the_control_clients_hand_a_squatter_no_key(squatter) -> None:
    """``k2fleet status --completion``, ``bench`` and ``eval`` on a control machine that is a fleet
    host: the endpoint's port held by uid 65534 is refused before the key is sent."""
    from k2fleet.control import ControlError
    from k2fleet.control.bench_run import _check_endpoint
    from k2fleet.control.endpoint import endpoint_completion

    port, proc = squatter
    base = f"http://{LOCAL}:{port}"
    ok, line = endpoint_completion(base, "kimi-k2", b"sk-control-key")
    assert not ok and f"uid {NOBODY}" in line
    with pytest.raises(ControlError, match=f"uid {NOBODY}"):
        _check_endpoint(base, b"sk-control-key")
    assert "AUTH" not in _seen(proc)


def test_ss_names_the_squatter(squatter) -> None:
    """``ss`` names the owner of the listener the connection reached (the squatter's uid)
    and, for the message, its process."""
    port, proc = squatter
    sock = socket.create_connection((LOCAL, port), 5)
    try:
        assert health.server_uid(sock) == NOBODY
        assert f"pid={proc.pid}" in health.listener_process(port)
    finally:
        sock.close()
    assert "AUTH" not in _seen(proc)


@pytest.mark.parametrize("bind", ["127.0.0.1", "0.0.0.0", "::"])
def test_a_root_listener_is_told_by_its_address_or_wildcard(bind: str) -> None:
    """The listener a connection to 127.0.0.1 reaches: bound to that address, to the IPv4
    wildcard or dual-stack (``*`` in ss's list): root's (ss prints no ``uid:`` for uid 0). A
    line without ss's details is nobody's to trust; an address not of this host has no
    owner here."""
    srv = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET)
    if ":" in bind:
        srv.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    srv.bind((bind, 0))
    srv.listen()
    sock = socket.create_connection((LOCAL, srv.getsockname()[1]), 5)
    try:
        assert health.server_uid(sock) == os.geteuid()
        assert health._ss_uid(["sk:1"]) is None
        assert health.is_local(LOCAL) and not health.is_local("198.51.100.7")
    finally:
        sock.close()
        srv.close()


def test_a_server_elsewhere_has_no_owner_here(monkeypatch) -> None:
    """No owner found (the server end lives in another network namespace: another host): the
    gate, whose service runs where it does, refuses; a control client passes."""
    srv = socket.socket()
    srv.bind((LOCAL, 0))
    srv.listen()
    sock = socket.create_connection((LOCAL, srv.getsockname()[1]), 5)
    try:
        monkeypatch.setattr(health, "server_uid", lambda _sock: None)
        with pytest.raises(health.Impostor, match="cannot tell its owner"):
            health.check_server(sock, LOCAL, 8000, required=True)
        health.check_server(sock, LOCAL, 8000, required=False)
    finally:
        sock.close()
        srv.close()
