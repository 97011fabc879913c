"""Engine flags checked offline against tables extracted from each engine's source.

The tables (``k2fleet/data/engine_flags/<engine>-<version>.json``) are written by
``tools/extract_engine_flags.py``. A pin without a table (TensorRT-LLM today) is not
checked for unknown flags; owned flags are refused everywhere.
"""

from __future__ import annotations

import difflib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from k2fleet.inventory.spec import SpecError

DATA = Path(__file__).parent / "data" / "engine_flags"

# flag -> inventory key that controls it ("" = k2fleet renders it, no key)
_VLLM_OWNED = {
    "--tensor-parallel-size": "k2_tp", "-tp": "k2_tp",
    "--pipeline-parallel-size": "k2_pp", "-pp": "k2_pp",
    "--data-parallel-size": "k2_dp", "-dp": "k2_dp",
    "--data-parallel-size-local": "k2_dp", "-dpl": "k2_dp",
    "--data-parallel-address": "k2_dp", "-dpa": "k2_dp",
    "--data-parallel-rpc-port": "k2_dp_rpc_port", "-dpp": "k2_dp_rpc_port",
    "--data-parallel-start-rank": "k2_dp", "-dpr": "k2_dp",
    "--decode-context-parallel-size": "k2_dcp", "-dcp": "k2_dcp",
    "--enable-expert-parallel": "k2_ep", "-ep": "k2_ep",
    "--headless": "k2_multinode_backend", "--nnodes": "k2_multinode_backend",
    "--node-rank": "k2_multinode_backend", "--master-addr": "k2_multinode_backend",
    "--master-port": "k2_master_port", "--distributed-executor-backend": "k2_multinode_backend",
    "--port": "k2_port", "--host": "", "--model": "k2_model",
    "--served-model-name": "k2_served_model_name",
}
_SGLANG_OWNED = {
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
}
_KT_OWNED = _SGLANG_OWNED | {
    "--kt-weight-path": "k2_gguf_repo", "--kt-method": "k2_kt", "--kt-cpuinfer": "k2_kt",
    "--kt-threadpool-count": "k2_kt", "--kt-num-gpu-experts": "k2_kt",
    "--model_path": "k2_model", "--gguf_path": "k2_gguf_repo", "--optimize_config_path": "k2_kt",
    "--cache_lens": "k2_kt",
}
_TRTLLM_OWNED = {
    "--tp_size": "k2_tp", "--pp_size": "k2_pp", "--ep_size": "k2_ep",
    "--host": "", "--port": "k2_port", "--config": "k2_trtllm_config",
    "--extra_llm_api_options": "k2_trtllm_config",
}
_OWNER_KEYS: dict[str, dict[str, str]] = {
    "vllm": _VLLM_OWNED, "sglang": _SGLANG_OWNED, "ktransformers": _KT_OWNED, "trtllm": _TRTLLM_OWNED,
}
OWNED_FLAGS: dict[str, frozenset[str]] = {e: frozenset(m) for e, m in _OWNER_KEYS.items()}

# keys of the LLM API YAML that k2fleet sets (render/trtllm.py api_options) -> inventory key
LLM_API_OWNED = {
    "tensor_parallel_size": "k2_tp", "pipeline_parallel_size": "k2_pp",
    "moe_expert_parallel_size": "k2_ep", "enable_attention_dp": "k2_attn_dp",
}


@lru_cache(maxsize=None)
def _table(engine: str, version: str) -> dict[str, Any] | None:
    path = DATA / f"{engine}-{version}.json"
    if not path.exists():
        return None
    return json.loads(path.read_text())


def has_table(engine: str, version: str) -> bool:
    """Whether a flag table was extracted for this pin.

    >>> has_table("vllm", "0.33.0"), has_table("vllm", "0.0.1")
    (True, False)
    """
    return _table(engine, version) is not None


@lru_cache(maxsize=None)
def known_flags(engine: str, version: str) -> frozenset[str]:
    """Every option string the engine's parser accepts at ``version``.

    >>> "-tp" in known_flags("vllm", "0.33.0")
    True
    """
    table = _table(engine, version)
    if table is None:
        raise LookupError(f"no flag table for {engine} {version} in {DATA}")
    return frozenset(table["flags"])


def _translated(engine: str, version: str, name: str, value: Any) -> list[str] | None:
    """The words ``render.common.flag_words`` emits when ``name`` is a known rename."""
    from k2fleet.planning.render.common import RENAMED_FLAGS, flag_words  # lazy: render imports deployment

    bare = name.lstrip("-")
    if not any(e == engine and old == bare for e, old, _, _ in RENAMED_FLAGS):
        return None
    words = flag_words(engine, version, bare, True if value in (None, False) else value)
    return [w for w in words if w.startswith("-")]


def check_engine_args(engine: str, version: str, args: dict[str, Any], key: str = "k2_engine_args") -> None:
    """Refuse unknown or k2fleet-owned flags in ``k2_engine_args``.

    >>> check_engine_args("vllm", "0.33.0", {"max-num-seqs": 256})
    >>> check_engine_args("vllm", "0.33.0", {"tensor-paralel-size": 8})
    Traceback (most recent call last):
    ...
    k2fleet.inventory.spec.SpecError: k2_engine_args: --tensor-paralel-size is not a flag of vllm 0.33.0; did you mean --tensor-parallel-size?
    """
    owners = _OWNER_KEYS.get(engine, {})
    for name, value in args.items():
        bare = str(name).lstrip("-")
        flag = ("-" if name.startswith("-") and not name.startswith("--") else "--") + bare
        if flag.startswith("--") and engine == "trtllm":
            flag = "--" + bare.replace("-", "_")
        words = _translated(engine, version, name, value)
        candidates = words if words is not None else [flag]
        for word in candidates:
            for form in (word, word.replace("_", "-") if engine == "vllm" else word):
                if form in owners:
                    where = f" from {owners[form]}" if owners[form] else ""
                    raise SpecError(key, f"{form} is set by k2fleet{where}; remove it from {key}")
            if not has_table(engine, version):
                continue
            flags = known_flags(engine, version)
            check = word.replace("_", "-") if engine == "vllm" and word.startswith("--") else word
            if engine == "vllm" and "." in check:  # --compilation-config.mode=...
                check = check.split(".", 1)[0]
            if check in flags:
                continue
            close = difflib.get_close_matches(check, sorted(flags), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise SpecError(key, f"{check} is not a flag of {engine} {version}{hint}")


def check_llm_api_config(
    version: str,
    config: dict[str, Any],
    key: str = "k2_trtllm_config",
    path: str = "",
    owned_values: dict[str, Any] | None = None,
    schema: dict[str, Any] | None = None,
) -> None:
    """Walk a TensorRT-LLM LLM API options dict against the extracted model tree.

    Keys that k2fleet renames before writing the YAML (``render.trtllm.RENAMED_KEYS``) are
    checked under their new name; a key in ``owned_values`` must equal its value.

    >>> tree = {"extra": "forbid", "fields": {"cuda_graph_config": {"extra": "forbid", "fields": {"enable_padding": None}}}}
    >>> check_llm_api_config("1.2.0", {"cuda_graph_config": {"padding_enabled": True}}, schema=tree)
    >>> check_llm_api_config("1.2.0", {"cuda_graph_config": {"enable_padingg": True}}, schema=tree)
    Traceback (most recent call last):
    ...
    k2fleet.inventory.spec.SpecError: k2_trtllm_config: cuda_graph_config.enable_padingg is not an LLM API option of trtllm 1.2.0; did you mean enable_padding?
    """
    from k2fleet.planning.render.trtllm import RENAMED_KEYS  # lazy: render imports deployment

    if schema is None and not path:
        table = _table("trtllm", version)
        schema = table.get("llm_api") if table else None
    for name, value in config.items():
        dotted = f"{path}.{name}" if path else name
        if not path and owned_values and name in owned_values and value != owned_values[name]:
            owner = LLM_API_OWNED.get(name, "k2fleet")
            raise SpecError(key, f"{name}: {value!r} contradicts {owner}={owned_values[name]!r}; remove it")
        if schema is None:
            continue
        fields = schema.get("fields", {})
        section = path.rsplit(".", 1)[-1] if path else ""
        real = RENAMED_KEYS.get((section, name), name) if path else name
        if real not in fields:
            if schema.get("extra") != "forbid":
                continue
            close = difflib.get_close_matches(real, sorted(fields), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise SpecError(key, f"{dotted} is not an LLM API option of trtllm {version}{hint}")
        sub = fields[real]
        if isinstance(sub, dict) and isinstance(value, dict):
            check_llm_api_config(version, value, key, dotted, None, sub)
