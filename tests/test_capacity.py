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


def test_tp8_on_h200_matches_the_seed() -> None:
    cap = serve_capacity(REPO / "inventories/h200.py")
    assert (cap.gpu, cap.kv_groups, cap.kv_bytes_per_token) == ("h200", 1, 70_272)
    assert cap.kv_gib == pytest.approx(46.80, rel=0.05)
    assert cap.tokens == pytest.approx(SEED_TP8_TOKENS, rel=0.05)
    assert cap.max_len == 262_144 and cap.fits == 2  # K2-Thinking's full context, twice


def test_dcp8_multiplies_the_tokens_by_8() -> None:
    tp8 = serve_capacity(REPO / "inventories/h200.py")
    dcp = serve_capacity(REPO / "inventories/h200-dcp.py")
    assert dcp.kv_gib == tp8.kv_gib and dcp.tokens == 8 * tp8.tokens
    assert dcp.tokens == pytest.approx(SEED_DCP8_TOKENS, rel=0.05)


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
    assert "KV tokens per instance" in line and "70,272 B/token" in line and "139.81 GiB h200 × 0.90" in line
    doc = json.loads(subprocess.run([tool("k2fleet"), "plan", "inventories/h200-dcp.py", "--json"], cwd=REPO,
                                    capture_output=True, text=True, check=True).stdout)
    serve = doc["capacity"]["serve"]
    assert serve["tokens"] == pytest.approx(SEED_DCP8_TOKENS, rel=0.05)
    assert {"kv_gib", "weights_gib", "non_expert_gib", "experts_gib", "kv_bytes_per_token", "fits"} <= set(serve)


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
    assert "spread the weights over at least 16 GPUs" in str(err)


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
