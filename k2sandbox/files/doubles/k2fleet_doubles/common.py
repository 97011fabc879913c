"""Shared machinery of the k2fleet-test-double engines (TEST DOUBLES ONLY).

Provides, with the Python standard library only:

* model-path resolution (local directory with ``config.json`` or a Hub id),
* a real TCP rendezvous (JSON lines) between a head that listens and members
  that connect, with timeouts that exit 1 naming the peer address,
* a readiness tracker (simulated load time + rendezvous completeness),
* a threaded HTTP server speaking a tiny, deterministic subset of the OpenAI
  API (``/health``, ``/v1/models``, ``/v1/chat/completions``,
  ``/v1/completions``), logging each request to stdout (journald).

Nothing here loads a model or touches a GPU: it is a stand-in used on
k2fleet's sandbox fleet, named ``k2fleet-test-double`` everywhere.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional

from . import DOUBLE_NAME

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
JsonDict = dict[str, Any]


# --------------------------------------------------------------------------
# logging, failure, environment
# --------------------------------------------------------------------------

def log(engine: str, message: str) -> None:
    """Print one line to stdout (journald under systemd)."""
    print(f"[{DOUBLE_NAME} {engine}] {message}", flush=True)


def fail(engine: str, message: str, code: int = 1) -> NoReturn:
    """Report a fatal error on stderr and exit; safe from any thread."""
    print(f"[{DOUBLE_NAME} {engine}] ERROR: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


def env_float(name: str, default: float) -> float:
    """Read a float environment knob, falling back to ``default``."""
    raw = os.environ.get(name, "").strip()
    try:
        return float(raw) if raw else default
    except ValueError:
        return default


def startup_seconds() -> float:
    """Simulated model load time (``K2FLEET_DOUBLE_STARTUP_SECONDS``)."""
    return max(0.0, env_float("K2FLEET_DOUBLE_STARTUP_SECONDS", 0.0))


def rdzv_timeout() -> float:
    """Rendezvous timeout in seconds (``K2FLEET_DOUBLE_RDZV_TIMEOUT``)."""
    return max(0.1, env_float("K2FLEET_DOUBLE_RDZV_TIMEOUT", 300.0))


def gpus_per_node() -> int:
    """Pretend GPU count per host (``K2FLEET_DOUBLE_GPUS_PER_NODE``)."""
    return max(1, int(env_float("K2FLEET_DOUBLE_GPUS_PER_NODE", 8)))


def parse_hostport(value: str) -> tuple[str, int]:
    """Split ``host:port`` / ``[v6]:port``; raise ValueError when malformed."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


# --------------------------------------------------------------------------
# model path
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelInfo:
    """What the double knows about the model argument."""

    spec: str
    local: bool
    model_type: Optional[str]


class ModelError(Exception):
    """The model argument would make the real engine fail to load."""


def resolve_model(spec: str) -> ModelInfo:
    """Accept a directory holding config.json, or a Hub id ``org/name``."""
    path = Path(spec)
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ModelError(f"model directory {spec} has no config.json; "
                             "refusing to serve it")
        try:
            data = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ModelError(f"{config} is not readable JSON: {exc}") from exc
        model_type = data.get("model_type") if isinstance(data, dict) else None
        return ModelInfo(spec, True, model_type if isinstance(model_type, str) else None)
    if path.exists():
        raise ModelError(f"model path {spec} exists but is not a directory")
    if HUB_ID.match(spec) and not spec.startswith((".", "/")):
        return ModelInfo(spec, False, None)
    raise ModelError(f"model path {spec} does not exist and is not a Hub id (org/name)")


GGUF_MAGIC = b"GGUF"


def gguf_files(gguf_path: str) -> list[Path]:
    """The ``*.gguf`` files KTransformers' ``GGUFLoader(gguf_path)`` would load; raises ModelError where
    it would raise (missing path, no .gguf file, bad magic or header)."""
    root = Path(gguf_path)
    if not root.exists():
        raise ModelError(f"GGUF dir not found: {gguf_path}")
    if root.is_file():
        root = root.parent
    found = sorted(Path(d) / f for d, _, files in os.walk(root) for f in files if f.endswith(".gguf"))
    if not found:
        raise ModelError(f"Cannot find any .gguf files in: {gguf_path}")
    for path in found:
        with open(path, "rb") as f:
            head = f.read(24)
        if head[:4] != GGUF_MAGIC or len(head) < 24:
            raise ModelError(f"{path}: not a GGUF file (magic {head[:4]!r})")
        version, _tensors, _kv = struct.unpack("<IQQ", head[4:24])
        if version != 3:
            log("gguf", f"warning: {path}: GGUF version {version} has never been tested, might not work")
    return found


# --------------------------------------------------------------------------
# TCP rendezvous
# --------------------------------------------------------------------------

class RendezvousError(Exception):
    """A rendezvous could not be completed."""


def _send_line(conn: socket.socket, payload: JsonDict) -> None:
    conn.sendall((json.dumps(payload) + "\n").encode())


def _recv_line(conn: socket.socket) -> Optional[JsonDict]:
    """Read one JSON line; None on EOF/reset."""
    buf = b""
    while not buf.endswith(b"\n"):
        try:
            chunk = conn.recv(1)
        except OSError:
            return None
        if not chunk:
            return None
        buf += chunk
        if len(buf) > 65536:
            return None
    try:
        data = json.loads(buf)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


@dataclass
class RendezvousGroup:
    """Ranks a group needs, what the head already covers, and the contract.

    ``kind`` and every ``expect`` item must match in a member's hello;
    ``claims`` maps a hello to the set of ranks the member brings.
    """

    kind: str
    required: frozenset[int]
    head_claims: frozenset[int]
    expect: JsonDict
    claims: Callable[[JsonDict], frozenset[int]]


class RendezvousServer:
    """Head side: listen, validate members' hellos, track coverage.

    ``fatal_loss``: a member that joined and then went away (its process died)
    ends the head with exit 1, naming it (vLLM's engine-death shutdown); else
    the head waits for it to rejoin (up to the rendezvous timeout).
    """

    def __init__(self, engine: str, host: str, port: int, group: RendezvousGroup,
                 fatal_loss: Optional[str] = None) -> None:
        self.engine, self.host, self.port, self.group = engine, host, port, group
        self.fatal_loss = fatal_loss
        self._lock = threading.RLock()
        self._members: dict[socket.socket, tuple[JsonDict, frozenset[int]]] = {}
        self._sock: Optional[socket.socket] = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> None:
        """Bind and accept in the background; exit 1 if the bind fails."""
        try:
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(64)
        except OSError as exc:
            fail(self.engine, f"cannot listen for rendezvous on {self.address}: {exc}")
        self._sock = sock
        log(self.engine, f"rendezvous ({self.group.kind}) listening on {self.address}; "
                         f"waiting for ranks {sorted(self.missing())}")
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def covered(self) -> frozenset[int]:
        with self._lock:
            ranks = set(self.group.head_claims)
            for _, claimed in self._members.values():
                ranks |= claimed
        return frozenset(ranks)

    def missing(self) -> list[int]:
        return sorted(self.group.required - self.covered())

    def complete(self) -> bool:
        return not self.missing()

    def members(self) -> list[JsonDict]:
        with self._lock:
            return [hello for hello, _ in self._members.values()]

    def member_addresses(self) -> list[str]:
        """Network addresses members joined from (other hosts only), as this head saw them."""
        return sorted({hello["_peer"] for hello in self.members() if hello.get("_peer")})

    def close(self) -> None:
        """Tell every member we are going away (clean shutdown)."""
        with self._lock:
            conns = list(self._members)
        for conn in conns:
            try:
                _send_line(conn, {"bye": True})
                conn.close()
            except OSError:
                pass

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve_member, args=(conn,), daemon=True).start()

    def _check(self, hello: JsonDict) -> tuple[Optional[str], frozenset[int]]:
        group = self.group
        if hello.get("kind") != group.kind:
            return f"expected a {group.kind!r} member, got {hello.get('kind')!r}", frozenset()
        for key, want in group.expect.items():
            if hello.get(key) != want:
                return f"{key} mismatch: head has {want!r}, member sent {hello.get(key)!r}", frozenset()
        try:
            claimed = group.claims(hello)
        except (KeyError, TypeError, ValueError) as exc:
            return f"malformed hello: {exc}", frozenset()
        if not claimed or not claimed <= group.required:
            return f"ranks {sorted(claimed)} outside {sorted(group.required)}", claimed
        taken = claimed & self.covered()
        if taken:
            return f"ranks {sorted(taken)} are already covered", claimed
        return None, claimed

    def _serve_member(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        hello = _recv_line(conn)
        if hello is None:
            conn.close()
            return
        try:
            peer, local = conn.getpeername()[0], conn.getsockname()[0]
        except OSError:
            peer = local = ""
        with self._lock:
            error, claimed = self._check(hello)
            if error is None:
                self._members[conn] = ({**hello, "_peer": peer if peer != local else ""}, claimed)
        if error is not None:
            log(self.engine, f"rejected member {hello.get('host')}: {error}")
            try:
                _send_line(conn, {"ok": False, "error": error, "server": DOUBLE_NAME})
            finally:
                conn.close()
            return
        log(self.engine, f"member {hello.get('host')} joined with ranks {sorted(claimed)}; "
                         f"still missing {self.missing()}")
        _send_line(conn, {"ok": True, "server": DOUBLE_NAME})
        conn.settimeout(None)
        _keepalive(conn)
        try:
            while conn.recv(1024):
                pass
        except OSError:
            pass
        with self._lock:
            self._members.pop(conn, None)
        if self.fatal_loss:
            fail(self.engine, f"ranks {sorted(claimed)} on {hello.get('host')} died: {self.fatal_loss}")
        log(self.engine, f"member {hello.get('host')} left; missing ranks {self.missing()}")


def _keepalive(conn: socket.socket) -> None:
    """Notice a head host that vanished without closing the connection."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def join(engine: str, host: str, port: int, hello: JsonDict, timeout: float) -> socket.socket:
    """Member side: connect (retrying) and present ``hello``; return the socket."""
    address = f"{host}:{port}"
    deadline = time.monotonic() + timeout
    last_error = "no attempt"
    while time.monotonic() < deadline:
        try:
            conn = socket.create_connection((host, port), timeout=5)
        except OSError as exc:
            last_error = str(exc)
            time.sleep(0.2)
            continue
        _send_line(conn, hello)
        reply = _recv_line(conn)
        if reply is None:
            conn.close()
            last_error = "peer closed the connection during the handshake"
            time.sleep(0.2)
            continue
        if not reply.get("ok"):
            conn.close()
            raise RendezvousError(f"rendezvous peer {address} refused us: {reply.get('error')}")
        conn.settimeout(None)
        _keepalive(conn)
        return conn
    raise RendezvousError(f"could not rendezvous with peer {address} within "
                          f"{timeout:g}s (last error: {last_error})")


def hold(conn: socket.socket) -> str:
    """Block while the head keeps the connection; return 'bye' or 'lost'."""
    reply = _recv_line(conn)
    conn.close()
    return "bye" if reply and reply.get("bye") else "lost"


class MemberLink:
    """Member side of a rendezvous, kept alive in a background thread.

    Exits the process 1 when the head cannot be (re)joined within the
    rendezvous timeout.  When the head goes away, either rejoins (a restarted
    head, vLLM/SGLang style) or exits (``rejoin=False``, MPI-rank style: 0 on
    a clean goodbye, 1 on a lost connection).
    """

    def __init__(self, engine: str, host: str, port: int, hello: JsonDict,
                 rejoin: bool = True) -> None:
        self.engine, self.host, self.port = engine, host, port
        self.hello, self.rejoin = hello, rejoin
        self.joined = threading.Event()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "MemberLink":
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def reason(self) -> Optional[str]:
        """Readiness check: None once joined."""
        return None if self.joined.is_set() else f"joining rendezvous at {self.address}"

    def _run(self) -> None:
        while True:
            try:
                conn = join(self.engine, self.host, self.port, self.hello, rdzv_timeout())
            except RendezvousError as exc:
                fail(self.engine, str(exc))
            log(self.engine, f"joined rendezvous at {self.address} as {self.hello.get('kind')} "
                             f"member ({self.hello.get('host')})")
            self.joined.set()
            outcome = hold(conn)
            self.joined.clear()
            if not self.rejoin:
                log(self.engine, f"head at {self.address} went away ({outcome}); exiting")
                sys.stdout.flush()
                os._exit(0 if outcome == "bye" else 1)
            log(self.engine, f"head at {self.address} went away ({outcome}); rejoining")


# --------------------------------------------------------------------------
# readiness
# --------------------------------------------------------------------------

class Readiness:
    """Ready = simulated load finished and every rendezvous is complete."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self._loaded_at = time.monotonic() + startup_seconds()
        self._checks: list[Callable[[], Optional[str]]] = []

    def add_check(self, check: Callable[[], Optional[str]]) -> None:
        """``check`` returns None when satisfied, else a reason string."""
        self._checks.append(check)

    def reason(self) -> Optional[str]:
        """None when ready, else why not."""
        if time.monotonic() < self._loaded_at:
            return "loading model (simulated)"
        for check in self._checks:
            why = check()
            if why:
                return why
        return None

    def watch_server(self, server: RendezvousServer) -> None:
        """Track ``server`` and exit 1 if it stays incomplete for too long."""
        def check() -> Optional[str]:
            missing = server.missing()
            return f"waiting for ranks {missing} on {server.address}" if missing else None

        self.add_check(check)
        threading.Thread(target=self._watchdog, args=(server,), daemon=True).start()

    def _watchdog(self, server: RendezvousServer) -> None:
        timeout = rdzv_timeout()
        since: Optional[float] = None
        while True:
            time.sleep(0.2)
            if server.complete():
                since = None
                continue
            since = since or time.monotonic()
            if time.monotonic() - since > timeout:
                fail(self.engine, f"rendezvous timed out after {timeout:g}s: "
                                  f"{server.address} still misses ranks {server.missing()} "
                                  f"(members so far: {[m.get('host') for m in server.members()]})")


# --------------------------------------------------------------------------
# OpenAI-ish responses
# --------------------------------------------------------------------------

class BadRequest(Exception):
    """Maps to an HTTP 4xx error response."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class EngineApp:
    """Everything the HTTP handler needs to impersonate one engine."""

    engine: str
    served_names: list[str]
    model: ModelInfo
    readiness: Readiness
    reasoning: bool = False
    tools: str = "ignore"  # "auto": call tools, "ignore": answer text, "reject": 400
    tools_error: str = ""
    api_key: Optional[str] = None
    guarded: tuple[str, ...] = ("/v1",)  # path prefixes the key guards (/health and the rest stay open)
    metadata: JsonDict = field(default_factory=dict)
    extra_get: dict[str, Callable[[], tuple[int, Any]]] = field(default_factory=dict)
    rendezvous: list = field(default_factory=list)  # RendezvousServers this head runs
    # called with (path, body) before a completion is answered; raises BadRequest to refuse
    on_request: Optional[Callable[[str, JsonDict], None]] = None
    counters: dict[str, int] = field(default_factory=lambda: {"requests": 0, "prompt": 0, "generation": 0})
    counters_lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, answer: JsonDict) -> None:
        usage = answer.get("usage") or {}
        with self.counters_lock:
            self.counters["requests"] += 1
            self.counters["prompt"] += int(usage.get("prompt_tokens") or 0)
            self.counters["generation"] += int(usage.get("completion_tokens") or 0)


# Prometheus text the engine doubles serve on GET /metrics (as vLLM and SGLang do on their API
# port): a few of the real families, with counters that move with the completions answered.
# Names as the engines publish them: vLLM's vllm/v1/metrics/loggers.py (0.33: vllm:kv_cache_usage_perc),
# SGLang's sglang/srt/metrics/collector.py.
METRIC_FAMILIES = {
    "vllm": (("vllm:request_success_total", "counter", "requests"),
             ("vllm:prompt_tokens_total", "counter", "prompt"),
             ("vllm:generation_tokens_total", "counter", "generation"),
             ("vllm:num_requests_running", "gauge", None),
             ("vllm:num_requests_waiting", "gauge", None),
             ("vllm:kv_cache_usage_perc", "gauge", None)),
    "sglang": (("sglang:num_requests_total", "counter", "requests"),
               ("sglang:prompt_tokens_total", "counter", "prompt"),
               ("sglang:generation_tokens_total", "counter", "generation"),
               ("sglang:num_running_reqs", "gauge", None),
               ("sglang:num_queue_reqs", "gauge", None),
               ("sglang:token_usage", "gauge", None)),
}


def metrics_text(app: "EngineApp") -> Optional[str]:
    """The double's ``/metrics`` body (None: this engine serves none here)."""
    families = METRIC_FAMILIES.get("sglang" if app.engine == "ktransformers" else app.engine)
    if families is None:
        return None
    label = f'{{model_name="{app.served_names[0]}"}}'
    with app.counters_lock:
        counts = dict(app.counters)
    lines = []
    for name, kind, counter in families:
        lines += [f"# HELP {name} k2fleet TEST DOUBLE of the engine's {name}", f"# TYPE {name} {kind}",
                  f"{name}{label} {float(counts[counter]) if counter else 0.0}"]
    return "\n".join(lines) + "\n"


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _digest(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _max_tokens(body: JsonDict) -> Optional[int]:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest("max_tokens must be a positive integer")
    return value


def _truncate(words: list[str], limit: Optional[int]) -> tuple[str, bool]:
    if limit is None or len(words) <= limit:
        return " ".join(words), False
    return " ".join(words[:max(1, limit)]), True


def _check_model(app: EngineApp, body: JsonDict) -> str:
    name = body.get("model")
    if name is None:
        return app.served_names[0]
    if name not in app.served_names:
        raise BadRequest(f"The model `{name}` does not exist.", 404)
    return name


def _messages(body: JsonDict) -> list[JsonDict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest("every message needs a string 'role'")
    return messages


def _tool_to_call(app: EngineApp, body: JsonDict) -> Optional[str]:
    tools = body.get("tools")
    if not tools:
        return None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise BadRequest("'tools' must be a list of {type: function, function: {name}}")
    choice = body.get("tool_choice", "auto")
    if choice == "none":
        return None
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        return str(choice["function"].get("name"))
    if app.tools == "reject":
        raise BadRequest(app.tools_error)
    return tools[0]["function"]["name"] if app.tools == "auto" or choice == "required" else None


def chat_completion(app: EngineApp, body: JsonDict) -> JsonDict:
    """Deterministic OpenAI chat.completion for ``body``."""
    model = _check_model(app, body)
    messages = _messages(body)
    limit = _max_tokens(body)
    tool = _tool_to_call(app, body)
    digest = _digest({"m": messages, "t": body.get("tools")})
    last = _text_of(messages[-1].get("content")).split()
    words = [DOUBLE_NAME, f"({app.engine})", "answer", digest[:8] + ":", "you", "said"]
    words += last[:24] or ["nothing"]
    content, truncated = _truncate(words, limit)
    message: JsonDict = {"role": "assistant", "content": content}
    if app.reasoning:
        thought = f"{DOUBLE_NAME} reasoning {digest[8:]}: the user wrote {len(last)} words."
        message["reasoning_content"] = thought
        message["reasoning"] = thought
    finish = "length" if truncated else "stop"
    if tool:
        message["tool_calls"] = [{"id": f"call_{digest}", "type": "function",
                                  "function": {"name": tool, "arguments": "{}"}}]
        finish = "tool_calls"
    prompt_tokens = sum(len(_text_of(m.get("content")).split()) for m in messages)
    completion_tokens = len(content.split())
    return {
        "id": f"chatcmpl-{digest}", "object": "chat.completion", "created": int(time.time()),
        "model": model, "system_fingerprint": DOUBLE_NAME,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def text_completion(app: EngineApp, body: JsonDict) -> JsonDict:
    """Deterministic OpenAI text_completion for ``body``."""
    model = _check_model(app, body)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = " ".join(str(p) for p in prompt)
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("'prompt' must be a non-empty string or list")
    limit = _max_tokens(body)
    digest = _digest(prompt)
    text, truncated = _truncate([DOUBLE_NAME, "completion", digest, "for"] + prompt.split()[:16], limit)
    tokens = len(text.split())
    return {
        "id": f"cmpl-{digest}", "object": "text_completion", "created": int(time.time()),
        "model": model, "system_fingerprint": DOUBLE_NAME,
        "choices": [{"index": 0, "text": text, "finish_reason": "length" if truncated else "stop",
                     "logprobs": None}],
        "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": tokens,
                  "total_tokens": len(prompt.split()) + tokens},
    }


def stream_chunks(completion: JsonDict) -> list[JsonDict]:
    """Split a chat.completion into chat.completion.chunk events."""
    choice = completion["choices"][0]
    base = {k: completion[k] for k in ("id", "created", "model", "system_fingerprint")}
    base["object"] = "chat.completion.chunk"
    deltas: list[JsonDict] = [{"role": "assistant", "content": ""}]
    message = choice["message"]
    if "reasoning_content" in message:
        deltas.append({"reasoning_content": message["reasoning_content"],
                       "reasoning": message["reasoning"]})
    deltas.append({"content": message["content"]})
    if "tool_calls" in message:
        deltas.append({"tool_calls": [dict(message["tool_calls"][0], index=0)]})
    chunks = [dict(base, choices=[{"index": 0, "delta": d, "finish_reason": None}]) for d in deltas]
    chunks.append(dict(base, choices=[{"index": 0, "delta": {},
                                       "finish_reason": choice["finish_reason"]}]))
    return chunks


DEVICE_PATHS = ("/dev/kfd", "/dev/dri", "/dev/nvidiactl", "/dev/infiniband")


def runtime_view() -> JsonDict:
    """What the process sees of its host or container: /dev/shm size (with ``--ipc host``
    the host's, whatever ``--shm-size`` said), the memlock limit (-1: unlimited), which
    GPU/RDMA device paths exist, and whether it runs in a container."""
    try:
        st = os.statvfs("/dev/shm")
        shm = st.f_blocks * st.f_frsize
    except OSError:
        shm = None
    try:
        import resource
        memlock = [(-1 if v == resource.RLIM_INFINITY else v) for v in resource.getrlimit(resource.RLIMIT_MEMLOCK)]
    except (ImportError, OSError, ValueError):
        memlock = None
    return {"dev_shm_bytes": shm, "memlock": memlock, "devices": [d for d in DEVICE_PATHS if os.path.exists(d)],
            "container": os.path.exists("/.dockerenv")}


def models_payload(app: EngineApp) -> JsonDict:
    """``/v1/models`` body, with double metadata attached (and :func:`runtime_view`)."""
    metadata = {"double": DOUBLE_NAME, "engine": app.engine,
                "model_type": app.model.model_type, "local": app.model.local, "runtime": runtime_view(),
                **app.metadata,
                "members": sorted({a for server in app.rendezvous for a in server.member_addresses()})}
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": app.engine,
         "root": app.model.spec, "parent": None, "metadata": metadata}
        for name in app.served_names]}


# --------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------

# The OpenAI completion routes every engine double answers: path → answer builder.
COMPLETION_ROUTES: dict[str, Callable[[EngineApp, JsonDict], JsonDict]] = {
    "/v1/chat/completions": chat_completion, "/v1/completions": text_completion}


class DoubleHTTPServer(ThreadingHTTPServer):
    """Threaded HTTP server that carries the app object."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str, port: int, handler: type, app: Any) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.app = app
        super().__init__((host, port), handler)


class JsonHandler(BaseHTTPRequestHandler):
    """JSON helpers, double-branded headers, stdout request logging."""

    protocol_version = "HTTP/1.1"
    server: DoubleHTTPServer

    @property
    def engine(self) -> str:
        return str(self.server.app.engine)

    def version_string(self) -> str:
        return f"{DOUBLE_NAME}/{self.engine}"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib name)
        log(self.engine, f"{self.address_string()} {format % args}")

    def send_json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_error_json(self, status: int, message: str) -> None:
        self.send_json(status, {"object": "error", "error": {
            "message": message, "type": "BadRequestError" if status < 500 else "ServerError",
            "code": status}, "message": message})

    def read_json(self) -> JsonDict:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise BadRequest(f"malformed JSON body: {exc}") from exc
        if not isinstance(body, dict):
            raise BadRequest("JSON body must be an object")
        return body


class EngineHandler(JsonHandler):
    """The OpenAI-compatible surface of an engine double."""

    @property
    def app(self) -> EngineApp:
        return self.server.app

    def _authorized(self) -> bool:
        """As vLLM's AuthenticationMiddleware: with a key, a guarded path needs
        ``Authorization: Bearer KEY`` (scheme in any case, constant-time compare), else 401."""
        key = self.app.api_key
        if not key or self.command == "OPTIONS" or not self.path.startswith(self.app.guarded):
            return True
        scheme, _, given = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), key.encode()):
            return True
        self.send_json(401, {"error": "Unauthorized"})
        return False

    def do_GET(self) -> None:  # noqa: N802 (stdlib naming)
        path = self.path.split("?", 1)[0]
        if not self._authorized():
            return
        if path in ("/health", "/health_generate"):
            reason = self.app.readiness.reason()
            self.send_json(503 if reason else 200,
                           {"status": reason or "ok", "double": DOUBLE_NAME})
        elif path == "/v1/models":
            self.send_json(200, models_payload(self.app))
        elif path == "/metrics" and (text := metrics_text(self.app)) is not None:
            data = text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif path in self.app.extra_get:
            self.send_json(*self.app.extra_get[path]())
        else:
            self.send_error_json(404, f"no route {path}")

    def do_POST(self) -> None:  # noqa: N802 (stdlib naming)
        path = self.path.split("?", 1)[0]
        if not self._authorized():
            return
        if path not in COMPLETION_ROUTES:
            self.send_error_json(404, f"no route {path}")
            return
        reason = self.app.readiness.reason()
        if reason:
            self.send_error_json(503, f"not ready: {reason}")
            return
        on_request = self.app.on_request
        self.complete(path, None if on_request is None else lambda body: on_request(path, body))

    def complete(self, path: str, before: Optional[Callable[[JsonDict], None]] = None) -> None:
        """Answer the completion route ``path``: read the JSON body, ``before(body)`` (may
        raise BadRequest), then the answer, streamed when the chat request asks for it."""
        try:
            body = self.read_json()
            if before is not None:
                before(body)
            answer = COMPLETION_ROUTES[path](self.app, body)
        except BadRequest as exc:
            self.send_error_json(exc.status, str(exc))
            return
        self.app.count(answer)
        if body.get("stream") and path == "/v1/chat/completions":
            self._stream(answer)
        else:
            self.send_json(200, answer)

    def _stream(self, completion: JsonDict) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for chunk in stream_chunks(completion):
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True


def serve_http(engine: str, host: str, port: int, handler: type, app: Any) -> DoubleHTTPServer:
    """Start the HTTP server in a daemon thread; exit 1 if it cannot bind."""
    try:
        server = DoubleHTTPServer(host, port, handler, app)
    except OSError as exc:
        fail(engine, f"cannot listen for HTTP on {host}:{port}: {exc}")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    log(engine, f"HTTP listening on {host or '0.0.0.0'}:{port}; sees {json.dumps(runtime_view(), sort_keys=True)}")
    return server


def wait_for_shutdown(engine: str, cleanups: list[Callable[[], None]]) -> int:
    """Block until SIGTERM/SIGINT, run ``cleanups``, return exit status 0."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log(engine, f"received {signal.Signals(signum).name}; shutting down")
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not stop.wait(1.0):
        pass
    for cleanup in cleanups:
        try:
            cleanup()
        except Exception as exc:  # noqa: BLE001 -- best effort on the way out
            log(engine, f"cleanup failed: {exc}")
    return 0
