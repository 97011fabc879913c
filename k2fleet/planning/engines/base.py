"""What every engine answers (:class:`Engine`): the one interface the planner, the checks, the
capacity rule, the metrics, the health gate and the bench client ask, so that no module outside
:mod:`k2fleet.planning.engines` compares an engine's name.

An engine is one package, ``k2fleet/planning/engines/<name>/``: its ``__init__`` defines the
:class:`Engine` subclass (validation, parallelism, memory fractions with their sources, metric
names, bench client), ``render.py`` its units, argv and config files. Defaults here are the
common case; a subclass overrides what differs. Methods that refuse return ``(key, message)``
(the caller raises :class:`~k2fleet.inventory.spec.SpecError` with the inventory's source).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k2fleet.planning import catalog

if TYPE_CHECKING:  # types only: the deployment resolves through the registry (no runtime import)
    from k2fleet.inventory.spec import HostEntry, HostSettings
    from k2fleet.planning.capacity import Capacity, Layout
    from k2fleet.planning.deployment import Deployment, Pool
    from k2fleet.planning.processes import Service

DEFAULT_GPU_UTIL = 0.9  # the fraction k2fleet names when an engine's own default is not known
Refusal = tuple[str, str]  # (inventory key, one line: what is wrong and the fix)
ProfileRows = dict[str, list[tuple[str, Any, str]]]  # profile -> [(flag or option, value, source)]


@dataclass(frozen=True)
class EngineMetrics:
    """Where an engine publishes Prometheus metrics."""

    path: str | None  # None: the engine publishes none k2fleet can scrape
    needs_flag: bool  # only with k2_metrics (SGLang's --enable-metrics)
    source: str


def arg(args: dict[str, Any], *names: str) -> Any:
    """The value of an engine flag in ``k2_engine_args`` or an LLM API option, however spelt
    (``--max-model-len``, ``max_model_len``); None when absent.

    >>> arg({"--max_model_len": 4096}, "max-model-len"), arg({}, "x")
    (4096, None)
    """
    wanted = {n.replace("_", "-") for n in names}
    for key, value in args.items():
        if key.lstrip("-").replace("_", "-") in wanted:
            return value
    return None


def norm_flag(name: str) -> str:
    return name.lstrip("-").replace("_", "-")


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on ``base``, merged per nested section (copies; ``base`` is left alone)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


class Engine:
    """One serving engine. Subclasses set the class attributes and override what differs."""

    name: str = ""  # k2_engine's value
    label: str = ""  # how messages name it
    unit: str = ""  # its main systemd unit
    package: str = ""  # the PyPI distribution installed into k2_venv
    entry: str = ""  # the executable its argv starts with (health gate, status)
    platforms: tuple[str, ...] = ("cuda",)  # k2_platform values it has builds for
    default_images: dict[str, str] = {}  # platform -> image template ({version})
    has_cpu_build: bool = False  # the sandbox's real-engine rehearsal (vLLM's CPU build)
    container_only: str | None = None  # why its venv runtime is refused (None: a venv works)
    owned_flags: dict[str, str] = {}  # flags its renderer emits -> the inventory key ("" none)
    renamed_flags: list[tuple[str, str, list[str] | None]] = []  # (old flag, gone in version, replacement)
    flexible_flag_spelling: bool = False  # its parser takes --a_b for --a-b and dotted --x.y JSON keys
    flag_dash: str = "-"  # "_": its flags are spelt with underscores (--tp_size)
    llm_api: bool = False  # takes LLM API options (a YAML) rather than flags from k2_profile
    profile_rows: ProfileRows = {}
    a2a_backends: dict[str, tuple[tuple[str, ...], str]] = {}  # version -> (k2_moe_a2a_backend choices, source)
    a2a_refusal: str | None = "no all-to-all (no expert parallel across GPUs)"  # why it takes none (None: it does)
    a2a_env: str | None = None  # the variable its backend is set from at old pins (k2_env may not set it)
    context_flag: str = "context-length"  # the flag that sets the context length
    fraction_flag: str = "gpu-memory-utilization"  # the engine flag k2_gpu_memory_utilization renders as
    fraction_tunable: bool = False  # plan suggests a higher k2_gpu_memory_utilization when the KV cache is short
    dcp: bool = False  # decode context parallel (k2_dcp)
    dp_multiplies_gpus: bool = False  # its DP ranks are GPUs of their own (tp × pp × dp per instance)
    ep_within_tp: bool = False  # EP ranks subdivide the TP group (MoE tp × ep = tp)
    experts_in_host_ram: bool = False  # routed experts on the CPU: no GPU-memory fit, RAM instead
    needs_gguf: bool = False  # serves GGUF weights (k2_gguf_repo)
    pd_disaggregation: bool = False  # prefill/decode/router roles
    slurm_disaggregation: bool = False  # the slurm-submit role
    launches_with_mpirun: bool = False  # multi-node instances start through mpirun over the mesh
    after_units: tuple[str, ...] = ()  # units its engine unit starts after
    block_tokens: int = 1  # tokens per KV cache block
    metrics: EngineMetrics = EngineMetrics(None, False, "")
    dashboard: str | None = None  # the Grafana dashboard of its metric names (k2fleet.planning.dashboards)
    dashboard_panels: tuple[str, list[tuple[str, str, list[str]]]] | None = None  # (title, [(panel, unit, [PromQL])])
    request_counter: str | None = None  # the /metrics counter every completed request moves
    torch_store_window: tuple[int, int] | None = None  # its random NCCL/torch store port: API port + lo..hi
    bench_client: str | None = None  # default benchmark client executable (None: no bench client wired)
    bench_format: str | None = None  # how the bench result file reads (k2fleet.control.bench_run)
    api_key_env: str | None = None  # the variable the engine takes its API key from (None: the API front)
    api_key_fronted: str = ""  # why it cannot take the key without argv, logs or a weaker check (the API front's reason)
    world_keys: tuple[tuple[str, str], ...] = ()  # (its /v1/models metadata key, the Pool attribute) the doubles report

    def __repr__(self) -> str:
        return f"<engine {self.name}>"

    # ---- versions, runtime, platform

    def default_runtime(self, platform: str) -> str:
        return "container" if platform == "rocm" else "venv"

    def image(self, platform: str, version: str) -> str | None:
        template = self.default_images.get(platform)
        return template.format(version=version) if template else None

    def legacy(self, version: str) -> bool:
        """A pin served by a legacy server of another shape (KTransformers 0.3.x)."""
        return False

    # ---- parallelism (resolved onto Pool once, by k2fleet.planning.deployment)

    def instance_gpus(self, s: HostSettings, tp: int) -> int:
        """GPUs of one instance: attention DP runs inside the TP group unless DP ranks are GPUs."""
        return tp * s.pp * (s.dp if self.dp_multiplies_gpus else 1)

    def parallel_product(self) -> str:
        """How refusals name the product of the sizes that must fill whole nodes."""
        return "tp×pp"

    def resolved_dcp(self, s: HostSettings) -> int:
        return s.dcp if self.dcp else 1

    def parallel_refusal(self, s: HostSettings, tp: int) -> Refusal | None:
        """The pool's parallel sizes against each other (before node counts)."""
        if s.dcp > 1 and not self.dcp:
            return "k2_dcp", f"decode context parallel is a vLLM feature; remove it for {self.name}"
        return None

    def needs_ray(self, pool: Pool) -> bool:
        """Whether ``pool``'s instances run a Ray cluster."""
        return False

    def instance_refusal(self, s: HostSettings, nodes: int) -> Refusal | None:
        """An instance of ``nodes`` hosts against what the engine can span."""
        return None

    def pool_refusal(self, pool: Pool) -> Refusal | None:
        """A resolved pool against what the engine can run."""
        return None

    def instance_address_refusal(self, nodes: tuple[HostEntry, ...]) -> Refusal | None:
        return None

    # ---- memory (k2fleet.planning.capacity asks these)

    def fraction_and_kv_dtype(self, args: dict[str, Any], s: HostSettings, version: str, profile: str) -> tuple[Any, Any]:
        """The memory fraction and KV cache dtype an instance runs with, from its merged flags
        (the engine flag is rendered after k2_gpu_memory_utilization: it wins)."""
        fraction = arg(args, self.fraction_flag)
        if fraction is None:
            fraction = s.gpu_memory_utilization
        return fraction, arg(args, "kv-cache-dtype")

    def dense_tp(self, args: dict[str, Any], s: HostSettings) -> Any:
        return None

    def config_context(self, s: HostSettings) -> tuple[Any, str] | None:
        """The context length from its config file keys (value, key), or None."""
        return None

    def attn_tp(self, layout: Layout) -> int:
        """GPUs that share one copy of attention, dense layers and embedding."""
        return layout.tp

    def moe_ranks(self, layout: Layout) -> int:
        """GPUs the routed experts are split over."""
        return layout.tp

    def kv_groups(self, layout: Layout) -> int:
        """Independent KV caches per instance (each holds whole requests)."""
        return 1

    def wider(self, layout: Layout, k: int) -> Layout:
        """``layout`` over ``k`` times the GPUs (the fewest-GPUs suggestion)."""
        return dataclasses.replace(layout, tp=layout.tp * k)

    def default_fraction(self, gpu: catalog.GpuType, layout: Layout) -> tuple[float, str]:
        """The engine's own memory fraction at its pin, and its source."""
        raise NotImplementedError(self.name)

    def runtime_reserve(self, gpu: catalog.GpuType, layout: Layout) -> tuple[float, str]:
        """GiB per GPU the engine uses beside weights and KV cache, and the figure's source."""
        raise NotImplementedError(self.name)

    def kv_memory(self, total: float, fraction: float, weights: float, reserve: float,
                  layout: Layout, reserve_source: str) -> tuple[float, float, str]:
        """(runtime overhead, KV GiB per GPU, reserve source) by how the engine sizes its cache:
        total × fraction − weights − reserve."""
        return reserve, total * fraction - weights - reserve, reserve_source

    def arithmetic(self, cap: Capacity, total: str, weights: str) -> str:
        """How the KV memory per GPU comes about, in the engine's own terms."""
        runtime = f" − {cap.overhead_gib:.1f} GiB runtime" if cap.overhead_gib else ""
        fraction = f"{cap.fraction:.3f}".rstrip("0") if round(cap.fraction, 2) != cap.fraction else f"{cap.fraction:.2f}"
        return f"{total} × {fraction} − {weights}{runtime}"

    # ---- flags and profiles

    def keyed_flags(self, dep: Deployment, pool: Pool) -> dict[str, str]:
        """Flags its renderer emits for ``pool`` only when an inventory key asks (flag -> key)."""
        return {}

    def a2a_backend(self, pool: Pool) -> str | None:
        """The all-to-all backend ``pool`` runs with (None: the engine's own default)."""
        return pool.settings.moe_a2a_backend if pool.ep > 1 else None

    def rdma_a2a(self, backend: str) -> bool:
        """Whether ``backend`` moves tokens over RDMA (GPUDirect: the fabric section)."""
        return backend.startswith("deepep")

    def profile_refusal(self, version: str, profile: str) -> str | None:
        return None

    def profile_flags(self, version: str, profile: str) -> dict[str, Any]:
        """The profile's engine flags (``{name: value}``, as ``k2_engine_args`` spells them)."""
        if self.llm_api or self.profile_refusal(version, profile):
            return {}
        return {name: copy.deepcopy(value) for name, value, _ in self.profile_rows.get(profile, [])}

    def profile_llm_api(self, version: str, profile: str) -> dict[str, Any]:
        """The profile's LLM API options (engines that take them)."""
        return {name: copy.deepcopy(value) for name, value, _ in self.profile_rows.get(profile, [])} if self.llm_api else {}

    def merged_args(self, version: str, profile: str, user: dict[str, Any]) -> dict[str, Any]:
        """The profile's flags under the inventory's ``k2_engine_args``: a flag set there (however spelt) wins."""
        mine = {norm_flag(k) for k in user}
        base = {k: v for k, v in self.profile_flags(version, profile).items() if norm_flag(k) not in mine}
        return base | dict(user)

    def merged_llm_api(self, version: str, profile: str, user: dict[str, Any]) -> dict[str, Any]:
        """The profile's LLM API options under ``k2_trtllm_config``, merged per section (a
        ``cuda_graph_config: null`` there removes the profile's section)."""
        return deep_merge(self.profile_llm_api(version, profile), user)

    def flag_words(self, version: str, name: str, value: Any, dash: str = "-") -> list[str]:
        """One extra flag as argv words, translated for ``version`` when it was renamed."""
        name = name.lstrip("-")
        if value is False or value is None:
            return []
        for old, gone_in, replacement in self.renamed_flags:
            if name == old and catalog.version_tuple(version) >= catalog.version_tuple(gone_in):
                if replacement is None:
                    return []
                words: list[str] = []
                for word in replacement:
                    words.extend(_value_words(value) if word == "{value}" else [word])
                return words
        if dash == "_":
            name = name.replace("-", "_")
        if value is True:
            return [f"--{name}"]
        return [f"--{name}", *_value_words(value)]

    def flag_forms(self, flag: str) -> list[str]:
        """The spellings of ``flag`` its parser takes as the same option."""
        return [flag, flag.replace("_", "-")] if self.flexible_flag_spelling else [flag]

    def table_flag(self, word: str) -> str:
        """``word`` as the engine's flag table lists it."""
        return word

    # ---- rendering, health, metrics, bench

    def render(self, dep: Deployment) -> Iterator[tuple[str, Any]]:
        raise NotImplementedError(self.name)

    def api_model_name(self, dep: Deployment) -> str:
        """The ``model`` clients send."""
        return dep.served_model_name

    def slurm_config(self, dep: Deployment, pool: Pool) -> dict[str, Any] | None:
        """The Slurm job config it renders for ``pool`` (None: it submits none)."""
        return None

    def metrics_path(self, dep: Deployment) -> str | None:
        """The path its instances serve Prometheus metrics on (None: none to scrape)."""
        if self.metrics.needs_flag and not dep.s.metrics:
            return None
        return self.metrics.path

    def server(self, version: str) -> "Engine":
        """The engine whose server runs at ``version`` (KTransformers >= 0.7: SGLang's, sglang-kt)."""
        return self

    def world(self, pool: Pool) -> dict[str, Any] | None:
        """The parallel sizes its test double reports in ``/v1/models`` metadata (None: none)."""
        if not self.world_keys:
            return None
        return {key: getattr(pool, attr) for key, attr in self.world_keys}

    def reports_members(self) -> bool:
        """Its rendezvous (not Ray) reports the addresses of the instance's other hosts."""
        return False

    def double_file(self, venv: str, rel: str) -> str | None:
        """Where a file of the engine test doubles goes beside a venv install (None: nowhere)."""
        return None

    def bench_prefix(self, client: str) -> list[str]:
        raise NotImplementedError(self.name)

    def result_filename(self, label: str, concurrency: int) -> str:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)
        return f"{safe}-c{concurrency}.json"

    def bench_argv(self, client: str, base: str, label: str, model: str, tokenizer: str, concurrency: int,
                   num_prompts: int, input_len: int, output_len: int, result_dir: Path) -> list[str]:
        raise NotImplementedError(self.name)


def _value_words(value: Any) -> list[str]:
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return [str(value)]
