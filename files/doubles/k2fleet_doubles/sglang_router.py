"""k2fleet-test-double for ``python -m sglang_router.launch_router`` -- TEST DOUBLE.

PD mode (``--pd-disaggregation --prefill URL [BOOTSTRAP_PORT] --decode URL``):
each completion request gets SGLang's bootstrap fields injected, is sent to a
prefill server and to a decode server (both round robin, whatever
``--policy`` says), and the decode server's answer is returned.  Regular mode
(``--worker-urls``) forwards round robin to one worker.  ``/health`` is 200
only when every prefill, decode (or regular) worker answers ``/health`` 200.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence
from urllib.parse import urlparse

from . import DOUBLE_NAME
from .common import BadRequest, JsonHandler, fail, log, serve_http, wait_for_shutdown

ENGINE = "sglang-router"
POLICIES = ["random", "round_robin", "cache_aware", "power_of_two"]
TIMEOUT = 30.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang_router.launch_router",
                                description=f"SGLang router ({DOUBLE_NAME})")
    p.add_argument("--version", action="version", version=f"sglang-router {DOUBLE_NAME}")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--worker-urls", nargs="*", default=[])
    p.add_argument("--pd-disaggregation", action="store_true")
    p.add_argument("--prefill", nargs="+", action="append", default=[],
                   metavar=("URL", "BOOTSTRAP_PORT"))
    p.add_argument("--decode", nargs=1, action="append", default=[], metavar="URL")
    p.add_argument("--policy", choices=POLICIES, default="cache_aware")
    p.add_argument("--prefill-policy", choices=POLICIES, default=None)
    p.add_argument("--decode-policy", choices=POLICIES, default=None)
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error", "critical"],
                   default="info")
    return p


def check_url(parser: argparse.ArgumentParser, url: str) -> str:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        parser.error(f"invalid worker URL {url!r} (expected http://host:port)")
    return url.rstrip("/")


def parse_prefill(parser: argparse.ArgumentParser, entry: list[str]) -> tuple[str, Optional[int]]:
    """``URL [BOOTSTRAP_PORT|none]`` -> (url, port or None)."""
    if len(entry) > 2:
        parser.error(f"--prefill takes URL [BOOTSTRAP_PORT], got {entry}")
    url = check_url(parser, entry[0])
    if len(entry) == 1:
        return url, 8998
    if entry[1].lower() == "none":
        return url, None
    if not entry[1].isdigit():
        parser.error(f"--prefill bootstrap port must be an integer or 'none', got {entry[1]!r}")
    return url, int(entry[1])


@dataclass
class RouterApp:
    """Workers and round-robin cursors."""

    prefill: list[tuple[str, Optional[int]]]
    decode: list[str]
    workers: list[str]
    engine: str = ENGINE
    _rooms: Iterator[int] = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _cursors: dict[str, Iterator[int]] = field(default_factory=dict)

    def all_urls(self) -> list[str]:
        return [u for u, _ in self.prefill] + self.decode + self.workers

    def pick(self, pool: str) -> int:
        size = len(getattr(self, pool))
        with self._lock:
            cursor = self._cursors.setdefault(pool, itertools.cycle(range(size)))
            return next(cursor)

    def room(self) -> int:
        with self._lock:
            return next(self._rooms)


def fetch(url: str, body: Optional[bytes] = None, timeout: float = TIMEOUT) -> tuple[int, bytes, str]:
    """GET/POST ``url``; return (status, body, content type).  Raises OSError."""
    request = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read(), response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers.get("Content-Type", "")


def worker_health(url: str) -> str:
    try:
        status, _, _ = fetch(f"{url}/health", timeout=3)
    except OSError as exc:
        return f"unreachable ({exc})"
    return "ok" if status == 200 else f"HTTP {status}"


class RouterHandler(JsonHandler):
    """Health aggregation and request forwarding."""

    @property
    def app(self) -> RouterApp:
        return self.server.app

    def do_GET(self) -> None:  # noqa: N802 (stdlib naming)
        path = self.path.split("?", 1)[0]
        if path in ("/health", "/health_generate", "/readiness"):
            states = {url: worker_health(url) for url in self.app.all_urls()}
            healthy = all(s == "ok" for s in states.values())
            self.send_json(200 if healthy else 503, {"double": DOUBLE_NAME, "workers": states})
        elif path == "/v1/models":
            self._relay_get(path)
        else:
            self.send_error_json(404, f"no route {path}")

    def do_POST(self) -> None:  # noqa: N802 (stdlib naming)
        path = self.path.split("?", 1)[0]
        if path not in ("/v1/chat/completions", "/v1/completions", "/generate"):
            self.send_error_json(404, f"no route {path}")
            return
        try:
            body = self.read_json()
        except BadRequest as exc:
            self.send_error_json(exc.status, str(exc))
            return
        if self.app.decode:
            self._forward_pd(path, body)
        else:
            self._relay(self.app.workers[self.app.pick("workers")], path, body)

    def _relay_get(self, path: str) -> None:
        url = (self.app.decode or self.app.workers)[0]
        try:
            status, data, ctype = fetch(url + path)
        except OSError as exc:
            self.send_error_json(502, f"worker {url} unreachable: {exc}")
            return
        self._send_raw(status, data, ctype)

    def _relay(self, url: str, path: str, body: dict[str, Any]) -> None:
        try:
            status, data, ctype = fetch(url + path, json.dumps(body).encode())
        except OSError as exc:
            self.send_error_json(502, f"worker {url} unreachable: {exc}")
            return
        self._send_raw(status, data, ctype)

    def _forward_pd(self, path: str, body: dict[str, Any]) -> None:
        prefill_url, bootstrap = self.app.prefill[self.app.pick("prefill")]
        decode_url = self.app.decode[self.app.pick("decode")]
        body = dict(body, bootstrap_host=urlparse(prefill_url).hostname,
                    bootstrap_port=bootstrap, bootstrap_room=self.app.room())
        payload = json.dumps(body).encode()
        prefill_result: dict[str, Any] = {}

        def run_prefill() -> None:
            try:
                prefill_result["status"] = fetch(prefill_url + path, payload)[0]
            except OSError as exc:
                prefill_result["error"] = str(exc)

        thread = threading.Thread(target=run_prefill)
        thread.start()
        try:
            status, data, ctype = fetch(decode_url + path, payload)
        except OSError as exc:
            thread.join()
            self.send_error_json(502, f"decode worker {decode_url} unreachable: {exc}")
            return
        thread.join()
        if "error" in prefill_result:
            self.send_error_json(502, f"prefill worker {prefill_url} unreachable: "
                                      f"{prefill_result['error']}")
            return
        self._send_raw(status, data, ctype)

    def _send_raw(self, status: int, data: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype or "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.pd_disaggregation:
        if not args.prefill or not args.decode:
            parser.error("--pd-disaggregation needs at least one --prefill and one --decode")
        app = RouterApp(prefill=[parse_prefill(parser, e) for e in args.prefill],
                        decode=[check_url(parser, d[0]) for d in args.decode], workers=[])
    else:
        if args.prefill or args.decode:
            parser.error("--prefill/--decode require --pd-disaggregation")
        if not args.worker_urls:
            parser.error("regular mode needs --worker-urls")
        app = RouterApp(prefill=[], decode=[],
                        workers=[check_url(parser, u) for u in args.worker_urls])
    if not 0 < args.port < 65536:
        fail(ENGINE, f"invalid --port {args.port}")
    log(ENGINE, f"{DOUBLE_NAME} router: prefill={app.prefill} decode={app.decode} "
                f"workers={app.workers} (policy {args.policy} served as round robin)")
    http = serve_http(ENGINE, args.host, args.port, RouterHandler, app)
    return wait_for_shutdown(ENGINE, [http.shutdown])


if __name__ == "__main__":
    sys.exit(main())
