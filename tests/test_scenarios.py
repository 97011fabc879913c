"""Every seed inventory plans offline, and its plan carries what the seed needs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from k2fleet.cli import load_plan

ROOT = Path(__file__).resolve().parents[1]
INV = ROOT / "inventories"
SCENARIOS = [
    "h200", "h200-dcp", "h800-pp", "h200-dp-ep", "h200-sglang-tp16", "h200-sglang-pd",
    "b200-trtllm", "h200-trtllm-mpi", "gb200-trtllm-disagg", "ktransformers", "mi300x",
    "h200-k2-0905", "h200-k25", "h200-k26", "h200-k3-sglang",  # issue #25's models
    "h200-sglang-dpa-ep",  # issue #34: DP attention + EP over 4 nodes, RDMA
]


def plan_json(name: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "k2fleet.cli", "plan", str(INV / f"{name}.py"), "--json"],
        check=True, capture_output=True, text=True, cwd=ROOT,
    )
    return json.loads(out.stdout)


def services(doc: dict, host: str) -> dict[str, dict]:
    return {s["name"]: s for s in doc["hosts"][host]["services"]}


def flag(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_scenario_plans_with_the_documented_shape(name: str) -> None:
    doc = plan_json(name)
    assert doc["hosts"], name
    for host in doc["hosts"].values():
        for svc in host["services"]:
            assert {"name", "argv", "env", "files"} <= set(svc)
            assert all(isinstance(w, str) for w in svc["argv"])


def test_h200_one_tp8_replica_per_node_with_parsers() -> None:
    doc = plan_json("h200")
    assert set(doc["hosts"]) == {"h200-0", "h200-1"}
    for host in ("h200-0", "h200-1"):
        argv = services(doc, host)["k2-vllm"]["argv"]
        assert argv[:2] == ["/opt/k2fleet/venv/vllm-0.33.0/bin/vllm", "serve"]
        assert argv[2] == doc["checkpoint_path"]
        assert doc["checkpoint_path"].endswith("a51ccc050d73dab088bf7b0e2dd9b30ae85a4e55")
        assert flag(argv, "--tensor-parallel-size") == "8"
        assert flag(argv, "--tool-call-parser") == "kimi_k2"
        assert flag(argv, "--reasoning-parser") == "kimi_k2"
        assert "--enable-auto-tool-choice" in argv and "--trust-remote-code" in argv
        for multi in ("--nnodes", "--headless", "--data-parallel-size", "--distributed-executor-backend"):
            assert multi not in argv
        env = services(doc, host)["k2-vllm"]["env"]
        assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "ens10f0np0"
        assert env["HF_HUB_OFFLINE"] == "1"


def test_h200_dcp8() -> None:
    argv = services(plan_json("h200-dcp"), "h200-1")["k2-vllm"]["argv"]
    assert flag(argv, "--decode-context-parallel-size") == "8"
    assert flag(argv, "--tensor-parallel-size") == "8"


def test_h800_tp8_pp2_on_ray() -> None:
    doc = plan_json("h800-pp")
    head, worker = services(doc, "h800-0"), services(doc, "h800-1")
    assert head["k2-ray"]["argv"][1:4] == ["start", "--head", "--port"]
    assert flag(worker["k2-ray"]["argv"], "--address") == "192.0.2.20:6379"
    assert head["k2-ray"]["env"]["VLLM_HOST_IP"] == "192.0.2.20"
    assert worker["k2-ray"]["env"]["VLLM_HOST_IP"] == "192.0.2.21"
    assert "k2-vllm" not in worker  # the head drives the Ray cluster
    argv = head["k2-vllm"]["argv"]
    assert flag(argv, "--tensor-parallel-size") == "8"
    assert flag(argv, "--pipeline-parallel-size") == "2"
    assert flag(argv, "--distributed-executor-backend") == "ray"
    assert flag(argv, "--quantization") == "fp8" and flag(argv, "--kv-cache-dtype") == "fp8"
    assert "--disable-log-requests" not in argv  # removed from vLLM 0.33
    assert head["k2-ray"]["stage"] < worker["k2-ray"]["stage"] < head["k2-vllm"]["stage"]
    assert doc["hosts"]["h800-0"]["services"][0]["env"]["NCCL_IB_HCA"] == "mlx5_0,mlx5_1,mlx5_2,mlx5_3"


def test_h200_dp16_ep_headless_second_node() -> None:
    doc = plan_json("h200-dp-ep")
    head = services(doc, "h200-0")["k2-vllm"]["argv"]
    tail = services(doc, "h200-1")["k2-vllm"]["argv"]
    for argv in (head, tail):
        assert flag(argv, "--data-parallel-size") == "16"
        assert flag(argv, "--data-parallel-size-local") == "8"
        assert flag(argv, "--data-parallel-address") == "192.0.2.30"
        assert flag(argv, "--data-parallel-rpc-port") == "13345"
        assert "--enable-expert-parallel" in argv
        assert flag(argv, "--served-model-name") == "kimi-k2"
    assert "--headless" not in head
    assert "--headless" in tail and flag(tail, "--data-parallel-start-rank") == "8"
    assert services(doc, "h200-0")["k2-vllm"]["health"]["port"] == 8000
    assert services(doc, "h200-1")["k2-vllm"]["health"] is None


def test_sglang_tp16_two_nodes_same_master() -> None:
    doc = plan_json("h200-sglang-tp16")
    for rank, host in enumerate(("h200-0", "h200-1")):
        argv = services(doc, host)["k2-sglang"]["argv"]
        assert argv[1:3] == ["-m", "sglang.launch_server"]
        assert flag(argv, "--tp-size") == "16" and "--tp" not in argv
        assert flag(argv, "--dist-init-addr") == "192.0.2.40:50000"
        assert flag(argv, "--nnodes") == "2" and flag(argv, "--node-rank") == str(rank)
        assert flag(argv, "--tool-call-parser") == "kimi_k2"


def test_sglang_pd_dp_attention_ep_and_router() -> None:
    doc = plan_json("h200-sglang-pd")
    pre = services(doc, "prefill-1")["k2-sglang-prefill"]["argv"]
    dec = services(doc, "decode-0")["k2-sglang-decode"]["argv"]
    assert flag(pre, "--disaggregation-mode") == "prefill" and flag(dec, "--disaggregation-mode") == "decode"
    assert flag(pre, "--dist-init-addr") == "192.0.2.50:5757" and flag(pre, "--node-rank") == "1"
    assert flag(dec, "--dist-init-addr") == "192.0.2.52:5757" and flag(dec, "--node-rank") == "0"
    for argv in (pre, dec):
        assert flag(argv, "--attn-dp-size") == "16" and "--enable-dp-attention" not in argv
        assert flag(argv, "--moe-a2a-backend") == "deepep" and "--enable-deepep-moe" not in argv
        assert flag(argv, "--ep-size") == "16"
        assert flag(argv, "--moe-dense-tp-size") == "1" and argv.count("--moe-dense-tp-size") == 1
        assert argv.count("--enable-dp-lm-head") == 1
        assert flag(argv, "--disaggregation-ib-device") == "mlx5_0,mlx5_1,mlx5_2,mlx5_3"
    assert flag(pre, "--deepep-mode") == "normal" and flag(dec, "--deepep-mode") == "low_latency"
    assert flag(dec, "--cuda-graph-bs-decode") == "480" and "--cuda-graph-bs" not in dec
    router = services(doc, "router-0")["k2-sglang-router"]
    argv = router["argv"]
    assert argv[1:3] == ["-m", "sglang_router.launch_router"] and "--pd-disaggregation" in argv
    assert argv[argv.index("--prefill") + 1 : argv.index("--prefill") + 3] == ["http://192.0.2.50:8000", "8998"]
    assert flag(argv, "--decode") == "http://192.0.2.52:8000"
    assert flag(argv, "--worker-startup-check-interval") == "1"  # 0.3.2's default asks its workers every 30 s
    assert router["stage"] > services(doc, "prefill-0")["k2-sglang-prefill"]["stage"]
    env = services(doc, "decode-1")["k2-sglang-decode"]["env"]
    assert env["SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"] == "480"


def test_sglang_older_pin_renders_old_spellings(tmp_path: Path) -> None:
    from tests.inventory_factory import write_inventory

    inv = write_inventory(tmp_path, hosts=2, k2_model="moonshotai/Kimi-K2-Instruct", k2_engine="sglang",
                          k2_engine_version="0.4.9", k2_gpu="h200", k2_tp=16, k2_dp=16, k2_attn_dp=True, k2_ep=16,
                          k2_ib_hcas=["mlx5_0", "mlx5_1"])
    _, plan = load_plan(inv)
    argv = next(iter(plan.hosts.values())).services[0].argv
    assert flag(argv, "--dp-size") == "16" and "--enable-dp-attention" in argv
    assert "--enable-deepep-moe" in argv and "--moe-a2a-backend" not in argv
    assert flag(argv, "--moe-dense-tp-size") == "1" and "--enable-dp-lm-head" in argv  # DP attention's companions


def test_b200_trtllm_container_and_seed_yaml() -> None:
    doc = plan_json("b200-trtllm")
    svc = services(doc, "b200-0")["k2-trtllm"]
    argv = svc["argv"]
    assert argv[:3] == ["/usr/bin/docker", "run", "--rm"]
    assert "nvcr.io/nvidia/tensorrt-llm/release:1.2.0" in argv
    assert flag(argv, "--gpus") == "all" and flag(argv, "--ipc") == "host"
    i = argv.index("trtllm-serve")
    assert argv[i + 1] == "serve" and argv[i + 2] == doc["checkpoint_path"]
    path = flag(argv, "--config")
    options = yaml.safe_load(svc["files"][path])
    assert options["max_batch_size"] == 128 and options["max_num_tokens"] == 8448 and options["max_seq_len"] == 8212
    assert options["tensor_parallel_size"] == 8 and options["moe_expert_parallel_size"] == 8
    assert options["enable_attention_dp"] is True and options["trust_remote_code"] is True
    assert options["kv_cache_config"] == {"free_gpu_memory_fraction": 0.75, "dtype": "fp8"}
    assert options["cache_transceiver_config"] == {"backend": "UCX", "max_tokens_in_buffer": 8448}


def test_h200_trtllm_mpirun_over_the_mesh_port() -> None:
    doc = plan_json("h200-trtllm-mpi")
    head = services(doc, "h200-0")
    assert "k2-trtllm" not in services(doc, "h200-1")
    argv = head["k2-trtllm"]["argv"]
    i = argv.index("mpirun")
    assert flag(argv, "-np") == "16" and flag(argv, "-H") == "192.0.2.70:8,192.0.2.71:8"
    rsh = argv[argv.index("plm_rsh_args") + 1]
    assert rsh.startswith("-p 2233 ") and "StrictHostKeyChecking=yes" in rsh and "/mesh/id_ed25519" in rsh
    assert "--allow-run-as-root" in argv[i:]
    j = argv.index("trtllm-llmapi-launch")
    assert argv[j + 1 : j + 3] == ["trtllm-serve", "serve"]
    assert flag(argv, "--tp_size") == "16" and flag(argv, "--ep_size") == "8"
    assert flag(argv, "--kv_cache_free_gpu_memory_fraction") == "0.95"
    options = yaml.safe_load(head["k2-trtllm"]["files"][flag(argv, "--config")])
    assert options["cuda_graph_config"] == {"enable_padding": True, "batch_sizes": [1, 2, 4, 8, 16, 32, 64, 128]}
    assert options["enable_attention_dp"] is True
    for host in ("h200-0", "h200-1"):  # every node's container runs the mesh sshd
        node = services(doc, host)["k2-trtllm-node"]["argv"]
        assert "/usr/sbin/sshd" in node and node[-1].endswith("mesh/sshd_config")
    assert head["k2-trtllm-node"]["stage"] < head["k2-trtllm"]["stage"]


def test_gb200_slurm_config_for_submit_py() -> None:
    doc = plan_json("gb200-trtllm-disagg")
    svc = services(doc, "gb200-login")["k2-trtllm-slurm-submit"]
    assert svc["argv"][1:3] == ["submit.py", "-c"] and svc["oneshot"] is True
    assert svc["workdir"].endswith("examples/disaggregated/slurm/benchmark")
    config = yaml.safe_load(svc["files"][svc["argv"][3]])
    assert set(config) >= {"slurm", "benchmark", "hardware", "environment", "worker_config"}
    assert config["slurm"]["script_file"] == "disaggr_torch.slurm" and config["slurm"]["numa_bind"] is True
    assert config["hardware"] == {"gpus_per_node": 4, "num_ctx_servers": 4, "num_gen_servers": 1}
    gen, ctx = config["worker_config"]["gen"], config["worker_config"]["ctx"]
    assert gen["tensor_parallel_size"] == 32 and gen["moe_expert_parallel_size"] == 32
    assert gen["moe_config"]["backend"] == "WIDEEP" and gen["moe_config"]["load_balancer"]["num_slots"] == 416
    assert ctx["tensor_parallel_size"] == 4 and ctx["cuda_graph_config"] is None
    assert config["environment"]["container_image"] == "nvcr.io/nvidia/tensorrt-llm/release:1.2.0"
    assert config["environment"]["model_path"] == doc["checkpoint_path"]


def test_ktransformers_legacy_amx_and_current_kt_kernel(tmp_path: Path) -> None:
    doc = plan_json("ktransformers")
    argv = services(doc, "kt-0")["k2-ktransformers"]["argv"]
    assert argv[1:3] == ["-m", "ktransformers.server.main"]
    assert flag(argv, "--gguf_path").endswith("unsloth--Kimi-K2-Instruct-GGUF/dc35109e1b6ecf981f1d30d57c117b9a58c0b31b")
    assert flag(argv, "--optimize_config_path").endswith("DeepSeek-V3-Chat-fp8-linear-ggml-experts-serve-amx.yaml")
    assert flag(argv, "--cache_lens") == "30000"
    from tests.inventory_factory import write_inventory

    inv = write_inventory(
        tmp_path, hosts=1, k2_model="moonshotai/Kimi-K2-Instruct", k2_engine="ktransformers", k2_gpu="h20",
        k2_gpus_per_node=1, k2_tp=1, k2_quantization="gguf", k2_gguf_repo="unsloth/Kimi-K2-Instruct-GGUF",
        k2_gguf_revision="dc35109e1b6ecf981f1d30d57c117b9a58c0b31b", k2_kt={"method": "LLAMAFILE", "cpuinfer": 96},
    )
    _, plan = load_plan(inv)
    argv = next(iter(plan.hosts.values())).services[0].argv
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert flag(argv, "--kt-method") == "LLAMAFILE" and flag(argv, "--kt-cpuinfer") == "96"
    assert "GGUF" in flag(argv, "--kt-weight-path")


def test_mi300x_rocm_container() -> None:
    doc = plan_json("mi300x")
    svc = services(doc, "mi300x-0")["k2-vllm"]
    argv = svc["argv"]
    assert "vllm/vllm-openai-rocm:v0.33.0" in argv
    assert "/dev/kfd" in argv and "/dev/dri" in argv and "--gpus" not in argv
    assert flag(argv, "--entrypoint") == "vllm"
    assert flag(argv, "--tensor-parallel-size") == "8" and "--no-enable-prefix-caching" in argv
    assert flag(argv, "--reasoning-parser") == "kimi_k2"
    assert svc["env"]["VLLM_ROCM_USE_AITER"] == "1" and "VLLM_USE_V1" not in svc["env"]
    assert "-e" in argv and "VLLM_ROCM_USE_AITER" in argv  # value passed by env, not argv


def test_human_plan_output_is_per_host() -> None:
    out = subprocess.run([sys.executable, "-m", "k2fleet.cli", "plan", str(INV / "h200-dp-ep.py")],
                         check=True, capture_output=True, text=True).stdout
    assert "== h200-0 (192.0.2.30)" in out and "== h200-1 (192.0.2.31)" in out
    assert "--data-parallel-start-rank 8" in out


def test_issue_25_models_render_their_parsers_and_notes() -> None:
    """K2.5/K2.6: Moonshot's vLLM argv (``--mm-encoder-tp-mode data``, kimi_k2 parsers); K3:
    the kimi_k3 parsers and no KV prediction (the plan's notes say why); 0905: no reasoning parser."""
    for name in ("h200-k25", "h200-k26"):
        doc = plan_json(name)
        argv = services(doc, "h200-0")["k2-vllm"]["argv"]
        assert flag(argv, "--mm-encoder-tp-mode") == "data"
        assert flag(argv, "--tool-call-parser") == flag(argv, "--reasoning-parser") == "kimi_k2"
        assert doc["capacity"]["serve"]["kv_bytes_per_token"] == 70_272
    doc = plan_json("h200-k3-sglang")
    argv = services(doc, "h200-0")["k2-sglang"]["argv"]
    assert flag(argv, "--tool-call-parser") == flag(argv, "--reasoning-parser") == "kimi_k3"
    assert doc["capacity"] == {} and any("no KV cache prediction" in n for n in doc["notes"])
    doc = plan_json("h200-k2-0905")
    argv = services(doc, "h200-0")["k2-vllm"]["argv"]
    assert flag(argv, "--tool-call-parser") == "kimi_k2" and "--reasoning-parser" not in argv


def test_sglang_dp_attention_ep_over_rdma() -> None:
    """4 × 8 H200, one SGLang DP-attention + DeepEP instance: the containers get the verbs
    devices and IPC_LOCK, the engines NCCL's and NVSHMEM's HCAs, and the plan shows the RDMA
    packages, GPUDirect RDMA and the fabric gate."""
    doc = plan_json("h200-sglang-dpa-ep")
    hcas = ",".join(f"mlx5_{i}" for i in range(8))
    for rank in range(4):
        svc = services(doc, f"h200-{rank}")["k2-sglang"]
        argv = svc["argv"]
        assert flag(argv, "--moe-a2a-backend") == "deepep" and flag(argv, "--node-rank") == str(rank)
        assert flag(argv, "--device") == "/dev/infiniband" and flag(argv, "--cap-add") == "IPC_LOCK"
        assert "memlock=-1" in argv
        assert svc["env"]["NCCL_IB_HCA"] == svc["env"]["NVSHMEM_HCA_LIST"] == hcas
        assert svc["env"]["NCCL_SOCKET_IFNAME"] == svc["env"]["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] == "ens10f0np0"
        assert "NVSHMEM_IB_ENABLE_IBGDA" not in svc["env"]  # DeepEP's Buffer sets it itself
        packages = {p["name"] for p in doc["hosts"][f"h200-{rank}"]["desired"]["bootstrap"]["packages"]}
        assert {"rdma-core", "ibverbs-utils", "infiniband-diags", "perftest"} <= packages
    text = subprocess.run([sys.executable, "-m", "k2fleet.cli", "plan", str(INV / "h200-sglang-dpa-ep.py")],
                          check=True, capture_output=True, text=True, cwd=ROOT).stdout
    section = text[text.index("== RDMA fabric"):]
    for words in ("rdma-core, ibverbs-utils, infiniband-diags, perftest", "GPUDirect RDMA: dma-buf",
                  "PeerMappingOverride=1", "GDRCopy", "--device /dev/infiniband --cap-add IPC_LOCK --ulimit memlock=-1",
                  f"NCCL_IB_HCA={hcas}", "fabric gate (preflight, before any change or engine start)",
                  "link layer InfiniBand, >= 400 Gb/s"):
        assert words in section, (words, section)


def test_rdma_without_hcas_adds_nothing() -> None:
    doc = plan_json("h200-sglang-tp16")
    argv = services(doc, "h200-0")["k2-sglang"]["argv"]
    assert "IPC_LOCK" not in argv and "/dev/infiniband" not in argv
    assert not any(k.startswith(("NCCL_IB", "NVSHMEM")) for k in services(doc, "h200-0")["k2-sglang"]["env"])
