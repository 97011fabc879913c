"""SGLang: multi-node TP, DP attention + EP (DeepEP), prefill/decode disaggregation behind the
router; CUDA venv or container, ROCm container. Also the server of KTransformers >= 0.7 (sglang-kt).

Memory: the static pool is ``mem_fraction_static`` × the GPU (weights + KV); unset, SGLang computes
that fraction from its own reserve (:func:`sglang_reserve_mib`, read at each pin)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from k2fleet.planning import catalog
from k2fleet.planning.engines.base import Engine, EngineMetrics, Refusal, arg
from k2fleet.planning.engines.sglang import render as _render

if TYPE_CHECKING:
    from k2fleet.inventory.spec import HostSettings
    from k2fleet.planning.capacity import Layout
    from k2fleet.planning.deployment import Deployment, Pool

# SGLang picks its NCCL/torch store port at API + randint(100, 1000), stepping by 42
NCCL_WINDOW = (100, 1100)
API_KEY_FRONTED = ("SGLang takes its API key only as --api-key (or in its --config YAML) and logs every server "
                   "argument, the key included, at start (server_args=...); its PD router (sglang-router 0.3.2) "
                   "has --api-key in argv only")

# k2_profile's rows: profile -> [(flag, value, source)]; flags spelt as the oldest supported pin spells them.
PROFILE_ROWS: dict[str, list[tuple[str, Any, str]]] = {
    "latency": [
        ("cuda-graph-max-bs", 64, "k2fleet's choice (no SGLang latency values in the seeds): decode batches "
         "up to 64 stay inside CUDA graphs"),
        ("max-running-requests", 64, "k2fleet's choice: no more running requests than the CUDA-graph batch"),
    ],
    "throughput": [
        ("max-running-requests", 1024, "[moonshot-deploy] SGLang Deployment, prefill node: --max-running-requests 1024"),
        ("chunked-prefill-size", 16384, "k2fleet's choice: twice SGLang's large-GPU default (8192) per instance, "
         "the seed's 131072 being for a DP32 prefill server"),
    ],
    "long-context": [
        ("chunked-prefill-size", 16384, "[k2-thinking-summary] Optional Tuning, For maximum context: 16384-token "
         "prefill chunks (vLLM's --max-num-batched-tokens, SGLang's equivalent)"),
    ],
}


def sglang_gpu_mib(gpu: catalog.GpuType) -> float:
    """The GPU memory SGLang sizes its defaults by: ``nvidia-smi --query-gpu=memory.total`` in MiB
    (sglang/srt/utils/common.py get_nvgpu_memory_capacity), :attr:`GpuType.smi_mib` where known,
    else the quoted memory."""
    return float(gpu.smi_mib or gpu.memory_gib * 1024)


def sglang_reserve_mib(gpu: catalog.GpuType, layout: Layout) -> float:
    """SGLang's own reserve beside weights and KV (MiB) at the pin, from which it computes
    ``mem_fraction_static = round((gpu_mem − reserve) / gpu_mem, 3)`` when unset.

    - 0.5.23: ``sglang/srt/arg_groups/memory_hook.py`` handle_gpu_memory_settings,
      reserve_for_graph_mb, reserve_for_deepep_a2a_mb (MLA models take no post-capture sizing);
    - 0.5.4: ``sglang/srt/server_args.py`` _handle_gpu_memory_settings;
    - 0.4.9: ``sglang/srt/server_args.py`` __post_init__ (a table by GPU size).

    >>> from k2fleet.planning.capacity import Layout
    >>> h200 = catalog.GPUS["h200"]
    >>> sglang_reserve_mib(h200, Layout("sglang", tp=8, version="0.5.23"))
    16384.0
    >>> round(1 - sglang_reserve_mib(h200, Layout("sglang", tp=8, version="0.5.23")) / sglang_gpu_mib(h200), 3)
    0.886
    """
    gpu_mem = sglang_gpu_mib(gpu)
    v = catalog.version_tuple(layout.version or catalog.ENGINE_VERSIONS["sglang"][0])
    attn_dp = layout.attn_dp and layout.dp > 1
    if v < (0, 5, 0):
        parallel = layout.tp * layout.pp
        if gpu_mem < 35 * 1024:
            reserve = (2.8 + parallel / 10) * 1024
        elif gpu_mem < 90 * 1024:
            reserve = (9.5 + parallel / 2) * 1024
        elif gpu_mem < 160 * 1024:
            reserve = (12 + parallel / 2) * 1024
        else:
            reserve = 32 * 1024
        return reserve + (4 * 1024 if attn_dp else 0)
    # chunked_prefill_size and the decode CUDA graph's max batch by GPU memory
    if gpu_mem < 35 * 1024:
        chunked, max_bs = 4096 if v >= (0, 5, 23) else 2048, (48 if v >= (0, 5, 23) else 16) if layout.tp < 4 else (160 if v >= (0, 5, 23) else 80)
    elif gpu_mem < 60 * 1024:
        chunked, max_bs = 4096, 32 if layout.tp < 4 else 160
    elif gpu_mem < 160 * 1024:
        chunked, max_bs = 8192, 256 if layout.tp < 4 else 512
    else:
        chunked, max_bs = 16384, 512
    chunked = layout.chunked_prefill or chunked
    if layout.cuda_graph_max_bs:
        max_bs = layout.cuda_graph_max_bs
    elif layout.max_running and v >= (0, 5, 23):
        max_bs = min(max_bs, layout.max_running)
    if v < (0, 5, 23):  # 0.5.4
        reserve = 512 + max(chunked, 2048) * 1.5 + max_bs * 2 + layout.tp * layout.pp / 8 * 1024
        if attn_dp:
            reserve += max_bs * layout.dp * 3 + (max_bs * layout.dp * 1.5 if max_bs > 300 else 0)
        return max(reserve, 10 * 1024) if gpu_mem > 60 * 1024 else reserve
    if layout.role == "decode":
        activation = max(layout.max_running or max_bs or 1, 2048)
    else:
        activation = max(chunked, 2048)
    reserve = 512 + activation * 1.5 + layout.tp * layout.pp / 8 * 1024
    graph = 0.0
    if layout.role != "prefill" and layout.decode_graph:
        graph += max_bs * 2
    if attn_dp and layout.role != "prefill":
        graph += max_bs * layout.dp * 3 + (max_bs * layout.dp * 1.5 if max_bs > 300 else 0)
    prefill_graph = (layout.prefill_graph and not layout.multimodal
                     and (layout.a2a_backend or "none") in ("none", "deepep", "megamoe", "flashinfer"))
    if layout.role != "decode" and prefill_graph:
        graph += 1.5 * 1024  # MLA
        if layout.a2a_backend == "deepep":
            graph += 1024
    reserve += graph
    if gpu_mem > 60 * 1024:
        reserve = max(reserve, 10 * 1024)
    if layout.role != "prefill" and layout.decode_graph and layout.a2a_backend == "deepep":
        reserve += 2 * 1024
    return reserve


# The Grafana dashboard k2fleet writes for its metric names: (title, [(panel title, unit, [PromQL])])
DASHBOARD_PANELS = ("SGLang", [
    ("Requests running / queued", "short", ["sum by (instance) (sglang:num_running_reqs)",
                                            "sum by (instance) (sglang:num_queue_reqs)"]),
    ("KV cache (token) usage", "percentunit", ["avg by (instance) (sglang:token_usage)"]),
    ("Token throughput (tokens/s)", "short", ["sum by (instance) (rate(sglang:prompt_tokens_total[1m]))",
                                              "sum by (instance) (rate(sglang:generation_tokens_total[1m]))"]),
    ("Time to first token p50 / p99", "s", [
        "histogram_quantile(0.5, sum by (le) (rate(sglang:time_to_first_token_seconds_bucket[5m])))",
        "histogram_quantile(0.99, sum by (le) (rate(sglang:time_to_first_token_seconds_bucket[5m])))"]),
    ("Inter-token latency p50 / p99", "s", [
        "histogram_quantile(0.5, sum by (le) (rate(sglang:inter_token_latency_seconds_bucket[5m])))",
        "histogram_quantile(0.99, sum by (le) (rate(sglang:inter_token_latency_seconds_bucket[5m])))"]),
])


class SGLang(Engine):
    name = "sglang"
    label = "SGLang"
    unit = "k2-sglang"
    package = "sglang[all]"
    entry = "python"
    platforms = ("cuda", "rocm")
    default_images = {"cuda": "lmsysorg/sglang:v{version}", "rocm": "lmsysorg/sglang:v{version}-rocm700-mi30x"}
    owned_flags = _render.OWNED_FLAGS
    renamed_flags = [
        ("enable-deepep-moe", "0.5.0", ["--moe-a2a-backend", "deepep"]),
        ("tp", "0.0.0", ["--tp-size", "{value}"]),
        ("nccl-init-addr", "0.4.0", ["--dist-init-addr", "{value}"]),
        ("cuda-graph-bs", "0.5.23", ["--cuda-graph-bs-decode", "{value}"]),
        ("cuda-graph-max-bs", "0.5.23", ["--cuda-graph-max-bs-decode", "{value}"]),
    ]
    profile_rows = PROFILE_ROWS
    # The all-to-all backends of expert parallel each pin accepts (k2_moe_a2a_backend), read from SGLang's own
    # sources (wheels from pypi.org, ``pip download --no-deps``, 2026-11-26):
    a2a_backends = {
        "0.5.23": (("none", "deepep", "mooncake", "nixl", "mori", "ascend_fuseep", "flashinfer", "megamoe",
                    "deepep_v2", "pplx", "ascend_tp", "flashinfer_megamoe"),
                   "sglang 0.5.23 sglang/srt/arg_groups/fields/exec_.py, moe_a2a_backend choices"),
        "0.5.4": (("none", "deepep", "mooncake"), "sglang 0.5.4 sglang/srt/server_args.py, --moe-a2a-backend choices"),
        "0.4.9": (("none", "deepep"), "sglang 0.4.9 sglang/srt/server_args.py: no --moe-a2a-backend, "
                  "only the bool --enable-deepep-moe"),
    }
    a2a_refusal = None
    context_flag = "context-length"
    fraction_flag = "mem-fraction-static"
    fraction_tunable = True
    dp_multiplies_gpus = True  # unless DP attention (instance_gpus)
    ep_within_tp = True
    pd_disaggregation = True
    block_tokens = 1
    metrics = EngineMetrics("/metrics", True, "SGLang's HTTP server exposes /metrics on the API port only with "
                            "--enable-metrics (flag in the 0.4.9/0.5.4/0.5.23 tables; k2fleet renders it with k2_metrics)")
    dashboard = "sglang"
    dashboard_panels = DASHBOARD_PANELS
    request_counter = "sglang:num_requests_total"  # sglang/srt/metrics/collector.py
    torch_store_window = NCCL_WINDOW
    bench_client = "python3"
    bench_format = "sglang-bench-serving-jsonl"
    api_key_fronted = API_KEY_FRONTED
    world_keys = (("tp_size", "tp"),)

    def instance_gpus(self, s: HostSettings, tp: int) -> int:
        """SGLang DP attention runs inside the TP group; plain DP ranks are GPUs of their own."""
        return tp * s.pp if s.attn_dp else tp * s.pp * s.dp

    def parallel_refusal(self, s: HostSettings, tp: int) -> Refusal | None:
        refused = super().parallel_refusal(s, tp)
        if refused is None and s.attn_dp and tp % s.dp:
            return "k2_dp", f"SGLang DP attention needs k2_dp ({s.dp}) to divide k2_tp ({tp})"
        return refused

    # memory
    def dense_tp(self, args: dict[str, Any], s: HostSettings) -> Any:
        if s.attn_dp and s.dp > 1:
            return 1  # render.DP_ATTENTION_COMPANIONS: --moe-dense-tp-size 1
        return arg(args, "moe-dense-tp-size")

    def attn_tp(self, layout: Layout) -> int:
        return max(1, layout.tp // layout.dp) if layout.attn_dp else layout.tp

    def kv_groups(self, layout: Layout) -> int:
        return layout.dp if layout.attn_dp else 1

    def default_fraction(self, gpu: catalog.GpuType, layout: Layout) -> tuple[float, str]:
        mib = sglang_gpu_mib(gpu)
        reserve = layout.reserve_gib * 1024 if layout.reserve_gib is not None else sglang_reserve_mib(gpu, layout)
        return round((mib - reserve) / mib, 3), f"SGLang {layout.version}'s mem_fraction_static, computed as it does"

    def runtime_reserve(self, gpu: catalog.GpuType, layout: Layout) -> tuple[float, str]:
        """The part of the GPU outside its static pool (:func:`sglang_reserve_mib`)."""
        mib = sglang_reserve_mib(gpu, layout)
        return mib / 1024, f"SGLang {layout.version}'s own heuristic ({mib:,.0f} MiB of {sglang_gpu_mib(gpu):,.0f})"

    def kv_memory(self, total: float, fraction: float, weights: float, reserve: float,
                  layout: Layout, reserve_source: str) -> tuple[float, float, str]:
        """total × mem_fraction_static − weights: the runtime is outside the static pool."""
        if layout.fraction:
            reserve_source = f"outside mem_fraction_static ({(1 - fraction) * total:.1f} GiB)"
        return 0.0, total * fraction - weights, reserve_source

    # flags, rendering, health
    def keyed_flags(self, dep: Deployment, pool: Pool) -> dict[str, str]:
        return _render.keyed_flags(dep, pool)

    def a2a_backend(self, pool: Pool) -> str | None:
        return _render.a2a_backend(pool)

    def render(self, dep: Deployment):
        return _render.render(dep)

    def reports_members(self) -> bool:
        return True

    # bench: SGLang's bench_serving
    def bench_prefix(self, client: str) -> list[str]:
        return [client, "-m", "sglang.bench_serving"]  # a module only: client is a Python with sglang

    def result_filename(self, label: str, concurrency: int) -> str:
        """SGLang appends JSON lines."""
        return super().result_filename(label, concurrency) + "l"

    def bench_argv(self, client: str, base: str, label: str, model: str, tokenizer: str, concurrency: int,
                   num_prompts: int, input_len: int, output_len: int, result_dir: Path) -> list[str]:
        # ignore_eos is its default; range ratio 1: fixed lengths as vLLM's
        return [*self.bench_prefix(client), "--backend", "sglang-oai-chat", "--base-url", base, "--model", model,
                "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(input_len),
                "--random-output-len", str(output_len), "--random-range-ratio", "1", "--num-prompts", str(num_prompts),
                "--max-concurrency", str(concurrency), "--request-rate", "inf", "--disable-tqdm",
                "--output-file", str(result_dir / self.result_filename(label, concurrency))]


ENGINE = SGLang()
