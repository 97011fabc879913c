"""The fleet spec: every ``k2_*`` inventory key, typed, with its default and meaning.

An inventory is a plain pyinfra inventory. k2fleet reads the ``k2_*`` keys of each
host's data (host data, group data, ``group_data/*.py`` — pyinfra's own merge) into a
:class:`HostSettings`. Each key has a *scope*:

- ``fleet``: must be the same on every host (model, revision, engine, ports, ...);
- ``pool``: must be the same on every host of one role (prefill, decode, serve, ...);
- ``host``: may differ per host (address, NIC).

``k2fleet keys`` prints the table below as Markdown; README's key table is that output.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

PREFIX = "k2_"
FLEET, POOL, HOST = "fleet", "pool", "host"
Role = Literal["serve", "prefill", "decode", "router", "slurm-submit"]
SHA_RE = re.compile(r"^[0-9a-f]{40}$")


def _key(scope: str, description: str, **kw: Any) -> Any:
    return Field(json_schema_extra={"scope": scope}, description=description, **kw)


class HostSettings(BaseModel):
    """All ``k2_*`` keys of one host (names without the ``k2_`` prefix)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- model -----------------------------------------------------------------
    model: str = _key(FLEET, "Hub repo id of the checkpoint, e.g. `moonshotai/Kimi-K2-Thinking`.")
    revision: str = _key(
        FLEET, "Pinned 40-hex commit sha of `k2_model` (never a branch or tag)."
    )
    served_model_name: str | None = _key(
        FLEET, "Name clients use in requests; default: `k2_model`.", default=None
    )
    checkpoint_bytes: int | None = _key(
        FLEET,
        "Checkpoint size in bytes, for the memory-fit check; default from k2fleet's catalog.",
        default=None,
        gt=0,
    )
    quantization: Literal["int4", "fp8", "nvfp4", "gguf", "bf16"] | None = _key(
        FLEET, "Weight format; default from the catalog (required for unknown models).", default=None
    )
    model_type_override: str | None = _key(
        FLEET,
        "Serve through a config overlay with this `model_type` (e.g. `deepseek_v3` for "
        "engines without Kimi support); the verified files are never edited.",
        default=None,
    )
    gguf_repo: str | None = _key(FLEET, "KTransformers: Hub repo id of the GGUF weights.", default=None)
    gguf_revision: str | None = _key(FLEET, "KTransformers: pinned commit of `k2_gguf_repo`.", default=None)
    gguf_pattern: str | None = _key(
        FLEET, "KTransformers: files of `k2_gguf_repo` to fetch, e.g. `Q4_K_M/*`.", default=None
    )
    checkpoint_source: str = _key(
        FLEET,
        "Where the checkpoint comes from: `hub` (huggingface-hub at `k2_revision`) or "
        "`control:/path` (a directory on the control machine holding the files and "
        "`.k2fleet/manifest.json`, e.g. made by `hf download` on a connected machine).",
        default="hub",
    )
    checkpoint_cache: str = _key(
        FLEET,
        "Control-machine directory the `hub` source downloads into and verifies "
        "(`DIR/<org>--<name>/<revision>`); the fleet then receives it from there once.",
        default="/var/cache/k2fleet/checkpoints",
    )
    hub_endpoint: str | None = _key(
        FLEET,
        "Hub URL for the `hub` source (an internal mirror); default: env `HF_ENDPOINT`, "
        "else huggingface.co.",
        default=None,
    )
    hub_token_file: str | None = _key(
        FLEET,
        "File on the control machine holding the Hub token; default: env `HF_TOKEN`. "
        "The token is read at execution time, never put in argv, logs or the plan.",
        default=None,
    )
    checkpoint_fetcher: str = _key(
        FLEET,
        "Who talks to the Hub for the `hub` source: `control` (the control machine downloads "
        "into `k2_checkpoint_cache`, verifies, and sends the fleet one copy) or the name of one "
        "inventory host that loads weights (it downloads into `k2_model_dir` itself, with "
        "huggingface_hub from an offline wheelhouse the control machine ships; the token goes "
        "there as a root-only file, removed after the download). The others receive from peers.",
        default="control",
    )
    shared_storage: bool = _key(
        FLEET,
        "`k2_model_dir` is shared storage (NFS, Lustre) seen by every host: only the first "
        "host fetches and verifies the checkpoint, the others only pass the gate.",
        default=False,
    )
    model_dir: str = _key(
        FLEET, "Where checkpoints live on hosts: `DIR/<org>--<name>/<revision>`.", default="/srv/k2fleet/models"
    )
    # --- engine ----------------------------------------------------------------
    engine: Literal["vllm", "sglang", "trtllm", "ktransformers"] = _key(
        FLEET, "Serving engine: `vllm`, `sglang`, `trtllm` or `ktransformers`."
    )
    engine_version: str | None = _key(
        FLEET,
        "Engine release to pin; default today's (vLLM 0.33.0, SGLang 0.5.23, TRT-LLM 1.2.0, "
        "KTransformers 0.7.2). Flag names are rendered for this version.",
        default=None,
    )
    runtime: Literal["venv", "container"] | None = _key(
        FLEET,
        "`venv` (engine installed in `k2_venv`) or `container` (Docker image `k2_image`); "
        "default: container for TRT-LLM and ROCm, venv otherwise.",
        default=None,
    )
    image: str | None = _key(FLEET, "Container image; default per engine, version and platform.", default=None)
    venv: str = _key(FLEET, "Python virtual environment of the engine (venv runtime).", default="/opt/k2fleet/venv")
    platform: Literal["cuda", "rocm"] | None = _key(
        FLEET, "Engine build: `cuda` or `rocm`; default from the GPU vendor.", default=None
    )
    package_source: Literal["apt", "bundle"] = _key(
        FLEET,
        "Host packages (rsync, OpenMPI, ...) from `apt` (hosts reach a mirror) or `bundle` "
        "(an offline .deb bundle with its full dependency closure, built on the control machine).",
        default="apt",
    )
    config_dir: str = _key(FLEET, "Where rendered config files go on hosts.", default="/etc/k2fleet")
    # --- hardware --------------------------------------------------------------
    gpu: str = _key(FLEET, "GPU type: h100, h800, h20, h200, b200, b300, gb200, gb300, mi300x, mi325x, mi355x.")
    gpus_per_node: int | None = _key(FLEET, "GPUs per host; default 8 (4 on GB200/GB300).", default=None, ge=1)
    simulated_gpus: bool = _key(
        FLEET,
        "Sandbox only: hosts have no GPUs and run engine test doubles. Requires "
        "`k2_engine_doubles`; refused on any other inventory.",
        default=False,
    )
    engine_doubles: bool = _key(
        FLEET, "Sandbox only: install k2fleet's engine test doubles instead of real engines.", default=False
    )
    # --- serving features --------------------------------------------------------
    tool_parser: str | None = _key(FLEET, "Tool-call parser (`--tool-call-parser`).", default="kimi_k2")
    reasoning_parser: str | None = _key(
        FLEET, "Reasoning parser; default `kimi_k2` for thinking models, none otherwise.", default=None
    )
    auto_tool_choice: bool = _key(FLEET, "vLLM `--enable-auto-tool-choice`.", default=True)
    max_model_len: int | None = _key(FLEET, "Context length cap (`--max-model-len`, `--context-length`).", default=None, ge=1)
    # --- ports -------------------------------------------------------------------
    port: int = _key(FLEET, "OpenAI API port of each serving process.", default=8000, ge=1, le=65535)
    router_port: int = _key(FLEET, "PD router's API port (router host).", default=8000, ge=1, le=65535)
    master_port: int = _key(FLEET, "vLLM `--master-port` (multi-node without Ray).", default=29501, ge=1, le=65535)
    dp_rpc_port: int = _key(FLEET, "vLLM `--data-parallel-rpc-port`.", default=13345, ge=1, le=65535)
    ray_port: int = _key(FLEET, "Ray head GCS port.", default=6379, ge=1, le=65535)
    dist_init_port: int = _key(FLEET, "SGLang `--dist-init-addr` port.", default=50000, ge=1, le=65535)
    bootstrap_port: int = _key(FLEET, "SGLang PD `--disaggregation-bootstrap-port`.", default=8998, ge=1, le=65535)
    mesh_port: int = _key(FLEET, "Port of k2fleet's own sshd for the SSH mesh (mpirun).", default=2233, ge=1, le=65535)
    mesh_user: str = _key(FLEET, "User mpirun connects as over the mesh.", default="root")
    health_timeout: int = _key(FLEET, "Seconds to wait for a real completion before failing.", default=3600, ge=1)
    # --- topology ------------------------------------------------------------------
    role: Role = _key(
        POOL,
        "What this host runs: `serve` (default), `prefill`, `decode`, `router` (SGLang PD), "
        "`slurm-submit` (TRT-LLM SLURM login node).",
        default="serve",
    )
    tp: int | None = _key(POOL, "Tensor parallel size; default `k2_gpus_per_node`.", default=None, ge=1)
    pp: int = _key(POOL, "Pipeline parallel size.", default=1, ge=1)
    dp: int = _key(POOL, "Data parallel size (vLLM DP ranks / SGLang `--dp-size`).", default=1, ge=1)
    ep: int = _key(POOL, "Expert parallel size; 1 = off. vLLM: must equal tp×dp.", default=1, ge=1)
    dcp: int = _key(POOL, "vLLM decode context parallel size; must divide `k2_tp`.", default=1, ge=1)
    attn_dp: bool = _key(POOL, "DP attention (SGLang `--enable-dp-attention`, TRT-LLM `enable_attention_dp`).", default=False)
    multinode_backend: Literal["ray", "mp"] = _key(
        POOL, "vLLM across nodes: `ray` (Ray cluster) or `mp` (`--nnodes/--node-rank`, headless ranks).", default="mp"
    )
    engine_args: dict[str, Any] = _key(
        POOL,
        "Extra engine flags `{flag: value}` (`True` = bare flag). Renamed flags are translated "
        "for the pinned version.",
        default_factory=dict,
    )
    env: dict[str, str] = _key(POOL, "Extra environment for the engine process.", default_factory=dict)
    gpu_memory_utilization: float | None = _key(
        POOL, "Fraction of GPU memory the engine may use (default 0.9).", default=None, gt=0, le=1
    )
    trtllm_config: dict[str, Any] = _key(
        POOL, "TRT-LLM extra LLM API options YAML (`--config`), merged over k2fleet's parallel keys.", default_factory=dict
    )
    slurm: dict[str, Any] | None = _key(
        POOL, "TRT-LLM SLURM submit: `slurm`, `benchmark`, `hardware`, `environment` sections of config.yaml.", default=None
    )
    disagg: dict[str, Any] | None = _key(
        POOL, "TRT-LLM SLURM disaggregation: `{ctx: {...LLM API...}, gen: {...}}` worker configs.", default=None
    )
    kt: dict[str, Any] = _key(
        POOL,
        "KTransformers settings: `method` (AMXINT4, AMXINT8, LLAMAFILE), `cpuinfer`, "
        "`threadpool_count`, `gpu_experts`, `optimize_rules` (legacy server), `cache_lens`.",
        default_factory=dict,
    )
    # --- per host --------------------------------------------------------------------
    address: str | None = _key(HOST, "Fleet-internal address; default `ssh_hostname`, else the host name.", default=None)
    nic: str | None = _key(HOST, "Interface for NCCL/Gloo sockets (`NCCL_SOCKET_IFNAME`, `GLOO_SOCKET_IFNAME`).", default=None)
    ib_hcas: list[str] = _key(HOST, "InfiniBand HCAs (`NCCL_IB_HCA`, SGLang `--disaggregation-ib-device`).", default_factory=list)


def scope_of(name: str) -> str:
    extra = HostSettings.model_fields[name].json_schema_extra
    assert isinstance(extra, dict)
    return str(extra["scope"])


class SpecError(Exception):
    """A bad inventory: ``key`` is the inventory key to fix, the message says how."""

    def __init__(self, key: str, message: str, where: str = "") -> None:
        self.key, self.message, self.where = key, message, where
        super().__init__(str(self))

    def __str__(self) -> str:
        prefix = f"{self.where}: " if self.where else ""
        return f"{prefix}{self.key}: {self.message}"


@dataclass(frozen=True)
class HostEntry:
    """One inventory host: its name, pyinfra data it connects with, its k2 settings."""

    name: str
    settings: HostSettings
    ssh_hostname: str | None = None
    groups: tuple[str, ...] = ()

    @property
    def address(self) -> str:
        return self.settings.address or self.ssh_hostname or self.name


@dataclass
class Fleet:
    """A validated inventory: hosts in inventory order, grouped into role pools."""

    source: str
    hosts: list[HostEntry]
    pools: dict[str, list[HostEntry]] = field(default_factory=dict)

    @property
    def settings(self) -> HostSettings:
        """Fleet-scope settings (identical on every host by construction)."""
        return self.hosts[0].settings


def parse_host(name: str, data: dict[str, Any], where: str = "", groups: tuple[str, ...] = ()) -> HostEntry:
    """Type-check one host's ``k2_*`` keys.

    >>> parse_host("n1", {"k2_model": "m/x", "k2_revision": "0"*40, "k2_engine": "vllm",
    ...                   "k2_gpu": "h200"}).settings.port
    8000
    """
    keys = {k[len(PREFIX):]: v for k, v in data.items() if k.startswith(PREFIX)}
    for key in keys:
        if key not in HostSettings.model_fields:
            close = difflib.get_close_matches(key, HostSettings.model_fields, n=1)
            hint = f"did you mean {PREFIX}{close[0]}?" if close else "see `k2fleet keys` for the list"
            raise SpecError(PREFIX + key, f"unknown key on host {name}; {hint}", where)
    try:
        settings = HostSettings(**keys)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = PREFIX + str(err["loc"][0]) if err["loc"] else "inventory"
        if err["type"] == "missing":
            msg = f"required on host {name} but not set; {HostSettings.model_fields[str(err['loc'][0])].description}"
        else:
            msg = f"{err['msg']} (got {err.get('input')!r} on host {name})"
        raise SpecError(loc, msg, where) from None
    return HostEntry(name=name, settings=settings, ssh_hostname=data.get("ssh_hostname"), groups=groups)


def build_fleet(source: str, entries: list[HostEntry]) -> Fleet:
    """Group hosts into pools and check fleet/pool scoped keys agree."""
    if not entries:
        raise SpecError("inventory", "no hosts", source)
    first = entries[0]
    pools: dict[str, list[HostEntry]] = {}
    for entry in entries:
        pools.setdefault(entry.settings.role, []).append(entry)
    for name in HostSettings.model_fields:
        scope = scope_of(name)
        if scope == HOST:
            continue
        for entry in entries:
            ref = first if scope == FLEET else pools[entry.settings.role][0]
            a, b = getattr(ref.settings, name), getattr(entry.settings, name)
            if a != b:
                what = "every host" if scope == FLEET else f"every {entry.settings.role} host"
                raise SpecError(
                    PREFIX + name,
                    f"must be the same on {what}, but {ref.name} has {a!r} and {entry.name} has {b!r}; "
                    "set it in group data",
                    source,
                )
    return Fleet(source=source, hosts=entries, pools=pools)


def keys_markdown() -> str:
    """The README table of every inventory key."""
    lines = ["| key | scope | default | meaning |", "|---|---|---|---|"]
    for name, info in HostSettings.model_fields.items():
        if info.is_required():
            default = "**required**"
        elif info.default_factory is not None:
            default = f"`{info.default_factory()!r}`"
        else:
            default = f"`{info.default!r}`"
        lines.append(f"| `{PREFIX}{name}` | {scope_of(name)} | {default} | {info.description} |")
    return "\n".join(lines) + "\n"
