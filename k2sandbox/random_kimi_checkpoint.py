"""A random-weight checkpoint of Kimi-K2's architecture that a real vLLM serves (CPU build).

Unlike :mod:`k2sandbox.synthetic_checkpoint` (the real layout, no model in it), this one is a
model: DeepSeek-V3 with MLA as Kimi-K2 has it (``model_type: kimi_k2``,
``DeepseekV3ForCausalLM``, bf16, no quantization), shrunk to 4.9 M parameters (9.9 MB) — hidden 256,
3 layers of which the first is dense (``first_k_dense_replace: 1``), 8 routed experts top-2
plus 1 shared expert, 4 heads, vocabulary 2048 — keeping ``kv_lora_rank`` 512 and
``qk_rope_head_dim`` 64, the only values vLLM's CPU MLA attention accepts. Its weights are
seeded random normal values (std 0.02; norms 1, router bias 0): the output is noise, but the
engine loads, schedules, samples, detokenizes and parses it like Kimi's own.

Files, in Kimi-K2-Thinking's layout: ``model-0000N-of-000003.safetensors`` (one decoder layer
each; embeddings in the first, final norm and ``lm_head`` in the last), an index whose
weight_map names every tensor, ``config.json``, ``generation_config.json``, a byte-level BPE
``tokenizer.json`` made without training (256 byte tokens, 1536 fixed merges of letters, and
Kimi-K2-Thinking's 256 special-token slots at the top of the vocabulary, in Kimi's order: the
chat, tool-call and ``<think>`` tokens the ``kimi_k2`` tool and reasoning parsers look for),
``tokenizer_config.json`` and ``chat_template.jinja`` (tools declared, tool calls and their
returns rendered in the format vLLM's ``kimi_k2`` parser reads).

Everything is a function of :data:`SEED` and this file: two builds are byte-identical.

    python -m k2sandbox.random_kimi_checkpoint      # make it (cached), print its directory

>>> names = [name for name, _, _ in tensor_specs()]
>>> len(names), names[0], names[-1]
(91, 'model.embed_tokens.weight', 'lm_head.weight')
>>> sum(prod(shape) for _, _, shape in tensor_specs())
4939408
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from array import array
from functools import cache
from math import prod
from pathlib import Path
from statistics import NormalDist
from typing import Any

from k2sandbox.checkpoint_cache import _build_once
from k2sandbox.synthetic_checkpoint import LFS_SUFFIXES, SynthFile, describe_dir, safetensors_header, shard_name

REPO_ID = "k2fleet-test/Kimi-K2-random-tiny"
REVISION = "8d1e0f3c2b4a59687766554433221100ffeeddcc"  # fixed: the generator is deterministic
SEED = 20251125
STD = 0.02
CACHE = Path(os.environ.get("K2SANDBOX_RANDOM_KIMI_CACHE", "/var/cache/k2fleet-sandbox/random-kimi-checkpoints"))

HIDDEN = 256
LAYERS = 3
FIRST_DENSE = 1  # first_k_dense_replace: layers below it have a dense MLP, the rest MoE
INTERMEDIATE = 512  # the dense MLP's
MOE_INTERMEDIATE = 128  # each expert's
EXPERTS, TOP_K, SHARED_EXPERTS = 8, 2, 1
HEADS = 4
Q_LORA_RANK = 128
KV_LORA_RANK = 512  # vLLM's CPU MLA attention: only 512
QK_ROPE_HEAD_DIM = 64  # and 64
QK_NOPE_HEAD_DIM = 64
V_HEAD_DIM = 64
VOCAB = 2048
SPECIAL_BASE = VOCAB - 256  # Kimi's special tokens take the vocabulary's top 256 ids, as in K2's 163840
KIMI_SPECIAL_BASE = 163584  # where they start in Kimi-K2's own vocabulary

# Kimi-K2-Thinking's named special tokens by offset from its first (163584 + offset);
# the other slots of the 256 are "<|reserved_token_ID|>" with Kimi's own id in the name.
SPECIAL_TOKENS: dict[int, str] = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>",
    18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>",
    22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
}

CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": SPECIAL_BASE,
    "eos_token_id": SPECIAL_BASE + 1,
    "pad_token_id": SPECIAL_BASE + 255,
    "first_k_dense_replace": FIRST_DENSE,
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "initializer_range": STD,
    "intermediate_size": INTERMEDIATE,
    "kv_lora_rank": KV_LORA_RANK,
    "max_position_embeddings": 262144,
    "moe_intermediate_size": MOE_INTERMEDIATE,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": EXPERTS,
    "n_shared_experts": SHARED_EXPERTS,
    "norm_topk_prob": True,
    "num_attention_heads": HEADS,
    "num_experts_per_tok": TOP_K,
    "num_hidden_layers": LAYERS,
    "num_key_value_heads": HEADS,
    "num_nextn_predict_layers": 0,
    "q_lora_rank": Q_LORA_RANK,
    "qk_nope_head_dim": QK_NOPE_HEAD_DIM,
    "qk_rope_head_dim": QK_ROPE_HEAD_DIM,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": V_HEAD_DIM,
    "vocab_size": VOCAB,
}

# What the chat template renders (Kimi-K2's conventions): a default system prompt; tools
# declared as JSON in a ``tool_declare`` system turn; an assistant's tool calls as
# <|tool_calls_section_begin|><|tool_call_begin|>ID<|tool_call_argument_begin|>ARGS<|tool_call_end|>...
# with ID ``functions.NAME:IDX``; a tool's return as "## Return of ID"; past reasoning in
# <think>…</think>; ``thinking=false`` (chat_template_kwargs) closes the think block at once.
CHAT_TEMPLATE = """\
{%- macro render_content(msg) -%}
{%- set c = msg.get('content') -%}
{%- if c is string -%}{{ c }}
{%- elif c is not none -%}{%- for part in c -%}{%- if part.get('type') == 'text' -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if tools -%}
<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}
{%- if messages | length == 0 or messages[0]['role'] != 'system' -%}
<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
{%- endif -%}
{%- for message in messages -%}
{%- set role_name = message.get('name') or message['role'] -%}
{%- if message['role'] == 'user' -%}<|im_user|>{{ role_name }}<|im_middle|>
{%- elif message['role'] == 'assistant' -%}<|im_assistant|>{{ role_name }}<|im_middle|>
{%- else -%}<|im_system|>{{ role_name }}<|im_middle|>
{%- endif -%}
{%- if message['role'] == 'assistant' -%}
<think>{{ message.get('reasoning') or message.get('reasoning_content') or '' }}</think>
{%- endif -%}
{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}
{{ render_content(message) }}<|tool_calls_section_begin|>
{%- for tool_call in message['tool_calls'] -%}
{%- set args = tool_call['function']['arguments'] -%}
<|tool_call_begin|>{{ tool_call['id'] }}<|tool_call_argument_begin|>{% if args is string %}{{ args }}{% else %}{{ args | tojson }}{% endif %}<|tool_call_end|>
{%- endfor -%}
<|tool_calls_section_end|>
{%- elif message['role'] == 'tool' -%}
## Return of {{ message.get('tool_call_id') }}
{{ render_content(message) }}
{%- else -%}
{{ render_content(message) }}
{%- endif -%}
<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_assistant|>assistant<|im_middle|>
{%- if thinking is defined and thinking is false -%}<think></think>{%- endif -%}
{%- endif -%}
"""

LETTERS = "etaoinshrdlcumwfgypbvkjxqz"  # by frequency in English text
SPACE = "\u0120"  # byte-level BPE's visible space ("Ġ")


def tensor_specs() -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of every tensor, in file order: the embeddings, each
    layer's (attention, then a dense MLP or router, routed experts and shared expert), the
    final norm and ``lm_head``."""
    qk_head = QK_NOPE_HEAD_DIM + QK_ROPE_HEAD_DIM
    specs: list[tuple[str, str, tuple[int, ...]]] = [("model.embed_tokens.weight", "BF16", (VOCAB, HIDDEN))]
    for layer in range(LAYERS):
        p = f"model.layers.{layer}"
        specs += [
            (f"{p}.input_layernorm.weight", "BF16", (HIDDEN,)),
            (f"{p}.self_attn.q_a_proj.weight", "BF16", (Q_LORA_RANK, HIDDEN)),
            (f"{p}.self_attn.q_a_layernorm.weight", "BF16", (Q_LORA_RANK,)),
            (f"{p}.self_attn.q_b_proj.weight", "BF16", (HEADS * qk_head, Q_LORA_RANK)),
            (f"{p}.self_attn.kv_a_proj_with_mqa.weight", "BF16", (KV_LORA_RANK + QK_ROPE_HEAD_DIM, HIDDEN)),
            (f"{p}.self_attn.kv_a_layernorm.weight", "BF16", (KV_LORA_RANK,)),
            (f"{p}.self_attn.kv_b_proj.weight", "BF16", (HEADS * (QK_NOPE_HEAD_DIM + V_HEAD_DIM), KV_LORA_RANK)),
            (f"{p}.self_attn.o_proj.weight", "BF16", (HIDDEN, HEADS * V_HEAD_DIM)),
            (f"{p}.post_attention_layernorm.weight", "BF16", (HIDDEN,)),
        ]
        if layer < FIRST_DENSE:
            specs += _mlp(f"{p}.mlp", INTERMEDIATE)
            continue
        specs += [(f"{p}.mlp.gate.weight", "BF16", (EXPERTS, HIDDEN)),
                  (f"{p}.mlp.gate.e_score_correction_bias", "F32", (EXPERTS,))]
        for expert in range(EXPERTS):
            specs += _mlp(f"{p}.mlp.experts.{expert}", MOE_INTERMEDIATE)
        specs += _mlp(f"{p}.mlp.shared_experts", MOE_INTERMEDIATE * SHARED_EXPERTS)
    specs += [("model.norm.weight", "BF16", (HIDDEN,)), ("lm_head.weight", "BF16", (VOCAB, HIDDEN))]
    return specs


def _mlp(prefix: str, intermediate: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """The three projections of one SwiGLU MLP (dense, an expert or the shared expert)."""
    return [(f"{prefix}.gate_proj.weight", "BF16", (intermediate, HIDDEN)),
            (f"{prefix}.up_proj.weight", "BF16", (intermediate, HIDDEN)),
            (f"{prefix}.down_proj.weight", "BF16", (HIDDEN, intermediate))]


def shard_of(name: str) -> int:
    """The shard (1-based) a tensor lives in: one decoder layer per shard, the embeddings in
    the first, the final norm and ``lm_head`` in the last.

    >>> shard_of("model.embed_tokens.weight"), shard_of("model.layers.1.mlp.gate.weight"), shard_of("lm_head.weight")
    (1, 2, 3)
    """
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) + 1
    return 1 if name.startswith("model.embed_tokens.") else LAYERS


def bf16_bits(value: float) -> int:
    """The bfloat16 bit pattern nearest ``value`` (float32's, rounded to nearest even).

    >>> hex(bf16_bits(1.0)), hex(bf16_bits(-2.0)), bf16_bits(0.0)
    ('0x3f80', '0xc000', 0)
    """
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


@cache
def _normal_table() -> array:
    """65536 bfloat16 patterns of N(0, STD) at evenly spaced quantiles (a 16-bit random
    index into it draws a normal value; the tails stop near ±4.3 std, no NaN or Inf)."""
    normal = NormalDist(0.0, STD)
    return array("H", (bf16_bits(normal.inv_cdf((i + 0.5) / 65536)) for i in range(65536)))


def tensor_bytes(name: str, dtype: str, shape: tuple[int, ...], seed: int = SEED) -> bytes:
    """The little-endian data of one tensor: norms 1.0, the router's score-correction bias 0.0
    (float32), everything else random normal bf16 from a SHAKE-256 stream of ``seed`` and
    the tensor's name (so a tensor does not depend on the others)."""
    count = prod(shape)
    if name.endswith("e_score_correction_bias"):
        return bytes(4 * count)
    if name.endswith(("layernorm.weight", "model.norm.weight")):
        return struct.pack("<H", bf16_bits(1.0)) * count
    indices = array("H", hashlib.shake_256(f"{seed}:{name}".encode()).digest(2 * count))
    if sys.byteorder == "big":
        indices.byteswap()
    table = _normal_table()
    values = array("H", map(table.__getitem__, indices))
    if sys.byteorder == "big":
        values.byteswap()
    assert dtype == "BF16"
    return values.tobytes()


_BYTE_CHARS = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: each byte as a printable character.

    >>> table = byte_to_unicode()
    >>> table[ord("a")], table[ord(" ")], len(set(table.values()))
    ('a', 'Ġ', 256)
    """
    out = {b: chr(b) for b in _BYTE_CHARS}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def merges() -> list[tuple[str, str]]:
    """The BPE merges, a fixed list (no training): every letter pair and space+letter
    (``Ġ``+x) first, then space+letter followed by a letter pair, in letter-frequency
    order, up to the 1536 ids between the byte tokens and the special tokens.

    >>> m = merges()
    >>> len(m), m[0], m[-1]
    (1536, ('Ġ', 'e'), ('Ġt', 'ts'))
    """
    starts = [SPACE, *LETTERS]
    pairs = [(a, b) for a in starts for b in LETTERS]
    spaced = [SPACE + x for x in LETTERS]
    bigrams = [a + b for a in LETTERS for b in LETTERS]
    longer = [(s, b) for b in bigrams for s in spaced]
    return (pairs + longer)[:SPECIAL_BASE - 256]


def special_tokens() -> dict[int, str]:
    """Id → content of the 256 special tokens (Kimi-K2-Thinking's, moved to this vocabulary's top).

    >>> special_tokens()[SPECIAL_BASE + 11], special_tokens()[SPECIAL_BASE + 5]
    ('<|tool_calls_section_begin|>', '<|reserved_token_163589|>')
    """
    return {SPECIAL_BASE + k: SPECIAL_TOKENS.get(k, f"<|reserved_token_{KIMI_SPECIAL_BASE + k}|>") for k in range(256)}


def tokenizer_json() -> dict[str, Any]:
    """A Hugging Face ``tokenizers`` byte-level BPE covering every id of the vocabulary."""
    vocab = {char: byte for byte, char in byte_to_unicode().items()}
    for a, b in merges():
        vocab[a + b] = len(vocab)
    assert len(vocab) == SPECIAL_BASE
    added = [{"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, text in special_tokens().items()]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": byte_level, "post_processor": byte_level, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [f"{a} {b}" for a, b in merges()]},
    }


def tokenizer_config() -> dict[str, Any]:
    """``tokenizer_config.json``: the fast tokenizer of ``tokenizer.json``, Kimi's BOS/EOS/PAD/UNK."""
    specials = special_tokens()
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": specials[SPECIAL_BASE], "eos_token": specials[SPECIAL_BASE + 1],
        "unk_token": specials[SPECIAL_BASE + 254], "pad_token": specials[SPECIAL_BASE + 255],
        "model_max_length": CONFIG["max_position_embeddings"], "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {str(i): {"content": text, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for i, text in specials.items()},
    }


def _dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def make_random_kimi_checkpoint(root: str | os.PathLike[str], seed: int = SEED) -> list[SynthFile]:
    """Write the checkpoint under ``root`` (created); return its files (what
    :func:`k2sandbox.synthetic_checkpoint.manifest_for` takes)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    by_shard: dict[int, list[tuple[str, str, tuple[int, ...]]]] = {}
    for spec in tensor_specs():
        by_shard.setdefault(shard_of(spec[0]), []).append(spec)
    weight_map: dict[str, str] = {}
    total = 0
    for shard, specs in sorted(by_shard.items()):
        name = shard_name(shard, LAYERS)
        datas = [tensor_bytes(n, dtype, shape, seed) for n, dtype, shape in specs]
        header = safetensors_header([(n, dtype, list(shape), len(data)) for (n, dtype, shape), data in zip(specs, datas)])
        with open(root / name, "wb") as f:
            f.write(header)
            for data in datas:
                f.write(data)
        total += sum(len(d) for d in datas)
        weight_map.update((n, name) for n, _, _ in specs)
    texts = {
        "model.safetensors.index.json": _dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}),
        "config.json": _dump(CONFIG),
        "generation_config.json": _dump({"bos_token_id": SPECIAL_BASE, "eos_token_id": SPECIAL_BASE + 2,
                                         "do_sample": True, "temperature": 1.0, "max_length": CONFIG["max_position_embeddings"]}),
        "tokenizer.json": _dump(tokenizer_json()),
        "tokenizer_config.json": _dump(tokenizer_config()),
        "chat_template.jinja": CHAT_TEMPLATE,
        "README.md": ("# Kimi-K2 architecture, random weights (k2fleet test model)\n\n"
                      f"Seed {seed}; made by k2sandbox/random_kimi_checkpoint.py. Its output is noise.\n"),
        ".gitattributes": "".join(f"*{s} filter=lfs diff=lfs merge=lfs -text\n" for s in LFS_SUFFIXES),
    }
    for rel, text in texts.items():
        (root / rel).write_text(text, encoding="utf-8")
    return describe_dir(root)


def random_kimi_checkpoint_dir(cache: Path = CACHE) -> Path:
    """Where :func:`ensure_random_kimi_checkpoint` keeps the checkpoint under ``cache``.

    >>> random_kimi_checkpoint_dir(Path("/c")).as_posix()
    '/c/k2fleet-test--Kimi-K2-random-tiny/8d1e0f3c2b4a59687766554433221100ffeeddcc'
    """
    return cache / REPO_ID.replace("/", "--") / REVISION


def ensure_random_kimi_checkpoint(cache: Path = CACHE) -> Path:
    """Make the checkpoint and its k2fleet manifest (``.k2fleet/manifest.json``) once under
    ``cache`` (built beside its directory, renamed into place); return its directory."""
    return _build_once(random_kimi_checkpoint_dir(cache), REPO_ID, REVISION, make_random_kimi_checkpoint)


REHEARSAL_CACHE = CACHE / "rehearsal"


def rehearsal_random_checkpoint(model: str, revision: str, cache: Path = REHEARSAL_CACHE) -> tuple[Path, int]:
    """This checkpoint as ``k2fleet rehearse --engine real`` serves it for an inventory's own
    ``k2_model``@``k2_revision``: the same files, with a manifest naming that repository and
    revision (what k2fleet's verify pins), made once; (directory, total bytes of its files)."""
    root = _build_once(cache / model.replace("/", "--") / revision, model, revision, make_random_kimi_checkpoint)
    size = sum(entry["size"] for entry in json.loads((root / ".k2fleet" / "manifest.json").read_text())["files"].values())
    return root, size


if __name__ == "__main__":
    print(ensure_random_kimi_checkpoint())
