"""Engine flag tables vs. what k2fleet renders, and the k2_engine_args / LLM API checks."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from k2fleet.cli import load_plan
from k2fleet.planning import catalog
from k2fleet.planning.engine_flags import DATA, OWNED_FLAGS, check_engine_args, check_llm_api_config, has_table, known_flags
from k2fleet.inventory.spec import SpecError
from tests.inventory_factory import scenario_inventories

ENTRY = {"vllm": "serve", "trtllm": "trtllm-serve", "sglang": "sglang.launch_server",
         "ktransformers": ("sglang.launch_server", "ktransformers.server.main")}
SCENARIOS = scenario_inventories()


def _engine_words(argv: list[str]) -> list[str] | None:
    """The words after an engine's entry point in ``argv``, or None when it runs none: SGLang's,
    KTransformers' module (``-m sglang.launch_server``), ``trtllm-serve``, or vLLM's ``serve``
    subcommand — only right after the ``vllm`` executable, or after the image of a container run
    with ``--entrypoint vllm`` (a ``serve`` anywhere else, e.g. a path or a value, is not one).

    >>> _engine_words(["/opt/venv/bin/vllm", "serve", "/m", "--port", "8000"])
    ['/m', '--port', '8000']
    >>> _engine_words(["docker", "run", "--entrypoint", "vllm", "img:1", "serve", "/m", "-tp", "8"])
    ['/m', '-tp', '8']
    >>> _engine_words(["/usr/bin/python3", "-m", "sglang.launch_server", "--tp-size", "8"])
    ['--tp-size', '8']
    >>> _engine_words(["trtllm-llmapi-launch", "trtllm-serve", "serve", "/m", "--tp_size", "16"])
    ['serve', '/m', '--tp_size', '16']
    >>> _engine_words(["/usr/bin/tool", "-v", "/srv/serve", "serve", "--port", "1"]) is None
    True
    >>> _engine_words(["/usr/bin/python3", "submit.py", "-c", "/etc/config.yaml"]) is None
    True
    """
    for i, word in enumerate(argv):
        base = os.path.basename(word)
        if base in ("trtllm-serve", "sglang.launch_server", "ktransformers.server.main"):
            return argv[i + 1:]
        if word == "serve" and i > 0 and (
            os.path.basename(argv[i - 1]) == "vllm" or (i >= 3 and argv[i - 3:i - 1] == ["--entrypoint", "vllm"])
        ):
            return argv[i + 1:]
    return None


def _slurm_worker_configs(service) -> dict:
    """The ctx/gen worker configs (TensorRT-LLM LLM API options) of a SLURM submit service:
    ``python3 submit.py -c CONFIG`` with CONFIG among its rendered files."""
    assert list(service.argv[:3]) == ["/usr/bin/python3", "submit.py", "-c"] and len(service.argv) == 4, service.argv
    config = yaml.safe_load(service.files[service.argv[3]])
    workers = config["worker_config"]
    assert set(workers) == {"gen", "ctx"}, workers
    return workers


def _leaf_keys(options: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in options.items():
        out += _leaf_keys(value, f"{prefix}{key}.") if isinstance(value, dict) and value else [prefix + key]
    return out


@pytest.mark.parametrize("inventory", SCENARIOS)
def test_rendered_flags_are_known(inventory):
    dep, plan = load_plan(inventory)
    if not has_table(dep.engine, dep.version):
        pytest.skip(f"no table for {dep.engine} {dep.version}")
    flags = known_flags(dep.engine, dep.version)
    seen = 0
    for host in plan.hosts.values():
        for service in host.services.values() if isinstance(host.services, dict) else host.services:
            if service.role == "slurm-submit":  # no engine argv here: submit.py starts trtllm-serve from the YAML
                for side, options in _slurm_worker_configs(service).items():
                    check_llm_api_config(dep.version, options, key=f"k2_disagg.{side}")
                    seen += len(_leaf_keys(options))
                continue
            words = _engine_words(list(service.argv))
            if words is None:
                continue
            for w in words:
                if w.startswith("-") and not w.lstrip("-").replace(".", "").isdigit():
                    assert w in flags, f"{inventory}: {service.name} renders {w}, unknown to {dep.engine} {dep.version}"
                    seen += 1
    assert seen, f"{inventory}: no engine flag or LLM API option was checked"


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
    # → --moe-a2a-backend deepep, which k2fleet renders from k2_moe_a2a_backend: refused under either name
    with pytest.raises(SpecError, match=r"--enable-deepep-moe is set by k2fleet from k2_moe_a2a_backend \(as --moe-a2a-backend\)"):
        check_engine_args("sglang", "0.5.23", {"enable-deepep-moe": True})
    with pytest.raises(SpecError, match="--enable-deepep-moe is set by k2fleet from k2_moe_a2a_backend"):
        check_engine_args("sglang", "0.4.9", {"enable-deepep-moe": True})
    check_engine_args("sglang", "0.5.23", {"cuda-graph-bs": 64})  # → --cuda-graph-bs-decode, a flag of 0.5.23


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
    """Every TensorRT-LLM YAML a scenario renders is read back and walked against the pinned
    version's LLM API table: ``extra-llm-api-config.yml`` (its parallel sizes those of the pool)
    and a SLURM submit host's ``config.yaml`` (its ctx/gen worker configs those of k2_disagg)."""
    dep, plan = load_plan(inventory)
    assert has_table("trtllm", dep.version), dep.version  # else the walk below checks names against nothing
    checked = 0
    for pool in dep.pools.values():
        s = pool.settings
        for host in pool.hosts:
            for service in plan.hosts[host.name].services:
                if service.role != pool.role:
                    continue
                if pool.role == "slurm-submit":
                    workers = _slurm_worker_configs(service)
                    for side in ("gen", "ctx"):
                        check_llm_api_config(dep.version, workers[side], key=f"k2_disagg.{side}")
                        assert set(workers[side]) == set(s.disagg[side]), side  # the inventory's, no more, no less
                        for key in ("tensor_parallel_size", "moe_expert_parallel_size", "enable_attention_dp"):
                            assert workers[side][key] == s.disagg[side][key], (side, key)
                        checked += len(_leaf_keys(workers[side]))
                    continue
                configs = [text for path, text in (service.files or {}).items() if path.endswith("extra-llm-api-config.yml")]
                assert len(configs) == 1, f"{service.name}: {sorted(service.files or {})}"
                options = yaml.safe_load(configs[0])
                check_llm_api_config(dep.version, options, owned_values={
                    "tensor_parallel_size": pool.tp, "pipeline_parallel_size": s.pp,
                    "moe_expert_parallel_size": s.ep, "enable_attention_dp": s.attn_dp})
                assert (options["tensor_parallel_size"], options["moe_expert_parallel_size"]) == (pool.tp, s.ep)
                checked += len(_leaf_keys(options))
    assert checked, f"{inventory}: no TensorRT-LLM YAML was checked"


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


# --- issue 34 item 5: every rendered flag owned, DP attention's companions, all-to-all key, IPv6, HCAs ---
from pathlib import Path  # noqa: E402

from k2fleet.planning.engine_flags import A2A_BACKENDS, owned_flags  # noqa: E402
from k2fleet.planning.render.common import extra_flags, pool_engine_args  # noqa: E402
from tests.inventory_factory import write_inventory  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DPA_EP = dict(k2_model="moonshotai/Kimi-K2-Instruct", k2_engine="sglang", k2_tp=16, k2_dp=16, k2_attn_dp=True,
              k2_ep=16, k2_ib_hcas=["mlx5_0", "mlx5_1"])


def _extra_words(dep, pool) -> set[str]:
    s = pool.settings
    legacy = dep.engine == "trtllm" or (dep.engine == "ktransformers" and dep.version.startswith("0.3"))
    args = s.engine_args if legacy else pool_engine_args(dep, s)
    return {w for w in extra_flags(dep, args, dash="_" if legacy else "-") if w.startswith("-")}


@pytest.mark.parametrize("inventory", SCENARIOS)
def test_every_flag_a_renderer_emits_is_owned(inventory):
    """Each flag word of an engine's argv is either one k2fleet owns for that pool (refused in
    k2_engine_args) or one the inventory's k2_engine_args / k2_profile put there — never both."""
    dep, plan = load_plan(inventory)
    checked = 0
    for pool in dep.pools.values():
        owned = owned_flags(dep, pool)
        extra = _extra_words(dep, pool)
        assert not set(owned) & extra, f"{inventory}: {set(owned) & extra} both rendered by k2fleet and given"
        for host in pool.hosts:
            for service in plan.hosts[host.name].services:
                if service.role != pool.role:
                    continue
                if pool.role == "slurm-submit":  # its flags are the worker configs' keys: k2_disagg's own
                    workers = _slurm_worker_configs(service)
                    for side in ("gen", "ctx"):
                        assert set(workers[side]) == set(pool.settings.disagg[side]), side
                        checked += len(workers[side])
                    continue
                words = _engine_words(list(service.argv))
                if words is None:
                    continue
                for w in words:
                    if w.startswith("-") and not w.lstrip("-").replace(".", "").isdigit():
                        assert w in owned or w in extra, f"{inventory}: {service.name} renders {w}, owned by no key"
                        checked += 1
    assert checked, f"{inventory}: no rendered flag was checked"


def _plan(tmp_path, hosts=2, **data):
    return load_plan(write_inventory(tmp_path, hosts=hosts, **data))


def _refused(tmp_path, hosts=2, **data) -> SpecError:
    with pytest.raises(SpecError) as info:
        _plan(tmp_path, hosts, **data)
    assert "\n" not in str(info.value)
    return info.value


def _argv(plan, host="node-0", name=None):
    return next(s.argv for s in plan.hosts[host].services if name is None or s.name == name)


@pytest.mark.parametrize("version", ["0.5.23", "0.5.4", "0.4.9"])
def test_dp_attention_renders_its_companions_at_every_sglang_pin(tmp_path, version):
    _, plan = _plan(tmp_path, k2_engine_version=version, **DPA_EP)
    argv = _argv(plan)
    i = argv.index("--moe-dense-tp-size")
    assert argv[i + 1] == "1" and argv.count("--enable-dp-lm-head") == 1
    flags = known_flags("sglang", version)
    assert {"--moe-dense-tp-size", "--enable-dp-lm-head"} <= flags
    # without DP attention, neither; and then k2_engine_args may set them
    _, plan = _plan(tmp_path / "tp", k2_engine_version=version, k2_model="moonshotai/Kimi-K2-Instruct",
                    k2_engine="sglang", k2_tp=16, k2_engine_args={"moe-dense-tp-size": 2})
    assert _argv(plan).count("--moe-dense-tp-size") == 1


@pytest.mark.parametrize("args,flag,owner", [
    ({"moe-a2a-backend": "none"}, "--moe-a2a-backend", "k2_moe_a2a_backend"),
    ({"--enable-dp-lm-head": True}, "--enable-dp-lm-head", "k2_attn_dp"),
    ({"moe-dense-tp-size": 1}, "--moe-dense-tp-size", "k2_attn_dp"),
    ({"trust-remote-code": True}, "--trust-remote-code", ""),
    ({"tool-call-parser": "kimi_k2"}, "--tool-call-parser", "k2_tool_parser"),
    ({"disaggregation-ib-device": "mlx5_9"}, None, None),  # a serve pool: k2fleet does not render it
])
def test_a_flag_k2fleet_renders_is_refused_in_engine_args(tmp_path, args, flag, owner):
    if flag is None:
        _plan(tmp_path, k2_engine_args=args, **DPA_EP)
        return
    err = _refused(tmp_path, k2_engine_args=args, **DPA_EP)
    assert err.key == "k2_engine_args"
    assert f"{flag} is set by k2fleet{' from ' + owner if owner else ''}; remove it from k2_engine_args" in str(err)


def test_keyed_flags_are_refused_only_when_the_key_renders_them(tmp_path):
    _plan(tmp_path / "a", hosts=1, k2_engine_args={"max-model-len": 65536})  # k2_max_model_len unset: the flag's
    err = _refused(tmp_path / "b", hosts=1, k2_max_model_len=65536, k2_engine_args={"max-model-len": 65536})
    assert "--max-model-len is set by k2fleet from k2_max_model_len" in str(err)
    err = _refused(tmp_path / "c", hosts=1, k2_gpu_memory_utilization=0.85,
                   k2_engine_args={"gpu-memory-utilization": 0.8})
    assert "--gpu-memory-utilization is set by k2fleet from k2_gpu_memory_utilization" in str(err)
    err = _refused(tmp_path / "d", hosts=1, k2_engine_args={"all2all-backend": "deepep_low_latency"})
    assert "--all2all-backend is set by k2fleet from k2_moe_a2a_backend" in str(err)


def test_a2a_backend_key_per_engine_and_pin(tmp_path):
    _, plan = _plan(tmp_path / "sg", k2_moe_a2a_backend="mooncake", **DPA_EP)
    assert _argv(plan)[_argv(plan).index("--moe-a2a-backend") + 1] == "mooncake"
    err = _refused(tmp_path / "old", k2_engine_version="0.5.4", k2_moe_a2a_backend="nixl", **DPA_EP)
    assert err.key == "k2_moe_a2a_backend" and "nixl is not an all-to-all backend of sglang 0.5.4" in str(err)
    assert "one of none, deepep, mooncake" in str(err)
    _, plan = _plan(tmp_path / "none", k2_engine_version="0.4.9", k2_moe_a2a_backend="none", **DPA_EP)
    assert "--enable-deepep-moe" not in _argv(plan) and "--moe-a2a-backend" not in _argv(plan)
    vllm_ep = dict(k2_model="moonshotai/Kimi-K2-Instruct", k2_dp=16, k2_tp=1, k2_ep=16, k2_ib_hcas=["mlx5_0"])
    _, plan = _plan(tmp_path / "v33", k2_moe_a2a_backend="deepep_low_latency", **vllm_ep)
    argv = _argv(plan)
    assert argv[argv.index("--all2all-backend") + 1] == "deepep_low_latency"
    _, plan = _plan(tmp_path / "v11", k2_engine_version="0.11.0", k2_moe_a2a_backend="deepep_low_latency", **vllm_ep)
    service = plan.hosts["node-0"].services[0]
    assert "--all2all-backend" not in service.argv and service.env["VLLM_ALL2ALL_BACKEND"] == "deepep_low_latency"
    err = _refused(tmp_path / "v10", k2_engine_version="0.10.0", k2_moe_a2a_backend="allgather_reducescatter", **vllm_ep)
    assert "not an all-to-all backend of vllm 0.10.0" in str(err)
    _, plan = _plan(tmp_path / "tp", hosts=1, k2_moe_a2a_backend="deepep_low_latency")  # k2_ep 1: unused
    assert "--all2all-backend" not in _argv(plan)
    assert set(A2A_BACKENDS) == {(e, v) for e in ("vllm", "sglang") for v in catalog.ENGINE_VERSIONS[e]}


def test_deepep_across_nodes_needs_rdma(tmp_path):
    bare = {k: v for k, v in DPA_EP.items() if k != "k2_ib_hcas"}
    err = _refused(tmp_path / "a", **bare)
    assert err.key == "k2_ib_hcas" and "DeepEP (deepep, k2fleet's default for SGLang expert parallel) across 2 nodes" in str(err)
    assert "node-0, node-1 list no HCA" in str(err)
    err = _refused(tmp_path / "b", k2_moe_a2a_backend="deepep", **bare)
    assert err.key == "k2_ib_hcas" and "default" not in str(err)
    _plan(tmp_path / "c", k2_moe_a2a_backend="none", **bare)  # no DeepEP: no RDMA needed
    _plan(tmp_path / "d", hosts=1, k2_model="moonshotai/Kimi-K2-Instruct", k2_engine="sglang", k2_tp=8, k2_ep=8,
          k2_gpu="b200")  # one node: DeepEP over NVLink


def test_duplicate_hcas_refused(tmp_path):
    for i, (hcas, clash) in enumerate(((["mlx5_0", "mlx5_0"], "mlx5_0 repeats mlx5_0;"),
                                       (["mlx5_0:1", "mlx5_1", "mlx5_0"], "mlx5_0 repeats mlx5_0:1;"))):
        err = _refused(tmp_path / str(i), **(DPA_EP | {"k2_ib_hcas": hcas}))
        assert err.key.startswith("k2_ib_hcas") and clash in str(err), str(err)


V6 = [(f"node-{i}", {"ssh_hostname": f"fd00::{10 + i}"}) for i in range(2)]


def test_ipv6_addresses_bracketed_where_engines_take_host_port(tmp_path):
    _, plan = _plan(tmp_path / "sg", hosts=V6, k2_model="moonshotai/Kimi-K2-Instruct", k2_engine="sglang", k2_tp=16)
    argv = _argv(plan, "node-1")
    assert argv[argv.index("--dist-init-addr") + 1] == "[fd00::10]:50000"
    _, plan = _plan(tmp_path / "ray", hosts=V6, k2_model="moonshotai/Kimi-K2-Instruct", k2_tp=16,
                    k2_multinode_backend="ray")
    worker = _argv(plan, "node-1", "k2-ray")
    assert worker[worker.index("--address") + 1] == "[fd00::10]:6379"
    assert worker[worker.index("--node-ip-address") + 1] == "fd00::11"
    _, plan = _plan(tmp_path / "mp", hosts=V6, k2_model="moonshotai/Kimi-K2-Instruct", k2_tp=16)
    argv = _argv(plan, "node-1")
    assert argv[argv.index("--master-addr") + 1] == "fd00::10"  # a bare host: no port to split from
    err = _refused(tmp_path / "trt", hosts=V6, k2_model="nvidia/Kimi-K2-Thinking-NVFP4", k2_engine="trtllm",
                   k2_gpu="b200", k2_tp=16, k2_ep=16, k2_runtime="container")
    assert err.key == "k2_address" and "mpirun -H HOST:SLOTS" in str(err)


def test_ipv6_router_urls_bracketed(tmp_path):
    hosts = [("p-0", {"ssh_hostname": "fd00::20", "k2_role": "prefill"}),
             ("d-0", {"ssh_hostname": "fd00::21", "k2_role": "decode"}),
             ("r-0", {"ssh_hostname": "fd00::22", "k2_role": "router"})]
    _, plan = _plan(tmp_path, hosts=hosts, k2_model="moonshotai/Kimi-K2-Instruct", k2_engine="sglang", k2_tp=8,
                    k2_max_model_len=32768)
    argv = _argv(plan, "r-0")
    assert argv[argv.index("--prefill") + 1] == "http://[fd00::20]:8000"
    assert argv[argv.index("--decode") + 1] == "http://[fd00::21]:8000"
