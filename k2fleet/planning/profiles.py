"""Tuning profiles (``k2_profile``): the seeds' low-latency, high-throughput and long-context
settings as one key, per engine, rendered for the pinned version (pure).

A profile is a table of engine flags (vLLM, SGLang, KTransformers ≥ 0.7 through sglang-kt)
or TensorRT-LLM LLM API options, each row with the seed section it comes from. The
renderers put a profile's flags *under* the pool's ``k2_engine_args`` (TRT-LLM: its options
under ``k2_trtllm_config``, merged per section): a flag or option the inventory sets itself
wins, and ``k2fleet plan`` lists what it overrode. Flags k2fleet owns (parallelism, port,
model, ``k2_gpu_memory_utilization``, ``enable_attention_dp``) are never in a profile. Flag
names renamed between pins are translated by :func:`k2fleet.planning.render.common.flag_words`
(SGLang 0.5.23: ``--cuda-graph-max-bs`` → ``--cuda-graph-max-bs-decode``), and every
rendered flag is checked against the pin's flag table (:mod:`k2fleet.planning.engine_flags`,
key ``k2_profile``). No profile changes the context length: ``long-context`` keeps the
model's full context (``k2_max_model_len`` still caps it, and the KV-cache capacity check of
:mod:`k2fleet.planning.capacity` holds it to ``k2_expected_concurrency`` requests, refusing in
its one line when it cannot).

Seeds (``shared/seeds``): [vllm-k2] vLLM's *moonshotai/Kimi-K2 Usage Guide*, "Additional
flags"; [k2-thinking-summary] the *Kimi-K2-Thinking Deployment Summary*, "Configuration
Details" and "Optional Tuning"; [trtllm-blackwell] TensorRT-LLM's *Deployment Guide for Kimi
K2 Thinking on TensorRT LLM - Blackwell*, "Launch the TensorRT LLM Server" and its SLURM
``worker_config``; [moonshot-deploy] Moonshot's *Kimi-K2 Deployment Guide*, "SGLang
Deployment" and "TensorRT-LLM Deployment". SGLang has no single-instance tuning in the
seeds: its rows say so where the value is k2fleet's own.

>>> flags("vllm", "0.33.0", "latency")
{'max-num-batched-tokens': 8192}
>>> flags("vllm", "0.33.0", "default")
{}
>>> merged_args("vllm", "0.33.0", "throughput", {"--max-num-batched-tokens": 65536})
{'--max-num-batched-tokens': 65536}
>>> merged_llm_api("1.2.0", "throughput", {"kv_cache_config": {"dtype": "auto"}})["kv_cache_config"]
{'free_gpu_memory_fraction': 0.75, 'dtype': 'auto'}
"""

from __future__ import annotations

import copy
from typing import Any

from k2fleet.planning.catalog import version_tuple

PROFILES = ("default", "latency", "throughput", "long-context")
KEY = "k2_profile"
LEGACY_KT_BEFORE = (0, 4, 0)  # KTransformers' legacy server (render.ktransformers.SGLANG_KT_SINCE)

# (engine, profile) -> [(flag, value, source)]; flags spelt as the oldest supported pin spells them.
_VLLM = {
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
_SGLANG = {
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
# TensorRT-LLM 1.2.0: LLM API options (the --config YAML), never enable_attention_dp (k2_attn_dp owns it).
_CUDA_GRAPH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]  # [moonshot-deploy] TensorRT-LLM Deployment, cuda_graph_config
_TRTLLM = {
    "latency": [
        ("max_batch_size", 32, "k2fleet's choice: the seed's CUDA-graph batch list cut at 32"),
        ("max_num_tokens", 4096, "[moonshot-deploy] TensorRT-LLM Deployment: --max_num_tokens 4096"),
        ("cuda_graph_config", {"enable_padding": True, "batch_sizes": _CUDA_GRAPH_SIZES[:6]},
         "[moonshot-deploy] TensorRT-LLM Deployment: cuda_graph_config padding_enabled (1.2: enable_padding), "
         "batch_sizes up to 32"),
    ],
    "throughput": [
        ("max_batch_size", 128, "[trtllm-blackwell] Launch the TensorRT LLM Server: max_batch_size: 128"),
        ("max_num_tokens", 8448, "[trtllm-blackwell] Launch the TensorRT LLM Server: max_num_tokens: 8448"),
        ("kv_cache_config", {"free_gpu_memory_fraction": 0.75, "dtype": "fp8"},
         "[trtllm-blackwell] Launch the TensorRT LLM Server: kv_cache_config free_gpu_memory_fraction 0.75, dtype fp8"),
        ("cuda_graph_config", {"enable_padding": True, "batch_sizes": _CUDA_GRAPH_SIZES},
         "[moonshot-deploy] TensorRT-LLM Deployment: cuda_graph_config, batch_sizes 1..128"),
    ],
    "long-context": [
        ("enable_chunked_prefill", True, "[k2-thinking-summary] chunked prefill, essential for long contexts "
         "(TRT-LLM's enable_chunked_prefill)"),
        ("max_num_tokens", 8448, "[trtllm-blackwell] SLURM worker_config ctx: max_num_tokens 8448"),
        ("kv_cache_config", {"dtype": "fp8"}, "[trtllm-blackwell] kv_cache_config dtype fp8: half the KV bytes per token"),
    ],
}
TABLES: dict[str, dict[str, list[tuple[str, Any, str]]]] = {
    "vllm": _VLLM, "sglang": _SGLANG, "ktransformers": _SGLANG, "trtllm": _TRTLLM,
}


def refusal(engine: str, version: str, profile: str) -> str | None:
    """Why ``profile`` cannot be rendered for this pin (one line), or None."""
    if profile == "default":
        return None
    if engine == "ktransformers" and version_tuple(version) < LEGACY_KT_BEFORE:
        return (f"{profile}: KTransformers {version}'s legacy server has no tuning flags k2fleet renders "
                "(only --cache_lens, k2_kt.cache_lens); use default, or pin KTransformers >= 0.7 (sglang-kt)")
    return None


def rows(engine: str, profile: str) -> list[tuple[str, Any, str]]:
    """The profile's table rows for ``engine``: (flag or option, value, source)."""
    return list(TABLES.get(engine, {}).get(profile, []))


def flags(engine: str, version: str, profile: str) -> dict[str, Any]:
    """The profile's engine flags (``{name: value}``, as ``k2_engine_args`` spells them)."""
    if engine == "trtllm" or refusal(engine, version, profile):
        return {}
    return {name: copy.deepcopy(value) for name, value, _ in rows(engine, profile)}


def llm_api(version: str, profile: str) -> dict[str, Any]:
    """TensorRT-LLM: the profile's LLM API options."""
    return {name: copy.deepcopy(value) for name, value, _ in rows("trtllm", profile)}


def _norm(name: str) -> str:
    return name.lstrip("-").replace("_", "-")


def merged_args(engine: str, version: str, profile: str, user: dict[str, Any]) -> dict[str, Any]:
    """The profile's flags under the inventory's ``k2_engine_args``: a flag set there (however spelt) wins."""
    mine = {_norm(k) for k in user}
    base = {k: v for k, v in flags(engine, version, profile).items() if _norm(k) not in mine}
    return base | dict(user)


def _deep(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def merged_llm_api(version: str, profile: str, user: dict[str, Any]) -> dict[str, Any]:
    """The profile's LLM API options under ``k2_trtllm_config``, merged per section (a
    ``cuda_graph_config: null`` there removes the profile's section)."""
    return _deep(llm_api(version, profile), user)


def overridden(engine: str, version: str, profile: str, user_args: dict[str, Any],
               user_config: dict[str, Any]) -> list[str]:
    """Profile settings the inventory overrides (``k2fleet plan`` names them)."""
    if engine == "trtllm":
        out = []
        for name, value, _ in rows(engine, profile):
            if name in user_config:
                if isinstance(value, dict) and isinstance(user_config[name], dict):
                    out += [f"{name}.{k}" for k in value if k in user_config[name]]
                else:
                    out.append(name)
        return out
    mine = {_norm(k) for k in user_args}
    return [name for name in flags(engine, version, profile) if _norm(name) in mine]


def describe(engine: str, version: str, profile: str, user_args: dict[str, Any] | None = None,
             user_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """``k2fleet plan --json``'s ``profile``: name, the settings with their sources, what the inventory overrode."""
    return {
        "name": profile,
        "settings": [{"name": n, "value": v, "source": src} for n, v, src in rows(engine, profile)]
        if not refusal(engine, version, profile) else [],
        "overridden": overridden(engine, version, profile, user_args or {}, user_config or {}),
    }
