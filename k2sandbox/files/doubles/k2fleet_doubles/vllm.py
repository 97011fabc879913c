"""k2fleet-test-double for vLLM 0.33 (``vllm serve MODEL ...``) -- TEST DOUBLE.

Accepts the subset of ``vllm serve`` flags k2fleet may render, validates them
the way vLLM does, and refuses anything else (exit 2).  Topologies:

* single node: serve HTTP at once (after ``K2FLEET_DOUBLE_STARTUP_SECONDS``);
* data parallel: the head (start rank 0, not ``--headless``, DP size > DP
  local) listens on ``--data-parallel-address:--data-parallel-rpc-port``;
  members (``--data-parallel-start-rank`` > 0, usually ``--headless``)
  connect and claim ranks ``[start, start + local)``.  The head's ``/health``
  is 503 until every DP rank is covered;
* multi-node (``--nnodes`` > 1): node 0 listens on
  ``--master-addr:--master-port`` and ``--headless`` nodes 1..n-1 connect;
* ``--distributed-executor-backend ray``: without the ``ray`` module the
  double refuses (exit 1) unless TP*PP fits on one node
  (``K2FLEET_DOUBLE_GPUS_PER_NODE``, default 8); with ``ray`` (the real
  package, run with the engine venv's python) it joins the running cluster
  (``ray.init(address="auto")``), waits until Ray reports enough alive nodes
  and GPUs for TP*PP, refuses to serve (exit 1) if they never come, and
  reports what it joined as ``ray_nodes`` / ``ray_gpus`` in ``/v1/models``
  metadata.

With an API key (``--api-key``, else env ``VLLM_API_KEY``, as vLLM) every
``/v1``, ``/v2``, ``/inference`` and ``/cohere`` request needs ``Authorization:
Bearer KEY`` (401 otherwise); ``/health`` stays open, as in vLLM.

Headless nodes never serve HTTP; they rejoin the head if it restarts.  A DP
member that dies after joining ends the head (exit 1), as vLLM's API server
shuts down on engine death unless ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1``.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
from typing import Optional, Sequence

from . import DOUBLE_NAME
from .common import (EngineApp, EngineHandler, MemberLink, ModelError, Readiness,
                     RendezvousGroup, RendezvousServer, fail, gpus_per_node, log,
                     rdzv_timeout, resolve_model, serve_http, wait_for_shutdown)

ENGINE = "vllm"
VERSION = "0.33.0"
BOOL = argparse.BooleanOptionalAction


def human_int(value: str) -> int:
    """vLLM-style sizes: ``131072``, ``128k``, ``1M`` (binary k/M on K/M)."""
    text = value.strip()
    units = {"k": 1000, "m": 1000 ** 2, "K": 1024, "M": 1024 ** 2}
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"invalid size {value!r}") from exc


def add_parallel_flags(p: argparse.ArgumentParser) -> None:
    """Parallelism and multi-node flags."""
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    p.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None)
    p.add_argument("--data-parallel-address", "-dpa", default=None)
    p.add_argument("--data-parallel-rpc-port", "-dpp", type=int, default=None)
    p.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=None)
    p.add_argument("--data-parallel-hybrid-lb", action=BOOL, default=False)
    p.add_argument("--data-parallel-external-lb", action=BOOL, default=False)
    p.add_argument("--enable-expert-parallel", action=BOOL, default=False)
    p.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1)
    p.add_argument("--distributed-executor-backend",
                   choices=["ray", "mp", "uni", "external_launcher"], default=None)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29501)
    p.add_argument("--headless", action="store_true")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """Model, scheduler, cache and frontend flags."""
    p.add_argument("model")
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--trust-remote-code", action=BOOL, default=False)
    p.add_argument("--tokenizer-mode", default="auto")
    p.add_argument("--enable-auto-tool-choice", action=BOOL, default=False)
    p.add_argument("--tool-call-parser", default=None)
    p.add_argument("--reasoning-parser", default=None)
    # MultiModalConfig.mm_encoder_tp_mode (vLLM >= 0.10.2): Kimi-K2.5/K2.6's vision encoder, data-parallel
    p.add_argument("--mm-encoder-tp-mode", choices=("weights", "data"), default="weights")
    p.add_argument("--max-model-len", type=human_int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=human_int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--quantization", "-q", default=None)
    p.add_argument("--dtype", default="auto",
                   choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
    p.add_argument("--enable-chunked-prefill", action=BOOL, default=None)
    p.add_argument("--enable-prefix-caching", action=BOOL, default=None)
    p.add_argument("--enable-log-requests", action=BOOL, default=False)
    p.add_argument("--api-key", default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm", description=f"vLLM CLI ({DOUBLE_NAME})")
    parser.add_argument("-v", "--version", action="version", version=f"{VERSION} {DOUBLE_NAME}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", description=f"vllm serve ({DOUBLE_NAME})")
    add_model_flags(serve)
    add_parallel_flags(serve)
    return parser


def validate(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Reject inconsistent combinations the way vLLM's config checks do."""
    sizes = {"tensor-parallel-size": a.tensor_parallel_size,
             "pipeline-parallel-size": a.pipeline_parallel_size,
             "data-parallel-size": a.data_parallel_size,
             "decode-context-parallel-size": a.decode_context_parallel_size,
             "nnodes": a.nnodes}
    for name, value in sizes.items():
        if value < 1:
            parser.error(f"--{name} must be >= 1, got {value}")
    if a.tensor_parallel_size % a.decode_context_parallel_size:
        parser.error(f"--decode-context-parallel-size {a.decode_context_parallel_size} must "
                     f"divide --tensor-parallel-size {a.tensor_parallel_size}")
    local = a.data_parallel_size_local
    if local is not None and not 1 <= local <= a.data_parallel_size:
        parser.error(f"--data-parallel-size-local {local} must be in "
                     f"[1, --data-parallel-size {a.data_parallel_size}]")
    start = a.data_parallel_start_rank
    if start is not None:
        if local is None:
            parser.error("--data-parallel-start-rank requires --data-parallel-size-local")
        if not 0 <= start or start + local > a.data_parallel_size:
            parser.error(f"ranks [{start}, {start + local}) exceed --data-parallel-size "
                         f"{a.data_parallel_size}")
    if not 0 <= a.node_rank < a.nnodes:
        parser.error(f"--node-rank {a.node_rank} must be in [0, --nnodes {a.nnodes})")
    multinode_worker = a.nnodes > 1 and a.node_rank > 0
    if a.headless and start is None and not multinode_worker:
        parser.error("--headless requires --data-parallel-start-rank (data parallel) or "
                     "--nnodes > 1 with --node-rank > 0 (multi-node)")
    if multinode_worker and not a.headless:
        parser.error("--node-rank > 0 must run with --headless")
    if a.enable_auto_tool_choice and not a.tool_call_parser:
        parser.error("--enable-auto-tool-choice requires --tool-call-parser to be set")
    if not 0 < a.gpu_memory_utilization <= 1:
        parser.error("--gpu-memory-utilization must be in (0, 1]")


def check_gpu_budget(a: argparse.Namespace) -> None:
    """Exit 1 when the layout needs more GPUs per node than the fleet has."""
    if a.distributed_executor_backend in ("ray", "external_launcher"):
        return
    gpus = gpus_per_node()
    local = a.data_parallel_size_local or a.data_parallel_size
    per_rank = a.tensor_parallel_size * a.pipeline_parallel_size
    needed = math.ceil(local * per_rank / a.nnodes)
    if needed > gpus:
        fail(ENGINE, f"this node would need {needed} GPUs ({local} DP rank(s) x TP*PP "
                     f"{per_rank} / {a.nnodes} node(s)) but has {gpus} "
                     "(K2FLEET_DOUBLE_GPUS_PER_NODE)")


def check_ray(a: argparse.Namespace) -> dict[str, int]:
    """Ray backend: join the real Ray cluster and wait for its nodes and GPUs (refuse if
    they never come, or if TP*PP spans nodes without Ray); what it joined, for metadata."""
    if a.distributed_executor_backend != "ray":
        return {}
    world = a.tensor_parallel_size * a.pipeline_parallel_size
    nodes_needed = math.ceil(world / gpus_per_node())
    try:
        import ray  # type: ignore[import-not-found]
    except ImportError:
        if nodes_needed > 1:
            fail(ENGINE, f"--distributed-executor-backend ray with TP*PP={world} spans "
                         f"{nodes_needed} nodes, but the ray module is not installed; "
                         f"the {DOUBLE_NAME} cannot fake a Ray cluster")
        log(ENGINE, "ray backend on a single node: no cluster needed")
        return {}
    ray.init(address="auto", log_to_driver=False)
    deadline = time.monotonic() + rdzv_timeout()
    while True:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        gpus = int(sum((n.get("Resources") or {}).get("GPU", 0) for n in alive))
        if len(alive) >= nodes_needed and gpus >= world:
            break
        if time.monotonic() > deadline:
            fail(ENGINE, f"Ray cluster has {len(alive)} alive node(s) with {gpus} GPU(s); TP*PP={world} "
                         f"needs {nodes_needed} node(s) and {world} GPUs")
        time.sleep(1)
    log(ENGINE, f"joined Ray {ray.__version__} cluster: {len(alive)} nodes, {gpus} GPUs")
    return {"ray_nodes": len(alive), "ray_gpus": gpus}


def hello_base(a: argparse.Namespace, kind: str) -> dict[str, object]:
    return {"kind": kind, "host": socket.gethostname(), "tp_size": a.tensor_parallel_size,
            "pp_size": a.pipeline_parallel_size}


def keep_alive_on_engine_death() -> bool:
    """vLLM's ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH`` (default 0: the API server exits
    when an engine core dies, so systemd restarts the instance)."""
    return bool(int(os.environ.get("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "0") or "0"))


def setup_dp(a: argparse.Namespace, readiness: Readiness) -> list[RendezvousServer]:
    """Data-parallel rendezvous: listen as head or join as member."""
    size = a.data_parallel_size
    local = a.data_parallel_size_local or size
    start = a.data_parallel_start_rank or 0
    address = a.data_parallel_address or "127.0.0.1"
    port = a.data_parallel_rpc_port or 29550
    expect = {"dp_size": size, "tp_size": a.tensor_parallel_size,
              "pp_size": a.pipeline_parallel_size}
    if start == 0 and not a.headless:
        if local >= size:
            return []
        group = RendezvousGroup(
            kind="vllm-dp", required=frozenset(range(size)),
            head_claims=frozenset(range(local)), expect=expect,
            claims=lambda h: frozenset(range(int(h["start_rank"]),
                                             int(h["start_rank"]) + int(h["local_size"]))))
        server = RendezvousServer(ENGINE, address, port, group, fatal_loss=None if keep_alive_on_engine_death() else
                                  "engine core dead, API server shutting down (VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=0)")
        server.start()
        readiness.watch_server(server)
        return [server]
    if a.data_parallel_start_rank is None:
        return []
    hello = dict(hello_base(a, "vllm-dp"), dp_size=size, start_rank=start, local_size=local)
    readiness.add_check(MemberLink(ENGINE, address, port, hello).start().reason)
    return []


def setup_nodes(a: argparse.Namespace, readiness: Readiness) -> list[RendezvousServer]:
    """``--nnodes`` rendezvous on ``--master-addr:--master-port``."""
    if a.nnodes <= 1:
        return []
    if a.node_rank == 0:
        group = RendezvousGroup(
            kind="vllm-nodes", required=frozenset(range(a.nnodes)), head_claims=frozenset({0}),
            expect={"nnodes": a.nnodes, "tp_size": a.tensor_parallel_size,
                    "pp_size": a.pipeline_parallel_size},
            claims=lambda h: frozenset({int(h["node_rank"])}))
        server = RendezvousServer(ENGINE, a.master_addr, a.master_port, group)
        server.start()
        readiness.watch_server(server)
        return [server]
    hello = dict(hello_base(a, "vllm-nodes"), nnodes=a.nnodes, node_rank=a.node_rank)
    readiness.add_check(MemberLink(ENGINE, a.master_addr, a.master_port, hello).start().reason)
    return []


def make_app(a: argparse.Namespace, readiness: Readiness, ray_world: dict[str, int]) -> EngineApp:
    model = resolve_model(a.model)
    return EngineApp(
        engine=ENGINE, served_names=a.served_model_name or [a.model], model=model,
        readiness=readiness, reasoning=bool(a.reasoning_parser),
        tools="auto" if a.enable_auto_tool_choice else "reject",
        tools_error='"auto" tool choice requires --enable-auto-tool-choice and '
                    '--tool-call-parser to be set',
        # vLLM 0.33 (entrypoints/serve/middleware/register.py): ``--api-key`` wins over env
        # VLLM_API_KEY; authenticate.py guards these prefixes, /health and /metrics stay open
        api_key=a.api_key or os.environ.get("VLLM_API_KEY") or None,
        guarded=("/v1", "/v2", "/inference", "/cohere"),
        metadata={"version": VERSION, "max_model_len": a.max_model_len,
                  "tensor_parallel_size": a.tensor_parallel_size,
                  "pipeline_parallel_size": a.pipeline_parallel_size,
                  "data_parallel_size": a.data_parallel_size, "nnodes": a.nnodes, **ray_world},
        extra_get={"/version": lambda: (200, {"version": VERSION, "double": DOUBLE_NAME})})


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    validate(parser, args)
    try:
        resolve_model(args.model)
    except ModelError as exc:
        fail(ENGINE, str(exc))
    check_gpu_budget(args)
    app = make_app(args, Readiness(ENGINE), check_ray(args))
    log(ENGINE, f"{DOUBLE_NAME} pretending to be vLLM {VERSION} serving {args.model}")
    servers = setup_dp(args, app.readiness) + setup_nodes(args, app.readiness)
    app.rendezvous = servers
    cleanups = [s.close for s in servers]
    if args.headless:
        log(ENGINE, "headless: no HTTP server")
    else:
        http = serve_http(ENGINE, args.host or "0.0.0.0", args.port, EngineHandler, app)
        cleanups.insert(0, http.shutdown)
    return wait_for_shutdown(ENGINE, cleanups)


if __name__ == "__main__":
    sys.exit(main())
