"""SGLang: multi-node TP, DP attention + EP (DeepEP), prefill/decode disaggregation
behind the router. Also the launch path of KTransformers ≥ 0.7 (sglang-kt).

Version-dependent spellings (SGLang 0.5.23): ``--tp-size`` (``--tp`` only parses as an
abbreviation), ``--attn-dp-size N`` for DP attention (older pins: ``--dp-size N
--enable-dp-attention``), ``--moe-a2a-backend deepep`` (older: ``--enable-deepep-moe``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from k2fleet.planning.catalog import version_tuple
from k2fleet.planning.processes import Health, Service
from k2fleet.planning.render.common import container_argv, engine_env, extra_flags, pool_engine_args, venv_bin
from k2fleet.inventory.spec import HostEntry

if TYPE_CHECKING:
    from k2fleet.planning.deployment import Deployment, Pool

ATTN_DP_SIZE_SINCE = (0, 5, 23)
# The flags this renderer emits and so owns: flag -> the inventory key that sets it ("": none);
# k2_engine_args may not set them (k2fleet.planning.engine_flags checks).
OWNED_FLAGS = {
    "--tp-size": "k2_tp", "--tensor-parallel-size": "k2_tp", "--tp": "k2_tp",
    "--pp-size": "k2_pp", "--pipeline-parallel-size": "k2_pp",
    "--dp-size": "k2_dp", "--data-parallel-size": "k2_dp", "--attn-dp-size": "k2_dp",
    "--enable-dp-attention": "k2_attn_dp",
    "--ep-size": "k2_ep", "--expert-parallel-size": "k2_ep", "--ep": "k2_ep",
    "--dist-init-addr": "k2_dist_init_port", "--nccl-init-addr": "k2_dist_init_port",
    "--nnodes": "", "--node-rank": "",
    "--disaggregation-mode": "k2_role", "--disaggregation-bootstrap-port": "k2_bootstrap_port",
    "--port": "k2_port", "--host": "", "--model-path": "k2_model", "--model": "k2_model",
    "--served-model-name": "k2_served_model_name",
    "--enable-metrics": "k2_metrics",
    "--trust-remote-code": "",
    "--moe-a2a-backend": "k2_moe_a2a_backend", "--enable-deepep-moe": "k2_moe_a2a_backend",
}
A2A_BACKEND_SINCE = (0, 5, 0)
# SGLang's companions of DP attention for DeepSeek-V3-shaped models (Moonshot's K2 deployment guide
# and SGLang's cookbook pair them with --enable-dp-attention): the dense MLP layers data parallel
# like attention (--moe-dense-tp-size 1) and the LM head vocabulary-parallel within the attention TP
# group (--enable-dp-lm-head, no all-gather across DP groups). Both exist at every SGLang pin, as read
# from the wheels: 0.4.9 and 0.5.4 sglang/srt/server_args.py (add_argument "--moe-dense-tp-size",
# "--enable-dp-lm-head"), 0.5.23 sglang/srt/arg_groups/fields/parallel.py (moe_dense_tp_size,
# enable_dp_lm_head); the flag tables in k2fleet/planning/data/engine_flags list them.
DP_ATTENTION_COMPANIONS = ["--moe-dense-tp-size", "1", "--enable-dp-lm-head"]


def parser_and_context_flags(dep: Deployment) -> dict[str, str]:
    """SGLang's parser and context-length flags (flag -> the inventory key), as SGLang and
    sglang-kt (KTransformers 0.7) take them."""
    out: dict[str, str] = {}
    if dep.tool_parser:
        out["--tool-call-parser"] = "k2_tool_parser"
    if dep.reasoning_parser:
        out["--reasoning-parser"] = "k2_reasoning_parser"
    if dep.s.max_model_len:
        out["--context-length"] = "k2_max_model_len"
    return out


def keyed_flags(dep: Deployment, pool: Pool) -> dict[str, str]:
    """Flags this renderer emits for ``pool`` only when an inventory key asks (flag -> the key);
    ``k2_engine_args`` may set them when k2fleet does not (the owned flags are refused always)."""
    s = pool.settings
    out: dict[str, str] = {}
    if s.attn_dp and pool.dp > 1:
        out |= {"--moe-dense-tp-size": "k2_attn_dp", "--enable-dp-lm-head": "k2_attn_dp"}
    out |= parser_and_context_flags(dep)
    if s.gpu_memory_utilization:
        out["--mem-fraction-static"] = "k2_gpu_memory_utilization"
    if pool.role in ("prefill", "decode") and any(h.settings.ib_hcas for h in pool.hosts):
        out["--disaggregation-ib-device"] = "k2_ib_hcas"
    return out


def a2a_backend(pool: Pool) -> str | None:
    """The all-to-all backend of expert parallel: ``k2_moe_a2a_backend``, else DeepEP (k2fleet's
    default since its first SGLang EP scenario, Moonshot's guide's --enable-deepep-moe)."""
    if pool.ep <= 1:
        return None
    return pool.settings.moe_a2a_backend or "deepep"


def host_port(address: str, port: int) -> str:
    """``HOST:PORT`` as SGLang parses it (sglang/srt/utils/network.py NetworkAddress.parse at 0.5.23,
    server_args.py's configure_ipv6 at 0.5.4: an IPv6 address must be bracketed)."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def python_module(dep: Deployment, module: str, words: list[str], env: dict[str, str], name: str) -> list[str]:
    """``python -m MODULE WORDS`` from the venv, or inside the container image."""
    if dep.runtime == "container":
        return container_argv(dep, name, ["python3", "-m", module, *words], env)
    return [venv_bin(dep, "python"), "-m", module, *words]


def parallel_words(dep: Deployment, pool: Pool) -> list[str]:
    s = pool.settings
    v = version_tuple(dep.version)
    words = ["--tp-size", str(pool.tp)]
    if pool.pp > 1:
        words += ["--pp-size", str(pool.pp)]
    if s.attn_dp and pool.dp > 1:
        if v >= ATTN_DP_SIZE_SINCE:
            words += ["--attn-dp-size", str(pool.dp)]
        else:
            words += ["--dp-size", str(pool.dp), "--enable-dp-attention"]
        words += DP_ATTENTION_COMPANIONS
    elif pool.dp > 1:
        words += ["--dp-size", str(pool.dp)]
    if pool.ep > 1:
        words += ["--ep-size", str(pool.ep)]
        backend = a2a_backend(pool)
        if v >= A2A_BACKEND_SINCE:
            words += ["--moe-a2a-backend", str(backend)]
        elif backend == "deepep":  # 0.4.9: a bool; "none" is its default (engine_flags checks the choice)
            words += ["--enable-deepep-moe"]
    return words


def feature_words(dep: Deployment) -> list[str]:
    words = ["--trust-remote-code"]
    if dep.tool_parser:
        words += ["--tool-call-parser", dep.tool_parser]
    if dep.reasoning_parser:
        words += ["--reasoning-parser", dep.reasoning_parser]
    if dep.s.max_model_len:
        words += ["--context-length", str(dep.s.max_model_len)]
    if dep.s.metrics:  # /metrics on the API port (SGLang's server_args: off unless --enable-metrics)
        words += ["--enable-metrics"]
    return words + list(dep.model_args)  # the model's own deployment flags (catalog; none for SGLang yet)


def _server_words(dep: Deployment, pool: Pool, host: HostEntry, rank: int, nodes: tuple[HostEntry, ...]) -> list[str]:
    s = pool.settings
    words = ["--model-path", dep.serve_path, "--served-model-name", dep.served_model_name]
    words += ["--host", "0.0.0.0", "--port", str(dep.s.port)]
    words += parallel_words(dep, pool)
    if len(nodes) > 1:
        words += ["--dist-init-addr", host_port(nodes[0].address, dep.s.dist_init_port)]
        words += ["--nnodes", str(len(nodes)), "--node-rank", str(rank)]
    if pool.role in ("prefill", "decode"):
        words += ["--disaggregation-mode", pool.role]
        if pool.role == "prefill":
            words += ["--disaggregation-bootstrap-port", str(dep.s.bootstrap_port)]
        if host.settings.ib_hcas:
            words += ["--disaggregation-ib-device", ",".join(host.settings.ib_hcas)]
    if s.gpu_memory_utilization:
        words += ["--mem-fraction-static", str(s.gpu_memory_utilization)]
    return words + feature_words(dep) + extra_flags(dep, pool_engine_args(dep, s))


def _pool_services(dep: Deployment, pool: Pool) -> Iterator[tuple[str, Service]]:
    for nodes in pool.instances:
        for rank, host in enumerate(nodes):
            env = engine_env(dep, host, pool.settings.env)
            ports = {}
            if rank == 0:
                ports["k2_port"] = dep.s.port
                if len(nodes) > 1:
                    ports["k2_dist_init_port"] = dep.s.dist_init_port
                if pool.role == "prefill":
                    ports["k2_bootstrap_port"] = dep.s.bootstrap_port
            name = "k2-sglang" if pool.role == "serve" else f"k2-sglang-{pool.role}"
            yield host.name, Service(
                name=name,
                argv=python_module(dep, "sglang.launch_server", _server_words(dep, pool, host, rank, nodes), env, name),
                env=env,
                ports=ports,
                stage=0 if rank == 0 else 1,  # node 0 (the --dist-init-addr store) first
                rank=rank,
                role=pool.role,
                health=Health(dep.s.port, chat=pool.role == "serve") if rank == 0 else None,
                description=f"SGLang {pool.role} node {rank} of {len(nodes)}",
            )


def _router(dep: Deployment) -> Iterator[tuple[str, Service]]:
    router = dep.pools["router"].hosts[0]
    words = ["--pd-disaggregation"]
    for nodes in dep.pools["prefill"].instances:
        words += ["--prefill", f"http://{host_port(nodes[0].address, dep.s.port)}", str(dep.s.bootstrap_port)]
    for nodes in dep.pools["decode"].instances:
        words += ["--decode", f"http://{host_port(nodes[0].address, dep.s.port)}"]
    # the router asks its workers' /health every second until they answer (sglang-router 0.3.2's
    # default: every 30 s, so a router started beside loading servers idled up to 30 s after them)
    words += ["--worker-startup-check-interval", "1"]
    words += ["--host", "0.0.0.0", "--port", str(dep.s.router_port)]
    env = {"PYTHONUNBUFFERED": "1"}
    yield router.name, Service(
        name="k2-sglang-router",
        argv=python_module(dep, "sglang_router.launch_router", words, env, "k2-sglang-router"),
        env=env,
        ports={"k2_router_port": dep.s.router_port},
        stage=2,
        role="router",
        health=Health(dep.s.router_port),
        needs_checkpoint=False,
        description="SGLang PD router: prefill and decode servers behind one endpoint",
    )


def render(dep: Deployment) -> Iterator[tuple[str, Service]]:
    for role, pool in dep.pools.items():
        if role != "router":
            yield from _pool_services(dep, pool)
    if "router" in dep.pools:
        yield from _router(dep)
