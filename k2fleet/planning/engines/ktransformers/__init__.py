"""KTransformers on GGUF weights: routed experts on the CPU, the rest on the GPUs; one host per
instance. Pins >= 0.7 serve through sglang-kt (SGLang's server, flags and metric names); the
legacy server (0.3.x) has its own argv, no ``/health`` and no metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

from k2fleet.planning import catalog
from k2fleet.planning.engines.base import Engine, EngineMetrics, Refusal
from k2fleet.planning.engines.ktransformers import render as _render
from k2fleet.planning.engines.sglang import DASHBOARD_PANELS as SGLANG_PANELS, ENGINE as SGLANG, NCCL_WINDOW
from k2fleet.planning.engines.sglang import PROFILE_ROWS as SGLANG_ROWS

if TYPE_CHECKING:
    from k2fleet.planning.deployment import Deployment, Pool

API_KEY_FRONTED = ("KTransformers takes its API key only as --api-key (0.7.2, sglang-kt, which logs it at start) "
                   "or --api_key / ~/.ktransformers/config.yaml (0.3.2, checked by an assert on "
                   "/v1/chat/completions alone)")


class KTransformers(Engine):
    name = "ktransformers"
    label = "KTransformers"
    unit = "k2-ktransformers"
    package = "ktransformers"
    entry = "python"
    platforms = ("cuda",)
    owned_flags = _render.OWNED_FLAGS
    profile_rows = SGLANG_ROWS  # sglang-kt takes SGLang's flags
    context_flag = "context-length"
    fraction_flag = "mem-fraction-static"
    experts_in_host_ram = True  # no GPU-memory fit: preflight checks RAM instead
    needs_gguf = True
    metrics = EngineMetrics("/metrics", True, "KTransformers >= 0.7 serves through sglang-kt: SGLang's "
                            "--enable-metrics (in the 0.7.2 table); the 0.3.x legacy server has no metrics route")
    dashboard = "sglang"  # sglang-kt: SGLang's names
    dashboard_panels = SGLANG_PANELS
    torch_store_window = NCCL_WINDOW  # sglang-kt's, as SGLang's
    api_key_fronted = API_KEY_FRONTED

    def legacy(self, version: str) -> bool:
        return catalog.version_tuple(version) < _render.SGLANG_KT_SINCE

    def profile_refusal(self, version: str, profile: str) -> str | None:
        if profile != "default" and self.legacy(version):
            return (f"{profile}: KTransformers {version}'s legacy server has no tuning flags k2fleet renders "
                    "(only --cache_lens, k2_kt.cache_lens); use default, or pin KTransformers >= 0.7 (sglang-kt)")
        return None

    def pool_refusal(self, pool: Pool) -> Refusal | None:
        """KTransformers has no multi-node mode: one instance lives on one host."""
        if pool.nodes_per_instance > 1:
            return "k2_tp", (f"{pool.role} pool: KTransformers runs on one host, but tp×pp = {pool.instance_gpus} "
                             f"GPUs spans {pool.nodes_per_instance} hosts of {pool.instance_gpus // pool.nodes_per_instance}; "
                             "set k2_tp×k2_pp to at most k2_gpus_per_node (more hosts serve as separate replicas)")
        return None

    def keyed_flags(self, dep: Deployment, pool: Pool) -> dict[str, str]:
        return _render.keyed_flags(dep, pool)

    def render(self, dep: Deployment):
        return _render.render(dep)

    def metrics_path(self, dep: Deployment) -> str | None:
        if self.legacy(dep.version):
            return None
        return super().metrics_path(dep)

    def server(self, version: str) -> Engine:
        return self if self.legacy(version) else SGLANG

    def double_file(self, venv: str, rel: str) -> str | None:
        """The legacy server's rule files, where a source install keeps them."""
        if rel.startswith("ktransformers/optimize/") and rel.endswith(".yaml"):
            return f"{venv}/src/ktransformers/{rel}"
        return None


ENGINE = KTransformers()
