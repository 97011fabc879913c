"""Tuning profiles (``k2_profile``): the seeds' low-latency, high-throughput and long-context
settings as one key, per engine, rendered for the pinned version (pure).

A profile is a table of engine flags (vLLM, SGLang, KTransformers ≥ 0.7 through sglang-kt)
or TensorRT-LLM LLM API options, each row with the seed section it comes from. The
renderers put a profile's flags *under* the pool's ``k2_engine_args`` (TRT-LLM: its options
under ``k2_trtllm_config``, merged per section): a flag or option the inventory sets itself
wins, and ``k2fleet plan`` lists what it overrode. Flags k2fleet owns (parallelism, port,
model, ``k2_gpu_memory_utilization``, ``enable_attention_dp``) are never in a profile. Flag
names renamed between pins are translated by the engine (:meth:`~k2fleet.planning.engines.base.Engine.flag_words`)
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
>>> merged_llm_api("trtllm", "1.2.0", "throughput", {"kv_cache_config": {"dtype": "auto"}})["kv_cache_config"]
{'free_gpu_memory_fraction': 0.75, 'dtype': 'auto'}
"""

from __future__ import annotations

from typing import Any

from k2fleet.planning import engines
from k2fleet.planning.engines.base import norm_flag as _norm

PROFILES = ("default", "latency", "throughput", "long-context")
KEY = "k2_profile"
# Each engine's rows are its own (``PROFILE_ROWS`` of k2fleet.planning.engines.<name>, asked as
# ``Engine.profile_rows``): (flag or option, value, source), flags spelt as the oldest supported pin
# spells them; KTransformers >= 0.7 takes SGLang's (sglang-kt), TensorRT-LLM LLM API options.
TABLES: dict[str, dict[str, list[tuple[str, Any, str]]]] = {name: e.profile_rows for name, e in engines.ENGINES.items()}


def refusal(engine: str, version: str, profile: str) -> str | None:
    """Why ``profile`` cannot be rendered for this pin (one line), or None."""
    if profile == "default":
        return None
    return engines.get(engine).profile_refusal(version, profile)


def rows(engine: str, profile: str) -> list[tuple[str, Any, str]]:
    """The profile's table rows for ``engine``: (flag or option, value, source)."""
    return list(TABLES.get(engine, {}).get(profile, []))


def flags(engine: str, version: str, profile: str) -> dict[str, Any]:
    """The profile's engine flags (``{name: value}``, as ``k2_engine_args`` spells them)."""
    return engines.get(engine).profile_flags(version, profile)


def llm_api(engine: str, version: str, profile: str) -> dict[str, Any]:
    """The profile's LLM API options (TensorRT-LLM; none for engines that take flags)."""
    return engines.get(engine).profile_llm_api(version, profile)


def merged_args(engine: str, version: str, profile: str, user: dict[str, Any]) -> dict[str, Any]:
    """The profile's flags under the inventory's ``k2_engine_args``: a flag set there (however spelt) wins."""
    return engines.get(engine).merged_args(version, profile, user)


def merged_llm_api(engine: str, version: str, profile: str, user: dict[str, Any]) -> dict[str, Any]:
    """The profile's LLM API options under ``k2_trtllm_config``, merged per section (a
    ``cuda_graph_config: null`` there removes the profile's section)."""
    return engines.get(engine).merged_llm_api(version, profile, user)


def overridden(engine: str, version: str, profile: str, user_args: dict[str, Any],
               user_config: dict[str, Any]) -> list[str]:
    """Profile settings the inventory overrides (``k2fleet plan`` names them)."""
    if engines.get(engine).llm_api:
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
