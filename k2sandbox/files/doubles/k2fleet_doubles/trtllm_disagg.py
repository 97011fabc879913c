"""k2fleet-test-double for TensorRT-LLM 1.2 ``trtllm-serve disaggregated -c CONFIG`` -- TEST DOUBLE.

The disaggregated front end: CONFIG is the server config TensorRT-LLM's Slurm scripts
write (``hostname``, ``port``, ``context_servers: {num_instances, urls}``,
``generation_servers: {num_instances, urls}``; read with PyYAML, as the real one does).

* ``/health`` answers 200 only when every context and generation server's ``/health``
  answers 200 (polled every second), else 503 naming the first that does not;
* ``/v1/models`` lists the generation servers' models; its metadata reports the
  disaggregated topology: per context / generation server its URL and the world it
  reported (``tp_size``, ``ep_size``, ``world``, ``hosts``, ...);
* ``POST /v1/chat/completions`` and ``/v1/completions``: the request goes to a context
  server first (``max_tokens`` 1, round robin: the prefill), then to a generation server
  (round robin), whose answer is returned, as the real front end routes a request.
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Optional, Sequence

from . import DOUBLE_NAME
from .common import JsonHandler, fail, log, serve_http, wait_for_shutdown

ENGINE = "trtllm-disaggregated"
POLL_S = 1.0
FORWARD_TIMEOUT_S = 60
SIDES = {"context_servers": "ctx", "generation_servers": "gen"}


def load_config(path: str) -> dict[str, Any]:
    """The server config; exit 1 naming what is missing."""
    try:
        import yaml  # the real front end's dependency too
    except ImportError:
        fail(ENGINE, "PyYAML is needed to read the disaggregated server config")
    try:
        with open(path, encoding="utf-8") as handle:
            config = yaml.safe_load(handle)
    except (OSError, yaml.YAMLError) as exc:
        fail(ENGINE, f"cannot read {path}: {exc}")
    if not isinstance(config, dict):
        fail(ENGINE, f"{path}: not a mapping")
    for side in SIDES:
        section = config.get(side)
        if not isinstance(section, dict) or not isinstance(section.get("urls"), list) or not section["urls"]:
            fail(ENGINE, f"{path}: {side}.urls must list the servers")
        if int(section.get("num_instances", len(section["urls"]))) != len(section["urls"]):
            fail(ENGINE, f"{path}: {side}.num_instances {section.get('num_instances')} != "
                         f"{len(section['urls'])} urls")
    return config


def _get(url: str, timeout: float = 5) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (OSError, ValueError):
        return 0, None


def _post(url: str, body: dict[str, Any]) -> tuple[int, bytes, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=FORWARD_TIMEOUT_S) as resp:
            return resp.status, resp.read(), resp.headers.get("Content-Type", "application/json")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), "application/json"
    except OSError as exc:
        return 502, json.dumps({"error": {"message": f"{url}: {exc}"}}).encode(), "application/json"


class Frontend:
    """The servers of the config, their last-seen health and reported world."""

    engine = ENGINE

    def __init__(self, config: dict[str, Any]) -> None:
        self.urls = {side: [u if "://" in u else f"http://{u}" for u in config[side]["urls"]] for side in SIDES}
        self.state: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._next = {side: itertools.cycle(urls) for side, urls in self.urls.items()}

    def poll_forever(self) -> None:
        while True:
            for urls in self.urls.values():
                for url in urls:
                    status, _ = _get(f"{url}/health")
                    models = _get(f"{url}/v1/models")[1] if status == 200 else None
                    with self._lock:
                        self.state[url] = {"health": status, "models": models}
            time.sleep(POLL_S)

    def reason(self) -> Optional[str]:
        with self._lock:
            for side, urls in self.urls.items():
                for url in urls:
                    seen = self.state.get(url)
                    if not seen or seen["health"] != 200:
                        code = seen["health"] if seen else "not polled yet"
                        return f"{SIDES[side]} server {url} /health: {code}"
        return None

    def pick(self, side: str) -> str:
        with self._lock:
            return next(self._next[side])

    def models(self) -> dict[str, Any]:
        with self._lock:
            topology = {side: [self._describe(url) for url in urls] for side, urls in self.urls.items()}
            gen = self.state.get(self.urls["generation_servers"][0], {}).get("models") or {"data": []}
        metadata = {"double": DOUBLE_NAME, "engine": "trtllm", "disaggregated": topology}
        return {"object": "list", "data": [dict(entry, metadata=dict(entry.get("metadata") or {}, **metadata))
                                           for entry in gen.get("data", [])]}

    def _describe(self, url: str) -> dict[str, Any]:
        models = (self.state.get(url) or {}).get("models") or {}
        data = models.get("data") or [{}]
        return {"url": url, **(data[0].get("metadata") or {})}


class FrontendHandler(JsonHandler):
    """HTTP surface of the front-end double."""

    @property
    def frontend(self) -> Frontend:
        return self.server.app

    def do_GET(self) -> None:  # noqa: N802 (stdlib naming)
        path = self.path.split("?", 1)[0]
        if path == "/health":
            reason = self.frontend.reason()
            self.send_json(503 if reason else 200, {"status": reason or "ok", "double": DOUBLE_NAME})
        elif path == "/v1/models":
            self.send_json(200, self.frontend.models())
        else:
            self.send_error_json(404, f"no route {path}")

    def do_POST(self) -> None:  # noqa: N802 (stdlib naming)
        path = self.path.split("?", 1)[0]
        if path not in ("/v1/chat/completions", "/v1/completions"):
            self.send_error_json(404, f"no route {path}")
            return
        reason = self.frontend.reason()
        if reason:
            self.send_error_json(503, f"not ready: {reason}")
            return
        try:
            body = self.read_json()
        except Exception as exc:  # noqa: BLE001 -- BadRequest from the shared reader
            self.send_error_json(400, str(exc))
            return
        ctx = self.frontend.pick("context_servers")
        prefill = dict(body, max_tokens=1, stream=False)
        prefill.pop("max_completion_tokens", None)
        status, raw, _ = _post(f"{ctx}{path}", prefill)
        if status != 200:
            self.send_error_json(502, f"context server {ctx}: HTTP {status}: {raw[:200].decode(errors='replace')}")
            return
        gen = self.frontend.pick("generation_servers")
        status, raw, ctype = _post(f"{gen}{path}", body)
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="trtllm-serve disaggregated",
                                     description=f"trtllm-serve disaggregated ({DOUBLE_NAME})")
    parser.add_argument("-c", "--config_file", required=True)
    parser.add_argument("-t", "--server_start_timeout", type=int, default=180)
    parser.add_argument("-r", "--request_timeout", type=int, default=180)
    parser.add_argument("-l", "--log_level", default="info")
    args = parser.parse_args(list(argv or []))
    config = load_config(args.config_file)
    frontend = Frontend(config)
    threading.Thread(target=frontend.poll_forever, daemon=True).start()
    log(ENGINE, f"{DOUBLE_NAME} pretending to be the TensorRT-LLM disaggregated server: "
                f"{len(frontend.urls['context_servers'])} context, "
                f"{len(frontend.urls['generation_servers'])} generation servers")
    http = serve_http(ENGINE, str(config.get("hostname") or "0.0.0.0"), int(config.get("port", 8000)),
                      FrontendHandler, frontend)
    return wait_for_shutdown(ENGINE, [http.shutdown])
