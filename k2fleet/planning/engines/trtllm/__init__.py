"""TensorRT-LLM: ``trtllm-serve`` in the release container with an extra LLM API options YAML;
multi-node through ``mpirun`` over k2fleet's SSH mesh; the SLURM disaggregated wide-EP path
(``k2_role: slurm-submit``). Memory: (total − weights − runtime) × ``free_gpu_memory_fraction``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from k2fleet.planning import catalog
from k2fleet.planning.engines.base import Engine, EngineMetrics, Refusal, arg
from k2fleet.planning.engines.trtllm import render as _render
from k2fleet.planning.engines.vllm import RESERVE_SOURCE, VLLM_RUNTIME_GIB

if TYPE_CHECKING:
    from k2fleet.inventory.spec import HostEntry, HostSettings
    from k2fleet.planning.capacity import Capacity, Layout
    from k2fleet.planning.deployment import Deployment, Pool

DEFAULT_FREE_FRACTION = 0.9  # TensorRT-LLM KvCacheConfig.free_gpu_memory_fraction default
API_KEY_FRONTED = "trtllm-serve 1.2.0 has no API key option at all"

# k2_profile's rows: LLM API options (the --config YAML), never enable_attention_dp (k2_attn_dp owns it).
# TensorRT-LLM 1.2.0: LLM API options (the --config YAML), never enable_attention_dp (k2_attn_dp owns it).
_CUDA_GRAPH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]  # [moonshot-deploy] TensorRT-LLM Deployment, cuda_graph_config
PROFILE_ROWS: dict[str, list[tuple[str, Any, str]]] = {
    "latency": [
        ("max_batch_size", 32, "k2fleet's choice: the seed's CUDA-graph batch list cut at 32"),
        ("max_num_tokens", 4096, "[moonshot-deploy] TensorRT-LLM Deployment: --max_num_tokens 4096"),
        ("cuda_graph_config", {"enable_padding": True, "batch_sizes": _CUDA_GRAPH_SIZES[:6]},
         "[moonshot-deploy] TensorRT-LLM Deployment: cuda_graph_config padding_enabled (1.2: enable_padding), "
         "batch_sizes up to 32"),
    ],
    "throughput": [
        ("max_batch_size", 128, "[trtllm-blackwell] Launch the TensorRT LLM Server: max_batch_size: 128"),
        ("max_num_tokens", 8448, "[trtllm-blackwell] Launch the TensorRT LLM Server: max_num_tokens: 8448"),
        ("kv_cache_config", {"free_gpu_memory_fraction": 0.75, "dtype": "fp8"},
         "[trtllm-blackwell] Launch the TensorRT LLM Server: kv_cache_config free_gpu_memory_fraction 0.75, dtype fp8"),
        ("cuda_graph_config", {"enable_padding": True, "batch_sizes": _CUDA_GRAPH_SIZES},
         "[moonshot-deploy] TensorRT-LLM Deployment: cuda_graph_config, batch_sizes 1..128"),
    ],
    "long-context": [
        ("enable_chunked_prefill", True, "[k2-thinking-summary] chunked prefill, essential for long contexts "
         "(TRT-LLM's enable_chunked_prefill)"),
        ("max_num_tokens", 8448, "[trtllm-blackwell] SLURM worker_config ctx: max_num_tokens 8448"),
        ("kv_cache_config", {"dtype": "fp8"}, "[trtllm-blackwell] kv_cache_config dtype fp8: half the KV bytes per token"),
    ],
}


class TensorRTLLM(Engine):
    name = "trtllm"
    label = "TensorRT-LLM"
    unit = "k2-trtllm"
    package = "tensorrt_llm"
    entry = "trtllm-serve"
    platforms = ("cuda",)
    default_images = {"cuda": "nvcr.io/nvidia/tensorrt-llm/release:{version}"}
    container_only = "TensorRT-LLM ships as a container image (the PyPI package is a stub); use container"
    owned_flags = _render.OWNED_FLAGS
    flag_dash = "_"
    llm_api = True
    profile_rows = PROFILE_ROWS
    a2a_refusal = "its LLM API moe_config in k2_trtllm_config"
    context_flag = "max_seq_len"
    ep_within_tp = True
    slurm_disaggregation = True
    launches_with_mpirun = True
    after_units = ("k2-mesh-sshd.service",)
    block_tokens = 32  # tokens_per_block
    metrics = EngineMetrics("/prometheus/metrics", False, "trtllm-serve: /metrics answers JSON iteration stats, "
                            "not the Prometheus format; its Prometheus route is /prometheus/metrics (not verified "
                            "at 1.2.0 from a source in this repository: a target that stays down says so)")
    api_key_fronted = API_KEY_FRONTED
    world_keys = (("tp_size", "tp"), ("pp_size", "pp"))

    def default_runtime(self, platform: str) -> str:
        return "container"

    def instance_address_refusal(self, nodes: tuple[HostEntry, ...]) -> Refusal | None:
        """Across nodes it names its hosts in ``mpirun -H HOST:SLOTS``, a form Open MPI splits at
        the colon: an IPv6 address has no spelling there that k2fleet has verified."""
        v6 = [h.name for h in nodes if ":" in h.address]
        if len(nodes) > 1 and v6:
            return "k2_address", (f"{', '.join(v6)}: TensorRT-LLM across nodes runs mpirun -H HOST:SLOTS, "
                                  "which takes no IPv6 address; give these hosts IPv4 fleet addresses")
        return None

    # memory
    def fraction_and_kv_dtype(self, args: dict[str, Any], s: HostSettings, version: str, profile: str) -> tuple[Any, Any]:
        kv_config = self.merged_llm_api(version, profile, s.trtllm_config).get("kv_cache_config") or {}
        fraction = kv_config.get("free_gpu_memory_fraction")
        if fraction is None:
            fraction = arg(args, "kv_cache_free_gpu_memory_fraction")
        return fraction, kv_config.get("dtype")

    def config_context(self, s: HostSettings) -> tuple[Any, str] | None:
        if s.trtllm_config.get("max_seq_len") is not None:
            return s.trtllm_config["max_seq_len"], "k2_trtllm_config.max_seq_len"
        return None

    def attn_tp(self, layout: Layout) -> int:
        return 1 if layout.attn_dp else layout.tp

    def kv_groups(self, layout: Layout) -> int:
        return layout.tp if layout.attn_dp else 1

    def default_fraction(self, gpu: catalog.GpuType, layout: Layout) -> tuple[float, str]:
        return DEFAULT_FREE_FRACTION, "TensorRT-LLM's KvCacheConfig.free_gpu_memory_fraction default"

    def runtime_reserve(self, gpu: catalog.GpuType, layout: Layout) -> tuple[float, str]:
        return VLLM_RUNTIME_GIB, "vLLM's, " + RESERVE_SOURCE.split(": ", 1)[1] + "; TensorRT-LLM's own not measured"

    def kv_memory(self, total: float, fraction: float, weights: float, reserve: float,
                  layout: Layout, reserve_source: str) -> tuple[float, float, str]:
        return reserve, (total - weights - reserve) * fraction, reserve_source

    def arithmetic(self, cap: Capacity, total: str, weights: str) -> str:
        return f"({total} − {weights} − {cap.overhead_gib:.1f} GiB runtime) × {cap.fraction:.2f}"

    # flags, rendering
    def keyed_flags(self, dep: Deployment, pool: Pool) -> dict[str, str]:
        return _render.keyed_flags(dep, pool)

    def render(self, dep: Deployment):
        return _render.render(dep)

    def api_model_name(self, dep: Deployment) -> str:
        """trtllm-serve names the model by its path."""
        return dep.serve_path

    def slurm_config(self, dep: Deployment, pool: Pool) -> dict[str, Any] | None:
        return _render.slurm_config(dep, pool)


ENGINE = TensorRTLLM()
