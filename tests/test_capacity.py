"""KV capacity offline (issue #24 item 4): ``k2fleet plan`` predicts the KV tokens of each
serving instance from GPU memory, the engine's memory fraction, weights per GPU (the parts
every rank of an attention group holds, and the routed experts TP/EP split) and MLA's bytes
per token; validate refuses a context length that cannot fit.

Calibration (the seed, vLLM's Kimi-K2-Thinking guide, TP8 on 8 × H200): "Available KV cache
memory: 46.80 GiB" → "GPU KV cache size: 715,072 tokens"; with DCP8 × 8 = 5,721,088.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from k2fleet.cli import load_plan
from k2fleet.inventory.spec import SpecError
from k2fleet.planning import capacity, catalog
from k2sandbox.harness import tool
from tests.inventory_factory import scenario_inventories, write_inventory

REPO = Path(__file__).resolve().parent.parent
SEED_TP8_TOKENS = 715_072
SEED_DCP8_TOKENS = 5_721_088
INSTRUCT = {"k2_model": "moonshotai/Kimi-K2-Instruct", "k2_revision": "fd1984e2b7a3350dbf7305fe73a4ede25c14de50"}


def serve_capacity(inventory: Path | str, *data: str) -> capacity.Capacity:
    dep, plan = load_plan(inventory, data)
    assert plan.capacity == dep.capacity
    return dep.capacity["serve"]


def test_kimi_k2_shape_and_bytes() -> None:
    arch = catalog.KIMI_K2
    params = arch.params()
    assert sum(params.values()) == pytest.approx(1.0264e12, rel=1e-3)  # "1T total" (1,026.4 B)
    assert params["experts"] / sum(params.values()) > 0.98
    assert arch.mla_bytes_per_token() == 70_272  # (512 + 64) × 61 × 2
    assert arch.mla_bytes_per_token(1) == 35_136
    raw = sum(n * catalog.WEIGHT_BYTES["int4"][part] for part, n in params.items())
    assert raw == pytest.approx(594e9, rel=0.01)  # Kimi-K2-Thinking's 62 shards
    raw = sum(n * catalog.WEIGHT_BYTES["fp8"][part] for part, n in params.items())
    assert raw == pytest.approx(1.03e12, rel=0.01)  # Kimi-K2-Instruct's 61 shards


# The guide ran a vLLM nightly of 2025-11: 0.9 default, CUDA graphs not counted, as at the 0.10.0 and 0.11.0
# pins (0.11.0 has no kimi_k2 reasoning parser, which h200.py renders: 0.10.0 here)
GUIDE_PIN = 'k2_engine_version="0.10.0"'


def test_tp8_on_h200_matches_the_seed() -> None:
    cap = serve_capacity(REPO / "inventories/h200.py", GUIDE_PIN)
    assert (cap.gpu, cap.kv_groups, cap.kv_bytes_per_token, cap.fraction) == ("h200", 1, 70_272, 0.9)
    assert cap.kv_gib == pytest.approx(46.80, rel=0.05)
    assert cap.tokens == pytest.approx(SEED_TP8_TOKENS, rel=0.05)
    assert cap.max_len == 262_144 and cap.fits == 2  # K2-Thinking's full context, twice
    assert cap.verified and "Available KV cache memory: 46.80 GiB" in cap.verified
    assert "verified against" in cap.summary()


def test_vllm_033_uses_its_own_default_and_says_it_is_unverified() -> None:
    """vLLM 0.33.0's --gpu-memory-utilization default is 0.92 (vllm/config/cache.py) and it subtracts its
    CUDA graph estimate too (since 0.21): the guide's log does not cover that accounting."""
    cap = serve_capacity(REPO / "inventories/h200.py")
    assert cap.fraction == 0.92 and "vLLM 0.33.0's --gpu-memory-utilization default" in cap.fraction_source
    assert cap.verified is None and "unverified" in cap.summary() and "CUDA graph" in cap.reserve_source
    assert cap.kv_gib == pytest.approx(139.81 * 0.92 - cap.weights_gib - capacity.VLLM_RUNTIME_GIB)


def test_dcp8_multiplies_the_tokens_by_8() -> None:
    tp8 = serve_capacity(REPO / "inventories/h200.py", GUIDE_PIN)
    dcp = serve_capacity(REPO / "inventories/h200-dcp.py", GUIDE_PIN)
    assert dcp.kv_gib == tp8.kv_gib and dcp.tokens == 8 * tp8.tokens
    assert dcp.tokens == pytest.approx(SEED_DCP8_TOKENS, rel=0.05) and dcp.verified


def test_ep_at_tp1_counts_what_every_rank_holds() -> None:
    """DP16 + EP16 at TP1: each rank holds all attention, dense layers and embedding, and 1/16 of the
    routed experts — not 1/16 of everything."""
    cap = serve_capacity(REPO / "inventories/h200-dp-ep.py")
    split = capacity.weight_split(catalog.KIMI_K2, "fp8", catalog.CHECKPOINTS["moonshotai/Kimi-K2-Instruct"].bytes)
    non_expert = sum(b for part, b in split.items() if part != "experts") / catalog.GIB
    assert cap.non_expert_gib == pytest.approx(non_expert)
    assert cap.experts_gib == pytest.approx(split["experts"] / 16 / catalog.GIB)
    assert cap.weights_gib > 1.03e12 / 16 / catalog.GIB + 12  # the old rule's all-weights / 16 missed ~13 GiB
    assert cap.kv_groups == 16 and cap.tokens == 16 * cap.tokens_per_kv_group


def test_plan_shows_the_prediction_as_text_and_json() -> None:
    text = subprocess.run([tool("k2fleet"), "plan", "inventories/h200.py"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout
    line = next(line for line in text.splitlines() if line.startswith("# KV cache (serve): "))
    assert "KV tokens per instance" in line and "70,272 B/token" in line and "139.81 GiB h200 × 0.92" in line
    assert "unverified" in line and "runtime reserve: measured" in line
    doc = json.loads(subprocess.run([tool("k2fleet"), "plan", "inventories/h200-dcp.py", "--json", "--data", GUIDE_PIN],
                                    cwd=REPO, capture_output=True, text=True, check=True).stdout)
    serve = doc["capacity"]["serve"]
    assert serve["tokens"] == pytest.approx(SEED_DCP8_TOKENS, rel=0.05)
    assert {"kv_gib", "weights_gib", "non_expert_gib", "experts_gib", "kv_bytes_per_token", "fits", "fraction_source",
            "reserve_source", "verified"} <= set(serve)
    assert "5,721,088" in serve["verified"]


@pytest.mark.parametrize("inventory", [p.split("/", 1)[1] for p in scenario_inventories()])
def test_every_scenario_still_fits(inventory: str) -> None:
    dep, plan = load_plan(REPO / "inventories" / inventory)
    for cap in dep.capacity.values():
        assert cap.kv_gib > 0 and (cap.fits is None or cap.fits >= cap.concurrency), cap.summary()


def _refusal(tmp_path: Path, hosts: int = 1, **data) -> SpecError:
    with pytest.raises(SpecError) as info:
        load_plan(write_inventory(tmp_path, hosts=hosts, **data))
    return info.value


def test_full_context_on_8_h100_is_refused(tmp_path: Path) -> None:
    err = _refusal(tmp_path, k2_gpu="h100", k2_max_model_len=262144)
    assert err.key == "k2_tp" and "70.9 GiB of int4 weights per GPU" in str(err)
    assert "spread the weights over at least 16 GPUs" in str(err) and "k2_runtime_reserve_gib" in str(err)


# The seed's 8 × H100 bring-up (shared/seeds, "Kimi-K2-Thinking Deployment Summary"): vLLM TP8,
# --max-model-len 262144, --max-num-seqs 4, --max-num-batched-tokens 32768, --gpu-memory-utilization 0.95;
# its budget: "Model weights ~74 GB", "KV cache ~4-6 GB", "Activations ~1-2 GB" per GPU.
H100_SEED = dict(k2_gpu="h100", k2_engine_version="0.10.0", k2_gpu_memory_utilization=0.95,
                 k2_max_model_len=262144, k2_engine_args={"max-num-seqs": 4, "max-num-batched-tokens": 32768})


def test_the_h100_seed_is_decided_with_its_arithmetic(tmp_path: Path) -> None:
    """0.95 × 79.18 GiB = 75.22 GiB; the checkpoint's 70.93 GiB per GPU leaves 4.29 GiB — the seed's "4-6 GB
    KV cache" — before any runtime memory. vLLM's measured runtime reserve (8.1 GiB, the guide's H200 TP8 log)
    does not fit in it: refused, saying so. An operator who measured their own reserve sets
    k2_runtime_reserve_gib: at 2 GiB it holds 2.29 GiB of KV = 35,008 tokens (whole 64-token blocks), so the
    seed's 262,144 is refused naming that length, and a context it can hold is accepted."""
    err = _refusal(tmp_path / "a", **H100_SEED)
    msg = str(err)
    assert err.key == "k2_tp" and "70.9 GiB of int4 weights per GPU" in msg and "+ 8.1 GiB runtime" in msg
    assert "79.18 GiB × 0.95 on h100" in msg and "measured: vLLM recipe Kimi-K2-Thinking TP8 log on H200" in msg
    err = _refusal(tmp_path / "b", **(H100_SEED | {"k2_runtime_reserve_gib": 2.0}))
    assert err.key == "k2_max_model_len" and "lower k2_max_model_len to at most 35,008" in str(err)
    cap = serve_capacity(write_inventory(tmp_path / "c", **(H100_SEED | {"k2_runtime_reserve_gib": 2.0,
                                                                          "k2_max_model_len": 32768})))
    assert cap.tokens == 35_008 and cap.fits == 1 and cap.reserve_source == "k2_runtime_reserve_gib"
    assert cap.kv_gib == pytest.approx(79.18 * 0.95 - cap.weights_gib - 2.0) and cap.verified is None


def test_sglang_fraction_is_its_own_at_the_pin(tmp_path: Path) -> None:
    """SGLang computes mem_fraction_static when unset: (nvidia-smi MiB − its reserve) / MiB. H200 TP8 at
    0.5.23: 512 + 8192 × 1.5 + 8/8 × 1024 + 512 × 2 (decode graph) + 1536 (MLA prefill graph) = 16,384 MiB
    of 143,771 → 0.886; under DP attention (DP8 + EP8, DeepEP) it adds 512 × 8 × 4.5 (18,432), 2,048 for
    DeepEP decode buffers and 1,024 for its prefill graph: 37,888 MiB → 0.736, far lower."""
    sg = dict(k2_engine="sglang", k2_model="moonshotai/Kimi-K2-Instruct", k2_max_model_len=32768)
    tp8 = serve_capacity(write_inventory(tmp_path / "tp8", **sg))
    assert tp8.fraction == 0.886 and "SGLang 0.5.23's mem_fraction_static" in tp8.fraction_source
    assert tp8.kv_gib == pytest.approx(139.81 * 0.886 - tp8.weights_gib) and tp8.verified is None
    assert "16,384 MiB of 143,771" in tp8.reserve_source
    dpa = serve_capacity(write_inventory(tmp_path / "dpa", **(sg | {"k2_model": "moonshotai/Kimi-K2-Thinking"}),
                                         k2_dp=8, k2_attn_dp=True, k2_ep=8))
    assert capacity.sglang_reserve_mib(catalog.GPUS["h200"], capacity.Layout(
        "sglang", tp=8, dp=8, ep=8, attn_dp=True, version="0.5.23", a2a_backend="deepep")) == 37_888
    assert dpa.fraction == round((143_771 - 37_888) / 143_771, 3) == 0.736
    old = serve_capacity(write_inventory(tmp_path / "old", **sg, k2_engine_version="0.4.9"))
    assert old.fraction == round((143_771 - (12 + 8 / 2) * 1024) / 143_771, 3)  # 0.4.9's table: H200 12 + TP/2 GiB
    set_ = serve_capacity(write_inventory(tmp_path / "set", **sg, k2_gpu_memory_utilization=0.9))
    assert set_.fraction == 0.9 and set_.fraction_source == "set by the inventory"
    own = serve_capacity(write_inventory(tmp_path / "own", **sg, k2_runtime_reserve_gib=12.0))
    assert own.fraction == round((143_771 - 12 * 1024) / 143_771, 3) and own.reserve_source == "k2_runtime_reserve_gib"


def test_trtllm_free_fraction_and_reserve(tmp_path: Path) -> None:
    cap = serve_capacity(write_inventory(tmp_path, k2_engine="trtllm", k2_model="nvidia/Kimi-K2-Thinking-NVFP4",
                                         k2_gpu="b200", k2_runtime="container"))
    assert cap.fraction == 0.9 and "free_gpu_memory_fraction default" in cap.fraction_source
    assert cap.kv_gib == pytest.approx((cap.gpu_total_gib - cap.weights_gib - 8.1) * 0.9)
    assert cap.verified is None and "TensorRT-LLM's own not measured" in cap.reserve_source


def test_context_times_concurrency_that_cannot_fit_is_refused_with_the_numbers(tmp_path: Path) -> None:
    err = _refusal(tmp_path, k2_max_model_len=262144, k2_expected_concurrency=3)
    msg = str(err)
    assert err.key == "k2_max_model_len"
    for words in ("262,144 tokens × 3 requests", "70,272 B/token", "lower k2_max_model_len to at most",
                  "raise k2_tp/k2_dcp, or use more GPUs"):
        assert words in msg, msg
    # the twins: 2 at once fit at TP8, 3 with DCP8
    load_plan(write_inventory(tmp_path / "two", k2_max_model_len=262144, k2_expected_concurrency=2))
    load_plan(write_inventory(tmp_path / "dcp", k2_max_model_len=262144, k2_expected_concurrency=3, k2_dcp=8))


def test_engine_flags_count(tmp_path: Path) -> None:
    """The context and memory fraction the engine gets from k2_engine_args, and an FP8 KV cache."""
    err = _refusal(tmp_path, k2_engine_args={"max-model-len": "128K"}, k2_expected_concurrency=6)
    assert err.key == "k2_engine_args.max-model-len" and "131,072 tokens × 6" in str(err)
    fp8 = serve_capacity(write_inventory(tmp_path / "fp8", k2_engine_args={"kv-cache-dtype": "fp8"}))
    assert fp8.kv_bytes_per_token == 35_136
    low = serve_capacity(write_inventory(tmp_path / "low", k2_engine_args={"gpu-memory-utilization": 0.8}))
    assert low.fraction == 0.8


def test_ktransformers_plan_says_its_capacity_is_unverified() -> None:
    """#34: every engine's prediction is verified against a cited log line or the plan says it is
    not; KTransformers gets none (experts in host RAM), and its plan says so."""
    dep, _ = load_plan(str(REPO / "inventories/ktransformers.py"))
    assert dep.capacity == {}
    assert any(n.startswith("ktransformers: no KV cache prediction") and n.endswith("capacity unverified")
               for n in dep.notes), dep.notes
