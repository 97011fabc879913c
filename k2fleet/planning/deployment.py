"""A validated fleet with every default resolved: what the planner and renderers read.

:func:`resolve` applies the cross-key rules (parallel sizes, node counts, hardware
fit, PD completeness, versions) and raises :class:`~k2fleet.inventory.spec.SpecError` naming the
key and the fix for the first one broken. Port clashes are checked on the plan
(:func:`k2fleet.planning.planner.make_plan`), where every port of every process is known.
"""

from __future__ import annotations

import ipaddress
import math
import os
import posixpath
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any
from urllib.parse import urlsplit

from k2fleet.planning.engine_side import engine_min_python, host_python
from k2fleet.planning import capacity, catalog, engines, mirrors, profiles
from k2fleet.planning.engines.base import Engine, arg as _arg
from k2fleet.planning.os_tables import MIRROR_LAYOUTS, DriverChoice, choose_driver, host_os
from k2fleet.inventory.spec import SHA_RE, Fleet, HostEntry, HostSettings, SpecError

DEFAULT_GPU_UTIL = capacity.DEFAULT_GPU_UTIL
PD_ROLES = ("prefill", "decode", "router")


@dataclass(frozen=True)
class Pool:
    """Hosts of one role and how they split into engine instances: the parallel sizes resolved
    once (:func:`resolve`, by the engine's rules); renderers and checks read them here, never
    from the raw settings. ``dcp`` is 1 for engines without decode context parallel."""

    role: str
    hosts: tuple[HostEntry, ...]
    settings: HostSettings
    tp: int
    instance_gpus: int
    nodes_per_instance: int
    pp: int = 1
    dp: int = 1
    ep: int = 1
    dcp: int = 1

    @property
    def instances(self) -> list[tuple[HostEntry, ...]]:
        n = self.nodes_per_instance
        return [self.hosts[i : i + n] for i in range(0, len(self.hosts), n)]


@dataclass(frozen=True)
class WeightSet:
    """One pinned Hub repository every weight-loading host must hold, verified file by
    file, at ``path`` (the same on every host), before any engine starts.

    ``check``: its HostState check name; ``source``: ``hub`` or ``control:/DIR``;
    ``patterns``: the repository files it holds (None: all); ``label``: what operation
    names add for it ("" for the model checkpoint); ``manifest_sha256``: the digest of the
    manifest every host must accept (:func:`k2fleet.hostprogs.verify.manifest_digest`),
    pinned by the control machine before any host receives a byte
    (:func:`k2fleet.control.checkpoint_copy.manifest_pins`; None: not pinned yet, e.g.
    ``k2fleet plan`` before the first deploy).
    """

    check: str
    repo: str
    revision: str
    path: str
    source: str
    patterns: tuple[str, ...] | None
    label: str
    manifest_sha256: str | None = None


CHECKPOINT_CHECK = "checkpoint-verified"
GGUF_CHECK = "gguf-verified"


@dataclass(frozen=True)
class Deployment:
    """Everything the renderers need, defaults resolved."""

    fleet: Fleet
    engine: str
    version: str
    platform: str
    runtime: str
    image: str | None
    gpu: catalog.GpuType | None
    gpus_per_node: int
    checkpoint_bytes: int
    quantization: str
    reasoning_parser: str | None
    served_model_name: str
    pools: dict[str, Pool]
    engine_impl: Engine  # k2_engine's engine (k2fleet.planning.engines): everything engine-specific is asked of it
    driver: DriverChoice | None = None  # NVIDIA driver the bootstrap installs (None: AMD)
    capacity: dict[str, capacity.Capacity] = field(default_factory=dict)  # per role (or disagg side): the KV prediction
    tool_parser: str | None = None  # k2_tool_parser, the catalog's parser for its default (kimi_k3 for Kimi-K3)
    model_args: tuple[str, ...] = ()  # flags the model's deployment adds (catalog.Checkpoint.engine_args)
    notes: tuple[str, ...] = ()  # what k2fleet could not check or predict for this model (``k2fleet plan`` shows them)
    manifest_pins: tuple[tuple[str, str], ...] = ()  # weight set check → pinned manifest digest (:meth:`pinned`)

    @property
    def s(self) -> HostSettings:
        return self.fleet.settings

    @cached_property
    def fleet_ips(self) -> tuple[str, ...]:
        """Every host's fleet IP (names were resolved before planning) and IP ``ssh_hostname``,
        each once, in inventory order (the firewall's "fleet"; computed once: every host's
        firewall asks for it)."""
        seen: dict[str, None] = {}
        for h in self.fleet.hosts:
            for value in (h.address, h.ssh_hostname):
                try:
                    seen.setdefault(str(ipaddress.ip_address(value or "")))
                except ValueError:
                    pass
        return tuple(seen)

    @property
    def engine_cpu_build(self) -> bool:
        """Sandbox only: ``k2_engine_cpu_build`` (with ``k2_simulated_gpus``) — the real engine, its
        CPU build: the stand-ins' engine wheelhouse (:mod:`k2fleet.control.stand_ins`) installs it
        for the pinned release into ``k2_venv`` with no package index."""
        return self.s.engine_cpu_build

    @property
    def version_tuple(self) -> tuple[int, ...]:
        return catalog.version_tuple(self.version)

    @property
    def venv(self) -> str:
        """The engine's venv (venv runtime): ``k2_venv/<engine>-<version>``, one per release, so
        a ``k2_engine_version`` change installs the new engine beside the one that serves."""
        return posixpath.join(self.s.venv, f"{self.engine}-{self.version}")

    @property
    def checkpoint_path(self) -> str:
        """``k2_model_dir/<org>--<name>/<revision>`` on every host."""
        return posixpath.join(self.s.model_dir, self.s.model.replace("/", "--"), self.s.revision)

    @property
    def gguf_path(self) -> str | None:
        if not self.s.gguf_repo:
            return None
        return posixpath.join(self.s.model_dir, self.s.gguf_repo.replace("/", "--"), str(self.s.gguf_revision))

    @property
    def weight_sets(self) -> tuple[WeightSet, ...]:
        """What hosts that load weights must hold: the ``k2_model`` checkpoint, and for
        GGUF engines the ``k2_gguf_repo`` files matching ``k2_gguf_pattern``."""
        s = self.s
        pins = dict(self.manifest_pins)
        sets = [WeightSet(CHECKPOINT_CHECK, s.model, s.revision, self.checkpoint_path,
                          self._weight_source(s.checkpoint_source, s.model, s.revision), None, "",
                          pins.get(CHECKPOINT_CHECK))]
        if s.gguf_repo and self.gguf_path:
            sets.append(WeightSet(GGUF_CHECK, s.gguf_repo, str(s.gguf_revision), self.gguf_path,
                                  self._weight_source(s.gguf_source, s.gguf_repo, str(s.gguf_revision)),
                                  (s.gguf_pattern,) if s.gguf_pattern else None, " (GGUF weights)",
                                  pins.get(GGUF_CHECK)))
        return tuple(sets)

    def pinned(self, pins: dict[str, str]) -> "Deployment":
        """This deployment with its weight sets' manifest digests pinned (weight set check →
        digest, from :func:`k2fleet.control.checkpoint_copy.manifest_pins`); itself when
        they are already these."""
        frozen = tuple(sorted(pins.items()))
        return self if frozen == self.manifest_pins else replace(self, manifest_pins=frozen)

    def _weight_source(self, source: str, repo: str, revision: str) -> str:
        """``k2_bundle``: a Hub source the control machine fetches is the bundle's copy."""
        if self.s.bundle and source == "hub" and self.s.checkpoint_fetcher in ("control", "auto"):
            return f"control:{self.s.bundle}/checkpoint/{repo.replace('/', '--')}/{revision}"
        return source

    @property
    def api_model_name(self) -> str:
        """The ``model`` clients send (trtllm-serve names the model by its path)."""
        return self.engine_impl.api_model_name(self)

    @property
    def serve_path(self) -> str:
        """What engines load: the verified checkpoint, or its config overlay."""
        if self.s.model_type_override:
            return self.checkpoint_path + ".overlay-" + self.s.model_type_override
        return self.checkpoint_path


def _fail(key: str, msg: str, fleet: Fleet) -> SpecError:
    return SpecError(key, msg, fleet.source)


SIZE_SLACK = (0.5, 2.0)  # k2_checkpoint_bytes of a catalog model: within these factors of its known size


def _check_model(fleet: Fleet) -> tuple[int, str, bool]:
    s = fleet.settings
    if not SHA_RE.match(s.revision):
        raise _fail(
            "k2_revision",
            f"{s.revision!r} is not a pinned commit; set the 40-hex commit sha of {s.model} "
            "(HfApi().model_info(repo).sha), never a branch or tag",
            fleet,
        )
    if s.gguf_repo and (not s.gguf_revision or not SHA_RE.match(s.gguf_revision)):
        raise _fail("k2_gguf_revision", "set the 40-hex commit sha of k2_gguf_repo", fleet)
    known = catalog.CHECKPOINTS.get(s.model)
    size = s.checkpoint_bytes or (known.bytes if known else None)
    quant = s.quantization or (known.quantization if known else None)
    if size is None or quant is None:
        raise _fail(
            "k2_checkpoint_bytes" if size is None else "k2_quantization",
            f"{s.model} is not in k2fleet's catalog; set k2_checkpoint_bytes and k2_quantization",
            fleet,
        )
    if known and s.checkpoint_bytes and not s.simulated_gpus and quant == known.quantization \
            and not known.bytes * SIZE_SLACK[0] <= s.checkpoint_bytes <= known.bytes * SIZE_SLACK[1]:
        # (the sandbox's synthetic checkpoints are tiny: simulated GPUs only; another weight format
        # of the same repo, k2_quantization, is another size)
        raise _fail(
            "k2_checkpoint_bytes",
            f"{s.checkpoint_bytes:,} bytes is {'below half' if s.checkpoint_bytes < known.bytes else 'over twice'} "
            f"the {known.bytes / 1e9:,.0f} GB checkpoint of {s.model} (k2fleet's catalog), so the memory-fit and "
            f"disk checks would be wrong; set its real size in bytes, or leave k2_checkpoint_bytes unset",
            fleet,
        )
    # k2_checkpoint_source's grammar (hub | control:/PATH) is owned by spec.checkpoint_source
    if known and known.max_context and s.max_model_len and s.max_model_len > known.max_context:
        raise _fail(
            "k2_max_model_len",
            f"{s.max_model_len} exceeds the {known.max_context}-token context of {s.model}; "
            f"set at most {known.max_context}",
            fleet,
        )
    reasoning = known.reasoning if known else "thinking" in s.model.lower()
    return size, quant, reasoning


def _check_model_serving(fleet: Fleet, gpu: catalog.GpuType | None, version: str) -> list[str]:
    """The catalog's engines, minimum versions and GPU families for ``k2_model`` (one line
    naming the key when this deployment cannot serve it); returns the plan's notes on what
    the catalog does not know and on a capacity k2fleet does not predict (KTransformers)."""
    s = fleet.settings
    known = catalog.CHECKPOINTS.get(s.model)
    if known is None:
        return []
    notes = []
    if known.engines is not None:
        if s.engine not in known.engines:
            raise _fail("k2_engine", f"{s.model} is not served by {s.engine} as far as k2fleet's catalog knows (its "
                        f"sources name {', '.join(known.engines)}); use {' or '.join(known.engines)}", fleet)
        least = known.engines[s.engine]
        if least is not None and catalog.version_tuple(version) < catalog.version_tuple(least):
            newer = [v for v in catalog.ENGINE_VERSIONS[s.engine]
                     if catalog.version_tuple(v) >= catalog.version_tuple(least)]
            raise _fail("k2_engine_version", f"{s.engine} {version} predates {s.model} ({s.engine} >= {least} "
                        f"serves it); use {' or '.join(newer) if newer else f'a pin >= {least}'}", fleet)
        if least is None:
            notes.append(f"{s.model}: the catalog's sources give no minimum {s.engine} version; {s.engine} "
                         f"{version} serving it is not verified")
    if s.engine in known.blackwell_only and gpu is not None and gpu.arch != catalog.BLACKWELL:
        blackwell = ", ".join(g.name for g in catalog.GPUS.values() if g.arch == catalog.BLACKWELL)
        raise _fail("k2_gpu", f"{s.engine} serves {s.model} on Blackwell GPUs only ({blackwell}), not {gpu.name}; "
                    f"use a Blackwell GPU or {' or '.join(e for e in (known.engines or {}) if e not in known.blackwell_only)}",
                    fleet)
    if known.arch is None:
        notes.append(f"{s.model}: no KV cache prediction — its {', '.join(u for u in known.unknown if u in ('layers', 'kv_lora_rank', 'KDA state size'))} "
                     "are not in k2fleet's sources (MLA every 4th layer caches per token, the KDA layers a fixed "
                     "state per sequence); only the checkpoint size and published node shapes were checked")
    engine = engines.get(s.engine)
    if engine.experts_in_host_ram:  # _check_fit predicts nothing: the experts live in host RAM (preflight checks it)
        notes.append(f"{s.engine}: no KV cache prediction (the routed experts run from host RAM and {engine.label} "
                     "sizes its GPU KV cache itself): capacity unverified")
    if known.heads is None:
        notes.append(f"{s.model}: its attention heads are not in k2fleet's sources; k2_tp was not checked against them")
    if known.max_context is None:
        notes.append(f"{s.model}: its context length is not in k2fleet's sources; k2_max_model_len was not checked "
                     "against it")
    return notes


def parser_refusal(engine: str, version: str, kind: str, name: str) -> str | None:
    """Why ``engine`` ``version`` would refuse ``name`` as its ``kind`` ("tool" or
    "reasoning") parser (one line: the fix), or None.

    Checked only where :data:`catalog.KIMI_PARSERS` has this exact (engine, version) and only
    for names starting ``kimi`` (the table lists those alone): for any other pin (vLLM 0.10.0,
    SGLang 0.4.9, TensorRT-LLM, KTransformers) or name nothing is known, so nothing is refused.
    The table says nothing about versions between the ones read (a name present at 0.15.0 and
    0.26.0 is not assumed present at 0.20.0), so no nearest-version inference is made.

    >>> parser_refusal("vllm", "0.11.0", "reasoning", "kimi_k2")
    'vllm 0.11.0 registers no kimi_k2 reasoning parser (it has no Kimi reasoning parser); k2_engine_version 0.33.0 has it (vllm has it from 0.15.0 among the versions read, catalog.KIMI_PARSERS)'
    >>> parser_refusal("sglang", "0.5.4", "reasoning", "kimi_k2")
    'sglang 0.5.4 registers no kimi_k2 reasoning parser (its Kimi reasoning parsers: kimi); k2_engine_version 0.5.23 has it (sglang has it from 0.5.16 among the versions read, catalog.KIMI_PARSERS)'
    >>> parser_refusal("sglang", "0.5.23", "tool", "kimi_k25")
    'sglang 0.5.23 registers no kimi_k25 tool parser (its Kimi tool parsers: kimi_k2, kimi_k3); no sglang version k2fleet read has it'
    >>> parser_refusal("vllm", "0.33.0", "tool", "kimi_k2") is None, parser_refusal("vllm", "0.10.0", "reasoning", "kimi_k2") is None
    (True, True)
    >>> parser_refusal("vllm", "0.11.0", "reasoning", "deepseek_r1") is None  # not a Kimi name: the table does not say
    True
    """
    side = 0 if kind == "tool" else 1
    known = catalog.KIMI_PARSERS.get((engine, version))
    if known is None or not name.startswith("kimi") or name in known[side]:
        return None
    has = known[side]
    which = f"its Kimi {kind} parsers: {', '.join(has)}" if has else f"it has no Kimi {kind} parser"
    read = sorted((v for (e, v), parsers in catalog.KIMI_PARSERS.items() if e == engine and name in parsers[side]),
                  key=catalog.version_tuple)
    if not read:
        return f"{engine} {version} registers no {name} {kind} parser ({which}); no {engine} version k2fleet read has it"
    pins = [v for v in catalog.ENGINE_VERSIONS[engine] if v in read]
    return (f"{engine} {version} registers no {name} {kind} parser ({which}); "
            + (f"k2_engine_version {' or '.join(pins)} has it " if pins else "")
            + f"({engine} has it from {read[0]} among the versions read, catalog.KIMI_PARSERS)")


def _check_parsers(fleet: Fleet, version: str, tool_parser: str | None, reasoning_parser: str | None) -> None:
    """The parser names the argv will carry are ones the pinned engine registers
    (:func:`parser_refusal`): refused before any host is contacted, since the engine would
    refuse its argv at start. The key is ``k2_tool_parser``/``k2_reasoning_parser`` when the
    inventory names the parser, ``k2_engine_version`` when it is the default (the catalog's).

    No default is swapped for another name: SGLang 0.5.4's ``kimi`` is not K2's reasoning
    format (SGLang maps ``kimi`` to KimiDetector, ◁think▷…◁/think▷, and ``kimi_k2`` to
    DeepSeekR1Detector, <think>…</think>), and the table records names, not equivalences."""
    s = fleet.settings
    chosen = {"tool": s.tool_parser not in (None, "kimi_k2"), "reasoning": s.reasoning_parser is not None}
    for kind, name in (("tool", tool_parser), ("reasoning", reasoning_parser)):
        why = parser_refusal(s.engine, version, kind, name) if name else None
        if why is None:
            continue
        if chosen[kind]:
            raise _fail(f"k2_{kind}_parser", f"{why}; or set k2_{kind}_parser to one {s.engine} {version} has",
                        fleet)
        raise _fail("k2_engine_version", f"{why}; or set k2_{kind}_parser to one {s.engine} {version} has (the "
                    f"default, {name}, is the catalog's for {s.model})", fleet)


def _check_size(fleet: Fleet, pool: Pool, gpu: catalog.GpuType, size: int) -> None:
    """Enough GPU memory for the weights: one instance's GPUs must hold the checkpoint, and a
    model with published node shapes (``catalog.Checkpoint.min_gpus``) gets at least those."""
    if pool.instance_gpus == 0 or engines.get(fleet.settings.engine).experts_in_host_ram:
        return
    s = fleet.settings
    known = catalog.CHECKPOINTS.get(s.model)
    per_node = pool.instance_gpus // pool.nodes_per_instance if pool.nodes_per_instance else pool.instance_gpus
    shape = (known.min_gpus or {}).get(gpu.name) if known else None
    if shape and pool.instance_gpus < shape:
        raise _fail("k2_tp", f"{pool.role} pool: {s.model} on {gpu.name} needs {shape} GPUs per instance (its published "
                    f"node shape, {shape // gpu.max_per_node}×{gpu.max_per_node}), not {pool.instance_gpus}; raise "
                    "k2_tp/k2_pp (with the hosts to match)", fleet)
    held = pool.instance_gpus * gpu.total_gib * catalog.GIB
    if held < size:
        least = math.ceil(size / (gpu.total_gib * catalog.GIB))
        nodes = math.ceil(least / max(per_node, 1))
        raise _fail("k2_tp", f"{pool.role} pool: {pool.instance_gpus} × {gpu.name} hold {held / 1e9:,.0f} GB, less than "
                    f"the {size / 1e9:,.0f} GB checkpoint of {s.model}; it needs at least {least} GPUs "
                    f"({nodes} nodes of {per_node}): raise k2_tp/k2_pp (with the hosts to match)", fleet)


def _check_hardware(fleet: Fleet) -> tuple[catalog.GpuType | None, int, str]:
    s = fleet.settings
    if s.simulated_gpus and not s.engine_doubles and not s.engine_cpu_build:
        raise _fail(
            "k2_simulated_gpus",
            "simulated GPUs are for the sandbox fleet only (with k2_engine_doubles: true); "
            "remove it from a production inventory",
            fleet,
        )
    if s.engine_doubles and not s.simulated_gpus:
        raise _fail("k2_engine_doubles", "engine test doubles need k2_simulated_gpus: true (sandbox only)", fleet)
    if s.engine_cpu_build and (not s.simulated_gpus or s.engine_doubles):
        raise _fail("k2_engine_cpu_build", "the engine's CPU build is for the sandbox's simulated GPUs (k2_simulated_gpus: "
                    "true) instead of the engine test doubles (k2_engine_doubles: false)", fleet)
    if s.engine_cpu_build and not engines.get(s.engine).has_cpu_build:
        raise _fail("k2_engine_cpu_build", f"the sandbox has a CPU build of vLLM only, not of {s.engine}", fleet)
    gpu = catalog.GPUS.get(s.gpu.lower())
    if gpu is None:
        raise _fail("k2_gpu", f"unknown GPU type {s.gpu!r}; one of {', '.join(catalog.GPUS)}", fleet)
    per_node = s.gpus_per_node or gpu.default_per_node
    if per_node > gpu.max_per_node:
        raise _fail(
            "k2_gpus_per_node",
            f"{per_node} GPUs per node on {gpu.name}: one {gpu.name} node ships at most {gpu.max_per_node}",
            fleet,
        )
    platform = s.platform or ("rocm" if gpu.vendor == "amd" else "cuda")
    if platform == "rocm" and gpu.vendor != "amd":
        raise _fail("k2_platform", f"a ROCm engine cannot run on NVIDIA {gpu.name} hosts; use platform cuda", fleet)
    if platform == "cuda" and gpu.vendor == "amd":
        raise _fail("k2_platform", f"a CUDA engine cannot run on AMD {gpu.name} hosts; use platform rocm", fleet)
    image = (s.image or "").lower()
    if "rocm" in image and gpu.vendor != "amd":
        raise _fail("k2_image", f"{s.image} is a ROCm image but the hosts have NVIDIA {gpu.name} GPUs", fleet)
    return gpu, per_node, platform


def _check_engine(fleet: Fleet, platform: str) -> tuple[str, str, str | None]:
    s = fleet.settings
    engine = engines.get(s.engine)
    versions = catalog.ENGINE_VERSIONS[s.engine]
    version = s.engine_version or versions[0]
    if version not in versions:
        raise _fail(
            "k2_engine_version",
            f"{s.engine} {version} is not supported; supported pins: {', '.join(versions)}",
            fleet,
        )
    if platform not in engine.platforms:
        builds = " or ".join(n for n, e in engines.ENGINES.items() if platform in e.platforms)
        raise _fail("k2_engine", f"{s.engine} has no ROCm build; use {builds} on AMD GPUs", fleet)
    runtime = s.runtime or engine.default_runtime(platform)
    if s.engine_cpu_build and runtime != "venv":
        raise _fail("k2_engine_cpu_build", "vLLM's CPU build runs in a venv (k2_runtime: venv)", fleet)
    if engine.container_only and runtime == "venv" and not s.engine_doubles:
        raise _fail("k2_runtime", engine.container_only, fleet)
    if s.image_id and runtime != "container":
        raise _fail("k2_image_id", "pins a container image; it needs k2_runtime container", fleet)
    image = s.image
    if runtime == "container" and image is None:
        image = engine.image(platform, version)
        if image is None:
            raise _fail("k2_image", f"no default image for {s.engine} on {platform}; set k2_image", fleet)
    return version, runtime, image


def _check_pool(fleet: Fleet, role: str, hosts: list[HostEntry], engine: Engine, per_node: int) -> Pool:
    """The pool's parallel sizes by ``engine``'s rules, resolved onto :class:`Pool` once."""
    s = hosts[0].settings
    where = f"{role} pool ({', '.join(h.name for h in hosts)})"
    sizes = {"pp": s.pp, "dp": s.dp, "ep": s.ep, "dcp": engine.resolved_dcp(s)}
    if role in ("router", "slurm-submit"):
        return Pool(role, tuple(hosts), s, tp=0, instance_gpus=0, nodes_per_instance=1, **sizes)
    tp = s.tp or per_node
    refused = engine.parallel_refusal(s, tp)
    if refused:
        raise _fail(*refused, fleet)
    gpus = engine.instance_gpus(s, tp)
    if gpus > per_node and gpus % per_node:
        raise _fail(
            "k2_tp",
            f"{where}: parallel sizes use {gpus} GPUs per instance, not a whole number of "
            f"{per_node}-GPU nodes; make {engine.parallel_product()} a multiple of {per_node}",
            fleet,
        )
    if gpus < per_node:
        raise _fail(
            "k2_tp",
            f"{where}: parallel sizes multiply to {gpus} GPUs but each node has {per_node}; "
            f"make {engine.parallel_product()} = {per_node} (or a multiple) or set k2_gpus_per_node",
            fleet,
        )
    nodes = math.ceil(gpus / per_node)
    if len(hosts) < nodes:
        raise _fail(
            "inventory",
            f"{where}: the topology needs {nodes} nodes of {per_node} GPUs ({gpus} GPUs) but the "
            f"inventory lists {len(hosts)}; add hosts or lower the parallel sizes",
            fleet,
        )
    if len(hosts) % nodes:
        raise _fail(
            "inventory",
            f"{where}: {len(hosts)} hosts do not split into instances of {nodes} nodes; "
            f"list a multiple of {nodes} hosts",
            fleet,
        )
    refused = engine.instance_refusal(s, nodes)
    if refused:
        raise _fail(*refused, fleet)
    return Pool(role, tuple(hosts), s, tp=tp, instance_gpus=gpus, nodes_per_instance=nodes, **sizes)


def _length(value: Any) -> int | None:
    """A context length as the engines parse it: ``262144``, ``"128k"`` (128,000), ``"128K"``
    (131,072); None for what k2fleet cannot read (``auto``, ``-1``: the engine decides)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value > 0 else None
    if isinstance(value, str):
        text = value.strip()
        scale = {"k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}.get(text[-1:], 1)
        digits = text[:-1] if scale != 1 else text
        try:
            number = float(digits)
        except ValueError:
            return None
        return int(number * scale) if number > 0 else None
    return None


def _context(fleet: Fleet, s: HostSettings, engine: Engine) -> tuple[int | None, str]:
    """The context length an instance must hold and the key it comes from: ``k2_max_model_len``,
    else the engine's own flag in ``k2_engine_args`` (or TRT-LLM's ``max_seq_len``), else the
    model's context (catalog)."""
    if fleet.settings.max_model_len:
        return fleet.settings.max_model_len, "k2_max_model_len"
    flag = engine.context_flag
    value = _arg(s.engine_args, flag)
    if value is not None:
        return _length(value), f"k2_engine_args.{next(k for k in s.engine_args if k.lstrip('-').replace('_', '-') == flag.replace('_', '-'))}"
    configured = engine.config_context(s)
    if configured is not None:
        return _length(configured[0]), configured[1]
    known = catalog.CHECKPOINTS.get(fleet.settings.model)
    return (known.max_context if known else None), "k2_max_model_len"


def _kv_dtype_bytes(value: Any) -> int:
    """``fp8``, ``fp8_e4m3``, ``fp8_e5m2``: one byte per value; anything else (``auto``: the
    model's bf16) two."""
    return 1 if isinstance(value, str) and value.lower().startswith("fp8") else 2


def _layout(fleet: Fleet, pool: Pool, engine: Engine, version: str) -> capacity.Layout:
    """How ``pool``'s instances use GPU memory, from its keys and engine flags (``k2_profile``'s
    under ``k2_engine_args`` / ``k2_trtllm_config``, as the renderers merge them)."""
    s = pool.settings
    profile = fleet.settings.profile
    args = engine.merged_args(version, profile, s.engine_args)
    max_len, _ = _context(fleet, s, engine)
    fraction, kv_dtype = engine.fraction_and_kv_dtype(args, s, version, profile)
    dense_tp = engine.dense_tp(args, s)
    known = catalog.CHECKPOINTS.get(fleet.settings.model)

    def _int(*names: str) -> int | None:
        value = _arg(args, *names)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    off = bool(_arg(args, "disable-cuda-graph"))
    return capacity.Layout(
        engine=engine.name, tp=pool.tp, pp=pool.pp, dp=pool.dp, ep=pool.ep, dcp=pool.dcp,
        attn_dp=s.attn_dp, dense_tp=dense_tp if isinstance(dense_tp, int) and dense_tp > 0 else None,
        fraction=float(fraction) if isinstance(fraction, (int, float)) and not isinstance(fraction, bool) else None,
        kv_dtype_bytes=_kv_dtype_bytes(kv_dtype), max_len=max_len, concurrency=s.expected_concurrency,
        version=version, role=pool.role, reserve_gib=s.runtime_reserve_gib,
        chunked_prefill=_int("chunked-prefill-size"),
        cuda_graph_max_bs=_int("cuda-graph-max-bs-decode", "cuda-graph-max-bs"),
        max_running=_int("max-running-requests"),
        decode_graph=not (off or _arg(args, "disable-decode-cuda-graph")),
        prefill_graph=not (off or _arg(args, "disable-prefill-cuda-graph") or _arg(args, "enable-two-batch-overlap")),
        a2a_backend=engine.a2a_backend(pool) if pool.ep > 1 else s.moe_a2a_backend,
        multimodal=bool(known and known.multimodal),
    )


def _fits(cap: capacity.Capacity) -> bool:
    if cap.kv_gib <= 0 or cap.tokens == 0:
        return False
    return cap.fits is None or cap.fits >= cap.concurrency


def _least_gpus(gpu: catalog.GpuType, arch: catalog.Architecture, quant: str, size: int,
                layout: capacity.Layout, gpus: int) -> int | None:
    """The fewest GPUs per instance (whole multiples of this instance) whose weights leave a KV
    cache that holds the context (:meth:`~k2fleet.planning.engines.base.Engine.wider`: more
    data-parallel MoE ranks for vLLM DP, more TP otherwise)."""
    engine = engines.get(layout.engine)
    for k in range(2, 65):
        wider = engine.wider(layout, k)
        if _fits(capacity.predict(gpu, arch, quant, size, wider)):
            return gpus * k
    return None


def _check_fit(fleet: Fleet, pool: Pool, gpu: catalog.GpuType, size: int, quant: str,
               engine: Engine, version: str) -> capacity.Capacity | None:
    """The memory-fit rule (one owner, :func:`k2fleet.planning.capacity.predict`): weights per
    GPU must leave a KV cache that holds ``k2_expected_concurrency`` requests of the context
    length. Returns the prediction ``k2fleet plan`` shows."""
    if engine.experts_in_host_ram or pool.instance_gpus == 0:
        return None  # KTransformers keeps experts in host RAM; preflight checks RAM instead
    s = pool.settings
    known = catalog.CHECKPOINTS.get(fleet.settings.model)
    arch = known.arch if known else catalog.KIMI_K2  # k2fleet serves Kimi K2 checkpoints: their shape
    if arch is None:
        return None  # the catalog does not know its KV layout (Kimi-K3): the plan's notes say so
    layout = _layout(fleet, pool, engine, version)
    cap = capacity.predict(gpu, arch, quant, size, layout)
    if _fits(cap):
        return cap
    _, len_key = _context(fleet, s, engine)
    where = f"{pool.role} pool ({pool.instance_gpus} × {gpu.name}, TP{pool.tp}" + (f" PP{pool.pp}" if pool.pp > 1 else "") + (
        f" DP{pool.dp}" if pool.dp > 1 else "") + (f" EP{pool.ep}" if pool.ep > 1 else "") + (f" DCP{layout.dcp}" if layout.dcp > 1 else "") + ")"
    weights = (f"{cap.weights_gib:.1f} GiB of {quant} weights per GPU ({cap.non_expert_gib:.1f} attention/dense/embedding "
               f"+ {cap.experts_gib:.1f} routed experts over {layout.moe_ranks * layout.pp} GPUs)")
    least = None  # the least utilisation (up to 0.95) that would fit, for vLLM and SGLang
    if engine.fraction_tunable:
        least = next((h / 100 for h in range(math.floor(cap.fraction * 100) + 1, 96)
                      if _fits(capacity.predict(gpu, arch, quant, size, replace(layout, fraction=h / 100)))), None)
    if cap.kv_gib <= 0 and least is not None:
        raise _fail(
            "k2_gpu_memory_utilization",
            f"{where}: {cap.fraction:.3g} of {gpu.name}'s {cap.gpu_total_gib:.2f} GiB with {weights}"
            + (f" and {cap.overhead_gib:.1f} GiB runtime ({cap.reserve_source})" if cap.overhead_gib else "")
            + f" leaves no room for weights and a KV cache of {_need(cap)}; set at least {least:.2f} "
            f"(the fraction now: {cap.fraction_source})",
            fleet,
        )
    if cap.kv_gib <= 0:
        need = _least_gpus(gpu, arch, quant, size, layout, pool.instance_gpus)
        raise _fail(
            "k2_tp",
            f"{where}: {weights}" + (f" + {cap.overhead_gib:.1f} GiB runtime ({cap.reserve_source}; k2_runtime_reserve_gib "
                                     "sets a measured one)" if cap.overhead_gib else "")
            + f" leave no KV cache in {cap.gpu_total_gib:.2f} GiB × {cap.fraction:.3g} on {gpu.name}; spread the weights "
            + (f"over at least {need} GPUs" if need else "over more GPUs") + " (more nodes, larger tp/pp or expert parallel)",
            fleet,
        )
    assert cap.max_len is not None
    groups = cap.kv_groups
    longest = cap.tokens_per_kv_group // -(-cap.concurrency // groups)
    raise _fail(
        len_key,
        f"{where}: {cap.max_len:,} tokens × {cap.concurrency} request{'s' if cap.concurrency > 1 else ''} "
        + ("(the model's context; k2_max_model_len unset) " if len_key == "k2_max_model_len" and not fleet.settings.max_model_len else "")
        + f"do not fit the predicted KV cache: {cap.kv_gib:.2f} GiB per GPU ({cap.arithmetic()}) / "
        f"{cap.kv_bytes_per_token:,} B/token" + (f" × DCP{layout.dcp}" if layout.dcp > 1 else "")
        + f" = {cap.tokens_per_kv_group:,} tokens"
        + (f" per cache × {groups}" if groups > 1 else "")
        + f"; lower {len_key} to at most {longest:,}"
        + (" or k2_expected_concurrency" if cap.concurrency > 1 else "")
        + ", raise k2_tp" + ("/k2_dcp" if engine.dcp else "") + ", or use more GPUs"
        + (f" (or k2_gpu_memory_utilization {least:.2f})" if least is not None else ""),
        fleet,
    )


def _need(cap: capacity.Capacity) -> str:
    if cap.max_len is None:
        return "any size"
    return f"{cap.max_len:,} tokens × {cap.concurrency}"


def _check_fetcher(fleet: Fleet) -> None:
    fetcher = fleet.settings.checkpoint_fetcher
    if fetcher in ("control", "auto"):  # auto: resolved to a host or control before the deploy changes anything
        return
    if fleet.settings.checkpoint_source != "hub":
        raise _fail("k2_checkpoint_fetcher", f"{fetcher!r} downloads from the Hub, but k2_checkpoint_source is "
                    f"{fleet.settings.checkpoint_source!r}; use `control` (or k2_checkpoint_source: hub)", fleet)
    if fleet.settings.gguf_repo and fleet.settings.gguf_source != "hub":
        raise _fail("k2_checkpoint_fetcher", f"{fetcher!r} downloads from the Hub, but k2_gguf_source is "
                    f"{fleet.settings.gguf_source!r}; use `control` (or k2_gguf_source: hub)", fleet)
    entry = next((h for h in fleet.hosts if h.name == fetcher), None)
    if entry is None:
        raise _fail("k2_checkpoint_fetcher", f"{fetcher!r} is neither `auto`, `control` nor a host of this inventory "
                    f"({', '.join(h.name for h in fleet.hosts)})", fleet)
    role = entry.settings.role
    if role in ("router", "slurm-submit"):
        raise _fail("k2_checkpoint_fetcher", f"{fetcher} is a {role} host and holds no checkpoint; "
                    "name a host that loads weights", fleet)


def _check_metrics(fleet: Fleet, gpu: Any = None) -> None:
    """``k2_node_exporter`` needs the OS table's package; the metrics keys need ``k2_metrics``;
    ``k2_gpu_exporter`` (NVIDIA's dcgm-exporter) needs NVIDIA GPUs on a host of the inventory."""
    s = fleet.settings
    if (s.metrics_scrapers or s.node_exporter or s.gpu_exporter) and not s.metrics:
        key = next(k for k, on in (("k2_metrics_scrapers", s.metrics_scrapers), ("k2_node_exporter", s.node_exporter),
                                   ("k2_gpu_exporter", s.gpu_exporter)) if on)
        raise _fail(key, "is a metrics setting; set k2_metrics: True too", fleet)
    if s.gpu_exporter_image_id and not s.gpu_exporter:
        raise _fail("k2_gpu_exporter_image_id", "pins the dcgm-exporter image; set k2_gpu_exporter: True too", fleet)
    if s.gpu_exporter:
        if gpu is not None and gpu.vendor != "nvidia":
            raise _fail("k2_gpu_exporter", f"runs NVIDIA's dcgm-exporter, which reads NVIDIA GPUs through DCGM; "
                        f"{gpu.name} is an AMD GPU: set k2_gpu_exporter: False (AMD's exporter is not wired)", fleet)
        if all(h.settings.role in ("router", "slurm-submit") for h in fleet.hosts):
            raise _fail("k2_gpu_exporter", "no host of this inventory carries GPUs (router / slurm-submit only): "
                        "the SLURM nodes are not k2fleet's; set k2_gpu_exporter: False", fleet)
    if s.node_exporter:
        from k2fleet.planning.os_tables import OS_TABLES, host_os

        for h in fleet.hosts:
            if OS_TABLES[host_os(h)].node_exporter is None:
                raise _fail("k2_node_exporter", f"{host_os(h)} (host {h.name}) has no Prometheus node exporter package "
                            "in its base repositories; set k2_node_exporter: False (or run one yourself on port 9100)", fleet)


def _check_api_key(fleet: Fleet) -> None:
    """``k2_api_key_file``: vLLM takes the key itself (its engine's ``api_key_env``), the other engines'
    endpoints get the API front (k2fleet.planning.api_front, the engine's ``api_key_fronted``); only
    a fleet with no endpoint on its hosts (TRT-LLM's Slurm submit host: the servers run in
    Slurm jobs k2fleet does not place) has nowhere to put the front."""
    s = fleet.settings
    if s.api_key_file is not None and "slurm-submit" in fleet.pools:
        raise _fail("k2_api_key_file", "not supported with k2_role: slurm-submit: the TRT-LLM servers run in "
                    "SLURM jobs on nodes k2fleet does not configure, so no host of this inventory serves the API "
                    f"to put the authenticating front before ({engines.get(s.engine).api_key_fronted})", fleet)


TLS_KEYS = ("k2_tls_cert_file", "k2_tls_key_file", "k2_tls_ca_file")


def _check_tls(fleet: Fleet) -> None:
    """``k2_tls_cert_file``, ``k2_tls_key_file``, ``k2_tls_ca_file``: all three or none (a
    certificate without its key cannot be served, one without a CA cannot be verified by
    k2fleet's clients); not with a Slurm submit host (its servers are not k2fleet's). The files
    themselves are checked on the control machine (k2fleet.deploy.gate.check_tls_files)."""
    s = fleet.settings
    given = [key for key in TLS_KEYS if getattr(s, key[3:]) is not None]
    if given and len(given) < len(TLS_KEYS):
        missing = next(key for key in TLS_KEYS if key not in given)
        raise _fail(missing, f"{', '.join(given)} set without {missing}: HTTPS needs the certificate, its private "
                    "key and the CA the clients verify it against; set all three (or none: plain HTTP)", fleet)
    if given and "slurm-submit" in fleet.pools:
        raise _fail("k2_tls_cert_file", "not supported with k2_role: slurm-submit: the TRT-LLM servers run in SLURM "
                    "jobs on nodes k2fleet does not configure, so no host of this inventory serves the API", fleet)


def _check_load_balancer(fleet: Fleet) -> None:
    """``k2_load_balancer`` names a host of this inventory, in a fleet of ``serve`` replicas
    (PD's router balances its own pools; a Slurm submit host's servers are not k2fleet's)."""
    lb = fleet.settings.load_balancer
    if lb is None:
        return
    names = [h.name for h in fleet.hosts]
    if lb not in names:
        raise _fail("k2_load_balancer", f"{lb!r} is not a host of this inventory ({', '.join(names)}); name the "
                    "host that runs the load balancer, or leave k2_load_balancer unset", fleet)
    other = sorted(set(fleet.pools) - {"serve"})
    if other:
        why = ("the SGLang PD router already balances the prefill and decode servers" if "router" in other else
               "the TRT-LLM servers run in SLURM jobs on nodes k2fleet does not configure")
        raise _fail("k2_load_balancer", f"balances `serve` replicas only, and this fleet has role {', '.join(other)}: "
                    f"{why}; leave k2_load_balancer unset", fleet)


def _check_venv_python(fleet: Fleet, engine: str, version: str, runtime: str) -> None:
    """A venv engine is installed with the host OS's venv interpreter (its OS table's): it
    must be one the engine's release installs on (its Requires-Python)."""
    need = engine_min_python(engine, version)
    if runtime != "venv" or need is None or fleet.settings.simulated_gpus:
        return
    for h in fleet.hosts:
        os_name = host_os(h)
        have = host_python(os_name)
        if tuple(map(int, have.split("."))) < tuple(map(int, need.split("."))):
            raise SpecError("k2_os", f"host {h.name} runs {os_name} (Python {have}) but {engine} {version} needs "
                            f"Python >= {need}; set another k2_os, k2_runtime: container, or an older "
                            f"k2_engine_version", fleet.source)


def _check_ip_addresses(fleet: Fleet) -> None:
    """Planning takes IP addresses only: engines (``VLLM_HOST_IP``, rendezvous addresses),
    the mesh (``AllowUsers``, ``from=``) and the firewall's sets never see a DNS name. The
    gate resolves names once per run on the control machine
    (:func:`k2fleet.control.addresses.resolve_addresses`) before planning; a fleet that
    reaches here with a name was planned without it, and no IP can be had."""
    for h in fleet.hosts:
        try:
            ipaddress.ip_address(h.address)
        except ValueError:
            raise _fail(h.address_key, f"host {h.name}'s address {h.address} is not an IP address and was not "
                        "resolved to one; plan through k2fleet's gate (k2fleet validate/plan, pyinfra with "
                        "config.py), which resolves names on the control machine, or set k2_address to the "
                        "host's IP", fleet) from None


def _check_bundle(fleet: Fleet) -> None:
    """``k2_bundle``: the deploy takes its packages from it, and it was made (its lock exists)."""
    s = fleet.settings
    if s.bundle is None:
        return
    if s.package_source != "bundle":
        raise _fail("k2_bundle", "the deploy takes its packages from the bundle; set k2_package_source: bundle", fleet)
    lock = posixpath.join(s.bundle, "k2fleet.lock")
    if not os.path.isfile(lock):
        raise _fail("k2_bundle", f"{lock} does not exist; make the bundle with "
                    f"`k2fleet bundle INVENTORY --out {s.bundle}` on a connected machine and copy it here", fleet)


def _check_roles(fleet: Fleet, engine: Engine) -> None:
    roles = set(fleet.pools)
    pd = roles & set(PD_ROLES)
    if pd:
        if not engine.pd_disaggregation:
            raise _fail("k2_role", f"prefill/decode/router roles are planned for SGLang; {engine.name} cannot use them", fleet)
        missing = [r for r in PD_ROLES if r not in roles]
        if missing:
            raise _fail(
                "k2_role",
                f"prefill/decode disaggregation needs prefill, decode and router hosts; none has role "
                f"{', '.join(missing)}",
                fleet,
            )
        if "serve" in roles:
            raise _fail("k2_role", "mixing role serve with prefill/decode hosts; give every host a PD role", fleet)
        if len(fleet.pools["router"]) != 1:
            raise _fail("k2_role", "exactly one router host is planned", fleet)
    if "slurm-submit" in roles:
        if not engine.slurm_disaggregation:
            raise _fail("k2_role", "slurm-submit is the TRT-LLM SLURM disaggregated path", fleet)
        s = fleet.pools["slurm-submit"][0].settings
        if not s.slurm or not s.disagg or not {"ctx", "gen"} <= set(s.disagg):
            raise _fail("k2_disagg", "a slurm-submit host needs k2_slurm and k2_disagg with ctx and gen worker configs", fleet)


def _check_slurm(fleet: Fleet, engine: Engine, gpu: catalog.GpuType, per_node: int, size: int,
                 quant: str) -> dict[str, capacity.Capacity]:
    s = fleet.pools["slurm-submit"][0].settings
    assert s.slurm is not None and s.disagg is not None
    hardware = s.slurm.get("hardware", {})
    if hardware.get("gpus_per_node", per_node) != per_node:
        raise _fail(
            "k2_slurm.hardware.gpus_per_node",
            f"{hardware['gpus_per_node']} differs from k2_gpus_per_node {per_node}; set both to the same",
            fleet,
        )
    caps: dict[str, capacity.Capacity] = {}
    for side in ("ctx", "gen"):
        worker = s.disagg[side]
        tp = int(worker.get("tensor_parallel_size", 1))
        ep = int(worker.get("moe_expert_parallel_size", 1))
        if tp % per_node and per_node % tp:
            raise _fail("k2_disagg", f"{side}.tensor_parallel_size {tp} does not fit {per_node}-GPU nodes", fleet)
        _check_shape(fleet, engine, tp, ep, f"k2_disagg.{side}.tensor_parallel_size",
                     f"k2_disagg.{side}.moe_expert_parallel_size")
        cap = _check_side_fit(fleet, engine, gpu, size, quant, side, worker, tp, ep)
        if cap is not None:
            caps[side] = cap
    return caps


def _check_side_fit(fleet: Fleet, engine: Engine, gpu: catalog.GpuType, size: int, quant: str, side: str,
                    worker: dict[str, Any], tp: int, ep: int) -> capacity.Capacity | None:
    """The memory-fit rule for one TRT-LLM disaggregated side (its LLM API options)."""
    known = catalog.CHECKPOINTS.get(fleet.settings.model)
    arch = known.arch if known else catalog.KIMI_K2
    if arch is None:
        return None  # the catalog does not know its KV layout (Kimi-K3): the plan's notes say so
    kv_config = worker.get("kv_cache_config") or {}
    fraction = kv_config.get("free_gpu_memory_fraction")
    max_len = _length(worker.get("max_seq_len")) or (known.max_context if known else None)
    layout = capacity.Layout(
        engine=engine.name, tp=tp, pp=int(worker.get("pipeline_parallel_size") or 1), ep=ep,
        attn_dp=bool(worker.get("enable_attention_dp")),
        fraction=float(fraction) if isinstance(fraction, (int, float)) and not isinstance(fraction, bool) else None,
        kv_dtype_bytes=_kv_dtype_bytes(kv_config.get("dtype")), max_len=max_len,
    )
    cap = capacity.predict(gpu, arch, quant, size, layout)
    if cap.kv_gib <= 0 or cap.tokens == 0:
        raise _fail("k2_disagg", f"{side}: {cap.weights_gib:.1f} GiB of weights per GPU ({cap.non_expert_gib:.1f} "
                    f"attention/dense/embedding + {cap.experts_gib:.1f} routed experts over {layout.moe_ranks} GPUs) + "
                    f"{cap.overhead_gib:.1f} GiB runtime leave no KV cache on {gpu.name} ({cap.gpu_total_gib:.2f} GiB); "
                    "raise its tensor_parallel_size/moe_expert_parallel_size", fleet)
    if cap.fits is not None and cap.fits < 1:
        raise _fail("k2_disagg", f"{side}: max_seq_len {cap.max_len:,} does not fit the predicted KV cache of "
                    f"{cap.tokens_per_kv_group:,} tokens ({cap.kv_gib:.2f} GiB per GPU / {cap.kv_bytes_per_token:,} B/token); "
                    f"lower {side}.max_seq_len or raise its tensor_parallel_size", fleet)
    return cap


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _check_shape(fleet: Fleet, engine: Engine, tp: int, ep: int, tp_key: str = "k2_tp", ep_key: str = "k2_ep") -> None:
    """Parallel sizes against the model's shape (catalog): tensor parallel splits the
    attention heads, expert parallel the routed experts; in SGLang and TRT-LLM the EP ranks
    subdivide the TP group (MoE tp × ep = tp), so EP must divide TP there."""
    known = catalog.CHECKPOINTS.get(fleet.settings.model)
    if known is None or tp == 0:
        return
    if known.heads is not None and known.heads % tp:
        raise _fail(tp_key, f"{tp} does not divide the {known.heads} attention heads of {known.repo_id}; "
                    f"use one of {_divisors(known.heads)} (with more pipeline or data parallel for more GPUs)", fleet)
    if ep > 1 and known.experts % ep:
        raise _fail(ep_key, f"{ep} does not divide the {known.experts} routed experts of {known.repo_id}; "
                    f"use one of {_divisors(known.experts)}", fleet)
    if ep > 1 and engine.ep_within_tp and tp % ep:
        raise _fail(ep_key, f"{ep} does not divide the tensor parallel size {tp}: {engine.name} splits each TP group "
                    f"into MoE tp × ep ranks; use one of {_divisors(tp)}", fleet)


GPU_LIST_ENV = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def _check_env(fleet: Fleet, per_node: int) -> None:
    """``k2_env`` must not contradict the keys k2fleet derives the same variables from:
    the socket interface (``k2_nic``), the HCAs (``k2_ib_hcas``) and the GPUs each host's
    engine is planned on (``k2_gpus_per_node``)."""
    for h in fleet.hosts:
        env, nic, hcas = h.settings.env, h.settings.nic, h.settings.ib_hcas
        if h.settings.role in ("router", "slurm-submit"):
            continue
        for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
            value = env.get(name)
            if nic and value is not None and value.removeprefix("=") != nic:
                raise _fail(f"k2_env.{name}", f"{value[:40]!r} contradicts k2_nic {nic} of host {h.name} (k2fleet "
                            f"sets {name} from k2_nic); remove it from k2_env", fleet)
        value = env.get("NCCL_IB_HCA")
        if hcas and value is not None and value.removeprefix("=") != ",".join(hcas):
            raise _fail("k2_env.NCCL_IB_HCA", f"{value[:40]!r} contradicts k2_ib_hcas {','.join(hcas)} of host "
                        f"{h.name} (k2fleet sets NCCL_IB_HCA from it); remove it from k2_env", fleet)
        for name in GPU_LIST_ENV:
            value = env.get(name)
            if value is None:
                continue
            ids = [part.strip() for part in value.split(",") if part.strip()]
            if len(ids) != per_node or len(set(ids)) != len(ids):
                raise _fail(f"k2_env.{name}", f"lists {len(set(ids))} distinct GPUs ({value[:40]!r}) but host {h.name}'s "
                            f"engine is planned on {per_node} (k2_gpus_per_node); remove it from k2_env or set "
                            "k2_gpus_per_node to the GPUs the engine may use", fleet)


def _check_hub_transport(fleet: Fleet) -> None:
    """A Hub token (``k2_hub_token_file``) is sent only over https, or http to loopback."""
    s = fleet.settings
    if not s.hub_token_file or not s.hub_endpoint:
        return
    parts = urlsplit(s.hub_endpoint)
    host = parts.hostname or ""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if parts.scheme != "https" and not loopback:
        raise _fail("k2_hub_endpoint", f"{parts.scheme}:// with k2_hub_token_file set would send the Hub token in "
                    "clear text; use https:// (plain http only to a loopback address) or unset k2_hub_token_file",
                    fleet)


def image_registry(image: str) -> str | None:
    """The registry host of an image reference (None: Docker Hub).

    >>> image_registry("nvcr.io/nvidia/vllm:25.10-py3"), image_registry("vllm/vllm-openai:v0.33.0")
    ('nvcr.io', None)
    """
    first, slash, _ = image.partition("/")
    registry = bool(slash) and ("." in first or ":" in first or first == "localhost")
    if not registry or first in ("docker.io", "index.docker.io", "registry-1.docker.io"):
        return None
    return first.rsplit(":", 1)[0] if not first.startswith("[") else first


def _check_mirrors(fleet: Fleet, runtime: str, image: str | None) -> None:
    """Mirror keys come with what they need (:mod:`k2fleet.planning.mirrors`), and
    ``k2_egress: mirrors-only`` only with what k2fleet can name the hosts' destinations for."""
    s = fleet.settings
    for mirror in ("os_mirror", "nvidia_repo", "container_toolkit_repo", "docker_repo"):
        keyring = f"{mirror}_keyring"
        if getattr(s, keyring) and not getattr(s, mirror):
            raise _fail(f"k2_{keyring}", f"is the key of k2_{mirror}, which is not set; set k2_{mirror} or remove it",
                        fleet)
    if s.os_security_mirror:
        if not s.os_mirror:
            raise _fail("k2_os_security_mirror", "is read beside k2_os_mirror, which is not set; set k2_os_mirror "
                        "(your mirror of the distribution's archive) or remove it", fleet)
        for h in fleet.hosts:
            if not MIRROR_LAYOUTS[host_os(h)].security_suites:
                raise _fail("k2_os_security_mirror", f"names Debian's separate security archive, but host {h.name} "
                            f"runs {host_os(h)}, whose security updates are in k2_os_mirror's own archive "
                            "(Ubuntu: its -security pocket) or repositories (dnf); remove it", fleet)
    if s.nvidia_repo and not s.nvidia_repo_keyring:
        raise _fail("k2_nvidia_repo", "needs k2_nvidia_repo_keyring: a file on this control machine with NVIDIA's "
                    "repository key (cuda-archive-keyring.gpg from the cuda-keyring package, or the .pub key the "
                    "repository serves), which apt/dnf check the mirror's packages with", fleet)
    if s.container_toolkit_repo and not s.container_toolkit_repo_keyring:
        raise _fail("k2_container_toolkit_repo", "needs k2_container_toolkit_repo_keyring: a file on this control "
                    "machine with the key the toolkit's repository is signed with (the gpgkey file it serves, "
                    "https://nvidia.github.io/libnvidia-container/gpgkey upstream), which apt/dnf check the mirror with",
                    fleet)
    if s.docker_repo and not s.docker_repo_keyring:
        raise _fail("k2_docker_repo", "needs k2_docker_repo_keyring: a file on this control machine with Docker's "
                    "armored repository key (https://download.docker.com/linux/rhel/gpg upstream), which dnf checks "
                    "the mirror's packages with", fleet)
    if s.egress != "mirrors-only":
        return
    if not s.firewall:
        raise _fail("k2_egress", "mirrors-only is enforced by k2fleet's nftables table; set k2_firewall: True "
                    "(or k2_egress: open)", fleet)
    if s.package_source == "apt" and not s.os_mirror:
        raise _fail("k2_egress", "mirrors-only with k2_package_source: apt needs k2_os_mirror: k2fleet does not know "
                    "which hosts the hosts' own apt/dnf sources name; set k2_os_mirror (or use k2_package_source: "
                    "bundle)", fleet)
    if s.checkpoint_fetcher not in ("control", "auto") and not s.hub_endpoint:  # auto: control there
        raise _fail("k2_egress", f"mirrors-only with k2_checkpoint_fetcher: {s.checkpoint_fetcher} needs "
                    "k2_hub_endpoint: huggingface.co serves its files from CDN hosts k2fleet cannot list; set "
                    "k2_hub_endpoint to your Hub mirror (or k2_checkpoint_fetcher: control)", fleet)
    if runtime == "container" and s.bundle is None and not s.engine_doubles:
        if image_registry(image or "") is None:
            raise _fail("k2_egress", "mirrors-only with the container runtime pulls the image from Docker Hub, whose "
                        "layers come from CDN hosts k2fleet cannot list; set k2_image to an image on your own "
                        "registry (registry.corp:5000/...) or ship images in k2_bundle", fleet)


def resolve(fleet: Fleet) -> Deployment:
    """Check the cross-key rules and resolve defaults; raises SpecError on the first problem."""
    s = fleet.settings
    size, quant, reasoning = _check_model(fleet)
    gpu, per_node, platform = _check_hardware(fleet)
    if quant == "nvfp4" and gpu is not None and gpu.arch != catalog.BLACKWELL:
        raise _fail(
            "k2_gpu",
            f"NVFP4 weights ({s.model}) need Blackwell GPUs (b200, b300, gb200, gb300), not {gpu.name}; "
            "use an FP8/INT4 checkpoint on this hardware",
            fleet,
        )
    engine = engines.get(s.engine)
    version, runtime, image = _check_engine(fleet, platform)
    why = profiles.refusal(s.engine, version, s.profile)
    if why:
        raise _fail(profiles.KEY, why, fleet)
    notes = _check_model_serving(fleet, gpu, version)
    known = catalog.CHECKPOINTS.get(s.model)
    reasoning_parser = s.reasoning_parser or (((known.reasoning_parser if known else None) or "kimi_k2") if reasoning else None)
    # k2_tool_parser's default names K2's parser: a known model's own parser replaces it (kimi_k3 for Kimi-K3)
    tool_parser = known.tool_parser if known and s.tool_parser == "kimi_k2" else s.tool_parser
    _check_parsers(fleet, version, tool_parser, reasoning_parser)
    if engine.needs_gguf and not s.gguf_repo:
        raise _fail("k2_gguf_repo", "KTransformers serves GGUF weights; set k2_gguf_repo, k2_gguf_revision and k2_gguf_pattern", fleet)
    _check_hub_transport(fleet)
    _check_mirrors(fleet, runtime, image)
    notes += filter(None, [mirrors.security_archive_note(s, {host_os(h) for h in fleet.hosts})])
    _check_roles(fleet, engine)
    _check_fetcher(fleet)
    _check_bundle(fleet)
    _check_api_key(fleet)
    _check_tls(fleet)
    _check_load_balancer(fleet)
    _check_metrics(fleet, gpu)
    _check_ip_addresses(fleet)
    _check_venv_python(fleet, s.engine, version, runtime)
    pools = {}
    capacities: dict[str, capacity.Capacity] = {}
    for role, hosts in fleet.pools.items():
        pools[role] = _check_pool(fleet, role, hosts, engine, per_node)
        _check_shape(fleet, engine, pools[role].tp, pools[role].ep)
        refused = engine.pool_refusal(pools[role])
        if refused:
            raise _fail(*refused, fleet)
        if gpu is not None:
            _check_size(fleet, pools[role], gpu, size)
            cap = _check_fit(fleet, pools[role], gpu, size, quant, engine, version)
            if cap is not None:
                capacities[role] = cap
    if "slurm-submit" in pools and gpu is not None:
        capacities |= {f"disagg.{side}": cap for side, cap in _check_slurm(fleet, engine, gpu, per_node, size, quant).items()}
    _check_env(fleet, per_node)
    driver = choose_driver(fleet, gpu, s.engine, version) if gpu is not None else None
    model_args = (known.engine_args or {}).get(s.engine, ()) if known else ()
    return Deployment(
        fleet=fleet,
        engine=s.engine,
        version=version,
        platform=platform,
        runtime=runtime,
        image=image,
        gpu=gpu,
        gpus_per_node=per_node,
        checkpoint_bytes=size,
        quantization=quant,
        reasoning_parser=reasoning_parser,
        served_model_name=s.served_model_name or s.model,
        pools=pools,
        engine_impl=engine,
        driver=driver,
        capacity=capacities,
        tool_parser=tool_parser,
        model_args=tuple(model_args),
        notes=tuple(notes),
    )
