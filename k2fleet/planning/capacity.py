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

from k2fleet.planning import catalog, engines
from k2fleet.planning.engines.base import DEFAULT_GPU_UTIL
from k2fleet.planning.engines.sglang import sglang_gpu_mib, sglang_reserve_mib
from k2fleet.planning.engines.vllm import VLLM_RUNTIME_GIB

# Each engine's own rules (its fractions with their sources, its runtime reserve, how its ranks
# share attention, experts and the KV cache, its cache blocks) are its package's
# (k2fleet.planning.engines.<name>: the Engine's memory methods); this module is the arithmetic.
__all__ = ["DEFAULT_GPU_UTIL", "VLLM_RUNTIME_GIB", "Capacity", "Layout", "predict", "sglang_gpu_mib",
           "sglang_reserve_mib", "weight_split", "weights_per_gpu"]
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
        return engines.get(self.engine).attn_tp(self)

    @property
    def moe_ranks(self) -> int:
        """GPUs the routed experts are split over."""
        return engines.get(self.engine).moe_ranks(self)

    @property
    def kv_groups(self) -> int:
        """Independent KV caches per instance (each holds whole requests)."""
        return engines.get(self.engine).kv_groups(self)


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
        return engines.get(self.engine).arithmetic(self, total, weights)

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


def runtime_reserve(gpu: catalog.GpuType, layout: Layout) -> tuple[float, str]:
    """GiB per GPU the engine uses beside weights and KV cache, and where the figure comes from.
    SGLang's is the part of the GPU outside its static pool (:func:`sglang_reserve_mib`)."""
    if layout.reserve_gib is not None:
        return layout.reserve_gib, "k2_runtime_reserve_gib"
    return engines.get(layout.engine).runtime_reserve(gpu, layout)


def default_fraction(gpu: catalog.GpuType, layout: Layout) -> tuple[float, str]:
    """The engine's own memory fraction at its pin, and its source."""
    return engines.get(layout.engine).default_fraction(gpu, layout)


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
    engine = engines.get(layout.engine)
    overhead, kv, reserve_source = engine.kv_memory(total, fraction, weights, reserve, layout, reserve_source)
    per_token = math.ceil(arch.mla_bytes_per_token(layout.kv_dtype_bytes) / layout.pp)
    block = engine.block_tokens
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
