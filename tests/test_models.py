"""Issue #25: the Kimi models people deploy now (K2-Instruct-0905, K2.5, K2.6, K3), offline.

Every model × engine pair the catalog's sources list plans (and its argv passes the pinned
engine's flag table); what cannot serve a model is refused in one line naming the key;
the K2-architecture models' capacity arithmetic is K2's; K3, whose KV layout k2fleet's
sources do not give, is planned without a KV prediction and the plan says so.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from k2fleet.cli import load_plan
from k2fleet.inventory.spec import SpecError
from k2fleet.planning import capacity, catalog, deployment
from k2fleet.planning.engine_flags import has_table, known_flags
from k2sandbox.checkpoint_cache import checkpoint_style
from tests.inventory_factory import write_inventory

K0905 = {"k2_model": "moonshotai/Kimi-K2-Instruct-0905", "k2_revision": "9" * 40}
K25 = {"k2_model": "moonshotai/Kimi-K2.5", "k2_revision": "5" * 40}
K26 = {"k2_model": "moonshotai/Kimi-K2.6", "k2_revision": "6" * 40}
K3 = {"k2_model": "moonshotai/Kimi-K3", "k2_revision": "3" * 40}

ENGINE_ENTRY = {"vllm": "serve", "sglang": "sglang.launch_server", "trtllm": "trtllm-serve"}


def _plan(tmp_path: Path, hosts: int, **data: Any):
    hosts_list = [(f"node-{i}", {"ssh_hostname": f"192.0.2.{10 + i}"}) for i in range(hosts)]
    return load_plan(str(write_inventory(tmp_path, hosts_list, **data)))


def _engine_words(argv: list[str]) -> list[str]:
    for i, word in enumerate(argv):
        if os.path.basename(word) in ("serve", "trtllm-serve", "sglang.launch_server"):
            return argv[i + 1:]
    return []


# model × engine × GPU pairs the sources list (docs/engines.md, "Kimi models"): (id, data, hosts)
PAIRS = [
    ("0905-vllm-h200-tp8pp2", K0905 | {"k2_tp": 8, "k2_pp": 2, "k2_multinode_backend": "mp",
                                       "k2_max_model_len": 131072}, 2),
    ("0905-sglang-h200-tp16", K0905 | {"k2_engine": "sglang", "k2_tp": 16, "k2_max_model_len": 131072}, 2),
    ("0905-trtllm-b200-tp8", K0905 | {"k2_engine": "trtllm", "k2_gpu": "b200", "k2_tp": 8,
                                      "k2_max_model_len": 32768}, 1),
    ("k25-vllm-h200-tp8", K25 | {"k2_tp": 8}, 1),
    ("k26-vllm-h200-tp8", K26 | {"k2_tp": 8}, 1),
    ("k26-vllm-b200-tp8", K26 | {"k2_gpu": "b200", "k2_tp": 8}, 1),
    ("k3-sglang-h200-2x8", K3 | {"k2_engine": "sglang", "k2_tp": 16}, 2),
    ("k3-sglang-b300-1x8", K3 | {"k2_engine": "sglang", "k2_gpu": "b300", "k2_tp": 8}, 1),
    ("k3-sglang-h100-4x8", K3 | {"k2_engine": "sglang", "k2_gpu": "h100", "k2_tp": 32}, 4),
    ("k3-sglang-gb200-4x4", K3 | {"k2_engine": "sglang", "k2_gpu": "gb200", "k2_tp": 16,
                                                     "k2_dist_init_port": 50001}, 4),  # 50000: IMEX's
    ("k3-vllm-b300-tp8", K3 | {"k2_gpu": "b300", "k2_tp": 8}, 1),
    ("k3-vllm-h200-tp8pp2", K3 | {"k2_tp": 8, "k2_pp": 2, "k2_multinode_backend": "mp"}, 2),
    ("k3-trtllm-b200-2x8", K3 | {"k2_engine": "trtllm", "k2_gpu": "b200", "k2_tp": 16}, 2),
]


@pytest.mark.parametrize("data,hosts", [p[1:] for p in PAIRS], ids=[p[0] for p in PAIRS])
def test_listed_pairs_plan_and_pass_the_flag_tables(tmp_path: Path, data: dict, hosts: int) -> None:
    dep, plan = _plan(tmp_path, hosts, **data)
    known = catalog.CHECKPOINTS[data["k2_model"]]
    seen = []
    for _, service in plan.services():
        words = _engine_words(list(service.argv))
        if not words:
            continue
        seen.append(words)
        if has_table(dep.engine, dep.version):
            flags = known_flags(dep.engine, dep.version)
            for w in words:
                if w.startswith("-") and not w.lstrip("-").replace(".", "").isdigit():
                    assert w in flags, f"{w} unknown to {dep.engine} {dep.version}"
    assert seen
    tool = "--tool_parser" if dep.engine == "trtllm" else "--tool-call-parser"
    for words in seen:
        assert words[words.index(tool) + 1] == known.tool_parser
        if dep.engine != "trtllm" and known.reasoning_parser:
            assert words[words.index("--reasoning-parser") + 1] == known.reasoning_parser
        if dep.engine in (known.engine_args or {}):  # K2.5/K2.6 on vLLM; not K3 (its sources name no such flag)
            assert words[words.index("--mm-encoder-tp-mode") + 1] == "data"
        else:
            assert "--mm-encoder-tp-mode" not in words


def test_k25_k26_render_moonshots_vllm_argv(tmp_path: Path) -> None:
    """Moonshot's guide: ``-tp 8 --mm-encoder-tp-mode data --trust-remote-code
    --tool-call-parser kimi_k2 --reasoning-parser kimi_k2``."""
    for model in (K25, K26):
        _, plan = _plan(tmp_path / model["k2_model"].rsplit("/", 1)[1], 1, **model, k2_tp=8)
        (_, svc), = plan.services()
        words = _engine_words(list(svc.argv))
        for pair in (["--tensor-parallel-size", "8"], ["--mm-encoder-tp-mode", "data"], ["--tool-call-parser", "kimi_k2"],
                     ["--reasoning-parser", "kimi_k2"]):
            i = words.index(pair[0])
            assert words[i:i + 2] == pair
        assert "--trust-remote-code" in words


def test_k3_is_planned_without_a_kv_prediction_and_says_so(tmp_path: Path) -> None:
    dep, plan = _plan(tmp_path, 2, **K3, k2_engine="sglang", k2_tp=16)
    assert plan.capacity == {} and dep.capacity == {}
    assert any("no KV cache prediction" in n and "KDA" in n for n in plan.notes)
    assert any("attention heads" in n for n in plan.notes)
    assert plan.to_json()["notes"] == plan.notes


def test_k3_catalog_records_unknowns_not_guesses() -> None:
    k3 = catalog.CHECKPOINTS["moonshotai/Kimi-K3"]
    assert k3.arch is None and k3.heads is None and k3.max_context is None
    assert k3.experts == 896 and k3.bytes == 1_560_000_000_000 and k3.quantization == "mxfp4"
    assert k3.engines == {"vllm": "0.27.0", "sglang": "0.5.17", "trtllm": None}
    assert k3.model_type == "kimi_k3" and k3.multimodal  # vLLM's and SGLang's KimiK3Config (vision_config)
    assert {"layers", "kv_lora_rank", "KDA state size", "attention heads"} <= set(k3.unknown)
    assert "not re-fetched" in k3.sources


def test_catalog_parsers_are_registered_from_the_first_serving_version() -> None:
    """Every parser a newer model's deployment names is registered (catalog.KIMI_PARSERS, read in
    the engines' wheels) at each version read from its first serving version on, and not before
    it where that version was read too (kimi_k3: vLLM 0.26.0, SGLang 0.5.16)."""
    newer = ("moonshotai/Kimi-K2.5", "moonshotai/Kimi-K2.6", "moonshotai/Kimi-K3")
    for repo in newer:
        c = catalog.CHECKPOINTS[repo]
        for (engine, version), (tools, reasonings) in catalog.KIMI_PARSERS.items():
            least = (c.engines or {}).get(engine)
            if least is None or catalog.version_tuple(version) < catalog.version_tuple(least):
                continue
            assert c.tool_parser in tools, (repo, engine, version)
            assert c.reasoning_parser in reasonings, (repo, engine, version)
    k3 = catalog.CHECKPOINTS["moonshotai/Kimi-K3"]
    for engine, before in (("vllm", "0.26.0"), ("sglang", "0.5.16")):
        tools, reasonings = catalog.KIMI_PARSERS[(engine, before)]
        assert k3.tool_parser not in tools and k3.reasoning_parser not in reasonings
    for engine, versions in catalog.ENGINE_VERSIONS.items():  # the default pins were read too
        if engine in ("vllm", "sglang"):
            assert (engine, versions[0]) in catalog.KIMI_PARSERS


def test_every_catalog_entry_names_its_sources() -> None:
    for c in catalog.CHECKPOINTS.values():
        assert c.sources, c.repo_id


REFUSALS = [
    ("k3-ktransformers", K3 | {"k2_engine": "ktransformers", "k2_engine_version": "0.7.2", "k2_gpu": "h200"}, 1,
     "k2_engine", "is not served by ktransformers"),
    ("k3-trtllm-h200", K3 | {"k2_engine": "trtllm", "k2_tp": 16}, 2, "k2_gpu", "Blackwell GPUs only"),
    ("k3-trtllm-h100", K3 | {"k2_engine": "trtllm", "k2_gpu": "h100", "k2_tp": 32}, 4, "k2_gpu", "Blackwell GPUs only"),
    ("k3-trtllm-h20", K3 | {"k2_engine": "trtllm", "k2_gpu": "h20", "k2_tp": 32}, 4, "k2_gpu", "Blackwell GPUs only"),
    ("k3-vllm-0.11", K3 | {"k2_engine_version": "0.11.0", "k2_tp": 8, "k2_pp": 2}, 2, "k2_engine_version",
     "vllm >= 0.27.0"),
    ("k3-sglang-0.5.4", K3 | {"k2_engine": "sglang", "k2_engine_version": "0.5.4", "k2_tp": 16}, 2,
     "k2_engine_version", "sglang >= 0.5.17"),
    ("k3-h200-one-node", K3 | {"k2_engine": "sglang", "k2_tp": 8}, 1, "k2_tp", "needs 16 GPUs per instance"),
    ("k3-gb200-two-trays", K3 | {"k2_engine": "sglang", "k2_gpu": "gb200", "k2_tp": 8}, 2, "k2_tp",
     "needs 16 GPUs per instance"),
    ("k3-h20-one-node", K3 | {"k2_tp": 8, "k2_gpu": "h20"}, 1, "k2_tp", "less than the 1,560 GB checkpoint"),
    ("k3-ep-not-dividing-896", K3 | {"k2_tp": 8, "k2_gpu": "b300", "k2_dp": 3, "k2_ep": 24}, 3, "k2_ep",
     "896 routed experts"),
    ("k25-sglang", K25 | {"k2_engine": "sglang", "k2_tp": 8}, 1, "k2_engine", "use vllm"),
    ("k25-vllm-0.10", K25 | {"k2_tp": 8, "k2_engine_version": "0.10.0"}, 1, "k2_engine_version",
     "vllm >= 0.15.0"),
    ("k25-vllm-0.11", K25 | {"k2_tp": 8, "k2_engine_version": "0.11.0"}, 1, "k2_engine_version",
     "vllm >= 0.15.0"),  # no KimiK25ForConditionalGeneration, no kimi_k2 reasoning parser
    ("k26-tp-not-dividing-heads", K26 | {"k2_tp": 8, "k2_gpus_per_node": 6, "k2_tp": 6}, 1, "k2_tp", "64 attention heads"),
    ("0905-h100-one-node", K0905 | {"k2_gpu": "h100", "k2_tp": 8}, 1, "k2_tp", "less than the 1,030 GB checkpoint"),
    # parser names the pin does not register (catalog.KIMI_PARSERS): the default's → k2_engine_version,
    # a named one → its own key; both name the fix
    ("thinking-vllm-0.11-default-reasoning", {"k2_engine_version": "0.11.0"}, 1, "k2_engine_version",
     "vllm 0.11.0 registers no kimi_k2 reasoning parser (it has no Kimi reasoning parser); k2_engine_version 0.33.0"),
    ("thinking-sglang-0.5.4-default-reasoning", {"k2_engine": "sglang", "k2_engine_version": "0.5.4"}, 1,
     "k2_engine_version", "sglang 0.5.4 registers no kimi_k2 reasoning parser (its Kimi reasoning parsers: kimi); "
     "k2_engine_version 0.5.23 has it"),
    ("sglang-0.5.4-named-reasoning", {"k2_engine": "sglang", "k2_engine_version": "0.5.4",
                                       "k2_reasoning_parser": "kimi_k2"}, 1, "k2_reasoning_parser", "parsers: kimi"),
    ("vllm-0.11-named-k3-tool", {"k2_engine_version": "0.11.0", "k2_reasoning_parser": "deepseek_r1",
                                  "k2_tool_parser": "kimi_k3"}, 1, "k2_tool_parser",
     "k2_engine_version 0.33.0 has it (vllm has it from 0.27.0"),
    ("sglang-0.5.23-named-k3-on-k2", {"k2_engine": "sglang", "k2_reasoning_parser": "kimi_k25"}, 1,
     "k2_reasoning_parser", "no sglang version k2fleet read has it"),
]


@pytest.mark.parametrize("data,hosts,key,words", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refusals_are_one_line_naming_the_key(tmp_path: Path, data: dict, hosts: int, key: str, words: str) -> None:
    with pytest.raises(SpecError) as err:
        _plan(tmp_path, hosts, **data)
    assert err.value.key == key, str(err.value)
    assert words in err.value.message, err.value.message
    assert "\n" not in str(err.value)


# parser names the table does not refuse: the pin's own Kimi name (SGLang 0.5.4's `kimi`, a different
# format from K2's, taken only when named: never swapped in for the default), a name outside the table
# (non-Kimi) and a pin the table does not have (vLLM 0.10.0: its parsers were not read, nothing refused)
PARSER_TWINS = [
    ("sglang-0.5.4-kimi", {"k2_engine": "sglang", "k2_engine_version": "0.5.4", "k2_reasoning_parser": "kimi"},
     "--reasoning-parser", "kimi"),
    ("vllm-0.11-non-kimi", {"k2_engine_version": "0.11.0", "k2_reasoning_parser": "deepseek_r1"},
     "--reasoning-parser", "deepseek_r1"),
    ("vllm-0.10-not-in-table", {"k2_engine_version": "0.10.0"}, "--reasoning-parser", "kimi_k2"),
    ("k3-vllm-0.33", K3 | {"k2_gpu": "b300", "k2_tp": 8}, "--tool-call-parser", "kimi_k3"),
]


@pytest.mark.parametrize("data,flag,value", [t[1:] for t in PARSER_TWINS], ids=[t[0] for t in PARSER_TWINS])
def test_parsers_the_table_does_not_refuse_are_rendered(tmp_path: Path, data: dict, flag: str, value: str) -> None:
    _, plan = _plan(tmp_path, 1, **data)
    words = [w for _, service in plan.services() for w in _engine_words(list(service.argv))]
    assert words[words.index(flag) + 1] == value


def test_parser_check_follows_the_table_exactly() -> None:
    """A Kimi parser name is refused at a version of the table exactly when that version's row
    lacks it; at a pin outside the table, never (its names are unknown)."""
    names = {n for tools, reasonings in catalog.KIMI_PARSERS.values() for n in tools + reasonings} | {"kimi_k25"}
    for (engine, version), row in catalog.KIMI_PARSERS.items():
        for side, kind in enumerate(("tool", "reasoning")):
            for name in names:
                why = deployment.parser_refusal(engine, version, kind, name)
                assert (why is None) == (name in row[side]), (engine, version, kind, name, why)
                assert why is None or "\n" not in why
    for engine, versions in catalog.ENGINE_VERSIONS.items():
        for version in versions:
            if (engine, version) not in catalog.KIMI_PARSERS:
                assert all(deployment.parser_refusal(engine, version, k, n) is None
                           for k in ("tool", "reasoning") for n in names)


K2_LAYOUTS = [capacity.Layout("vllm", tp=8), capacity.Layout("sglang", tp=16), capacity.Layout("trtllm", tp=8, ep=8, attn_dp=True),
              capacity.Layout("vllm", tp=8, pp=2, kv_dtype_bytes=1, max_len=131072)]


@pytest.mark.parametrize("layout", K2_LAYOUTS)
def test_k2_architecture_models_have_k2s_capacity_arithmetic(layout: capacity.Layout) -> None:
    h200 = catalog.GPUS["h200"]
    base = {"int4": catalog.CHECKPOINTS["moonshotai/Kimi-K2-Thinking"], "fp8": catalog.CHECKPOINTS["moonshotai/Kimi-K2-Instruct"]}
    for repo in ("moonshotai/Kimi-K2-Instruct-0905", "moonshotai/Kimi-K2.5", "moonshotai/Kimi-K2.6"):
        new = catalog.CHECKPOINTS[repo]
        old = base[new.quantization]
        assert new.arch == old.arch == catalog.KIMI_K2 and new.heads == 64 and new.experts == 384
        # the same arithmetic: equal at K2's checkpoint size, and the same bytes per KV token at their own
        assert capacity.predict(h200, new.arch, new.quantization, old.bytes, layout) == \
            capacity.predict(h200, old.arch, old.quantization, old.bytes, layout)
        assert capacity.predict(h200, new.arch, new.quantization, new.bytes, layout).kv_bytes_per_token == \
            capacity.predict(h200, old.arch, old.quantization, old.bytes, layout).kv_bytes_per_token
    assert catalog.KIMI_K2.mla_bytes_per_token() == 70_272


def test_synthetic_checkpoint_layout_comes_from_the_catalog() -> None:
    assert checkpoint_style("moonshotai/Kimi-K2-Thinking") == (62, "thinking")
    assert checkpoint_style("moonshotai/Kimi-K2-Instruct") == (61, "instruct")
    for repo in ("moonshotai/Kimi-K2.5", "moonshotai/Kimi-K2.6", "moonshotai/Kimi-K3"):
        assert catalog.CHECKPOINTS[repo].shard_style is None  # not in the sources: a stand-in layout
        assert checkpoint_style(repo) == (62, "thinking")
    assert checkpoint_style("moonshotai/Kimi-K2-Instruct-0905") == (61, "instruct")
