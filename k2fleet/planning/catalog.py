"""Static facts k2fleet plans with: GPU types, known checkpoints, engine pins.

Everything here is data, read by the spec, the validator and the renderers. Numbers
are deliberately conservative; an inventory can override the checkpoint size with
``k2_checkpoint_bytes`` when it serves a checkpoint this table does not know.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class GpuType:
    """One accelerator model: vendor, memory and architecture family.

    ``memory_gib``: the memory the vendor quotes; ``reported_gib``: the total CUDA/HIP
    reports for the device (``torch.cuda.mem_get_info``), which the engines multiply by their
    memory utilisation — where known (PyTorch's out-of-memory message "GPU 0 has a total
    capacity of X GiB" on that device), else ``memory_gib``."""

    name: str
    vendor: str  # "nvidia" | "amd"
    memory_gib: float
    arch: str  # "hopper" | "blackwell" | "cdna3" | "cdna4"
    default_per_node: int = 8
    max_per_node: int = 8  # what one node of this type ships (HGX/OAM boards: 8, GB200/GB300 trays: 4)
    reported_gib: float | None = None
    smi_mib: int | None = None  # nvidia-smi --query-gpu=memory.total (MiB), what SGLang sizes its defaults by

    @property
    def total_gib(self) -> float:
        """What the engine sees as the device's total memory (``reported_gib`` or ``memory_gib``)."""
        return self.reported_gib or self.memory_gib


GPUS: dict[str, GpuType] = {
    g.name: g
    for g in (
        # reported_gib: PyTorch's OOM message on the device (H100 SXM 79.18, H200 139.81,
        # B200 178.35, MI300X 191.69 GiB: "GPU 0 has a total capacity of ... GiB")
        # smi_mib: nvidia-smi's memory.total of H100 SXM 80GB (81559 MiB) and H200 (143771 MiB)
        # (H200 checked on a real one, 2026-11-27: 143771 MiB, PyTorch's total 139.80 GiB with
        # 616 MiB reserved by the driver: tests/fixtures/real_gpu_h200)
        GpuType("h100", "nvidia", 80, "hopper", reported_gib=79.18, smi_mib=81559),
        GpuType("h800", "nvidia", 80, "hopper"),
        GpuType("h20", "nvidia", 96, "hopper"),
        GpuType("h200", "nvidia", 141, "hopper", reported_gib=139.81, smi_mib=143771),
        GpuType("b200", "nvidia", 180, "blackwell", reported_gib=178.35),
        GpuType("b300", "nvidia", 268, "blackwell"),
        GpuType("gb200", "nvidia", 186, "blackwell", default_per_node=4, max_per_node=4),
        GpuType("gb300", "nvidia", 279, "blackwell", default_per_node=4, max_per_node=4),
        GpuType("mi300x", "amd", 192, "cdna3", reported_gib=191.69),
        GpuType("mi325x", "amd", 256, "cdna3"),
        GpuType("mi355x", "amd", 288, "cdna4"),
    )
}


@dataclass(frozen=True)
class Architecture:
    """The shape of a Kimi K2 checkpoint, from its ``config.json`` (``DeepseekV3ForCausalLM``,
    ``model_type: kimi_k2``; the same values in moonshotai/Kimi-K2-Instruct, -Instruct-0905,
    -Thinking and nvidia/Kimi-K2-Thinking-NVFP4, and in K2.5's ``text_config``): MLA attention
    with a LoRA-compressed query and a 512-wide latent KV, one dense layer
    (``first_k_dense_replace``), then MoE layers of 384 routed experts + 1 shared expert, an
    untied 163,840-token embedding and LM head (``tie_word_embeddings: false``). No MTP layer
    (``num_nextn_predict_layers: 0``)."""

    layers: int = 61  # num_hidden_layers
    dense_layers: int = 1  # first_k_dense_replace (the rest are MoE layers: moe_layer_freq 1)
    hidden: int = 7168  # hidden_size
    intermediate: int = 18432  # intermediate_size: the dense layers' MLP
    moe_intermediate: int = 2048  # moe_intermediate_size: each routed and shared expert
    experts: int = 384  # n_routed_experts
    shared_experts: int = 1  # n_shared_experts
    heads: int = 64  # num_attention_heads
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    vocab: int = 163_840  # vocab_size

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    def params(self) -> dict[str, int]:
        """Parameter counts by how the engines shard them (1,026.4 B in all for Kimi K2):

        - ``replicated``: on every rank whatever the TP size — the query and KV down-projections
          (``q_a_proj``, ``kv_a_proj_with_mqa``: vLLM's replicated ``fused_qkv_a_proj``), norms,
          the MoE router (``gate``, 384 × hidden per MoE layer);
        - ``attention``: ``q_b_proj``, ``kv_b_proj``, ``o_proj`` (split by heads: TP);
        - ``dense``: the dense layers' MLP and the shared experts (TP-split);
        - ``embedding``: ``embed_tokens`` + ``lm_head`` (vocab-parallel: TP-split);
        - ``experts``: the routed experts (split over the MoE ranks: TP, or EP × MoE-TP).
        Under attention data parallel (vLLM DP ranks at TP1, SGLang DP attention, TRT-LLM
        attention DP) the TP group of attention/dense/embedding is smaller, down to 1: every
        rank then holds all of them.
        """
        h, L = self.hidden, self.layers
        q_a = h * self.q_lora_rank + self.q_lora_rank
        kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        q_b = self.q_lora_rank * self.heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        kv_b = self.kv_lora_rank * self.heads * (self.qk_nope_head_dim + self.v_head_dim)
        o = self.heads * self.v_head_dim * h
        expert = 3 * h * self.moe_intermediate  # gate_proj, up_proj, down_proj
        return {
            "replicated": (q_a + kv_a + 2 * h) * L + (h * self.experts + self.experts) * self.moe_layers + h,
            "attention": (q_b + kv_b + o) * L,
            "dense_mlp": 3 * h * self.intermediate * self.dense_layers,
            "shared_experts": expert * self.shared_experts * self.moe_layers,
            "embedding": 2 * self.vocab * h,
            "experts": expert * self.experts * self.moe_layers,
        }

    def mla_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV cache of one token: MLA caches the compressed latent and the RoPE key,
        ``kv_lora_rank + qk_rope_head_dim`` values per layer (the same on every TP rank:
        MLA's KV is not split by heads). Kimi K2 in bf16: (512 + 64) × 61 × 2 = 70,272 bytes."""
        return (self.kv_lora_rank + self.qk_rope_head_dim) * self.layers * dtype_bytes


KIMI_K2 = Architecture()

# Bytes per parameter of each part, by weight format (scales included):
# - int4: compressed-tensors pack-quantized int4, group 32, a bf16 scale per group
#   (0.5 + 2/32 bytes); its ``ignore`` list keeps ``lm_head``, every ``self_attn`` and the
#   ``shared_experts`` in bf16, so the quantized Linears are the routed experts and the dense
#   layer's MLP (Kimi-K2-Thinking config.json); embedding and router are not Linears (bf16).
# - nvfp4: NVFP4 (4-bit, an FP8 scale per 16: 0.5 + 1/16) on the routed experts; the rest bf16.
# - fp8: block FP8 (128 × 128 blocks, an fp32 scale per block: ~1 byte) on every Linear of the
#   decoder (Kimi-K2-Instruct, as DeepSeek-V3); embedding, LM head and router in bf16.
# - bf16: 2 bytes everywhere. The catalog's checkpoint size (or k2_checkpoint_bytes) scales
#   the result: 593.6 GB computed for Kimi-K2-Thinking against its 594 GB of shards.
_I4 = 0.5 + 2 / 32
_FP4 = 0.5 + 1 / 16
WEIGHT_BYTES: dict[str, dict[str, float]] = {
    "int4": {"replicated": 2, "attention": 2, "dense_mlp": _I4, "shared_experts": 2, "embedding": 2, "experts": _I4},
    "nvfp4": {"replicated": 2, "attention": 2, "dense_mlp": 2, "shared_experts": 2, "embedding": 2, "experts": _FP4},
    "fp8": {"replicated": 1, "attention": 1, "dense_mlp": 1, "shared_experts": 1, "embedding": 2, "experts": 1},
    "bf16": {part: 2 for part in ("replicated", "attention", "dense_mlp", "shared_experts", "embedding", "experts")},
}


# What a catalog entry's figures rest on (each entry names one of these in ``sources``).
# The newer models' sizes and shapes are per Moonshot's model cards and the engines' guides as
# summarised in the project notes (../shared/NOTES.md, "Kimi models after K2-Thinking"): the
# moonshotai/Kimi-K2.5, -K2.6 and -K3 repositories themselves could not be read (issue #25's
# check). Their model_type, the parser names and the first engine versions were checked against
# the engines' own code (SOURCE_ENGINES, issue #25). Anything neither gives is recorded as
# unknown (None) here, and what needs it is refused or skipped, never guessed.
SOURCE_K2 = ("config.json of each moonshotai/Kimi-K2-* repository (model_type kimi_k2, DeepseekV3ForCausalLM); "
             "shard names and sizes as read from the repositories (project notes, 'Checkpoints and engines')")
SOURCE_NOTES = ("per Moonshot's model card as summarised in the project notes ('Kimi models after K2-Thinking'), "
                "not re-fetched")
SOURCE_SGLANG_K3 = "SGLang's Kimi-K3 cookbook node shapes, as given in the project's brief for issue #25, not re-fetched"
SOURCE_ENGINES = ("model_type, parsers and first versions read in the engines' PyPI wheels (issue #25): "
                  "vllm/model_executor/models/registry.py, vllm/transformers_utils/configs/kimi_k25.py and kimi_k3.py, "
                  "vllm/tool_parsers/__init__.py, vllm/reasoning/__init__.py (vllm 0.14.1, 0.15.0, 0.26.0, 0.27.0, "
                  "0.27.1, 0.33.0); sglang/srt/configs/kimi_k3.py, sglang/srt/function_call/function_call_parser.py "
                  "(FunctionCallParser.ToolCallParserEnum), sglang/srt/parser/reasoning_parser.py "
                  "(ReasoningParser.DetectorMap) (sglang 0.5.16, 0.5.17, 0.5.23)")

# The Kimi parser names each engine registers at the versions read (SOURCE_ENGINES; vllm 0.11.0
# and sglang 0.5.4 likewise): (tool-call parsers, reasoning parsers). vLLM: the keys of
# ``_TOOL_PARSERS_TO_REGISTER`` / ``_REASONING_PARSERS_TO_REGISTER`` (0.11.0: the
# ``@ToolParserManager.register_module`` names under vllm/entrypoints/openai/tool_parsers/ and
# ``@ReasoningParserManager.register_module`` under vllm/reasoning/); SGLang: the keys of
# ``ToolCallParserEnum`` / ``DetectorMap``. Only names starting "kimi" are listed.
# ``kimi_k3`` first appears in vLLM 0.27.0 (absent from 0.26.0; 0.27.1 differs from 0.27.0 only
# in vllm/_version.py and qwen3_dspark.py) and SGLang 0.5.17 (absent from 0.5.16). vLLM 0.11.0
# and SGLang 0.5.4 have no ``kimi_k2`` reasoning parser (SGLang 0.5.4 has ``kimi``).
# TensorRT-LLM is not listed: no trtllm-serve release was read (its main branch registers a
# ``kimi_k3`` tool parser, NVIDIA/TensorRT-LLM PR #17327, merged 2026-08; which release first has
# it is unknown).
KIMI_PARSERS: dict[tuple[str, str], tuple[tuple[str, ...], tuple[str, ...]]] = {
    ("vllm", "0.11.0"): (("kimi_k2",), ()),
    ("vllm", "0.15.0"): (("kimi_k2",), ("kimi_k2",)),
    ("vllm", "0.26.0"): (("kimi_k2",), ("kimi_k2",)),
    ("vllm", "0.27.0"): (("kimi_k2", "kimi_k3"), ("kimi_k2", "kimi_k3")),
    ("vllm", "0.27.1"): (("kimi_k2", "kimi_k3"), ("kimi_k2", "kimi_k3")),
    ("vllm", "0.33.0"): (("kimi_k2", "kimi_k3"), ("kimi_k2", "kimi_k3")),
    ("sglang", "0.5.4"): (("kimi_k2",), ("kimi",)),
    ("sglang", "0.5.16"): (("kimi_k2",), ("kimi", "kimi_k2")),
    ("sglang", "0.5.17"): (("kimi_k2", "kimi_k3"), ("kimi", "kimi_k2", "kimi_k3")),
    ("sglang", "0.5.23"): (("kimi_k2", "kimi_k3"), ("kimi", "kimi_k2", "kimi_k3")),
}


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint k2fleet knows: size on disk, weight format, reasoning or not, its
    maximum context (``max_position_embeddings`` of its config.json) and its shape:
    attention heads (``num_attention_heads``; tensor parallel splits them) and routed
    experts (``n_routed_experts``; expert parallel splits them). Every Kimi K2 release
    has 64 heads and 384 routed experts (config.json of each repository).

    ``None`` is *unknown* (not in the sources): ``max_context`` None skips the context check,
    ``heads`` None the TP-divides-heads check, ``arch`` None the KV prediction of
    :mod:`k2fleet.planning.capacity` (the plan says so), ``shards``/``shard_style`` None the
    real shard naming (the rehearsal's synthetic checkpoint then uses the K2-Thinking layout and
    says it is a stand-in).

    ``engines``: engine → the first version that serves it (None: the sources give no
    version); ``None`` for the whole map: no restriction recorded (the K2 releases: every engine
    k2fleet renders). An engine missing from the map is refused. ``blackwell_only``: engines
    that serve it on Blackwell GPUs only. ``min_gpus``: GPU type → the fewest GPUs of one
    serving instance (published node shapes). ``engine_args``: engine → flags its deployment
    adds to the argv. ``tool_parser``/``reasoning_parser``: the parsers its deployment names
    (``reasoning_parser`` None: not a reasoning model)."""

    repo_id: str
    bytes: int
    quantization: str  # "int4" | "fp8" | "nvfp4" | "gguf" | "mxfp4"
    reasoning: bool
    max_context: int | None = None
    model_type: str | None = "kimi_k2"
    heads: int | None = 64
    experts: int = 384
    arch: Architecture | None = KIMI_K2
    shards: int | None = None
    shard_style: str | None = None  # "thinking": model-00001-of-000062 | "instruct": model-1-of-61
    multimodal: bool = False
    tool_parser: str = "kimi_k2"
    reasoning_parser: str | None = None
    engines: dict[str, str | None] | None = None
    blackwell_only: tuple[str, ...] = ()
    min_gpus: dict[str, int] | None = None
    engine_args: dict[str, tuple[str, ...]] | None = None
    sources: str = SOURCE_K2
    unknown: tuple[str, ...] = ()  # what the sources do not give (shown by ``k2fleet plan``)


# K2.5 / K2.6 on vLLM: Moonshot's guide (as the notes summarise it) serves them with
# ``vllm serve … -tp 8 --mm-encoder-tp-mode data --trust-remote-code --tool-call-parser kimi_k2
# --reasoning-parser kimi_k2`` (K2.6 reuses K2.5's deployment). ``--mm-encoder-tp-mode`` is
# vLLM's ``MultiModalConfig.mm_encoder_tp_mode: Literal["weights", "data"]`` (default "weights";
# vllm/config/multimodal.py in 0.11.0, 0.26.0, 0.27.x and 0.33.0; not in the 0.10.0 flag table).
_K25_VLLM_ARGS = {"vllm": ("--mm-encoder-tp-mode", "data")}
# Kimi-K3's published node shapes (SGLang cookbook): the fewest GPUs of one instance per GPU type.
K3_NODE_SHAPES = {"b300": 8, "b200": 16, "h200": 16, "h100": 32, "gb200": 16}

CHECKPOINTS: dict[str, Checkpoint] = {
    c.repo_id: c
    for c in (
        Checkpoint("moonshotai/Kimi-K2-Thinking", 594_000_000_000, "int4", True, max_context=262_144,
                   shards=62, shard_style="thinking", reasoning_parser="kimi_k2"),
        Checkpoint("moonshotai/Kimi-K2-Instruct", 1_030_000_000_000, "fp8", False, max_context=131_072,
                   shards=61, shard_style="instruct"),
        # K2-Instruct-0905: the K2 architecture, block FP8 like K2-Instruct, about 1 TB (project notes);
        # 262,144 context from its config.json (entry predates issue #25). Shard naming not recorded.
        Checkpoint("moonshotai/Kimi-K2-Instruct-0905", 1_030_000_000_000, "fp8", False, max_context=262_144,
                   sources=SOURCE_K2 + "; " + SOURCE_NOTES, unknown=("shard naming",)),
        Checkpoint("nvidia/Kimi-K2-Thinking-NVFP4", 595_000_000_000, "nvfp4", True, max_context=262_144,
                   reasoning_parser="kimi_k2"),
        # K2.5: multimodal (a vision encoder over K2's text model: its text_config has K2's shape, so
        # the capacity arithmetic is K2's; the encoder's few GB are folded into the scaled parts),
        # native INT4, about 620 GB (notes); served by vLLM with --mm-encoder-tp-mode data and the
        # kimi_k2 parsers (notes; both parsers registered from vLLM 0.15.0 on: KIMI_PARSERS).
        # model_type kimi_k25: vLLM's KimiK25Config (vllm/transformers_utils/configs/kimi_k25.py);
        # vLLM >= 0.15.0: KimiK25ForConditionalGeneration is in vllm/model_executor/models/registry.py
        # of 0.15.0, not of 0.14.1. The notes name no other engine, no context and no shard layout.
        Checkpoint("moonshotai/Kimi-K2.5", 620_000_000_000, "int4", True, max_context=None, model_type="kimi_k25",
                   multimodal=True, reasoning_parser="kimi_k2", engines={"vllm": "0.15.0"},
                   engine_args=_K25_VLLM_ARGS, sources=SOURCE_NOTES + "; " + SOURCE_ENGINES,
                   unknown=("context length", "shard naming", "engines besides vLLM")),
        # K2.6: K2.5's architecture, about 640 GB, deployed like K2.5 (project notes); hence K2.5's
        # model_type and first vLLM version (vLLM 0.33.0 registers no other Kimi K2.x class), which
        # rests on the notes' "K2.5's architecture": its config.json was not read.
        Checkpoint("moonshotai/Kimi-K2.6", 640_000_000_000, "int4", True, max_context=None, model_type="kimi_k25",
                   multimodal=True, reasoning_parser="kimi_k2", engines={"vllm": "0.15.0"},
                   engine_args=_K25_VLLM_ARGS, sources=SOURCE_NOTES + "; " + SOURCE_ENGINES,
                   unknown=("context length", "shard naming", "engines besides vLLM")),
        # K3 (notes): 2.8T parameters (~104B active), 896 routed experts (16 active), Kimi Delta
        # Attention with full MLA every fourth layer, a 1M-token context, routed experts in MXFP4, about
        # 1.56 TB; TensorRT-LLM on Blackwell only (no version given); not KTransformers (not named).
        # Engine code (SOURCE_ENGINES): model_type kimi_k3 (vLLM's and SGLang's KimiK3Config, with a
        # vision_config: multimodal; KimiK3ForConditionalGeneration in vLLM's registry and SGLang's
        # EntryClass); parsers kimi_k3 in vLLM from 0.27.0 (the notes' 0.27.1 is not the first: 0.27.0
        # has the model class and both parsers) and in SGLang from 0.5.17 (0.5.16 has neither).
        # Unknown: attention heads, layer count, kv_lora_rank, the KDA recurrent state size, the exact
        # max_position_embeddings, shard naming — moonshotai/Kimi-K3's config.json was not read. (Copies
        # of a config.json in third-party repositories give 93 layers, 96 heads, kv_lora_rank 512,
        # max_position_embeddings 1,048,576 and 96 shards named model-000NN-of-000096, 1,560,936,091,448
        # bytes: not the model's repository, so not entered.) So no KV prediction (capacity needs
        # per-token MLA bytes of the MLA layers and the per-sequence KDA state) and no TP-divides-heads check.
        Checkpoint("moonshotai/Kimi-K3", 1_560_000_000_000, "mxfp4", True, max_context=None, model_type="kimi_k3",
                   heads=None, experts=896, arch=None, multimodal=True, tool_parser="kimi_k3", reasoning_parser="kimi_k3",
                   engines={"vllm": "0.27.0", "sglang": "0.5.17", "trtllm": None}, blackwell_only=("trtllm",),
                   min_gpus=K3_NODE_SHAPES, sources=SOURCE_NOTES + "; " + SOURCE_SGLANG_K3 + "; " + SOURCE_ENGINES,
                   unknown=("attention heads", "layers", "kv_lora_rank", "KDA state size", "exact context length",
                            "minimum TensorRT-LLM version", "TensorRT-LLM's kimi_k3 parsers at its pin",
                            "shard naming")),
    )
}

QUANTIZATIONS = ("int4", "fp8", "nvfp4", "gguf", "bf16", "mxfp4")

# Engines and their supported pins. The first of each list is today's default.
ENGINE_VERSIONS: dict[str, tuple[str, ...]] = {
    "vllm": ("0.33.0", "0.11.0", "0.10.0"),
    "sglang": ("0.5.23", "0.5.4", "0.4.9"),
    "trtllm": ("1.2.0", "1.0.0"),
    "ktransformers": ("0.7.2", "0.3.2"),
}

# Their default container images (per platform) are each engine's own: k2fleet.planning.engines.<name>.

BLACKWELL = "blackwell"


def version_tuple(version: str) -> tuple[int, ...]:
    """``"0.5.23"`` → ``(0, 5, 23)``; non-numeric parts (rc1, post1) are dropped."""
    parts = []
    for piece in version.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


# How each engine takes the endpoint API key of ``k2_api_key_file`` without argv (the variable its
# server reads: ``Engine.api_key_env``), or why it cannot (``Engine.api_key_fronted``: its endpoints get
# k2fleet's authenticating front instead, k2fleet.planning.api_front) is each engine's own
# (k2fleet.planning.engines.<name>). vLLM 0.33.0 vllm/entrypoints/serve/middleware/register.py reads
# ``args.api_key or envs.VLLM_API_KEY`` (the same variable since 0.2.x, so the older pins too).
