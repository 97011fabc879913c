"""GPU memory of one serving instance: weights per GPU, what is left for the KV cache, and
how many tokens that holds (pure arithmetic, no host contacted).

:func:`predict` is the one owner of the memory-fit rule: :mod:`k2fleet.planning.deployment`
refuses what it says cannot fit, and ``k2fleet plan`` shows what it predicts.

Weights per GPU (:meth:`~k2fleet.planning.catalog.Architecture.params`, bytes from
:data:`~k2fleet.planning.catalog.WEIGHT_BYTES`, scaled to the checkpoint's size):
``replicated`` on every rank + (``attention`` + ``dense`` + ``embedding``) / the attention TP
size + ``experts`` / the MoE ranks, all / PP. The attention TP size is ``k2_tp`` except under
attention data parallel (SGLang DP attention: tp/dp, TRT-LLM attention DP: 1), where every
rank holds more; vLLM's DP ranks each hold their own TP group's share, while its MoE spans
tp × dp ranks (with or without expert parallel).

KV memory per GPU, by how each engine sizes its cache at its pin (the fraction is the engine's
own default unless ``k2_gpu_memory_utilization`` or the engine's flag sets it; the runtime reserve
is :func:`runtime_reserve`'s unless ``k2_runtime_reserve_gib`` sets it):

- vLLM: total × ``gpu_memory_utilization`` − weights − runtime reserve (activations of the profile
  run, NCCL and library workspaces; CUDA graphs from 0.21 on). Default fraction 0.92 at 0.33.0
  (``vllm/config/cache.py`` CacheConfig), 0.9 at 0.11.0 (the same file) and 0.10.0
  (``vllm/config.py``), read from the wheels on pypi.org;
- SGLang: total × ``mem_fraction_static`` − weights (the static pool is weights + KV; the runtime
  reserve is the rest). Unset, SGLang computes the fraction itself from its own reserve
  (:func:`sglang_reserve_mib`, its ``server_args.py`` / ``arg_groups/memory_hook.py`` at the pin,
  DP attention included): ``(GPU MiB − reserve) / GPU MiB``; ``k2_runtime_reserve_gib`` replaces
  that reserve;
- TensorRT-LLM: (total − weights − runtime reserve) × ``free_gpu_memory_fraction`` (default 0.9:
  ``KvCacheConfig`` in the LLM API reference, nvidia.github.io/TensorRT-LLM/llm-api/reference/KvCacheConfig.html).

KV tokens: MLA caches ``kv_lora_rank + qk_rope_head_dim`` values per token and layer,
whatever the TP size (70,272 bytes in bf16 for Kimi K2; half with an FP8 KV cache); PP
divides the layers, vLLM's decode context parallel (DCP) spreads each sequence's tokens over
``k2_dcp`` ranks, multiplying the tokens by it. Rounded down to whole blocks.

Calibration and verification (:data:`PUBLISHED`): the vLLM Kimi-K2-Thinking guide's TP8 log on
8 × H200 ("Available KV cache memory: 46.80 GiB", "GPU KV cache size: 715,072 tokens"; × 8 =
5,721,088 with DCP8), run on a vLLM nightly of 2025-11 (default 0.9, CUDA graphs not counted).
With H200's 139.81 GiB × 0.9 and 70.93 GiB of weights per GPU, the runtime reserve that leaves
46.80 GiB is 8.1 GiB: :data:`VLLM_RUNTIME_GIB`. Only that layout is checked against a published
line; every other prediction says it is unverified (``Capacity.verified``), and so does every
SGLang and TensorRT-LLM one (no published Kimi K2 log line of theirs was found).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from k2fleet.planning import catalog

DEFAULT_GPU_UTIL = 0.9  # the fraction k2fleet names when an engine's own default is not known
# vLLM's --gpu-memory-utilization default per pin (vllm/config/cache.py at 0.33.0 and 0.11.0, vllm/config.py at 0.10.0)
VLLM_GPU_UTIL = {"0.33.0": 0.92, "0.11.0": 0.9, "0.10.0": 0.9}
DEFAULT_TRTLLM_FREE_FRACTION = 0.9  # TensorRT-LLM KvCacheConfig.free_gpu_memory_fraction default
# vLLM's runtime reserve, measured: the guide's TP8 log on H200 (139.81 × 0.9 − 70.93 − 46.80 = 8.08 GiB)
VLLM_RUNTIME_GIB = 8.1
VLLM_CUDA_GRAPHS_COUNTED_SINCE = (0, 21, 0)  # gpu_worker.py: "CUDA graph memory profiling is enabled (default since v0.21.0)"
BLOCK_TOKENS = {"vllm": 64, "sglang": 1, "trtllm": 32}  # vLLM: FlashMLA's 64-token blocks; TRT-LLM tokens_per_block
# Published start-up log lines a prediction is checked against (within 5%): engine, GPU, tp, dcp,
# fraction, pins whose accounting matches the run, the line, its source.
PUBLISHED = (
    ("vllm", "h200", 8, 1, 0.9, ("0.10.0", "0.11.0"), 46.80, 715_072,
     '"Available KV cache memory: 46.80 GiB", "GPU KV cache size: 715,072 tokens"',
     "vLLM recipe Kimi-K2-Thinking, TP8 on 8 × H200 (shared/seeds, vLLM nightly 2025-11)"),
    ("vllm", "h200", 8, 8, 0.9, ("0.10.0", "0.11.0"), 46.80, 5_721_088,
     '"Available KV cache memory: 46.80 GiB", "GPU KV cache size: 5,721,088 tokens"',
     "vLLM recipe Kimi-K2-Thinking, TP8+DCP8 on 8 × H200 (shared/seeds, vLLM nightly 2025-11)"),
)
VERIFY_TOLERANCE = 0.05


@dataclass(frozen=True)
class Layout:
    """How one instance spreads over its GPUs, as far as memory is concerned."""

    engine: str
    tp: int
    pp: int = 1
    dp: int = 1
    ep: int = 1
    dcp: int = 1
    attn_dp: bool = False
    dense_tp: int | None = None  # SGLang --moe-dense-tp-size
    fraction: float | None = None  # the engine's memory fraction (see the module docstring)
    kv_dtype_bytes: int = 2
    max_len: int | None = None  # context length the instance must hold
    concurrency: int = 1  # requests of max_len it must hold at once
    version: str = ""  # the engine pin (its defaults)
    role: str = "serve"  # serve, prefill or decode (SGLang's reserve differs)
    reserve_gib: float | None = None  # k2_runtime_reserve_gib
    # SGLang's inputs to its own reserve (None: its defaults for the GPU)
    chunked_prefill: int | None = None
    cuda_graph_max_bs: int | None = None
    max_running: int | None = None
    decode_graph: bool = True
    prefill_graph: bool = True
    a2a_backend: str | None = None
    multimodal: bool = False

    @property
    def attn_tp(self) -> int:
        """GPUs that share one copy of attention, dense layers and embedding."""
        if self.attn_dp and self.engine == "sglang":
            return max(1, self.tp // self.dp)
        if self.attn_dp and self.engine == "trtllm":
            return 1
        return self.tp

    @property
    def moe_ranks(self) -> int:
        """GPUs the routed experts are split over."""
        return self.tp * self.dp if self.engine == "vllm" else self.tp

    @property
    def kv_groups(self) -> int:
        """Independent KV caches per instance (each holds whole requests)."""
        if self.engine == "vllm" or (self.engine == "sglang" and self.attn_dp):
            return self.dp
        if self.engine == "trtllm" and self.attn_dp:
            return self.tp
        return 1


@dataclass(frozen=True)
class Capacity:
    """The prediction for one instance (GiB per GPU unless named otherwise)."""

    engine: str
    gpu: str
    gpu_total_gib: float
    fraction: float
    weights_gib: float
    non_expert_gib: float  # of weights_gib: attention (MLA), dense layers, shared expert, embedding, router
    experts_gib: float  # of weights_gib: its share of the routed experts
    overhead_gib: float
    kv_gib: float
    kv_bytes_per_token: int  # per GPU (MLA: all layers of its pipeline stage)
    tokens_per_kv_group: int
    kv_groups: int
    tokens: int  # per instance
    max_len: int | None
    concurrency: int
    fits: int | None  # requests of max_len the instance holds at once
    fraction_source: str = ""  # where the fraction comes from (the engine's default at its pin, or a key)
    reserve_source: str = ""  # where the runtime reserve comes from
    verified: str | None = None  # the published log line the prediction is within 5% of, or None: unverified

    def to_json(self) -> dict[str, Any]:
        return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in asdict(self).items()}

    def arithmetic(self) -> str:
        """How the KV memory per GPU comes about, in the engine's own terms."""
        weights = (f"{self.weights_gib:.2f} GiB weights ({self.non_expert_gib:.2f} attention/dense/embedding + "
                   f"{self.experts_gib:.2f} routed experts)")
        total = f"{self.gpu_total_gib:.2f} GiB {self.gpu}"
        if self.engine == "trtllm":
            return f"({total} − {weights} − {self.overhead_gib:.1f} GiB runtime) × {self.fraction:.2f}"
        runtime = f" − {self.overhead_gib:.1f} GiB runtime" if self.overhead_gib else ""
        fraction = f"{self.fraction:.3f}".rstrip("0") if round(self.fraction, 2) != self.fraction else f"{self.fraction:.2f}"
        return f"{total} × {fraction} − {weights}{runtime}"

    def summary(self) -> str:
        """One line for ``k2fleet plan``."""
        line = f"{self.tokens:,} KV tokens per instance ({self.kv_gib:.2f} GiB KV per GPU = {self.arithmetic()}"
        line += f"; {self.kv_bytes_per_token:,} B/token"
        if self.kv_groups > 1:
            line += f"; {self.kv_groups} caches of {self.tokens_per_kv_group:,}"
        line += ")"
        if self.max_len:
            line += f"; {self.fits:,} requests of {self.max_len:,} tokens fit at once (need {self.concurrency})"
        line += f"; fraction: {self.fraction_source}; runtime reserve: {self.reserve_source}"
        line += f"; verified against {self.verified}" if self.verified else "; unverified: no published log line of this layout"
        return line


def weight_split(arch: catalog.Architecture, quantization: str, checkpoint_bytes: int) -> dict[str, float]:
    """Bytes of each part of the checkpoint (:meth:`Architecture.params` × the format's bytes
    per parameter, scaled so the parts add up to ``checkpoint_bytes``)."""
    per_param = catalog.WEIGHT_BYTES.get(quantization, catalog.WEIGHT_BYTES["bf16"])
    raw = {part: n * per_param[part] for part, n in arch.params().items()}
    scale = checkpoint_bytes / sum(raw.values())
    return {part: b * scale for part, b in raw.items()}


def weights_per_gpu(split: dict[str, float], layout: Layout) -> tuple[float, float]:
    """(non-expert, routed-expert) bytes one GPU holds: the replicated part whole, attention,
    dense layers and embedding over the attention TP group, routed experts over the MoE ranks."""
    dense_tp = layout.dense_tp or layout.attn_tp
    non_expert = (
        split["replicated"]
        + (split["attention"] + split["embedding"]) / layout.attn_tp
        + (split["dense_mlp"] + split["shared_experts"]) / dense_tp
    ) / layout.pp
    return non_expert, split["experts"] / layout.moe_ranks / layout.pp


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


def runtime_reserve(gpu: catalog.GpuType, layout: Layout) -> tuple[float, str]:
    """GiB per GPU the engine uses beside weights and KV cache, and where the figure comes from.
    SGLang's is the part of the GPU outside its static pool (:func:`sglang_reserve_mib`)."""
    if layout.reserve_gib is not None:
        return layout.reserve_gib, "k2_runtime_reserve_gib"
    if layout.engine == "sglang":
        mib = sglang_reserve_mib(gpu, layout)
        return mib / 1024, f"SGLang {layout.version}'s own heuristic ({mib:,.0f} MiB of {sglang_gpu_mib(gpu):,.0f})"
    source = "measured: vLLM recipe Kimi-K2-Thinking TP8 log on H200 (46.80 GiB KV at 0.9)"
    if layout.engine == "trtllm":
        return VLLM_RUNTIME_GIB, "vLLM's, " + source.split(": ", 1)[1] + "; TensorRT-LLM's own not measured"
    if catalog.version_tuple(layout.version or "0") >= VLLM_CUDA_GRAPHS_COUNTED_SINCE:
        source += "; vLLM >= 0.21 also subtracts its CUDA graph estimate, not measured for Kimi K2"
    return VLLM_RUNTIME_GIB, source


def default_fraction(gpu: catalog.GpuType, layout: Layout) -> tuple[float, str]:
    """The engine's own memory fraction at its pin, and its source."""
    if layout.engine == "sglang":
        mib = sglang_gpu_mib(gpu)
        reserve = layout.reserve_gib * 1024 if layout.reserve_gib is not None else sglang_reserve_mib(gpu, layout)
        return round((mib - reserve) / mib, 3), f"SGLang {layout.version}'s mem_fraction_static, computed as it does"
    if layout.engine == "trtllm":
        return DEFAULT_TRTLLM_FREE_FRACTION, "TensorRT-LLM's KvCacheConfig.free_gpu_memory_fraction default"
    util = VLLM_GPU_UTIL.get(layout.version)
    if util is None:
        return DEFAULT_GPU_UTIL, f"k2fleet's {DEFAULT_GPU_UTIL} (vLLM {layout.version}'s default not read)"
    return util, f"vLLM {layout.version}'s --gpu-memory-utilization default"


def _verified(cap_kv: float, tokens: int, gpu: catalog.GpuType, layout: Layout, fraction: float,
              reserve_source: str) -> str | None:
    for engine, name, tp, dcp, frac, pins, kv, published, line, source in PUBLISHED:
        if (engine, name, tp, dcp) != (layout.engine, gpu.name, layout.tp, layout.dcp):
            continue
        if layout.pp != 1 or layout.dp != 1 or layout.ep != 1 or layout.kv_dtype_bytes != 2 or abs(fraction - frac) > 1e-9:
            continue
        if layout.version not in pins or reserve_source == "k2_runtime_reserve_gib":
            continue
        if abs(cap_kv - kv) <= VERIFY_TOLERANCE * kv and abs(tokens - published) <= VERIFY_TOLERANCE * published:
            return f"{line} ({source})"
    return None


def predict(gpu: catalog.GpuType, arch: catalog.Architecture, quantization: str, checkpoint_bytes: int,
            layout: Layout) -> Capacity:
    """Weights, KV memory and KV tokens of one instance laid out as ``layout`` on ``gpu``."""
    total = gpu.total_gib
    non_expert, experts = (b / catalog.GIB for b in weights_per_gpu(weight_split(arch, quantization, checkpoint_bytes), layout))
    weights = non_expert + experts
    if layout.fraction:
        fraction, fraction_source = layout.fraction, "set by the inventory"
    else:
        fraction, fraction_source = default_fraction(gpu, layout)
    reserve, reserve_source = runtime_reserve(gpu, layout)
    if layout.engine == "sglang":
        overhead = 0.0  # outside the static pool: 1 − mem_fraction_static
        kv = total * fraction - weights
        if layout.fraction:
            reserve_source = f"outside mem_fraction_static ({(1 - fraction) * total:.1f} GiB)"
    elif layout.engine == "trtllm":
        overhead = reserve
        kv = (total - weights - overhead) * fraction
    else:
        overhead = reserve
        kv = total * fraction - weights - overhead
    per_token = math.ceil(arch.mla_bytes_per_token(layout.kv_dtype_bytes) / layout.pp)
    block = BLOCK_TOKENS.get(layout.engine, 1)
    blocks = int(max(kv, 0.0) * catalog.GIB // (per_token * block))
    per_group = blocks * block * layout.dcp
    fits = layout.kv_groups * (per_group // layout.max_len) if layout.max_len else None
    return Capacity(
        engine=layout.engine, gpu=gpu.name, gpu_total_gib=total, fraction=fraction, weights_gib=weights, non_expert_gib=non_expert,
        experts_gib=experts, overhead_gib=overhead, kv_gib=kv, kv_bytes_per_token=per_token,
        tokens_per_kv_group=per_group, kv_groups=layout.kv_groups, tokens=per_group * layout.kv_groups,
        max_len=layout.max_len, concurrency=layout.concurrency, fits=fits,
        fraction_source=fraction_source, reserve_source=reserve_source,
        verified=_verified(kv, per_group * layout.kv_groups, gpu, layout, fraction, reserve_source),
    )
