"""k2fleet-test-double for SGLang 0.5.23 (``python -m sglang.launch_server``).

TEST DOUBLE.  Accepts the SGLang (and sglang-kt KTransformers) flags k2fleet
may render and refuses anything else (exit 2).  Topologies:

* single node: rank 0 serves HTTP;
* multi-node (``--nnodes`` > 1): rank 0 listens on ``--dist-init-addr``,
  ranks 1..n-1 connect (and rejoin if rank 0 restarts) and never serve HTTP;
  rank 0's ``/health`` is 503 until every rank has joined;
* PD disaggregation: prefill and decode servers both serve HTTP; a prefill
  rank 0 also runs a bootstrap HTTP server on ``--host:--disaggregation-bootstrap-port``.
  Like SGLang's, a PD server answers a completion only with the bootstrap fields the
  PD router adds (``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room``; 400
  otherwise) and records them: ``GET /k2fleet/pd_requests`` lists the last ones, so a
  health gate can prove one request reached a prefill and a decode server (same room).
"""

from __future__ import annotations

import argparse
import collections
import socket
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Sequence

from . import DOUBLE_NAME
from .common import (BadRequest, EngineApp, EngineHandler, JsonHandler, MemberLink, ModelError,
                     Readiness, RendezvousGroup, RendezvousServer, fail, gguf_files, gpus_per_node, log,
                     parse_hostport, resolve_model, serve_http, wait_for_shutdown)

ENGINE = "sglang"
VERSION = "0.5.23"
GGUF_KT_METHODS = ("LLAMAFILE",)  # kt methods whose weight path holds GGUF files


def add_server_flags(p: argparse.ArgumentParser) -> None:
    """Model, HTTP and scheduling flags."""
    p.add_argument("--model-path", "--model", dest="model_path", required=True)
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--tool-call-parser", default=None)
    p.add_argument("--reasoning-parser", default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None)
    # SGLang 0.5.23 splits --cuda-graph-bs into decode/prefill (k2fleet renders these)
    p.add_argument("--cuda-graph-bs-decode", type=int, nargs="+", default=None)
    p.add_argument("--cuda-graph-bs-prefill", type=int, nargs="+", default=None)
    p.add_argument("--cuda-graph-max-bs-decode", type=int, default=None)
    p.add_argument("--cuda-graph-max-bs-prefill", type=int, default=None)
    p.add_argument("--decode-log-interval", type=int, default=40)
    p.add_argument("--watchdog-timeout", type=float, default=300)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--quantization", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--api-key", default=None)
    p.add_argument("--log-level", default="info")
    p.add_argument("--enable-metrics", action="store_true")


def add_parallel_flags(p: argparse.ArgumentParser) -> None:
    """Parallelism, multi-node, MoE and PD flags."""
    p.add_argument("--tp-size", "--tensor-parallel-size", "--tp", dest="tp_size", type=int, default=1)
    p.add_argument("--pp-size", "--pipeline-parallel-size", dest="pp_size", type=int, default=1)
    p.add_argument("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1)
    p.add_argument("--ep-size", "--expert-parallel-size", "--ep", dest="ep_size", type=int, default=1)
    p.add_argument("--attn-dp-size", "--attention-data-parallel-size", dest="attn_dp_size",
                   type=int, default=None)
    p.add_argument("--enable-dp-attention", action="store_true")
    p.add_argument("--enable-dp-lm-head", action="store_true")
    p.add_argument("--dist-init-addr", "--nccl-init-addr", dest="dist_init_addr", default=None)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--moe-a2a-backend", default="none")
    p.add_argument("--deepep-mode", choices=["normal", "low_latency", "auto"], default="auto")
    p.add_argument("--moe-dense-tp-size", type=int, default=None)
    p.add_argument("--disable-shared-experts-fusion", action="store_true")
    p.add_argument("--enable-two-batch-overlap", action="store_true")
    p.add_argument("--enable-eplb", action="store_true")
    p.add_argument("--ep-dispatch-algorithm", default=None)
    p.add_argument("--eplb-algorithm", default="auto")
    p.add_argument("--ep-num-redundant-experts", type=int, default=0)
    p.add_argument("--disaggregation-mode", choices=["null", "prefill", "decode"], default="null")
    p.add_argument("--disaggregation-ib-device", default=None)
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    p.add_argument("--disaggregation-transfer-backend", default="mooncake")


def add_kt_flags(p: argparse.ArgumentParser) -> None:
    """KTransformers (sglang-kt 0.7.2 / kt-kernel) hybrid CPU/GPU MoE flags: exactly the
    ``--kt-*`` flags of sglang-kt 0.7.2's sglang/srt/server_args.py, same types/defaults."""
    p.add_argument("--kt-weight-path", type=str, default=None)
    p.add_argument("--kt-method", type=str, default="AMXINT4")
    p.add_argument("--kt-cpuinfer", type=int, default=None)
    p.add_argument("--kt-threadpool-count", type=int, default=2)
    p.add_argument("--kt-numa-nodes", type=int, nargs="+", default=None)
    p.add_argument("--kt-num-gpu-experts", type=int, default=None)
    p.add_argument("--kt-gpu-experts-ratio", type=float, default=None)
    p.add_argument("--kt-max-deferred-experts-per-token", type=int, default=None)
    p.add_argument("--kt-gpu-prefill-token-threshold", type=int, default=None)
    p.add_argument("--record-kt-gpu-expert-distribution", action="store_true")
    p.add_argument("--kt-enable-dynamic-expert-update", action="store_true")
    p.add_argument("--kt-expert-placement-strategy", type=str, default=None,
                   choices=["frequency", "front-loading", "uniform", "random"])
    p.add_argument("--kt-lora-path", type=str, default=None)
    p.add_argument("--kt-expert-lora-path", type=str, default=None)


def kt_settings(a: argparse.Namespace) -> Optional[dict]:
    """The ``--kt-*`` values the double was started with (reported in /v1/models), or None."""
    if not a.kt_weight_path:
        return None
    return {k.removeprefix("kt_"): v for k, v in sorted(vars(a).items()) if k.startswith("kt_")}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sglang.launch_server",
                                     description=f"SGLang server ({DOUBLE_NAME})")
    parser.add_argument("--version", action="version", version=f"{VERSION} {DOUBLE_NAME}")
    add_server_flags(parser)
    add_parallel_flags(parser)
    add_kt_flags(parser)
    return parser


def validate(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Reject combinations SGLang's ServerArgs checks would reject."""
    for name in ("tp_size", "pp_size", "dp_size", "ep_size", "nnodes"):
        if getattr(a, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= a.node_rank < a.nnodes:
        parser.error(f"--node-rank {a.node_rank} must be in [0, --nnodes {a.nnodes})")
    if a.nnodes > 1 and not a.dist_init_addr:
        parser.error("--nnodes > 1 requires --dist-init-addr HOST:PORT")
    if a.dist_init_addr:
        try:
            parse_hostport(a.dist_init_addr)
        except ValueError as exc:
            parser.error(f"--dist-init-addr: {exc}")
    if (a.tp_size * a.pp_size) % a.nnodes:
        parser.error(f"tp-size*pp-size {a.tp_size * a.pp_size} must be divisible by --nnodes {a.nnodes}")
    if a.tp_size % a.ep_size:
        parser.error(f"--ep-size {a.ep_size} must divide --tp-size {a.tp_size}")
    if a.enable_dp_attention and a.tp_size % a.dp_size:
        parser.error(f"--enable-dp-attention needs --dp-size {a.dp_size} to divide --tp-size {a.tp_size}")
    if a.attn_dp_size is not None and (a.attn_dp_size < 1 or a.tp_size % a.attn_dp_size):
        parser.error(f"--attn-dp-size {a.attn_dp_size} must divide --tp-size {a.tp_size}")


def check_runtime(a: argparse.Namespace) -> None:
    """Runtime failures (exit 1): GPU budget, KTransformers weights."""
    per_node = a.tp_size * a.pp_size // a.nnodes
    if per_node > gpus_per_node():
        fail(ENGINE, f"this node would need {per_node} GPUs but has {gpus_per_node()} "
                     "(K2FLEET_DOUBLE_GPUS_PER_NODE)")
    kt = a.kt_weight_path
    if kt and kt.startswith(("/", ".")) and not Path(kt).exists():
        fail(ENGINE, f"--kt-weight-path {kt} does not exist")
    if kt and a.kt_method in GGUF_KT_METHODS:
        try:
            gguf_files(kt)  # kt-kernel's llamafile backend reads GGUF experts from this folder
        except ModelError as exc:
            fail(ENGINE, f"--kt-weight-path with --kt-method {a.kt_method}: {exc}")


def setup_ranks(a: argparse.Namespace, readiness: Readiness) -> list[RendezvousServer]:
    """Multi-node rendezvous on ``--dist-init-addr``."""
    if a.nnodes <= 1:
        return []
    host, port = parse_hostport(a.dist_init_addr)
    expect = {"nnodes": a.nnodes, "tp_size": a.tp_size, "pp_size": a.pp_size,
              "disaggregation_mode": a.disaggregation_mode}
    if a.node_rank == 0:
        group = RendezvousGroup(kind="sglang-dist", required=frozenset(range(a.nnodes)),
                                head_claims=frozenset({0}), expect=expect,
                                claims=lambda h: frozenset({int(h["node_rank"])}))
        server = RendezvousServer(ENGINE, host, port, group)
        server.start()
        readiness.watch_server(server)
        return [server]
    hello = dict(expect, kind="sglang-dist", host=socket.gethostname(), node_rank=a.node_rank)
    readiness.add_check(MemberLink(ENGINE, host, port, hello).start().reason)
    return []


class BootstrapHandler(JsonHandler):
    """The prefill server's disaggregation bootstrap endpoint."""

    def do_GET(self) -> None:  # noqa: N802 (stdlib naming)
        if self.path.startswith("/health"):
            self.send_json(200, {"status": "ok", "double": DOUBLE_NAME})
        elif self.path.startswith("/route"):
            self.send_json(200, {"double": DOUBLE_NAME, "role": "prefill"})
        else:
            self.send_error_json(404, f"no route {self.path}")


PD_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


class PdRequests:
    """The bootstrap fields of the last completions a PD server answered."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.seen: collections.deque = collections.deque(maxlen=256)
        self.lock = threading.Lock()

    def check(self, path: str, body: dict) -> None:
        missing = [f for f in PD_FIELDS if body.get(f) is None]
        if missing:
            raise BadRequest(f"disaggregation mode {self.mode} needs {', '.join(missing)} "
                             "(send requests through the PD router)")
        with self.lock:
            self.seen.append({"path": path, **{f: body[f] for f in PD_FIELDS}})

    def payload(self) -> tuple[int, dict]:
        with self.lock:
            return 200, {"mode": self.mode, "requests": list(self.seen), "double": DOUBLE_NAME}


def make_app(a: argparse.Namespace, readiness: Readiness) -> EngineApp:
    model = resolve_model(a.model_path)
    pd = PdRequests(a.disaggregation_mode) if a.disaggregation_mode != "null" else None
    server_info = dict(vars(a), version=VERSION, double=DOUBLE_NAME)
    name = a.served_model_name or a.model_path
    info = {"model_path": a.model_path, "is_generation": True,
            "disaggregation_mode": a.disaggregation_mode, "double": DOUBLE_NAME}
    return EngineApp(
        engine=ENGINE, served_names=[name], model=model, readiness=readiness,
        reasoning=bool(a.reasoning_parser), tools="auto" if a.tool_call_parser else "ignore",
        api_key=a.api_key,
        metadata={"version": VERSION, "tp_size": a.tp_size, "dp_size": a.dp_size,
                  "ep_size": a.ep_size, "nnodes": a.nnodes,
                  "disaggregation_mode": a.disaggregation_mode,
                  "ktransformers": kt_settings(a)},
        extra_get={"/get_model_info": lambda: (200, info), "/model_info": lambda: (200, info),
                   "/get_server_info": lambda: (200, server_info),
                   "/server_info": lambda: (200, server_info),  # 0.5.23 serves both names
                   **({"/k2fleet/pd_requests": pd.payload} if pd else {})},
        on_request=pd.check if pd else None)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    validate(parser, args)
    try:
        app = make_app(args, Readiness(ENGINE))
    except ModelError as exc:
        fail(ENGINE, str(exc))
    check_runtime(args)
    log(ENGINE, f"{DOUBLE_NAME} pretending to be SGLang {VERSION} serving {args.model_path} "
                f"(rank {args.node_rank}/{args.nnodes}, mode {args.disaggregation_mode})")
    servers = setup_ranks(args, app.readiness)
    app.rendezvous = servers
    cleanups = [s.close for s in servers]
    if args.node_rank == 0:
        http = serve_http(ENGINE, args.host, args.port, EngineHandler, app)
        cleanups.insert(0, http.shutdown)
        if args.disaggregation_mode == "prefill":
            boot = serve_http(ENGINE, args.host, args.disaggregation_bootstrap_port,
                              BootstrapHandler, SimpleNamespace(engine="sglang-bootstrap"))
            cleanups.insert(0, boot.shutdown)
    else:
        log(ENGINE, f"node rank {args.node_rank}: worker only, no HTTP server")
    return wait_for_shutdown(ENGINE, cleanups)


if __name__ == "__main__":
    sys.exit(main())
