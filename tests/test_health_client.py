"""The health program's own HTTP client (:func:`k2fleet.hostprogs.health.request`) against
real sockets on loopback: length-delimited and chunked answers, a thinking model's answer,
an answer over the size cap, a peer that does not speak HTTP."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from k2fleet.hostprogs import health


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        if self.path == "/chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for part in (b'{"a": ', b'"b"}'):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
            return
        if self.path == "/huge":
            body = b"x" * (health.MAX_BODY + 1_000_000)
        else:
            body = json.dumps({"path": self.path}).encode()
        self.send_response(404 if self.path == "/missing" else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        sent = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        # a thinking model whose 16 tokens ended inside the thinking (real vLLM 0.32)
        body = json.dumps({"choices": [{"message": {"content": None, "reasoning": f"thinking about {sent['model']}"},
                                        "finish_reason": "length"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_length_and_chunked_answers(server):
    assert health.request(f"{server}/v1/models") == (200, b'{"path": "/v1/models"}')
    assert health.request(f"{server}/chunked") == (200, b'{"a": "b"}')
    assert health.get_status(f"{server}/missing") == 404
    assert health.get_json(f"{server}/x?y=1") == {"path": "/x?y=1"}


def test_thinking_answer_counts(server):
    assert health.chat(server, "m1") == "thinking about m1"


def test_answer_over_the_cap_is_refused(server):
    with pytest.raises(ValueError, match="larger than"):
        health.request(f"{server}/huge")


def test_not_http_and_not_listening():
    peer = socket.socket()
    peer.bind(("127.0.0.1", 0))
    peer.listen()
    port = peer.getsockname()[1]

    def garbage():
        conn, _ = peer.accept()
        conn.recv(1000)
        conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
        conn.close()

    threading.Thread(target=garbage, daemon=True).start()
    with pytest.raises(ValueError, match="not an HTTP status line"):
        health.request(f"http://127.0.0.1:{port}/health")
    peer.close()
    assert health.get_status(f"http://127.0.0.1:{port}/health") is None  # nothing listens now
    with pytest.raises(ValueError, match="https:// needs a CA file"):  # TLS only against a CA (tests/test_tls.py)
        health.request("https://127.0.0.1/health")
    with pytest.raises(ValueError, match="not an http:// or https:// URL"):
        health.request("ftp://127.0.0.1/health")


class CountingEngine(BaseHTTPRequestHandler):
    """/health, a chat completion, and /metrics whose request counter moves with each
    completion (``moves``), stays (a gate answered by something else), or is absent."""

    protocol_version = "HTTP/1.1"
    done = 0
    mode = "moves"

    def log_message(self, *args):
        pass

    def _send(self, body: bytes, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/metrics":
            family = "vllm:request_success_total" if type(self).mode != "absent" else "vllm:other_total"
            self._send(f'# TYPE {family} counter\n{family}{{finished_reason="stop"}} {type(self).done}.0\n'.encode())
        else:
            self._send(b"{}")

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        if type(self).mode != "stays":
            type(self).done += 1
        self._send(json.dumps({"choices": [{"message": {"content": "ready"}}]}).encode())


@pytest.mark.parametrize("mode, code", [("moves", 0), ("stays", 1), ("absent", 0)])
def test_the_gate_reads_the_engines_request_counter(mode: str, code: int, capsys) -> None:
    handler = type(f"Engine{mode}", (CountingEngine,), {"mode": mode, "done": 0})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{srv.server_address[1]}"
        argv = ["--base", base, "--model", "m", "--unit", "k2-vllm.service", "--timeout", "8",
                "--expect-counter", "vllm:request_success_total"]
        assert health.main(argv) == code
    finally:
        srv.shutdown()
    err = capsys.readouterr().err
    if code:
        assert "vllm:request_success_total did not move after the gate's completion (0 -> 0.0)" in err, err
