"""k2fleet-test-double for TensorRT-LLM 1.2 ``trtllm-serve [serve] MODEL`` -- TEST DOUBLE.

Accepts the ``trtllm-serve serve`` options k2fleet may render (underscore
spelling, as in the real click CLI) and refuses anything else (exit 2).

Under ``mpirun`` the world is ``OMPI_COMM_WORLD_SIZE``/``OMPI_COMM_WORLD_RANK``,
under Slurm's ``srun`` (one task per GPU, as TensorRT-LLM's disaggregated Slurm
scripts launch workers) ``SLURM_NTASKS``/``SLURM_PROCID``; it must equal TP*PP*CP.
As in the real ``trtllm-serve``, the parallel sizes in the ``--config`` YAML
(``tensor_parallel_size`` ...) override the command line's.  Rendezvous, in order of preference:

* ``K2FLEET_DOUBLE_RDZV=host:port`` set: TCP -- rank 0 listens there, the
  other ranks connect;
* otherwise ``mpi4py`` (Debian ``python3-mpi4py``): a real ``allgather`` of
  hostnames and a barrier;
* otherwise: refuse (exit 1).

Rank 0 serves HTTP (``/health`` 503 until every rank has joined); the other
ranks block until rank 0 exits.  ``/v1/models`` metadata reports the world
(size, parallel sizes, the hosts of the ranks).

``trtllm-serve disaggregated -c CONFIG`` runs the disaggregated front-end
double (:mod:`k2fleet_doubles.trtllm_disagg`).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from . import DOUBLE_NAME
from .common import (EngineApp, EngineHandler, MemberLink, ModelError, Readiness,
                     RendezvousGroup, RendezvousServer, fail, gpus_per_node, log,
                     parse_hostport, resolve_model, serve_http, wait_for_shutdown)

ENGINE = "trtllm"
VERSION = "1.2.0"
SUBCOMMANDS_REFUSED = ("disaggregated_mpi_worker", "mm_embedding_serve", "grpc")
YAML_KEY = re.compile(r"^[A-Za-z_][\w.-]*\s*:(\s.*)?$")
# top-level YAML keys that set the parallel layout, as trtllm-serve reads them -> our dest
YAML_PARALLEL = {"tensor_parallel_size": "tp_size", "pipeline_parallel_size": "pp_size",
                 "context_parallel_size": "cp_size", "moe_expert_parallel_size": "ep_size"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trtllm-serve", description=f"trtllm-serve ({DOUBLE_NAME})")
    p.add_argument("--version", action="version", version=f"{VERSION} {DOUBLE_NAME}")
    p.add_argument("model")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--host", default="localhost")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--backend", choices=["pytorch", "tensorrt", "trt", "_autodeploy"],
                   default="pytorch")
    p.add_argument("--log_level", default="info",
                   choices=["internal_error", "error", "warning", "info", "verbose", "debug", "trace"])
    p.add_argument("--max_beam_width", type=int, default=1)
    p.add_argument("--max_batch_size", type=int, default=None)
    p.add_argument("--max_num_tokens", type=int, default=None)
    p.add_argument("--max_seq_len", type=int, default=None)
    p.add_argument("--tensor_parallel_size", "--tp_size", dest="tp_size", type=int, default=1)
    p.add_argument("--pipeline_parallel_size", "--pp_size", dest="pp_size", type=int, default=1)
    p.add_argument("--context_parallel_size", "--cp_size", dest="cp_size", type=int, default=1)
    p.add_argument("--moe_expert_parallel_size", "--ep_size", dest="ep_size", type=int, default=None)
    p.add_argument("--moe_cluster_parallel_size", "--cluster_size", dest="cluster_size",
                   type=int, default=None)
    p.add_argument("--gpus_per_node", type=int, default=None)
    p.add_argument("--free_gpu_memory_fraction", "--kv_cache_free_gpu_memory_fraction",
                   dest="free_gpu_memory_fraction", type=float, default=0.9)
    p.add_argument("--num_postprocess_workers", type=int, default=0)
    p.add_argument("--trust_remote_code", action="store_true")
    p.add_argument("--revision", default=None)
    p.add_argument("--config", "--extra_llm_api_options", dest="extra_llm_api_options", default=None)
    p.add_argument("--reasoning_parser", default=None)
    p.add_argument("--tool_parser", default=None)
    p.add_argument("--server_role", default=None)
    p.add_argument("--enable_chunked_prefill", action="store_true")
    p.add_argument("--chat_template", default=None)
    p.add_argument("--fail_fast_on_attention_window_too_large", action="store_true")
    return p


def strip_subcommand(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``trtllm-serve serve MODEL`` == ``trtllm-serve MODEL``; refuse other subcommands."""
    if argv and argv[0] == "serve":
        return argv[1:]
    if argv and argv[0] in SUBCOMMANDS_REFUSED:
        parser.error(f"subcommand {argv[0]!r} is not implemented by the {DOUBLE_NAME}")
    return argv


def yaml_keys(path: str) -> list[str]:
    """Minimal YAML sanity check: readable, non-empty, top-level ``key: value`` lines."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    keys: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or stripped in ("---", "..."):
            continue
        if "\t" in line[: len(line) - len(line.lstrip())]:
            raise ValueError(f"{path}:{number}: tab in indentation")
        if line[0] in " -":
            if not keys:
                raise ValueError(f"{path}:{number}: indented content before any top-level key")
            continue
        if not YAML_KEY.match(line):
            raise ValueError(f"{path}:{number}: expected 'key: value', got {line!r}")
        keys.append(line.split(":", 1)[0].strip())
    if not keys:
        raise ValueError(f"{path} has no top-level 'key: value' entries")
    return keys


def yaml_parallel(path: str) -> dict[str, Any]:
    """The parallel layout set by top-level scalars of the options YAML (dest -> value);
    ``enable_attention_dp`` as a bool."""
    found: dict[str, Any] = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line or line[0] in " -#":
            continue
        key, _, value = line.partition(":")
        value = value.split("#", 1)[0].strip()
        if key.strip() in YAML_PARALLEL and value.isdigit():
            found[YAML_PARALLEL[key.strip()]] = int(value)
        elif key.strip() == "enable_attention_dp" and value.lower() in ("true", "false"):
            found["attention_dp"] = value.lower() == "true"
    return found


def validate(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    for name in ("tp_size", "pp_size", "cp_size"):
        if getattr(a, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if a.ep_size is not None and (a.ep_size < 1 or a.tp_size % a.ep_size):
        parser.error(f"--ep_size {a.ep_size} must divide --tp_size {a.tp_size}")
    if not 0 < a.free_gpu_memory_fraction <= 1:
        parser.error("--kv_cache_free_gpu_memory_fraction must be in (0, 1]")


def mpi_world() -> tuple[int, int]:
    """(rank, size) from OpenMPI's environment, else from srun's (one task per rank);
    (0, 1) outside both."""
    if "OMPI_COMM_WORLD_SIZE" in os.environ:
        return int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    if "SLURM_STEP_ID" in os.environ and "SLURM_PROCID" in os.environ:
        return int(os.environ["SLURM_PROCID"]), int(os.environ.get("SLURM_NTASKS", "1"))
    return 0, 1


def check_world(a: argparse.Namespace, size: int) -> None:
    """Exit 1 when the MPI world does not match the parallel layout."""
    needed = a.tp_size * a.pp_size * a.cp_size
    if size > 1 and size != needed:
        fail(ENGINE, f"MPI world size {size} != tp_size*pp_size*cp_size {needed}; refusing")
    per_node = needed if size == 1 else 1
    gpus = a.gpus_per_node or gpus_per_node()
    if per_node > gpus:
        fail(ENGINE, f"single-process launch needs {per_node} GPUs on this node but it has "
                     f"{gpus}; launch under mpirun across nodes")


def _record_hosts(server: RendezvousServer, metadata: dict[str, Any], recorded: threading.Event) -> None:
    """Once every rank joined, report the hosts they run on (``/v1/models`` metadata)."""
    while not server.complete():
        time.sleep(0.2)
    metadata["hosts"] = sorted({socket.gethostname()} | {str(m.get("host")) for m in server.members()})
    recorded.set()


def tcp_rendezvous(a: argparse.Namespace, rank: int, size: int, readiness: Readiness,
                   address: str, metadata: dict[str, Any]) -> list[RendezvousServer]:
    """TCP rendezvous on K2FLEET_DOUBLE_RDZV; non-zero ranks exit with rank 0."""
    try:
        host, port = parse_hostport(address)
    except ValueError as exc:
        fail(ENGINE, f"K2FLEET_DOUBLE_RDZV: {exc}")
    expect = {"world": size, "tp_size": a.tp_size, "pp_size": a.pp_size}
    if rank == 0:
        group = RendezvousGroup(kind="trtllm-mpi", required=frozenset(range(size)),
                                head_claims=frozenset({0}), expect=expect,
                                claims=lambda h: frozenset({int(h["rank"])}))
        server = RendezvousServer(ENGINE, host, port, group)
        server.start()
        readiness.watch_server(server)
        recorded = threading.Event()  # /health stays 503 until the metadata names every rank's host
        readiness.add_check(lambda: None if recorded.is_set() else "recording the hosts of the ranks")
        threading.Thread(target=_record_hosts, args=(server, metadata, recorded), daemon=True).start()
        return [server]
    hello = dict(expect, kind="trtllm-mpi", rank=rank, host=socket.gethostname())
    MemberLink(ENGINE, host, port, hello, rejoin=False).start()
    return []


def mpi_rendezvous(rank: int, size: int) -> Any:
    """Real MPI allgather + barrier via mpi4py; return the communicator."""
    try:
        from mpi4py import MPI  # type: ignore[import-not-found]
    except ImportError:
        fail(ENGINE, f"MPI world of {size} ranks but neither mpi4py nor K2FLEET_DOUBLE_RDZV "
                     "is available for the rendezvous")
    comm = MPI.COMM_WORLD
    if comm.Get_size() != size or comm.Get_rank() != rank:
        fail(ENGINE, f"mpi4py sees rank {comm.Get_rank()}/{comm.Get_size()}, "
                     f"environment says {rank}/{size}")
    hosts = comm.allgather(socket.gethostname())
    comm.Barrier()
    log(ENGINE, f"MPI rendezvous complete: rank {rank}/{size}, hosts {hosts}")
    return comm


def mpi_worker_wait(comm: Any) -> int:
    """Non-zero MPI rank: wait (without spinning) for rank 0's goodbye."""
    request = comm.irecv(source=0, tag=7)
    while True:
        done, _ = request.test()
        if done:
            log(ENGINE, "rank 0 said goodbye; exiting")
            return 0
        time.sleep(0.2)


def mpi_goodbye(comm: Any) -> None:
    for peer in range(1, comm.Get_size()):
        comm.send("bye", dest=peer, tag=7)


def make_app(a: argparse.Namespace, readiness: Readiness, yaml: list[str], world: int = 1) -> EngineApp:
    return EngineApp(
        engine=ENGINE, served_names=[a.model], model=resolve_model(a.model), readiness=readiness,
        reasoning=bool(a.reasoning_parser), tools="auto" if a.tool_parser else "ignore",
        metadata={"version": VERSION, "backend": a.backend, "tp_size": a.tp_size,
                  "pp_size": a.pp_size, "ep_size": a.ep_size, "extra_llm_api_options": yaml,
                  "world": world, "enable_attention_dp": a.attention_dp, "hosts": [socket.gethostname()]},
        extra_get={"/version": lambda: (200, {"version": VERSION, "double": DOUBLE_NAME}),
                   "/metrics": lambda: (200, [])})


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    if words and words[0] == "disaggregated":
        from .trtllm_disagg import main as disaggregated_main
        return disaggregated_main(words[1:])
    args = parser.parse_args(strip_subcommand(parser, words))
    args.attention_dp = False
    yaml: list[str] = []
    if args.extra_llm_api_options:
        try:
            yaml = yaml_keys(args.extra_llm_api_options)
            for dest, value in yaml_parallel(args.extra_llm_api_options).items():
                setattr(args, dest, value)
        except ValueError as exc:
            fail(ENGINE, f"--config/--extra_llm_api_options: {exc}")
    validate(parser, args)
    rank, size = mpi_world()
    try:
        app = make_app(args, Readiness(ENGINE), yaml, size)
    except ModelError as exc:
        fail(ENGINE, str(exc))
    check_world(args, size)
    log(ENGINE, f"{DOUBLE_NAME} pretending to be TensorRT-LLM {VERSION} serving {args.model} "
                f"(rank {rank}/{size})")
    cleanups = []
    comm = None
    if size > 1 and os.environ.get("K2FLEET_DOUBLE_RDZV"):
        servers = tcp_rendezvous(args, rank, size, app.readiness, os.environ["K2FLEET_DOUBLE_RDZV"], app.metadata)
        cleanups += [s.close for s in servers]
    elif size > 1:
        comm = mpi_rendezvous(rank, size)
        if rank != 0:
            return mpi_worker_wait(comm)
        cleanups.append(lambda: mpi_goodbye(comm))
    if rank != 0:
        log(ENGINE, f"rank {rank}: worker only, waiting for rank 0")
        return wait_for_shutdown(ENGINE, cleanups)
    http = serve_http(ENGINE, args.host, args.port, EngineHandler, app)
    return wait_for_shutdown(ENGINE, [http.shutdown] + cleanups)


if __name__ == "__main__":
    sys.exit(main())
