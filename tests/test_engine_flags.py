"""Engine flag tables vs. what k2fleet renders, and the k2_engine_args / LLM API checks."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from k2fleet.cli import load_plan
from k2fleet.planning.engine_flags import DATA, OWNED_FLAGS, check_engine_args, check_llm_api_config, has_table, known_flags
from k2fleet.inventory.spec import SpecError
from tests.inventory_factory import scenario_inventories

ENTRY = {"vllm": "serve", "trtllm": "trtllm-serve", "sglang": "sglang.launch_server",
         "ktransformers": ("sglang.launch_server", "ktransformers.server.main")}
SCENARIOS = scenario_inventories()


def _engine_words(argv: list[str]) -> list[str] | None:
    for i, word in enumerate(argv):
        base = os.path.basename(word)
        if base in ("serve", "trtllm-serve", "sglang.launch_server", "ktransformers.server.main") and (
            base != "serve" or i == 0 or os.path.basename(argv[i - 1]) in ("vllm",) or argv[i - 1] == "--entrypoint" or "vllm" in argv[i - 1] or True
        ):
            return argv[i + 1:]
    return None


@pytest.mark.parametrize("inventory", SCENARIOS)
def test_rendered_flags_are_known(inventory):
    dep, plan = load_plan(inventory)
    if not has_table(dep.engine, dep.version):
        pytest.skip(f"no table for {dep.engine} {dep.version}")
    flags = known_flags(dep.engine, dep.version)
    seen = 0
    for host in plan.hosts.values():
        for service in host.services.values() if isinstance(host.services, dict) else host.services:
            words = _engine_words(list(service.argv))
            if words is None:
                continue
            for w in words:
                if w.startswith("-") and not w.lstrip("-").replace(".", "").isdigit():
                    assert w in flags, f"{inventory}: {service.name} renders {w}, unknown to {dep.engine} {dep.version}"
                    seen += 1
    assert seen or dep.engine == "trtllm"


def test_typo_refused_with_did_you_mean():
    with pytest.raises(SpecError, match=r"--tensor-paralel-size is not a flag of vllm 0.33.0; did you mean --tensor-parallel-size\?"):
        check_engine_args("vllm", "0.33.0", {"--tensor-paralel-size": 8})
    check_engine_args("vllm", "0.33.0", {"max-num-seqs": 256, "--no-enable-prefix-caching": True})


@pytest.mark.parametrize("engine,flag,owner", [("vllm", "--port", "k2_port"), ("vllm", "-tp", "k2_tp"),
                                               ("sglang", "tp-size", "k2_tp"), ("trtllm", "tp_size", "k2_tp")])
def test_owned_flag_refused(engine, flag, owner):
    version = {"vllm": "0.33.0", "sglang": "0.5.23", "trtllm": "1.2.0"}[engine]
    with pytest.raises(SpecError, match=f"set by k2fleet from {owner}"):
        check_engine_args(engine, version, {flag: 8})


def test_version_specific_flag():
    # --nnodes exists at vLLM 0.33 but not at 0.10; SGLang's --kt-* flags are new since 0.4.9
    assert "--nnodes" in known_flags("vllm", "0.33.0") and "--nnodes" not in known_flags("vllm", "0.10.0")
    check_engine_args("sglang", "0.5.23", {"kt-weight-path": "/gguf"})  # a real 0.5.23 flag
    with pytest.raises(SpecError, match="--kt-weight-path is not a flag of sglang 0.4.9"):
        check_engine_args("sglang", "0.4.9", {"kt-weight-path": "/gguf"})


def test_renamed_flag_checked_by_translation():
    check_engine_args("sglang", "0.5.23", {"enable-deepep-moe": True})  # → --moe-a2a-backend deepep
    check_engine_args("sglang", "0.4.9", {"enable-deepep-moe": True})


TREE = {"extra": "forbid", "fields": {"tensor_parallel_size": None, "cuda_graph_config": {
    "extra": "forbid", "fields": {"enable_padding": None, "batch_sizes": None}}}}


def test_llm_api_walk():
    check_llm_api_config("1.2.0", {"cuda_graph_config": {"padding_enabled": True}}, schema=TREE)
    with pytest.raises(SpecError, match=r"cuda_graph_config.enable_padingg is not .*did you mean enable_padding\?"):
        check_llm_api_config("1.2.0", {"cuda_graph_config": {"enable_padingg": True}}, schema=TREE)
    with pytest.raises(SpecError, match="tensor_parallel_size: 8 contradicts k2_tp=16"):
        check_llm_api_config("1.2.0", {"tensor_parallel_size": 8}, owned_values={"tensor_parallel_size": 16}, schema=TREE)
    check_llm_api_config("1.2.0", {"tensor_parallel_size": 16}, owned_values={"tensor_parallel_size": 16}, schema=TREE)


@pytest.mark.parametrize("inventory", [p for p in SCENARIOS if "trtllm" in p])
def test_scenario_trtllm_yaml(inventory):
    dep, plan = load_plan(inventory)
    for host in plan.hosts.values():
        services = host.services.values() if isinstance(host.services, dict) else host.services
        for service in services:
            for path, text in (service.files or {}).items():
                if path.endswith("extra-llm-api-config.yml"):
                    check_llm_api_config(dep.version, yaml.safe_load(text))


def test_tables_have_source():
    files = sorted(DATA.glob("*.json"))
    assert len(files) >= 8
    for f in files:
        data = json.loads(f.read_text())
        assert data["source"]["date"] and data["source"]["files"], f
        assert data["flags"] == sorted(set(data["flags"])), f
    assert set(OWNED_FLAGS) == {"vllm", "sglang", "ktransformers", "trtllm"}


def test_trtllm_table_refuses_misspelt_options_and_keys():
    # trtllm-serve serve options (k2_engine_args, dashes or underscores) and their click aliases
    check_engine_args("trtllm", "1.2.0", {"kv_cache_free_gpu_memory_fraction": 0.9, "max-num-tokens": 4096,
                                          "backend": "pytorch", "trust_remote_code": True})
    with pytest.raises(SpecError, match=r"--max_batch_sise is not a flag of trtllm 1\.2\.0; did you mean --max_batch_size\?"):
        check_engine_args("trtllm", "1.2.0", {"max_batch_sise": 128})
    with pytest.raises(SpecError, match=r"--tensor_parallel_size is set by k2fleet from k2_tp \(as --tp_size\)"):
        check_engine_args("trtllm", "1.2.0", {"tensor_parallel_size": 8})  # the same click option as --tp_size
    with pytest.raises(SpecError, match=r"--extra_llm_api_options is set by k2fleet from k2_trtllm_config"):
        check_engine_args("trtllm", "1.2.0", {"extra_llm_api_options": "/tmp/x.yml"})
    # LLM API keys: top level, nested sections, the speculative_config variants and dict-typed sub-models
    check_llm_api_config("1.2.0", {"speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 3},
                                   "moe_config": {"backend": "WIDEEP", "load_balancer": {"num_slots": 416}},
                                   "scheduler_config": {"dynamic_batch_config": {"enable_batch_size_tuning": True}}})
    refused = [
        ({"max_batch_sizes": 8}, r"max_batch_sizes is not an LLM API option of trtllm 1\.2\.0; did you mean max_batch_size\?"),
        ({"kv_cache_config": {"free_gpu_memory_fracton": 0.8}},
         r"kv_cache_config\.free_gpu_memory_fracton is not .*; did you mean free_gpu_memory_fraction\?"),
        ({"moe_config": {"load_balancer": {"num_slot": 416}}},
         r"moe_config\.load_balancer\.num_slot is not .*; did you mean num_slots\?"),
        ({"speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layer": 3}},
         r"speculative_config\.num_nextn_predict_layer is not .*; did you mean num_nextn_predict_layers\?"),
    ]
    for config, message in refused:
        with pytest.raises(SpecError, match=message):
            check_llm_api_config("1.2.0", config)


def test_trtllm_table_provenance():
    data = json.loads((DATA / "trtllm-1.2.0.json").read_text())
    assert data["source"]["repo"] == "github.com/NVIDIA/TensorRT-LLM"
    assert data["source"]["commit"] == "7e873e54c296912df55b4c961e67079963ae4d34"
    assert data["source"]["files"] == ["1.2.0/_modules/tensorrt_llm/llmapi/llm_args.html",
                                       "1.2.0/commands/trtllm-serve/trtllm-serve.html"]
    assert data["llm_api"]["model"] == "TorchLlmArgs" and data["llm_api"]["extra"] == "forbid"
    assert ["--config", "--extra_llm_api_options"] in data["aliases"]
