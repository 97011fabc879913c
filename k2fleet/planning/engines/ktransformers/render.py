"""KTransformers on GGUF weights: experts on the CPU (AMX / llamafile kernels), the
rest on the GPUs.

- pins ≥ 0.7 (``kt-kernel`` + ``sglang-kt``): ``python -m sglang.launch_server
  --model-path CONFIG --kt-weight-path GGUF --kt-method LLAMAFILE ...``;
- the legacy server (0.3.x, the seed's): ``python -m ktransformers.server.main
  --model_path CONFIG --model_name NAME --gguf_path GGUF --optimize_config_path RULES.yaml``,
  where RULES is the AMX serve rule file; it has no ``/health``, so its gate reads
  ``/v1/models``.

The GGUF directory holds the expert weights (``k2_gguf_repo`` files matching
``k2_gguf_pattern``, a weight set of its own: ``Deployment.weight_sets``); the config and
tokenizer come from ``k2_model`` (whose whole repository is fetched today, though the
legacy server reads only its config and tokenizer).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from k2fleet.planning.catalog import version_tuple
from k2fleet.planning.processes import Health, Service
from k2fleet.planning.render.common import engine_env, extra_flags, pool_engine_args, venv_bin
from k2fleet.planning.engines.sglang.render import OWNED_FLAGS as SGLANG_OWNED_FLAGS, feature_words, parser_and_context_flags

if TYPE_CHECKING:
    from k2fleet.planning.deployment import Deployment

LEGACY_AMX_RULES = "ktransformers/optimize/optimize_rules/DeepSeek-V3-Chat-fp8-linear-ggml-experts-serve-amx.yaml"
SGLANG_KT_SINCE = (0, 4, 0)
# The flags this renderer emits (sglang-kt's beside SGLang's, and the legacy server's) and so owns.
OWNED_FLAGS = SGLANG_OWNED_FLAGS | {
    "--kt-weight-path": "k2_gguf_repo", "--kt-method": "k2_kt", "--kt-cpuinfer": "k2_kt",
    "--kt-threadpool-count": "k2_kt", "--kt-num-gpu-experts": "k2_kt",
    "--model_path": "k2_model", "--gguf_path": "k2_gguf_repo", "--optimize_config_path": "k2_kt",
    "--cache_lens": "k2_kt",
    "--disable-shared-experts-fusion": "", "--model_name": "k2_served_model_name",
}


def keyed_flags(dep: Deployment, pool) -> dict[str, str]:
    """Flags this renderer emits only when an inventory key asks (sglang-kt: SGLang's feature flags)."""
    if version_tuple(dep.version) < SGLANG_KT_SINCE:
        return {}
    return parser_and_context_flags(dep)
# The legacy server has no /health; it listens only once the model is loaded, and
# GET /v1/models is its cheapest route (ktransformers/server/api/openai/endpoints/chat.py).
LEGACY_READY_PATH = "/v1/models"


def _kt_words(dep: Deployment, kt: dict, tp: int) -> list[str]:
    words = ["--model-path", dep.serve_path, "--served-model-name", dep.served_model_name]
    words += ["--host", "0.0.0.0", "--port", str(dep.s.port), "--tp-size", str(tp)]
    words += ["--kt-weight-path", str(dep.gguf_path), "--kt-method", str(kt.get("method", "LLAMAFILE"))]
    words += ["--kt-cpuinfer", str(kt.get("cpuinfer", 64)), "--kt-threadpool-count", str(kt.get("threadpool_count", 2))]
    words += ["--kt-num-gpu-experts", str(kt.get("gpu_experts", 0))]
    return words + feature_words(dep) + ["--disable-shared-experts-fusion"]


def _legacy_words(dep: Deployment, kt: dict) -> list[str]:
    # --model_name: what /v1/models lists (the server's default is its config.yaml's name)
    words = ["--model_path", dep.serve_path, "--model_name", dep.served_model_name, "--gguf_path", str(dep.gguf_path)]
    words += ["--cache_lens", str(kt.get("cache_lens", 30000)), "--port", str(dep.s.port), "--host", "0.0.0.0"]
    rules = kt.get("optimize_rules", LEGACY_AMX_RULES)
    if rules:
        words += ["--optimize_config_path", f"{dep.venv}/src/ktransformers/{rules}" if not rules.startswith("/") else rules]
    return words


def render(dep: Deployment) -> Iterator[tuple[str, Service]]:
    for pool in dep.pools.values():
        s = pool.settings
        for nodes in pool.instances:
            host = nodes[0]
            env = engine_env(dep, host, s.env)
            health = Health(dep.s.port)
            if version_tuple(dep.version) >= SGLANG_KT_SINCE:
                words = _kt_words(dep, s.kt, pool.tp) + extra_flags(dep, pool_engine_args(dep, s))
                argv = [venv_bin(dep, "python"), "-m", "sglang.launch_server", *words]
                what = f"KTransformers {dep.version} (sglang-kt, kt-method {s.kt.get('method', 'LLAMAFILE')})"
            else:
                words = _legacy_words(dep, s.kt) + extra_flags(dep, s.engine_args, dash="_")
                argv = [venv_bin(dep, "python"), "-m", "ktransformers.server.main", *words]
                what = f"KTransformers {dep.version} legacy server with AMX rules"
                health = Health(dep.s.port, path=LEGACY_READY_PATH)
            yield host.name, Service(
                name="k2-ktransformers", argv=argv, env=env, ports={"k2_port": dep.s.port},
                role=pool.role, health=health, description=what,
            )
