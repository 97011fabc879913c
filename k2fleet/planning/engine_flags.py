"""Engine flags checked offline against tables extracted from each engine's source.

The tables (``k2fleet/planning/data/engine_flags/<engine>-<version>.json``) are written by
``tools/extract_engine_flags.py`` (vLLM, SGLang, KTransformers, from their wheels or tags) and
``tools/extract_trtllm_docs.py`` (TensorRT-LLM 1.2.0, from its documentation build: the
``trtllm-serve serve`` options, their aliases, and the LLM API model tree under ``llm_api``).
A pin without a table is not checked for unknown flags; owned flags are refused everywhere.

Every flag a renderer emits is one ``k2_engine_args`` may not set (:func:`owned_flags`): the
engine's ``owned_flags`` always (its renderer's ``OWNED_FLAGS``), its ``keyed_flags(dep, pool)`` where the key that renders them
is set (``--max-model-len`` with ``k2_max_model_len``, SGLang's DP-attention companions with
``k2_attn_dp``...), and the model's own deployment flags; the refusal is one line naming the flag
and the key that owns it. ``k2_moe_a2a_backend`` is checked against the engine's ``a2a_backends``
(:data:`A2A_BACKENDS`, read from each pin's source), and DeepEP across nodes needs ``k2_ib_hcas`` on every host of the instance.
"""

from __future__ import annotations

import difflib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from k2fleet.inventory.spec import SpecError
from k2fleet.planning import catalog, engines, profiles
from k2fleet.planning.deployment import Deployment, Pool
from k2fleet.planning.engines.trtllm.render import LLM_API_OWNED, RENAMED_KEYS

DATA = Path(__file__).parent / "data" / "engine_flags"

# Each engine declares the flags its renderer owns beside the words it emits (flag -> the inventory key
# that controls it, "" = k2fleet renders it, no key); this module only checks against them.
OWNED_FLAGS: dict[str, frozenset[str]] = {name: frozenset(e.owned_flags) for name, e in engines.ENGINES.items()}


def owned_flags(dep: Deployment, pool: Pool) -> dict[str, str]:
    """Every flag k2fleet renders for ``pool`` (flag -> the inventory key that sets it, "" none):
    the renderer's owned flags, those its keys turn on for this pool, and the model's deployment
    flags (catalog ``engine_args``). ``k2_engine_args`` may set none of them."""
    out = dict(dep.engine_impl.owned_flags) | dep.engine_impl.keyed_flags(dep, pool)
    for word in dep.model_args:
        if word.startswith("-"):
            out.setdefault(word, "k2_model")
    return out


# The all-to-all backends of expert parallel each pin accepts (k2_moe_a2a_backend): (engine, version) ->
# (choices, source), each engine's own table (``Engine.a2a_backends``, read from its source).
A2A_BACKENDS: dict[tuple[str, str], tuple[tuple[str, ...], str]] = {
    (name, version): known for name, e in engines.ENGINES.items() for version, known in e.a2a_backends.items()}


def a2a_backend(dep: Deployment, pool: Pool) -> str | None:
    """The all-to-all backend ``pool`` runs with (None: the engine's own default)."""
    return dep.engine_impl.a2a_backend(pool)


def _check_a2a(dep: Deployment, pool: Pool) -> None:
    """``k2_moe_a2a_backend`` per engine and pin; DeepEP across nodes only over RDMA."""
    s = pool.settings
    key = "k2_moe_a2a_backend"
    if pool.role in ("router", "slurm-submit"):
        return  # no engine of its own
    engine = dep.engine_impl
    if s.moe_a2a_backend is not None:
        if engine.a2a_refusal is not None:
            raise SpecError(key, f"{dep.engine} takes no all-to-all backend from k2fleet ({engine.a2a_refusal}); remove it")
        known = engine.a2a_backends.get(dep.version)
        if known and s.moe_a2a_backend not in known[0]:
            raise SpecError(key, f"{s.moe_a2a_backend} is not an all-to-all backend of {dep.engine} {dep.version} "
                            f"(one of {', '.join(known[0])}; {known[1]})")
        if engine.a2a_env is not None and engine.a2a_env in s.env:
            raise SpecError("k2_env", f"{engine.a2a_env} is set by k2fleet from {key}; remove it from k2_env")
    backend = a2a_backend(dep, pool)
    if not backend or not backend.startswith("deepep") or dep.s.simulated_gpus:
        return  # simulated GPUs (the sandbox): the engine test doubles run no all-to-all, and hosts have no HCA
    for nodes in pool.instances:
        bare = [h.name for h in nodes if not h.settings.ib_hcas]
        if len(nodes) > 1 and bare:
            raise SpecError("k2_ib_hcas", f"{pool.role} instance {nodes[0].name}..{nodes[-1].name}: DeepEP ({backend}"
                            + ("" if s.moe_a2a_backend else ", k2fleet's default for SGLang expert parallel")
                            + f") across {len(nodes)} nodes needs RDMA, but {', '.join(bare)} list no HCA; set k2_ib_hcas "
                            "on every host of the instance, or choose another k2_moe_a2a_backend")


def _check_addresses(dep: Deployment, pool: Pool) -> None:
    """Each instance's addresses against what the engine can name them in (TensorRT-LLM's
    ``mpirun -H HOST:SLOTS`` takes no IPv6 address)."""
    for nodes in pool.instances:
        refused = dep.engine_impl.instance_address_refusal(nodes)
        if refused:
            raise SpecError(*refused)



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


def _same_option(engine: str, version: str, flag: str) -> list[str]:
    """``flag`` and the other names of the same option (TensorRT-LLM's click aliases).

    >>> _same_option("trtllm", "1.2.0", "--tensor_parallel_size")
    ['--tensor_parallel_size', '--tp_size']
    """
    table = _table(engine, version) or {}
    for names in table.get("aliases", ()):
        if flag in names:
            return [flag] + [n for n in names if n != flag]
    return [flag]


def _translated(engine: str, version: str, name: str, value: Any) -> list[str] | None:
    """The words the engine renders for ``name`` when it is a known rename (``Engine.flag_words``)."""
    bare = name.lstrip("-")
    eng = engines.get(engine)
    if not any(old == bare for old, _, _ in eng.renamed_flags):
        return None
    words = eng.flag_words(version, bare, True if value in (None, False) else value)
    return [w for w in words if w.startswith("-")]


def check_engine_args(engine: str, version: str, args: dict[str, Any], key: str = "k2_engine_args",
                      owned: dict[str, str] | None = None) -> None:
    """Refuse unknown or k2fleet-owned flags in ``k2_engine_args``.

    >>> check_engine_args("vllm", "0.33.0", {"max-num-seqs": 256})
    >>> check_engine_args("vllm", "0.33.0", {"tensor-paralel-size": 8})
    Traceback (most recent call last):
    ...
    k2fleet.inventory.spec.SpecError: k2_engine_args: --tensor-paralel-size is not a flag of vllm 0.33.0; did you mean --tensor-parallel-size?
    >>> check_engine_args("trtllm", "1.2.0", {"kv_cache_free_gpu_memory_fraction": 0.9})
    >>> check_engine_args("trtllm", "1.2.0", {"max-num-token": 4096})
    Traceback (most recent call last):
    ...
    k2fleet.inventory.spec.SpecError: k2_engine_args: --max_num_token is not a flag of trtllm 1.2.0; did you mean --max_num_tokens?
    >>> check_engine_args("trtllm", "1.2.0", {"tensor_parallel_size": 8})
    Traceback (most recent call last):
    ...
    k2fleet.inventory.spec.SpecError: k2_engine_args: --tensor_parallel_size is set by k2fleet from k2_tp (as --tp_size); remove it from k2_engine_args
    """
    eng = engines.get(engine)
    owners = eng.owned_flags if owned is None else owned
    for name, value in args.items():
        bare = str(name).lstrip("-")
        flag = ("-" if name.startswith("-") and not name.startswith("--") else "--") + bare
        if flag.startswith("--") and eng.flag_dash == "_":
            flag = "--" + bare.replace("-", "_")
        words = _translated(engine, version, name, value)
        candidates = words if words is not None else [flag]
        for word in candidates:
            for form in eng.flag_forms(word):
                for same in _same_option(engine, version, form):
                    if same in owners:
                        where = f" from {owners[same]}" if owners[same] else ""
                        alias = f" (as {same})" if same != form else ""
                        shown = flag if words is not None and form != flag else form
                        via = f" (as {form})" if shown != form and not alias else ""
                        raise SpecError(key, f"{shown} is set by k2fleet{where}{alias}{via}; remove it from {key}")
            if not has_table(engine, version):
                continue
            flags = known_flags(engine, version)
            check = eng.table_flag(word)
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

    Keys that k2fleet renames before writing the YAML (``engines.trtllm.render.RENAMED_KEYS``) are
    checked under their new name; a key in ``owned_values`` must equal its value.

    >>> tree = {"extra": "forbid", "fields": {"cuda_graph_config": {"extra": "forbid", "fields": {"enable_padding": None}}}}
    >>> check_llm_api_config("1.2.0", {"cuda_graph_config": {"padding_enabled": True}}, schema=tree)
    >>> check_llm_api_config("1.2.0", {"cuda_graph_config": {"enable_padingg": True}}, schema=tree)
    Traceback (most recent call last):
    ...
    k2fleet.inventory.spec.SpecError: k2_trtllm_config: cuda_graph_config.enable_padingg is not an LLM API option of trtllm 1.2.0; did you mean enable_padding?
    >>> check_llm_api_config("1.2.0", {"kv_cache_config": {"free_gpu_memory_fracton": 0.8}})
    Traceback (most recent call last):
    ...
    k2fleet.inventory.spec.SpecError: k2_trtllm_config: kv_cache_config.free_gpu_memory_fracton is not an LLM API option of trtllm 1.2.0; did you mean free_gpu_memory_fraction?
    """
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


def _check_model_args(dep: Deployment) -> None:
    """The flags the model's deployment adds (catalog ``engine_args``, e.g. K2.5's
    ``--mm-encoder-tp-mode``) must exist at the pinned version."""
    if not dep.model_args or not has_table(dep.engine, dep.version):
        return
    flags = known_flags(dep.engine, dep.version)
    for word in dep.model_args:
        if word.startswith("-") and word not in flags:
            newer = [v for v in catalog.ENGINE_VERSIONS[dep.engine] if has_table(dep.engine, v) and word in known_flags(dep.engine, v)]
            raise SpecError("k2_engine_version", f"{dep.engine} {dep.version} has no {word}, which {dep.s.model}'s "
                            f"deployment needs; use {' or '.join(newer) if newer else 'a newer pin'}")


def check_deployment(dep: Deployment) -> None:
    """Flag names of ``k2_engine_args`` (every pool) and TRT-LLM LLM API option names
    (``k2_trtllm_config``, both ``k2_disagg`` sides) against the pinned version's tables;
    raises SpecError naming the key (the planner's first step)."""
    try:
        _check_model_args(dep)
        if dep.engine_impl.llm_api:
            check_llm_api_config(dep.version, profiles.llm_api(dep.engine, dep.version, dep.s.profile), key=profiles.KEY)
        else:
            check_engine_args(dep.engine, dep.version, profiles.flags(dep.engine, dep.version, dep.s.profile),
                              key=profiles.KEY)
        for pool in dep.pools.values():
            s = pool.settings
            _check_a2a(dep, pool)
            _check_addresses(dep, pool)
            check_engine_args(dep.engine, dep.version, s.engine_args, key="k2_engine_args", owned=owned_flags(dep, pool))
            if not dep.engine_impl.llm_api:
                continue
            if s.trtllm_config and pool.tp:
                owned = {"tensor_parallel_size": pool.tp, "pipeline_parallel_size": pool.pp,
                         "moe_expert_parallel_size": pool.ep, "enable_attention_dp": s.attn_dp}
                check_llm_api_config(dep.version, s.trtllm_config, key="k2_trtllm_config", owned_values=owned)
            for side in ("ctx", "gen"):
                if s.disagg and side in s.disagg:
                    check_llm_api_config(dep.version, s.disagg[side], key=f"k2_disagg.{side}")
    except SpecError as exc:
        raise SpecError(exc.key, exc.message, exc.where or dep.fleet.source) from None
