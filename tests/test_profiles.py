"""k2_profile: the seeds' tuning tables rendered per engine and pinned version, checked by the
flag tables (offline); the inventory's own flags win; the capacity check still holds."""

from __future__ import annotations

import json

import pytest
import yaml

from k2fleet.cli import load_plan, main
from k2fleet.inventory.spec import SpecError
from k2fleet.planning import profiles
from k2fleet.planning.engine_flags import check_llm_api_config, has_table, known_flags
from tests.test_engine_flags import _engine_words
from tests.inventory_factory import scenario_inventories

SCENARIOS = scenario_inventories()
TUNED = [p for p in profiles.PROFILES if p != "default"]
# every other pinned version with a flag table, on an inventory of its engine
PINS = [("inventories/h200.py", "0.11.0"), ("inventories/h200.py", "0.10.0"),
        ("inventories/h200-sglang-tp16.py", "0.5.4"), ("inventories/h200-sglang-tp16.py", "0.4.9"),
        ("inventories/ktransformers.py", "0.7.2")]
# vLLM 0.11.0 registers no Kimi reasoning parser (catalog.KIMI_PARSERS), so h200.py's K2-Thinking is refused
# there with its default kimi_k2; a non-Kimi name (outside the table, not checked) lets its flags be checked
PIN_DATA = {("inventories/h200.py", "0.11.0"): ["k2_reasoning_parser=deepseek_r1"]}


def _argv_flags(dep, plan) -> list[str]:
    out = []
    for host in plan.hosts.values():
        for service in host.services:
            words = _engine_words(list(service.argv))
            if words:
                out += [w for w in words if w.startswith("--")]
    return out


def _yamls(plan) -> list[dict]:
    return [yaml.safe_load(text) for host in plan.hosts.values() for service in host.services
            for path, text in (service.files or {}).items() if path.endswith("extra-llm-api-config.yml")]


def _check(dep, plan, profile):
    if dep.engine == "trtllm":
        for doc in _yamls(plan):
            check_llm_api_config(dep.version, doc)
            for pool in dep.pools.values():
                user = pool.settings.trtllm_config
                for name, value, _ in profiles.rows("trtllm", profile):
                    if isinstance(value, dict):
                        for sub, v in value.items():
                            if sub not in (user.get(name) or {}):
                                assert doc[name][sub] == v, (name, sub)
                    elif name not in user:
                        assert doc[name] == value, name
        return
    rendered = _argv_flags(dep, plan)
    flags = known_flags(dep.engine, dep.version)
    for w in rendered:
        assert w in flags, f"{dep.engine} {dep.version}: {w} unknown"
    for name in profiles.flags(dep.engine, dep.version, profile):
        spelt = "--" + name
        if dep.engine == "sglang" and dep.version == "0.5.23" and name == "cuda-graph-max-bs":
            spelt = "--cuda-graph-max-bs-decode"  # renamed at 0.5.23 (the SGLang engine's renamed_flags)
        assert spelt in rendered, (dep.engine, dep.version, profile, spelt)


@pytest.mark.parametrize("profile", TUNED)
@pytest.mark.parametrize("inventory", SCENARIOS)
def test_scenario_profiles_pass_flag_tables(inventory, profile):
    try:
        dep, plan = load_plan(inventory, [f"k2_profile={profile}"])
    except SpecError as exc:  # the legacy KTransformers server: one line naming the key
        assert exc.key == "k2_profile" and "legacy server" in exc.message
        return
    assert dep.s.profile == profile and has_table(dep.engine, dep.version)
    _check(dep, plan, profile)


@pytest.mark.parametrize("profile", TUNED)
@pytest.mark.parametrize("inventory,version", PINS)
def test_pinned_versions(inventory, version, profile):
    dep, plan = load_plan(inventory, [f"k2_profile={profile}", f"k2_engine_version={version}",
                                      *PIN_DATA.get((inventory, version), [])])
    assert dep.version == version
    _check(dep, plan, profile)


def test_sglang_rename_per_pin():
    _, new = load_plan("inventories/h200-sglang-tp16.py", ["k2_profile=latency"])
    _, old = load_plan("inventories/h200-sglang-tp16.py", ["k2_profile=latency", "k2_engine_version=0.5.4"])
    new_argv = " ".join(new.hosts[next(iter(new.hosts))].services[0].argv)
    old_argv = " ".join(old.hosts[next(iter(old.hosts))].services[0].argv)
    assert "--cuda-graph-max-bs-decode 64" in new_argv and "--cuda-graph-max-bs 64" in old_argv


def test_inventory_flags_win(tmp_path):
    dep, plan = load_plan("inventories/h200.py", ["k2_profile=throughput", 'k2_engine_args={"max_num_batched_tokens": 4096}'])
    argv = plan.hosts[next(iter(plan.hosts))].services[0].argv
    assert argv.count("--max-num-batched-tokens") + argv.count("--max_num_batched_tokens") == 1
    assert profiles.overridden("vllm", "0.33.0", "throughput", {"max_num_batched_tokens": 4096}, {}) == ["max-num-batched-tokens"]
    merged = profiles.merged_llm_api("trtllm", "1.2.0", "throughput", {"kv_cache_config": {"free_gpu_memory_fraction": 0.9}})
    assert merged["kv_cache_config"] == {"free_gpu_memory_fraction": 0.9, "dtype": "fp8"}


def test_default_renders_nothing_new():
    _, plain = load_plan("inventories/h200.py")
    _, default = load_plan("inventories/h200.py", ["k2_profile=default"])
    assert plain.to_json() == default.to_json()


def test_plan_json_shows_profile(capsys):
    assert main(["plan", "inventories/h200.py", "--json", "--data", "k2_profile=long-context"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["profile"]["serve"]["name"] == "long-context"
    names = [s["name"] for s in doc["profile"]["serve"]["settings"]]
    assert names == ["max-num-batched-tokens", "enable-chunked-prefill"]
    assert all(s["source"] for s in doc["profile"]["serve"]["settings"])


def test_long_context_meets_the_capacity_check():
    # the model's full context, held k2_expected_concurrency times: refused in the capacity check's one line
    with pytest.raises(SpecError) as err:
        load_plan("inventories/h200.py", ["k2_profile=long-context", "k2_expected_concurrency=4096"])
    assert err.value.key == "k2_max_model_len" and "do not fit the predicted KV cache" in err.value.message


def test_trtllm_profile_kv_settings_reach_the_capacity_check():
    base, _ = load_plan("inventories/h200-trtllm-mpi.py")
    tuned, _ = load_plan("inventories/h200-trtllm-mpi.py", ["k2_profile=throughput"])
    (role, cap), = [(r, c) for r, c in base.capacity.items()][:1]
    # fp8 KV: half the bytes per token; free_gpu_memory_fraction 0.75
    assert tuned.capacity[role].kv_bytes_per_token * 2 == cap.kv_bytes_per_token
