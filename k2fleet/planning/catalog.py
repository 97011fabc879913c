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
    """One accelerator model: vendor, usable memory and architecture family."""

    name: str
    vendor: str  # "nvidia" | "amd"
    memory_gib: float
    arch: str  # "hopper" | "blackwell" | "cdna3" | "cdna4"
    default_per_node: int = 8
    max_per_node: int = 8  # what one node of this type ships (HGX/OAM boards: 8, GB200/GB300 trays: 4)


GPUS: dict[str, GpuType] = {
    g.name: g
    for g in (
        GpuType("h100", "nvidia", 80, "hopper"),
        GpuType("h800", "nvidia", 80, "hopper"),
        GpuType("h20", "nvidia", 96, "hopper"),
        GpuType("h200", "nvidia", 141, "hopper"),
        GpuType("b200", "nvidia", 180, "blackwell"),
        GpuType("b300", "nvidia", 268, "blackwell"),
        GpuType("gb200", "nvidia", 186, "blackwell", default_per_node=4, max_per_node=4),
        GpuType("gb300", "nvidia", 279, "blackwell", default_per_node=4, max_per_node=4),
        GpuType("mi300x", "amd", 192, "cdna3"),
        GpuType("mi325x", "amd", 256, "cdna3"),
        GpuType("mi355x", "amd", 288, "cdna4"),
    )
}


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint k2fleet knows: size on disk, weight format, reasoning or not, its
    maximum context (``max_position_embeddings`` of its config.json) and its shape:
    attention heads (``num_attention_heads``; tensor parallel splits them) and routed
    experts (``n_routed_experts``; expert parallel splits them). Every Kimi K2 release
    has 64 heads and 384 routed experts (config.json of each repository)."""

    repo_id: str
    bytes: int
    quantization: str  # "int4" | "fp8" | "nvfp4" | "gguf"
    reasoning: bool
    max_context: int | None = None
    model_type: str = "kimi_k2"
    heads: int = 64
    experts: int = 384


CHECKPOINTS: dict[str, Checkpoint] = {
    c.repo_id: c
    for c in (
        Checkpoint("moonshotai/Kimi-K2-Thinking", 594_000_000_000, "int4", True, max_context=262_144),
        Checkpoint("moonshotai/Kimi-K2-Instruct", 1_030_000_000_000, "fp8", False, max_context=131_072),
        Checkpoint("moonshotai/Kimi-K2-Instruct-0905", 1_030_000_000_000, "fp8", False, max_context=262_144),
        Checkpoint("nvidia/Kimi-K2-Thinking-NVFP4", 595_000_000_000, "nvfp4", True, max_context=262_144),
    )
}

QUANTIZATIONS = ("int4", "fp8", "nvfp4", "gguf", "bf16")

# Engines and their supported pins. The first of each list is today's default.
ENGINE_VERSIONS: dict[str, tuple[str, ...]] = {
    "vllm": ("0.33.0", "0.11.0", "0.10.0"),
    "sglang": ("0.5.23", "0.5.4", "0.4.9"),
    "trtllm": ("1.2.0", "1.0.0"),
    "ktransformers": ("0.7.2", "0.3.2"),
}

DEFAULT_IMAGES: dict[tuple[str, str], str] = {
    ("trtllm", "cuda"): "nvcr.io/nvidia/tensorrt-llm/release:{version}",
    ("vllm", "rocm"): "vllm/vllm-openai-rocm:v{version}",
    ("vllm", "cuda"): "vllm/vllm-openai:v{version}",
    ("sglang", "cuda"): "lmsysorg/sglang:v{version}",
    ("sglang", "rocm"): "lmsysorg/sglang:v{version}-rocm700-mi30x",
}

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


# How each engine takes the endpoint API key of ``k2_api_key_file`` without argv: the
# environment variable its server reads (hosts hold it in a root-only EnvironmentFile=).
# Read at the pins (README "Protected endpoints"): vLLM 0.33.0
# vllm/entrypoints/serve/middleware/register.py reads ``args.api_key or envs.VLLM_API_KEY``
# (the same variable since 0.2.x, so the older pins too).
API_KEY_ENV: dict[str, str] = {"vllm": "VLLM_API_KEY"}
# Engines that cannot take it without argv, logs or a weaker check: why, in one line.
API_KEY_REFUSED: dict[str, str] = {
    "sglang": "SGLang takes its API key only as --api-key (or in its --config YAML) and logs every server "
              "argument, the key included, at start (server_args=...); its PD router (sglang-router 0.3.2) "
              "has --api-key in argv only",
    "trtllm": "trtllm-serve 1.2.0 has no API key option at all",
    "ktransformers": "KTransformers takes its API key only as --api-key (0.7.2, sglang-kt, which logs it at start) "
                     "or --api_key / ~/.ktransformers/config.yaml (0.3.2, checked by an assert on "
                     "/v1/chat/completions alone)",
}
