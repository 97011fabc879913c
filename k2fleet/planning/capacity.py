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

KV memory per GPU, by how each engine sizes its cache:

- vLLM: total × ``gpu_memory_utilization`` (default 0.9) − weights − runtime overhead
  (activations of the profile run, CUDA graphs, NCCL and library workspaces);
- SGLang: total × ``mem_fraction_static`` − weights (the static pool is weights + KV; the
  overhead lives outside it); k2fleet's default is the same 0.9;
- TensorRT-LLM: (total − weights − overhead) × ``free_gpu_memory_fraction`` (default 0.9).

KV tokens: MLA caches ``kv_lora_rank + qk_rope_head_dim`` values per token and layer,
whatever the TP size (70,272 bytes in bf16 for Kimi K2; half with an FP8 KV cache); PP
divides the layers, vLLM's decode context parallel (DCP) spreads each sequence's tokens over
``k2_dcp`` ranks, multiplying the tokens by it. Rounded down to whole blocks.

Calibration: the vLLM Kimi-K2-Thinking guide's TP8 log on 8 × H200 ("Available KV cache
memory: 46.80 GiB", "GPU KV cache size: 715,072 tokens"; × 8 = 5,721,088 with DCP8).
With H200's 139.81 GiB × 0.9 and 70.93 GiB of weights per GPU, the runtime overhead that
leaves 46.80 GiB is 8.1 GiB: :data:`RUNTIME_OVERHEAD_GIB` is 8.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from k2fleet.planning import catalog

DEFAULT_GPU_UTIL = 0.9  # vLLM's --gpu-memory-utilization default; k2fleet's for every engine
DEFAULT_TRTLLM_FREE_FRACTION = 0.9  # TensorRT-LLM KvCacheConfig.free_gpu_memory_fraction default
RUNTIME_OVERHEAD_GIB = 8.0  # non-weight, non-KV memory per GPU (calibrated above)
BLOCK_TOKENS = {"vllm": 64, "sglang": 1, "trtllm": 32}  # vLLM: FlashMLA's 64-token blocks; TRT-LLM tokens_per_block


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

    def to_json(self) -> dict[str, Any]:
        return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in asdict(self).items()}

    def arithmetic(self) -> str:
        """How the KV memory per GPU comes about, in the engine's own terms."""
        weights = (f"{self.weights_gib:.2f} GiB weights ({self.non_expert_gib:.2f} attention/dense/embedding + "
                   f"{self.experts_gib:.2f} routed experts)")
        total = f"{self.gpu_total_gib:.2f} GiB {self.gpu}"
        if self.engine == "trtllm":
            return f"({total} − {weights} − {self.overhead_gib:.0f} GiB runtime) × {self.fraction:.2f}"
        runtime = f" − {self.overhead_gib:.0f} GiB runtime" if self.overhead_gib else ""
        return f"{total} × {self.fraction:.2f} − {weights}{runtime}"

    def summary(self) -> str:
        """One line for ``k2fleet plan``."""
        line = f"{self.tokens:,} KV tokens per instance ({self.kv_gib:.2f} GiB KV per GPU = {self.arithmetic()}"
        line += f"; {self.kv_bytes_per_token:,} B/token"
        if self.kv_groups > 1:
            line += f"; {self.kv_groups} caches of {self.tokens_per_kv_group:,}"
        line += ")"
        if self.max_len:
            line += f"; {self.fits:,} requests of {self.max_len:,} tokens fit at once (need {self.concurrency})"
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


def predict(gpu: catalog.GpuType, arch: catalog.Architecture, quantization: str, checkpoint_bytes: int,
            layout: Layout) -> Capacity:
    """Weights, KV memory and KV tokens of one instance laid out as ``layout`` on ``gpu``."""
    total = gpu.total_gib
    non_expert, experts = (b / catalog.GIB for b in weights_per_gpu(weight_split(arch, quantization, checkpoint_bytes), layout))
    weights = non_expert + experts
    if layout.engine == "sglang":
        fraction = layout.fraction or DEFAULT_GPU_UTIL
        overhead = 0.0
        kv = total * fraction - weights
    elif layout.engine == "trtllm":
        fraction = layout.fraction or DEFAULT_TRTLLM_FREE_FRACTION
        overhead = RUNTIME_OVERHEAD_GIB
        kv = (total - weights - overhead) * fraction
    else:
        fraction = layout.fraction or DEFAULT_GPU_UTIL
        overhead = RUNTIME_OVERHEAD_GIB
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
    )
