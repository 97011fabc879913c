"""The authenticating API front (``k2fleet/planning/api_front.py``): with ``k2_api_key_file``
and an engine that cannot take the key itself (SGLang and its PD router, trtllm-serve,
KTransformers), the endpoint is HAProxy on the API port and the engine listens on
127.0.0.1 only.

The first test is the exploit: with a key set, nothing but the front may listen on the API
port of a non-loopback address (before the front, validation refused the key; serving the
engine there would have answered anyone). The offline tests check the plan and the desired
state per engine; the loopback tests run the real HAProxy (the OS package: ``dev.sh``
installs it) with k2fleet's config before a stdlib stand-in of an OpenAI endpoint.
"""

from __future__ import annotations

import dataclasses
import http.client
import http.server
import json
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from k2fleet.cli import format_plan, load_plan, plan_document
from k2fleet.control.artifacts import read_control_artifacts
from k2fleet.hostprogs import health
from k2fleet.planning import api_front
from k2fleet.planning.desired import desired_state
from k2fleet.planning.firewall import ANYONE, FLEET, host_firewall
from k2fleet.planning.units import api_key_paths, unit_file
from tests.test_api_key import key_file
from tests.test_doubles import LOCAL, free_port
from tests.test_roles_offline import control_calls  # noqa: F401 (fixture)

# inventory, extra --data, the API port's inventory key, the fronted engine service
ENGINES = [
    ("inventories/h200-sglang-tp16.py", [], "k2_port", "k2-sglang"),
    ("inventories/h200-sglang-pd.py", [], "k2_router_port", "k2-sglang-router"),
    ("inventories/b200-trtllm.py", [], "k2_port", "k2-trtllm"),
    ("inventories/h200-trtllm-mpi.py", [], "k2_port", "k2-trtllm"),
    ("inventories/ktransformers.py", [], "k2_port", "k2-ktransformers"),  # legacy 0.3.2
    ("inventories/ktransformers.py", ["k2_engine_version=0.7.2"], "k2_port", "k2-ktransformers"),  # sglang-kt
]
IDS = ["sglang-tp16", "sglang-pd", "trtllm", "trtllm-mpi", "kt-0.3.2", "kt-0.7.2"]


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _plan(tmp_path: Path, inventory: str, data: list[str], key: str):
    path = key_file(tmp_path, key)
    dep, plan = load_plan(inventory, [*data, f"k2_api_key_file={path}"])
    return path, dep, plan


@pytest.mark.parametrize("inventory,data,port_key,engine", ENGINES, ids=IDS)
def test_exploit_only_the_front_listens_on_the_api_port(tmp_path: Path, inventory: str, data: list[str],
                                                        port_key: str, engine: str) -> None:
    """A key set for an engine that cannot check it: no engine may answer on the API port
    (the front does, and refuses requests without the key)."""
    _, dep, plan = _plan(tmp_path, inventory, data, "k2-" + secrets.token_hex(16))
    api_port = dep.s.router_port if port_key == "k2_router_port" else dep.s.port
    fronts = 0
    for hp in plan.hosts.values():
        for svc in hp.services:
            if svc.name == api_front.FRONT:
                fronts += 1
                continue
            if "--host" in svc.argv and svc.health is not None and svc.health.chat and svc.role not in ("prefill", "decode"):
                assert _value(svc.argv, "--host") == "127.0.0.1", (hp.name, svc.argv)
                assert _value(svc.argv, "--port") != str(api_port)
    assert fronts >= 1


@pytest.mark.parametrize("inventory,data,port_key,engine", ENGINES, ids=IDS)
def test_each_endpoint_gets_the_front_and_the_engine_moves_to_loopback(tmp_path: Path, inventory: str, data: list[str],
                                                                      port_key: str, engine: str) -> None:
    key = "k2-" + secrets.token_hex(20)
    path, dep, plan = _plan(tmp_path, inventory, data, key)
    api_port = dep.s.router_port if port_key == "k2_router_port" else dep.s.port
    backend = dep.s.api_backend_port
    key_path, env_path = api_key_paths(dep)
    shown = format_plan(plan, dep.s.api_key_file, dep.api_model_name) + json.dumps(plan_document(dep, plan))
    assert key not in shown and key[3:15] not in shown
    endpoint = plan.endpoint()
    assert endpoint is not None and endpoint[1] == api_port  # the curl line targets the front's port
    assert f"curl -s http://{endpoint[0]}:{api_port}/v1/chat/completions" in shown
    assert f'-H "Authorization: Bearer $(cat {path})"' in shown
    desired = desired_state(dep, plan, read_control_artifacts(dep, plan))
    doc = plan_document(dep, plan)
    fronted_hosts = 0
    for hp in plan.hosts.values():
        d = desired[hp.name]
        names = [s.name for s in hp.services]
        files = {p: spec for role in d.files.values() for p, spec in role.items()}
        files |= {p: spec for role in d.service_files.values() for p, spec in role.items()}
        holding = {p for p, spec in files.items() if spec.content and key.encode() in spec.content}
        for svc in hp.services:
            assert key not in " ".join(svc.argv) and key not in json.dumps(svc.env)
            assert key not in unit_file(dep, svc) and "api-key.env" not in unit_file(dep, svc)
        if api_front.FRONT not in names:
            assert not holding and "haproxy" not in d.packages and api_front.UNIT not in d.units
            assert env_path not in files and api_front.keys_path(dep) not in files
            continue
        fronted_hosts += 1
        front = next(s for s in hp.services if s.name == api_front.FRONT)
        eng = next(s for s in hp.services if s.name == engine)
        # the engine: 127.0.0.1 on k2_api_backend_port; its Health still names the API port
        assert _value(eng.argv, "--host") == "127.0.0.1" and _value(eng.argv, "--port") == str(backend)
        assert eng.ports.get(api_front.BACKEND_KEY) == backend and port_key not in eng.ports
        assert eng.health is not None and eng.health.port == api_port
        # the front: HAProxy, k2fleet's unit, on the API port of the address the engine had
        assert front.argv == [api_front.HAPROXY, "-Ws", "-f", api_front.config_path(dep)]
        assert front.ports == {port_key: api_port} and front.stage == eng.stage and not front.needs_checkpoint
        unit = unit_file(dep, front)
        assert f"ExecStart={api_front.HAPROXY} -Ws -f {api_front.config_path(dep)}" in unit
        assert "Type=notify" in unit and "ExecReload=/bin/kill -USR2 $MAINPID" in unit
        assert api_front.UNIT in d.units and engine + ".service" in d.units
        cfg = files[api_front.config_path(dep)]
        assert cfg.mode == "644" and key.encode() not in cfg.content
        text = cfg.content.decode()
        assert f"bind 0.0.0.0:{api_port}\n" in text and f"server engine 127.0.0.1:{backend}\n" in text
        assert f"-f {api_front.keys_path(dep)}" in text
        # the key: the gate's file and the front's pattern file, both 0600, "(secret)" in the plan
        assert holding == {key_path, api_front.keys_path(dep)}
        assert files[api_front.keys_path(dep)].content == f"Bearer {key}\n".encode()
        for p in holding:
            assert files[p].mode == "600"
            assert doc["hosts"][hp.name]["desired"]["files"][p]["sha256"] == "(secret)"
        assert d.api_key_services == [api_front.FRONT]  # a changed key restarts the front, not the engine
        # the health gate calls through the front, with the key file
        assert d.health_argv[d.health_argv.index("--base") + 1].endswith(f":{api_port}")
        assert d.health_argv[d.health_argv.index("--api-key-file") + 1] == key_path
        assert d.health_argv[d.health_argv.index("--unit") + 1] == engine + ".service"
        assert "haproxy" in d.packages and "haproxy" in d.bundle_request
        # the firewall: the API port is the front's (as open as before), the backend the fleet's
        fw = host_firewall(dep, hp)
        assert fw is not None
        by_port = {o.ports: o for o in fw.openings}
        assert by_port[str(api_port)].who in (ANYONE, "api-clients") and api_front.FRONT in by_port[str(api_port)].what
        assert by_port[str(backend)].who == FLEET and api_front.BACKEND_KEY in by_port[str(backend)].what
        assert api_front.UNIT in fw.before
    assert fronted_hosts == 1


def test_bind_address_fleet_puts_the_front_on_the_fleet_address(tmp_path: Path) -> None:
    _, dep, plan = _plan(tmp_path, "inventories/b200-trtllm.py", ["k2_bind_address=fleet"], "k2-" + secrets.token_hex(8))
    hp = next(h for h in plan.hosts.values() if api_front.has_front(h))
    front = next(s for s in hp.services if s.name == api_front.FRONT)
    eng = next(s for s in hp.services if s.name == "k2-trtllm")
    assert f"bind {hp.address}:{dep.s.port}\n" in front.files[api_front.config_path(dep)]
    assert _value(eng.argv, "--host") == "127.0.0.1" and eng.health.host == hp.address


def test_backend_port_clash_is_refused(tmp_path: Path) -> None:
    from k2fleet.inventory.spec import SpecError

    with pytest.raises(SpecError, match="port 8000"):
        _plan(tmp_path, "inventories/b200-trtllm.py", ["k2_api_backend_port=8000"], "k2-x")


def test_vllm_keeps_its_own_key_and_gets_no_front(tmp_path: Path) -> None:
    _, dep, plan = _plan(tmp_path, "inventories/h200.py", [], "k2-" + secrets.token_hex(8))
    assert not api_front.fronted(dep)
    assert not any(api_front.has_front(h) for h in plan.hosts.values())
    d = desired_state(dep, plan, read_control_artifacts(dep, plan))
    assert all("haproxy" not in x.packages for x in d.values())


def test_without_a_key_no_front(tmp_path: Path) -> None:
    dep, plan = load_plan("inventories/h200-sglang-pd.py")
    assert not any(api_front.has_front(h) for h in plan.hosts.values())
    router = next(s for h in plan.hosts.values() for s in h.services if s.name == "k2-sglang-router")
    assert _value(router.argv, "--host") == "0.0.0.0" and _value(router.argv, "--port") == str(dep.s.router_port)


# --------------------------------------------------------------------------- the real HAProxy, on loopback

HAPROXY = shutil.which("haproxy") or api_front.HAPROXY
# SGLang's HTTP server serves these beside the OpenAI routes (sglang/srt/entrypoints/http_server.py):
# weights swapped, caches flushed, profiling started, the server's arguments read
ADMIN_ROUTES = ("/update_weights_from_disk", "/flush_cache", "/start_profile", "/get_server_info", "/generate")
STREAM = [f'data: {{"choices": [{{"delta": {{"content": "tok{i}"}}}}]}}\n\n' for i in range(5)] + ["data: [DONE]\n\n"]


class OpenAIStandIn(http.server.ThreadingHTTPServer):
    """A stdlib stand-in of an OpenAI endpoint: /health, /metrics, /v1/models, chat
    completions (JSON, or SSE with ``stream``: the last events wait for ``release``)."""

    daemon_threads = True

    def __init__(self, port: int) -> None:
        super().__init__((LOCAL, port), _Handler)
        self.release = threading.Event()
        self.seen_auth: list[str | None] = []
        self.seen_paths: list[str] = []
        self.upgraded: list[str] = []  # paths answered 101
        self.tunnelled: list[bytes] = []  # bytes read after a 101

    def handle_error(self, request, client_address) -> None:
        pass  # a client the front cut off mid-answer (the tests cut some on purpose): no traceback on stderr


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: OpenAIStandIn

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _tunnel(self) -> bool:
        """An engine that answers ``Upgrade`` with 101 and then reads raw bytes (what a
        websocket route does): every later byte on the connection is recorded."""
        if not self.headers.get("Upgrade"):
            return False
        self.send_response(101)
        self.send_header("Upgrade", self.headers["Upgrade"])
        self.send_header("Connection", "Upgrade")
        if self.headers.get("Sec-WebSocket-Key"):  # RFC 6455's handshake (HAProxy checks it)
            import base64
            import hashlib

            magic = (self.headers["Sec-WebSocket-Key"] + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()
            self.send_header("Sec-WebSocket-Accept", base64.b64encode(hashlib.sha1(magic).digest()).decode())
        self.end_headers()
        self.wfile.flush()
        self.server.upgraded.append(self.path)
        self.connection.settimeout(3)
        try:
            while chunk := self.connection.recv(65536):
                self.server.tunnelled.append(chunk)
        except OSError:
            pass
        self.close_connection = True
        return True

    def do_GET(self) -> None:
        self.server.seen_auth.append(self.headers.get("Authorization"))
        self.server.seen_paths.append(self.path)
        if self._tunnel():
            return
        if self.path == "/health":
            self._send(200, b"")
        elif self.path == "/metrics":
            self._send(200, b"vllm:num_requests_running 0\n", "text/plain")
        elif self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": "kimi-k2", "object": "model"}]}).encode())
        else:
            self._send(404, b'{"error": "not found"}')

    def do_POST(self) -> None:
        self.server.seen_auth.append(self.headers.get("Authorization"))
        self.server.seen_paths.append(self.path)
        if self._tunnel():
            return
        if self.path in ADMIN_ROUTES:  # SGLang-style admin routes: answered as the engine would
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            self._send(200, b'{"success": true}')
            return
        req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
        if self.path != "/v1/chat/completions":
            self._send(404, b'{"error": "not found"}')
        elif req.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i, event in enumerate(STREAM):
                if i == 2:
                    self.server.release.wait(20)  # the client must see the first events before the rest exist
                data = event.encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        else:
            self._send(200, json.dumps({"object": "chat.completion", "model": req.get("model"),
                                        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ready"},
                                                     "finish_reason": "stop"}]}).encode())


@pytest.fixture
def front(tmp_path: Path):
    """The real HAProxy with k2fleet's config on 127.0.0.1 before the stand-in; yields
    (front port, key, stand-in, haproxy process, config path, keys path)."""
    if not os.path.exists(HAPROXY):
        pytest.fail(f"{HAPROXY} is missing: install Debian's haproxy (dev.sh does)")
    key = "sk-" + secrets.token_hex(24)
    backend, port = free_port(), free_port()
    engine = OpenAIStandIn(backend)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    keys = tmp_path / "api-front.keys"
    fd = os.open(keys, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, api_front.keys_file(key))
    os.close(fd)
    cfg = tmp_path / "api-front.cfg"
    cfg.write_text(api_front.config(LOCAL, port, backend, str(keys), "the stand-in"))
    log = open(tmp_path / "haproxy.log", "w+")
    proc = subprocess.Popen([HAPROXY, "-Ws", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if _get(port, "/health")[0] == 200:
                break
        except OSError:
            time.sleep(0.1)
    engine.seen_auth.clear()  # the readiness probe's /health
    engine.seen_paths.clear()
    try:
        yield port, key, engine, proc, cfg, keys
    finally:
        proc.send_signal(signal.SIGTERM)  # the master stops its workers
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        engine.shutdown()
        engine.server_close()
        log.close()


def _request(port: int, method: str, path: str, body: bytes | None = None,
             auth: str | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(LOCAL, port, timeout=30)
    headers = {"Content-Type": "application/json", **({"Authorization": auth} if auth else {})}
    conn.request(method, path, body, headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data


def _get(port: int, path: str, auth: str | None = None) -> tuple[int, dict[str, str], bytes]:
    return _request(port, "GET", path, auth=auth)


CHAT = json.dumps({"model": "kimi-k2", "messages": [{"role": "user", "content": "hi"}]}).encode()


def test_haproxy_accepts_the_rendered_config(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_bytes(api_front.keys_file("sk-x"))
    for bind in ("0.0.0.0", "127.0.0.1", "::1"):
        cfg = tmp_path / "front.cfg"
        cfg.write_text(api_front.config(bind, 18000, 18001, str(keys)))
        check = subprocess.run([HAPROXY, "-c", "-f", str(cfg)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        assert "Configuration file is valid" in check.stdout + check.stderr


def test_the_front_refuses_requests_without_the_key(front) -> None:
    port, key, engine, *_ = front
    for auth in (None, "Bearer wrong-" + key, f"Bearer {key[:-1]}", f"bearer {key}", key, f"Bearer {key} x"):
        for method, path, body in (("POST", "/v1/chat/completions", CHAT), ("GET", "/v1/models", None),
                                   ("POST", "/health", b"{}"), ("GET", "/v1/../health", None)):
            status, headers, data = _request(port, method, path, body, auth)
            assert status == 401, (auth, method, path)
            assert json.loads(data) == {"error": "Unauthorized"} and headers["content-type"] == "application/json"
            assert headers.get("www-authenticate") == "Bearer"
    assert engine.seen_auth == []  # nothing reached the engine


def test_the_front_passes_the_key_and_leaves_health_and_metrics_open(front) -> None:
    port, key, engine, *_ = front
    assert _get(port, "/health")[0] == 200
    assert _get(port, "/metrics")[2].startswith(b"vllm:")
    status, _, data = _request(port, "POST", "/v1/chat/completions", CHAT, f"Bearer {key}")
    assert status == 200 and json.loads(data)["choices"][0]["message"]["content"] == "ready"
    assert _get(port, "/v1/models", f"Bearer {key}")[0] == 200


def _raw(port: int, data: bytes, then: bytes = b"", wait: float = 1.0) -> bytes:
    """Send ``data`` on one connection, read the answer's head, send ``then`` on the same
    connection (what a client does in a tunnel after a 101) and read what comes back."""
    import socket

    with socket.create_connection((LOCAL, port), timeout=5) as sock:
        sock.sendall(data)
        got = b""
        while b"\r\n\r\n" not in got:
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
        if then:
            try:
                sock.sendall(then)
                sock.settimeout(wait)
                while chunk := sock.recv(65536):
                    got += chunk
            except OSError:
                pass
        return got


ADMIN_PATHS = [*ADMIN_ROUTES, "/v1/../flush_cache", "/v1/%2e%2e/flush_cache", "/v1/%2E%2E/flush_cache",
               "//flush_cache", "/v1/./../flush_cache", "/health/../flush_cache", "/v1%2f..%2fflush_cache",
               "/v1/..%2fflush_cache", "/V1/chat/completions/../../flush_cache", "/flush_cache?x=/v1/"]


def test_exploit_a_keyed_client_reaches_no_engine_admin_route(front) -> None:
    """SGLang's HTTP server serves admin routes (weights from disk, cache flush, profiling)
    beside the OpenAI API: the front passes only the routes the deployment serves, with the key
    too, and no dot segment or encoded separator sneaks one through."""
    port, key, engine, *_ = front
    for path in ADMIN_PATHS:
        for auth in (f"Bearer {key}", None):
            status, _, data = _request(port, "POST", path, b"{}", auth)
            assert status in (401, 404) and (status == 401) == (auth is None), (path, auth, status)
            if status == 404:
                assert json.loads(data) == {"error": "Not Found"}
    assert engine.seen_paths == []  # nothing reached the engine
    assert _request(port, "POST", "/v1/chat/completions", CHAT, f"Bearer {key}")[0] == 200  # the API still passes


def test_exploit_no_upgrade_and_no_tunnel_after_it(front) -> None:
    """An ``Upgrade`` answered 101 turns HAProxy's connection into a tunnel: later requests on
    it are never checked. The front refuses ``Upgrade`` (without the key: 401; with it, 400:
    the deployment serves no websocket) and never passes a 101 on."""
    port, key, engine, *_ = front
    smuggled = b"POST /flush_cache HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
    for path, auth, want in (("/health", None, b" 400 "), ("/metrics", None, b" 400 "),
                             ("/v1/models", None, b" 401 "), ("/v1/models", f"Bearer {key}", b" 400 ")):
        head = f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n" \
               f"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        head += f"Authorization: {auth}\r\n" if auth else ""
        got = _raw(port, (head + "\r\n").encode(), smuggled)
        status_line = got.split(b"\r\n", 1)[0]
        assert want in status_line and b"101" not in status_line, (path, auth, got[:200])
    for method in ("CONNECT", "GET"):  # a CONNECT tunnel, an h2c upgrade
        extra = "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n" \
            if method == "GET" else ""
        target = "127.0.0.1:22" if method == "CONNECT" else "/health"
        got = _raw(port, f"{method} {target} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n{extra}\r\n".encode(),
                   smuggled)
        assert b" 101 " not in got.split(b"\r\n", 1)[0] and b" 200 " not in got.split(b"\r\n", 1)[0], got[:200]
    assert engine.upgraded == [] and engine.tunnelled == []
    assert not [p for p in engine.seen_paths if "flush" in p]


def test_a_streamed_answer_passes_through_intact_and_unbuffered(front) -> None:
    port, key, engine, *_ = front
    conn = http.client.HTTPConnection(LOCAL, port, timeout=30)
    body = json.dumps({"model": "kimi-k2", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json",
                                                         "Authorization": f"Bearer {key}"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    first = b""
    while first.count(b"\n\n") < 2:  # the first two events arrive while the engine holds the rest back
        chunk = resp.read1(65536)
        assert chunk, "the stream ended early"
        first += chunk
    engine.release.set()
    rest = resp.read()
    conn.close()
    assert (first + rest).decode() == "".join(STREAM)


def test_the_health_gate_passes_through_the_front_only_with_the_key(front, tmp_path: Path) -> None:
    port, key, *_ = front
    argv = ["--base", f"http://{LOCAL}:{port}", "--model", "kimi-k2", "--unit", "k2-sglang.service", "--timeout", "3"]
    (tmp_path / "good").mkdir()
    assert health.main([*argv, "--api-key-file", key_file(tmp_path / "good", key)]) == 0
    assert health.main([*argv, "--timeout", "2"]) == 1


def test_the_key_is_in_no_argv_and_not_in_the_config(front) -> None:
    port, key, engine, proc, cfg, keys = front
    assert key not in cfg.read_text() and str(keys) in cfg.read_text()
    assert oct(keys.stat().st_mode & 0o777) == "0o600"
    pids = [proc.pid] + [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == proc.pid]
    assert len(pids) >= 2  # the master and its worker
    for pid in pids:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert key.encode() not in cmdline and b"haproxy" in cmdline
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert key.encode() not in environ


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``signum`` (``SigCgt`` in /proc)."""
    with open(f"/proc/{pid}/status") as fh:
        caught = next(int(line.split()[1], 16) for line in fh if line.startswith("SigCgt:"))
    return bool(caught & (1 << (signum - 1)))


def test_a_new_key_takes_effect_on_reload(front) -> None:
    """The services role rewrites the pattern file and restarts the front; a reload
    (``systemctl reload k2-api-front``: SIGUSR2 to the master) takes the new key too."""
    port, key, engine, proc, cfg, keys = front
    ready = time.monotonic() + 60
    while _get(port, "/v1/models", f"Bearer {key}")[0] != 200:
        assert time.monotonic() < ready, "the front does not serve the first key"
        time.sleep(0.2)
    # HAProxy's worker serves a few ms before its master catches SIGUSR2 (measured: 70 vs 77 ms
    # on an idle machine, wider under load); a SIGUSR2 in between never reloads (a failed run:
    # 60 s of the old key, no "Reexecuting Master" in the log). systemctl reload comes long after.
    while not _catches(proc.pid, signal.SIGUSR2):
        assert time.monotonic() < ready, "the HAProxy master never catches SIGUSR2"
        time.sleep(0.05)
    new = "sk-" + secrets.token_hex(24)
    keys.write_bytes(api_front.keys_file(new))
    proc.send_signal(signal.SIGUSR2)
    deadline = time.monotonic() + 60  # HAProxy's new worker parses its config under a loaded CPU
    while _get(port, "/v1/models", f"Bearer {new}")[0] != 200:
        log = (cfg.parent / "haproxy.log").read_text()[-2000:] if (cfg.parent / "haproxy.log").exists() else ""
        assert time.monotonic() < deadline, f"the reloaded front does not take the new key:\n{log}"
        time.sleep(0.2)
    assert _get(port, "/v1/models", f"Bearer {key}")[0] == 401


# --------------------------------------------------------------------------- the roles carry it out (@fake hosts)


def test_a_changed_key_rewrites_the_pattern_file_privately_and_restarts_only_the_front(tmp_path: Path,
                                                                                       control_calls) -> None:  # noqa: F811
    """The services role (tests/test_roles_offline.py's @fake harness) on a fleet that holds
    the front with key A, deployed with key B: the pattern file and the gate's key file are
    created 0600 before the upload, the front restarts, the engine keeps running."""
    from tests.test_roles_offline import artifacts, run_roles, settled_fleet

    def desired_for(key: str, where: Path):
        where.mkdir()
        dep, plan = load_plan("inventories/h200-sglang-tp16.py", [f"k2_api_key_file={key_file(where, key)}"])
        art = dataclasses.replace(artifacts(dep, plan), api_key=key.encode())
        return dep, plan, desired_state(dep, plan, art)

    dep_a, _, desired_a = desired_for("sk-" + secrets.token_hex(16), tmp_path / "a")
    dep, plan, desired = desired_for("sk-" + secrets.token_hex(16), tmp_path / "b")
    facts = settled_fleet(dep_a, desired_a)
    head = next(name for name, hp in plan.hosts.items() if api_front.has_front(hp))
    out = run_roles(dep, plan, desired, facts, tmp_path, control_calls)
    keyed = out.op(head, "the endpoints' API key (root-only files its units read)")
    assert keyed.changed
    for path in (api_front.keys_path(dep), api_key_paths(dep)[0]):
        prepared = next(i for i, c in enumerate(keyed.commands) if "umask 077" in c and path in c)
        assert "chmod 600" in keyed.commands[prepared] and prepared < keyed.commands.index(f"<upload> {path}")
    restarts = [c.split(" || ")[0] for c in out.commands(head)  # (the reachability listener aside: its own test)
                if c.startswith(("systemctl stop", "systemctl start")) and "k2-reach.service" not in c]
    assert restarts == [f"systemctl stop {api_front.UNIT}", f"systemctl start {api_front.UNIT}"]
    for name in out.ops:
        if name != head:
            assert not [c for c in out.commands(name) if c.startswith("systemctl")], name
