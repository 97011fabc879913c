"""Every validation rule, on every entry: a bad inventory is refused by
``pyinfra -y INV deploys/kimi.py``, ``k2fleet validate INV`` and ``k2fleet plan INV --json``
with exit code 2, exactly one ``error: SOURCE: KEY: message`` line naming the key, no
traceback, and zero TCP connections to the listener standing in for the hosts' sshd.

Families: (a) types and ranges, (b) injection (a newline in every string key, generated
from HostSettings, plus nested values; shell metacharacters in paths; zero-width, bidi and
other invisible characters), (c) identities and addresses, (d) topology (model shape and
environment variables that contradict keys included), (e) structure (wrong nested types,
flag smuggling, group-data files), (f) secrets (credentials in URLs included), (g) resource
(length, size, depth and alias-bomb caps). Each family has a good twin that must pass, so
no rule refuses valid input.

All subprocesses of all cases run once, concurrently (module fixture ``outcomes``); each
parametrized test then checks its own case's three results.
"""

from __future__ import annotations

import copy
import json
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import types
import typing
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from k2fleet.cli import load_plan
from k2fleet.inventory.spec import HostEntry, HostSettings, SpecError, build_fleet, parse_host
from tests.inventory_factory import THINKING_SHA, write_inventory

REPO = Path(__file__).resolve().parent.parent
ENTRIES = ("pyinfra", "validate", "plan")
INSTRUCT = {"k2_model": "moonshotai/Kimi-K2-Instruct", "k2_revision": "fd1984e2b7a3350dbf7305fe73a4ede25c14de50"}
NVFP4 = {"k2_model": "nvidia/Kimi-K2-Thinking-NVFP4", "k2_revision": "1" * 40}
K3 = {"k2_model": "moonshotai/Kimi-K3", "k2_revision": "3" * 40}  # issue #25's models (catalog)
K25 = {"k2_model": "moonshotai/Kimi-K2.5", "k2_revision": "5" * 40}
K0905 = {"k2_model": "moonshotai/Kimi-K2-Instruct-0905", "k2_revision": "9" * 40}
INJECT = "\nExecStartPre=/bin/sh -c id"


# this module's files on the control machine (tokens, checkpoint copies), made at import (the cases
# name them); tests/conftest.py removes the directory when the session ends (in every xdist worker)
SCRATCH = Path(tempfile.mkdtemp(prefix="k2validation-"))
REMOVE_AT_UNCONFIGURE = (SCRATCH,)


def _token_file(mode: int, content: bytes = b"hf_token_for_validation_tests\n") -> str:
    """A control-machine token file of ``mode`` (made once per test session, in a private temp dir
    of :data:`SCRATCH`)."""
    directory = Path(tempfile.mkdtemp(prefix="token-", dir=SCRATCH))
    path = directory / f"token-{mode:o}-{len(content)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, content)
    os.close(fd)
    os.chmod(path, mode)
    return str(path)


TOKEN_FILE = _token_file(0o600)  # a good one: the twins use it


def _control_copy(manifest: bool = True) -> str:
    """A control-machine checkpoint directory (``control:`` source), with or without its manifest
    (in a temp dir of :data:`SCRATCH`)."""
    top = Path(tempfile.mkdtemp(prefix="control-", dir=SCRATCH))
    root = top / "kimi-k2+v1"
    (root / ".k2fleet").mkdir(parents=True)
    if manifest:
        (root / ".k2fleet" / "manifest.json").write_text("{}\n")
    return str(root)


CONTROL_COPY = _control_copy()
CONTROL_COPY_BARE = _control_copy(manifest=False)
KEYRING_FILE = _token_file(0o644, b"\x99\x01\x0d" + b"k" * 64)  # a binary OpenPGP key (a public key: any mode)
HF = "hf_" + "Q7xk2LmN9pR4sT6vW8yZ1aB3cD5eF7gH"  # token-shaped, not a real token
GH = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"
GH_PAT = "github_pat_" + "11ABCDEFG0123456789_abcdefghijklmnop"
AWS = "AKIA" + "IOSFODNN7EXAMPLE"


@dataclass(frozen=True)
class Case:
    id: str
    data: dict[str, Any]  # group data over the factory defaults (None removes a key)
    key: str  # the key the error line must name (exactly)
    words: str = ""  # words the message must contain
    hosts: int | list[tuple[str, dict[str, Any]]] = 1
    cli_data: tuple[str, ...] = ()  # --data KEY=VALUE, given to every entry
    secret: str = ""  # must not appear in any output
    group_py: str = ""  # Python appended to the group-data file (shared references, raising, ...)
    inventory_py: str = ""  # Python appended to the inventory file (more groups)
    family: str = field(default="", compare=False)


def family(name: str, cases: list[Case]) -> list[Case]:
    return [Case(**{**c.__dict__, "family": name}) for c in cases]


# --- (a) types and ranges --------------------------------------------------------------
TYPES = family("types", [
    Case("port-bool", {"k2_port": True}, "k2_port", "valid integer"),
    Case("metrics-scrapers-not-a-network", {"k2_metrics": True, "k2_metrics_scrapers": ["prometheus.corp"]},
         "k2_metrics_scrapers[0]", "IPv4/IPv6 address or network"),
    Case("metrics-scrapers-without-metrics", {"k2_metrics_scrapers": ["10.9.0.5"]}, "k2_metrics_scrapers", "k2_metrics"),
    Case("node-exporter-string", {"k2_metrics": True, "k2_node_exporter": "yes"}, "k2_node_exporter", "valid boolean"),
    Case("gpu-exporter-without-metrics", {"k2_gpu_exporter": True}, "k2_gpu_exporter", "set k2_metrics: True"),
    Case("gpu-exporter-on-amd", {"k2_metrics": True, "k2_gpu_exporter": True, "k2_gpu": "mi300x"}, "k2_gpu_exporter",
         "AMD GPU"),
    Case("gpu-exporter-image-id-without-key", {"k2_metrics": True, "k2_gpu_exporter_image_id": "sha256:" + "1" * 64},
         "k2_gpu_exporter_image_id", "set k2_gpu_exporter: True"),
    Case("node-exporter-on-rhel", {"k2_metrics": True, "k2_node_exporter": True, "k2_os": "rhel-9"},
         "k2_node_exporter", "no Prometheus node exporter"),
    Case("profile-unknown", {"k2_profile": "fast"}, "k2_profile", "long-context"),
    Case("profile-bool", {"k2_profile": True}, "k2_profile", "latency"),
    Case("port-numeric-string", {"k2_port": "9000"}, "k2_port", "valid integer"),
    Case("port-float", {"k2_port": 9000.0}, "k2_port", "valid integer"),
    Case("port-zero", {"k2_port": 0}, "k2_port", "greater than or equal to 1"),
    Case("port-too-big", {"k2_mesh_port": 65536}, "k2_mesh_port", "less than or equal to 65535"),
    Case("port-bool-via-data", {}, "k2_port", "valid integer", cli_data=("k2_port=true",)),
    Case("ssh-port-bool-via-data", {}, "ssh_port", "valid integer", cli_data=("ssh_port=true",)),
    Case("ssh-config-file-newline", {"ssh_config_file": "a\nProxyCommand sh -c x"}, "ssh_config_file", "control character"),
    Case("ssh-config-file-100k", {"ssh_config_file": "x" * 100_000}, "ssh_config_file", "at most 4096 characters"),
    Case("ssh-config-file-list", {"ssh_config_file": ["/etc/ssh/ssh_config"]}, "ssh_config_file", "valid string"),
    Case("sudo-user-space", {"_sudo": True, "_sudo_user": "root -s"}, "_sudo_user", "POSIX user name"),
    Case("tp-bool", {"k2_tp": True}, "k2_tp", "valid integer"),
    Case("health-timeout-string", {"k2_health_timeout": "3600"}, "k2_health_timeout", "valid integer"),
    Case("attn-dp-string", {"k2_attn_dp": "yes"}, "k2_attn_dp", "valid boolean"),
    Case("checkpoint-bytes-negative", {"k2_checkpoint_bytes": -1}, "k2_checkpoint_bytes", "greater than or equal to 1"),
    Case("gpu-util-above-one", {"k2_gpu_memory_utilization": 1.5}, "k2_gpu_memory_utilization", "fraction in (0, 1]"),
    Case("gpu-util-zero", {"k2_gpu_memory_utilization": 0.0}, "k2_gpu_memory_utilization", "fraction in (0, 1]"),
    Case("gpu-util-bool", {"k2_gpu_memory_utilization": True}, "k2_gpu_memory_utilization", "valid number"),
    Case("gpu-util-no-room", {"k2_gpu_memory_utilization": 0.08}, "k2_gpu_memory_utilization", "leaves no room for weights"),
    Case("nine-gpus-on-h200", {"k2_gpus_per_node": 9, "k2_tp": 9}, "k2_gpus_per_node", "at most 8"),
    Case("eight-gpus-on-gb200", NVFP4 | {"k2_engine": "trtllm", "k2_gpu": "gb200", "k2_gpus_per_node": 8},
         "k2_gpus_per_node", "at most 4"),
    Case("context-beyond-model", {"k2_max_model_len": 262145}, "k2_max_model_len", "262144-token context"),
    Case("context-beyond-instruct", INSTRUCT | {"k2_tp": 16, "k2_max_model_len": 200000}, "k2_max_model_len",
         "131072", hosts=2),
    Case("engine-arg-fraction", {"k2_engine_args": {"gpu-memory-utilization": 1.2}},
         "k2_engine_args.gpu-memory-utilization", "fraction in (0, 1]"),
    Case("rollout-unknown", {"k2_rollout": "blue-green"}, "k2_rollout", "all-at-once"),
    Case("drain-timeout-zero", {"k2_drain_timeout": 0}, "k2_drain_timeout", "greater than or equal to 1"),
    Case("load-balancer-port-string", {"k2_load_balancer": "node-0", "k2_load_balancer_port": "8080"},
         "k2_load_balancer_port", "valid integer"),
    Case("trtllm-fraction-engine-arg", INSTRUCT | {"k2_engine": "trtllm", "k2_tp": 16,
                                                   "k2_engine_args": {"kv_cache_free_gpu_memory_fraction": 1.5}},
         "k2_engine_args.kv_cache_free_gpu_memory_fraction", "fraction in (0, 1]", hosts=2),
    Case("trtllm-fraction-nested", NVFP4 | {"k2_engine": "trtllm", "k2_gpu": "b200",
                                            "k2_trtllm_config": {"kv_cache_config": {"free_gpu_memory_fraction": 0}}},
         "k2_trtllm_config.kv_cache_config.free_gpu_memory_fraction", "fraction in (0, 1]"),
])
TYPES_TWIN = {"k2_port": 9000, "k2_mesh_port": 65535, "k2_health_timeout": 60, "k2_attn_dp": False,
              "k2_checkpoint_bytes": 594_000_000_000, "k2_gpu_memory_utilization": 1, "k2_gpus_per_node": 8,
              "k2_max_model_len": 262144, "k2_engine_args": {"max-num-seqs": 4}}
# (not also {"gpu-memory-utilization": 0.95}: with k2_gpu_memory_utilization set, k2fleet renders that flag
# itself and refuses a second copy; test_capacity.test_engine_flags_count has the flag's good twin alone)

# --- (b) injection -------------------------------------------------------------------------
# One valid value per string key: the injected value is this + a newline (so the newline is
# what is refused), and all of them together make the family's good twin.
GOOD_STRINGS: dict[str, str] = {
    "model": "moonshotai/Kimi-K2-Thinking",
    "revision": THINKING_SHA,
    "served_model_name": "kimi-k2",
    "model_type_override": "deepseek_v3",
    "gguf_repo": "unsloth/Kimi-K2-Instruct-GGUF",
    "gguf_revision": "dc35109e1b6ecf981f1d30d57c117b9a58c0b31b",
    "gguf_pattern": "UD-Q3_K_XL/*",
    "checkpoint_source": "hub",
    "gguf_source": "hub",
    "checkpoint_cache": "/var/cache/k2fleet/checkpoints",
    "hub_endpoint": "https://hub.internal.example:8443/mirror",
    "hub_token_file": TOKEN_FILE,
    "os_mirror": "https://mirror.internal.example/ubuntu",
    "os_mirror_keyring": KEYRING_FILE,
    "os_security_mirror": "https://mirror.internal.example/debian-security",
    "nvidia_repo": "https://mirror.internal.example/cuda-repos",
    "nvidia_repo_keyring": KEYRING_FILE,
    "container_toolkit_repo": "https://mirror.internal.example/libnvidia-container",
    "container_toolkit_repo_keyring": KEYRING_FILE,
    "docker_repo": "https://mirror.internal.example/docker-ce/linux/rhel",
    "docker_repo_keyring": KEYRING_FILE,
    "pypi_index": "http://127.0.0.1:3141/simple",
    "api_key_file": TOKEN_FILE,
    "tls_cert_file": "/etc/k2fleet-control/tls/server.pem",
    "tls_key_file": TOKEN_FILE,
    "tls_ca_file": "/etc/k2fleet-control/tls/ca.pem",
    "checkpoint_fetcher": "control",
    "model_dir": "/srv/k2fleet/models",
    "engine_version": "0.33.0",
    "image": "registry.example:5000/vllm/vllm-openai:v0.33.0",
    "image_id": "sha256:" + "0" * 64,
    "gpu_exporter_image": "registry.example:5000/nvidia/k8s/dcgm-exporter:4.2.3-4.1.3-ubuntu22.04",
    "gpu_exporter_image_id": "sha256:" + "1" * 64,
    "venv": "/opt/k2fleet/venv",
    "config_dir": "/etc/k2fleet",
    "bundle": "/srv/k2fleet-bundle",
    "gpu": "h200",
    "tool_parser": "kimi_k2",
    "moe_a2a_backend": "deepep_low_latency",
    "reasoning_parser": "kimi_k2",
    "mesh_user": "root",
    "address": "192.0.2.10",
    "nic": "ens10f0np0",
    "driver_version": "580.95.05",
    "imex_address": "192.0.2.10",
    "load_balancer": "node-0",
}


def _is_string_key(info: Any) -> bool:
    """A key whose value is a string (a path, a name, an address...), not a closed Literal."""
    ann = info.annotation
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
    else:
        args = [ann]
    base = [typing.get_args(a)[0] if typing.get_origin(a) is typing.Annotated else a for a in args]
    return bool(base) and all(b is str for b in base)


STRING_KEYS = [name for name, info in HostSettings.model_fields.items() if _is_string_key(info)]
SLURM = {
    "slurm": {"script_file": "disaggr_torch.slurm", "partition": "gpu", "account": "llm", "job_time": "02:00:00",
              "job_name": "kimi", "numa_bind": True},
    "benchmark": {"mode": "e2e", "input_length": 1024, "output_length": 1024, "concurrency_list": "16"},
    "hardware": {"gpus_per_node": 4, "num_ctx_servers": 1, "num_gen_servers": 1},
    "environment": {"container_mount": "/lustre:/lustre", "work_dir": "/lustre/work", "trtllm_repo": "/lustre/src/TensorRT-LLM",
                    "worker_env_var": "TLLM_LOG_LEVEL=INFO"},
}
DISAGG = {"ctx": {"tensor_parallel_size": 4, "moe_expert_parallel_size": 4, "max_batch_size": 1,
                  "kv_cache_config": {"free_gpu_memory_fraction": 0.75, "dtype": "fp8"}},
          "gen": {"tensor_parallel_size": 8, "moe_expert_parallel_size": 8, "enable_attention_dp": True,
                  "max_batch_size": 128, "cuda_graph_config": {"enable_padding": True, "batch_sizes": [1, 2, 4]}}}
SLURM_FLEET = NVFP4 | {"k2_engine": "trtllm", "k2_gpu": "gb200", "k2_gpus_per_node": 4, "k2_role": "slurm-submit",
                       "k2_slurm": SLURM, "k2_disagg": DISAGG}
KT_FLEET = INSTRUCT | {"k2_engine": "ktransformers", "k2_engine_version": "0.3.2", "k2_gpu": "h20",
                       "k2_gpus_per_node": 1, "k2_tp": 1, "k2_quantization": "gguf",
                       "k2_gguf_repo": "unsloth/Kimi-K2-Instruct-GGUF",
                       "k2_gguf_revision": "dc35109e1b6ecf981f1d30d57c117b9a58c0b31b", "k2_gguf_pattern": "UD-Q3_K_XL/*",
                       "k2_kt": {"cache_lens": 30000, "optimize_rules": "ktransformers/optimize/optimize_rules/x-amx.yaml"}}
B200 = NVFP4 | {"k2_engine": "trtllm", "k2_gpu": "b200"}


def _with(base: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(base)
    node = out
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return out


def _injection_cases() -> list[Case]:
    missing = set(STRING_KEYS) - set(GOOD_STRINGS)
    assert not missing, f"add a valid value for every string key to GOOD_STRINGS: {missing}"
    cases = []
    for name in STRING_KEYS:
        data = {f"k2_{name}": GOOD_STRINGS[name] + INJECT}
        cases.append(Case(f"newline-in-k2_{name}", data, f"k2_{name}", "control character"))
    nested = [
        ("env-value", {"k2_env": {"NCCL_DEBUG": "INFO" + INJECT}}, "k2_env.NCCL_DEBUG"),
        ("env-name", {"k2_env": {"NCCL_DEBUG\nX": "INFO"}}, "k2_env.'NCCL_DEBUG\\nX'"),
        ("engine-arg-value", {"k2_engine_args": {"chat-template": "/x.jinja" + INJECT}}, "k2_engine_args.chat-template"),
        ("engine-arg-list-item", {"k2_engine_args": {"cuda-graph-sizes": ["1", "2\n3"]}},
         "k2_engine_args.cuda-graph-sizes[1]"),
        ("engine-arg-nul", {"k2_engine_args": {"chat-template": "a\x00b"}}, "k2_engine_args.chat-template"),
        ("ib-hca-item", {"k2_ib_hcas": ["mlx5_0", "mlx5_1" + INJECT]}, "k2_ib_hcas[1]"),
        ("slurm-trtllm-repo", _with(SLURM_FLEET, ("k2_slurm", "environment", "trtllm_repo"), "/opt/TRT" + INJECT),
         "k2_slurm.environment.trtllm_repo"),
        ("slurm-worker-env", _with(SLURM_FLEET, ("k2_slurm", "environment", "worker_env_var"), "A=1" + INJECT),
         "k2_slurm.environment.worker_env_var"),
        ("disagg-string", _with(SLURM_FLEET, ("k2_disagg", "gen", "moe_config"), {"backend": "WIDEEP" + INJECT}),
         "k2_disagg.gen.moe_config.backend"),
        ("trtllm-config-string", B200 | {"k2_trtllm_config": {"kv_cache_config": {"dtype": "fp8" + INJECT}}},
         "k2_trtllm_config.kv_cache_config.dtype"),
        ("kt-optimize-rules", _with(KT_FLEET, ("k2_kt", "optimize_rules"), "rules.yaml" + INJECT), "k2_kt.optimize_rules"),
    ]
    cases += [Case(f"newline-in-{cid}", data, key, "control character") for cid, data, key in nested]
    invisible = [  # zero-width, word joiner, BOM, bidi embeddings/overrides/isolates, soft hyphen, Arabic letter mark
        ("zero-width-space-env", {"k2_env": {"NCCL_DEBUG": "IN\u200bFO"}}, "k2_env.NCCL_DEBUG"),
        ("word-joiner-env", {"k2_env": {"NCCL_DEBUG": "IN\u2060FO"}}, "k2_env.NCCL_DEBUG"),
        ("bom-engine-arg", {"k2_engine_args": {"chat-template": "\ufeff/srv/t.jinja"}}, "k2_engine_args.chat-template"),
        ("word-joiner-engine-arg", {"k2_engine_args": {"chat-template": "/srv/t\u2060.jinja"}},
         "k2_engine_args.chat-template"),
        ("bidi-override-slurm", _with(SLURM_FLEET, ("k2_slurm", "slurm", "partition"), "gpu\u202e"),
         "k2_slurm.slurm.partition"),
        ("bidi-isolate-list-item", {"k2_engine_args": {"middleware": ["a\u2066b"]}}, "k2_engine_args.middleware[0]"),
        ("soft-hyphen-env", {"k2_env": {"NCCL_DEBUG": "IN\u00adFO"}}, "k2_env.NCCL_DEBUG"),
        ("arabic-letter-mark-env", {"k2_env": {"NCCL_DEBUG": "IN\u061cFO"}}, "k2_env.NCCL_DEBUG"),
        ("zero-width-joiner-ssh-hostname", {}, "ssh_hostname"),
    ]
    for cid, data, key in invisible:
        hosts: Any = [("node-0", {"ssh_hostname": "gpu\u200d0.example"})] if key == "ssh_hostname" else 1
        cases.append(Case(f"invisible-{cid}", data, key, "control character", hosts=hosts))
    cases += [
        Case("zero-width-in-host-name", {}, "inventory", "host name", hosts=[("node\u200b0", {})]),
        Case("bidi-in-model-dir", {"k2_model_dir": "/srv/k2\u202emodels"}, "k2_model_dir", "control character"),
    ]
    meta = [
        ("semicolon-in-model-dir", {"k2_model_dir": "/srv/models;rm -rf /"}, "k2_model_dir", "may only use"),
        ("space-in-venv", {"k2_venv": "/opt/k2 venv"}, "k2_venv", "may only use"),
        ("dollar-in-config-dir", {"k2_config_dir": "/etc/$HOME"}, "k2_config_dir", "may only use"),
        ("quote-in-checkpoint-cache", {"k2_checkpoint_cache": "/var/cache/'x"}, "k2_checkpoint_cache", "may only use"),
        ("dotdot-in-token-file", {"k2_hub_token_file": "/etc/k2fleet/../shadow"}, "k2_hub_token_file", "normalised"),
        ("double-slash-in-model-dir", {"k2_model_dir": "/srv//models"}, "k2_model_dir", "normalised"),
        ("trailing-slash-in-venv", {"k2_venv": "/opt/venv/"}, "k2_venv", "normalised"),
        ("relative-config-dir", {"k2_config_dir": "etc/k2fleet"}, "k2_config_dir", "absolute"),
        ("semicolon-in-control-source", {"k2_checkpoint_source": "control:/srv/k2;id"}, "k2_checkpoint_source", "may only use"),
        ("dotdot-in-kt-rules", _with(KT_FLEET, ("k2_kt", "optimize_rules"), "../../etc/passwd"), "k2_kt.optimize_rules",
         "without `..`"),
    ]
    cases += [Case(cid, data, key, words) for cid, data, key, words in meta]
    return family("injection", cases)


INJECTION = _injection_cases()

# --- (c) identities and addresses --------------------------------------------------------------
IDENTITY = family("identity", [
    Case("address-not-ipv4", {"k2_address": "300.1.1.1"}, "k2_address", "not a valid IPv4"),
    Case("address-bad-dns-label", {"k2_address": "gpu_0.example.com"}, "k2_address", "DNS name"),
    Case("address-unspecified", {"k2_address": "0.0.0.0"}, "k2_address", "unspecified"),
    Case("address-unspecified-v6", {"k2_address": "::"}, "k2_address", "unspecified"),
    Case("venv-is-usr", {"k2_venv": "/usr"}, "k2_venv", "system's own directory"),
    Case("model-dir-in-etc", {"k2_model_dir": "/etc/models"}, "k2_model_dir", "system's own directory"),
    Case("ssh-hostname-not-ipv4", {}, "ssh_hostname", "not a valid IPv4", hosts=[("node-0", {"ssh_hostname": "300.1.1.1"})]),
    Case("duplicate-address", {"k2_tp": 16}, "k2_address", "node-0 and node-1 both have address 192.0.2.7",
         hosts=[("node-0", {"k2_address": "192.0.2.7"}), ("node-1", {"k2_address": "192.0.2.7"})]),
    Case("duplicate-ssh-hostname", {"k2_tp": 16}, "ssh_hostname", "node-0 and node-1 both have address",
         hosts=[("node-0", {"k2_address": None}), ("node-1", {"k2_address": None})]),
    Case("host-name-with-space", {}, "inventory", "host name", hosts=[("node 0", {})]),
    Case("host-name-listed-twice", {}, "inventory", "node-0 is listed twice", hosts=[("node-0", {}), ("node-0", {})]),
    # DNS names resolve once, on the control machine, before planning (k2fleet.control.addresses);
    # `.invalid` never resolves (RFC 6761): one line naming the host and the key, offline too
    Case("address-does-not-resolve", {"k2_address": "gpu-0.fleet.invalid"}, "k2_address",
         "node-0's k2_address gpu-0.fleet.invalid does not resolve on this control machine"),
    Case("ssh-hostname-does-not-resolve", {}, "ssh_hostname", "node-0's ssh_hostname gpu-0.fleet.invalid does not resolve",
         hosts=[("node-0", {"ssh_hostname": "gpu-0.fleet.invalid"})]),
    Case("host-name-does-not-resolve", {}, "inventory", "gpu-0.fleet.invalid's name gpu-0.fleet.invalid does not resolve",
         hosts=[("gpu-0.fleet.invalid", {"ssh_hostname": None})]),
    Case("second-host-does-not-resolve", {"k2_tp": 16}, "ssh_hostname", "node-1's ssh_hostname gpu-1.fleet.invalid",
         hosts=[("node-0", {"k2_address": None}), ("node-1", {"k2_address": None, "ssh_hostname": "gpu-1.fleet.invalid"})]),
    Case("api-clients-host-bits", {"k2_api_clients": ["10.0.0.1/8"]}, "k2_api_clients[0]", "host bits"),
    Case("api-clients-dns-name", {"k2_api_clients": ["clients.example"]}, "k2_api_clients[0]", "IPv4/IPv6 address or network"),
    Case("api-clients-empty", {"k2_api_clients": []}, "k2_api_clients", "let no one reach the API"),
    Case("api-clients-not-a-list", {"k2_api_clients": "10.0.0.0/8"}, "k2_api_clients", "valid list"),
    Case("ssh-user-newline", {}, "ssh_user", "control character", hosts=[("node-0", {"ssh_user": "root\nAllowUsers *"})]),
    Case("ssh-user-shell", {}, "ssh_user", "POSIX user", hosts=[("node-0", {"ssh_user": "root;id"})]),
    Case("ssh-key-with-space", {}, "ssh_key", "", hosts=[("node-0", {"ssh_key": "/root/.ssh/id ed25519"})]),
    Case("host-name-with-newline", {}, "inventory", "host name", hosts=[("node-0\nExecStartPre=/bin/sh", {})]),
    Case("fetcher-not-a-name", {"k2_checkpoint_fetcher": "node;id"}, "k2_checkpoint_fetcher", "host name"),
    Case("mesh-user-uppercase", {"k2_mesh_user": "Root"}, "k2_mesh_user", "POSIX user"),
    Case("mesh-user-shell", {"k2_mesh_user": "root;id"}, "k2_mesh_user", "POSIX user"),
    Case("nic-too-long", {"k2_nic": "enp1s0f0np0vlan1"}, "k2_nic", "interface name"),
    Case("nic-dotdot", {"k2_nic": ".."}, "k2_nic", "interface name"),
    Case("ib-hca-space", {"k2_ib_hcas": ["mlx5 0"]}, "k2_ib_hcas[0]", "InfiniBand HCA"),
    Case("model-no-org", {"k2_model": "Kimi-K2-Thinking"}, "k2_model", "org/name"),
    Case("model-double-dash", {"k2_model": "moonshotai/Kimi--K2"}, "k2_model", "no `--`"),
    Case("model-too-long", {"k2_model": "moonshotai/" + "K" * 90}, "k2_model", "at most 96"),
    Case("gguf-repo-path", KT_FLEET | {"k2_gguf_repo": "../unsloth/x"}, "k2_gguf_repo", "org/name"),
    Case("served-name-space", {"k2_served_model_name": "kimi k2"}, "k2_served_model_name", "A-Z a-z 0-9"),
    Case("image-uppercase", {"k2_runtime": "container", "k2_image": "Vllm/vllm-openai:v0.33.0"}, "k2_image", "Docker image"),
    Case("image-bad-tag", {"k2_runtime": "container", "k2_image": "vllm/vllm-openai:v0.33.0;id"}, "k2_image", "Docker image"),
    Case("image-id-short", {"k2_runtime": "container", "k2_image_id": "sha256:abc"}, "k2_image_id", "an image ID"),
    Case("parser-uppercase", {"k2_tool_parser": "Kimi_K2"}, "k2_tool_parser", "a-z 0-9"),
    Case("model-type-space", {"k2_model_type_override": "deepseek v3"}, "k2_model_type_override", "a-z 0-9"),
    Case("env-name-digit", {"k2_env": {"1NCCL": "x"}}, "k2_env.1NCCL", "environment variable name"),
    Case("engine-flag-name-space", {"k2_engine_args": {"max num seqs": 1}}, "k2_engine_args.'max num seqs'", "flag name"),
    Case("hub-endpoint-ftp", {"k2_hub_endpoint": "ftp://mirror.example"}, "k2_hub_endpoint", "http:// or https://"),
    Case("hub-endpoint-no-host", {"k2_hub_endpoint": "https:///path"}, "k2_hub_endpoint", "name a host"),
])
IDENTITY_TWIN_HOSTS = [("node-0", {"k2_address": "gpu-0.fleet.example"}), ("node-1", {"k2_address": "2001:db8::1"})]
# The twins' DNS names, resolved through the gate's resolver seam (names no real resolver knows)
TWIN_NAMES = {"gpu-0.fleet.example": ["192.0.2.20"], "gpu-1.fleet.example": ["2001:db8::21"],
              "gpu-2.fleet.example": ["192.0.2.22"]}


def twin_resolver(name: str) -> list[str]:
    if name not in TWIN_NAMES:
        raise OSError(f"{name}: not a twin's name")
    return TWIN_NAMES[name]


IDENTITY_TWIN = {"k2_tp": 16, "k2_mesh_user": "k2svc", "k2_nic": "bond0.100", "k2_ib_hcas": ["mlx5_0", "mlx5_1:1"],
                 "k2_served_model_name": "moonshotai/kimi-k2:thinking", "k2_runtime": "container",
                 "k2_image": "nvcr.io/nvidia/vllm:25.10-py3@sha256:" + "a" * 64, "k2_hub_endpoint": "http://10.0.0.5:8080",
                 "k2_env": {"_PRIVATE_FLAG": "1"}, "k2_engine_args": {"--max-num-seqs": 8},
                 "k2_api_clients": ["10.0.0.0/8", "192.0.2.9", "2001:db8:1::/48"]}

# --- (d) topology (cross-key rules) ----------------------------------------------------------------
TOPOLOGY = family("topology", [
    Case("no-hosts", {}, "inventory", "no hosts", hosts=[]),
    Case("sizes-not-gpus", {"k2_tp": 6}, "k2_tp", "multiply to 6 GPUs but each node has 8"),
    Case("sizes-not-whole-nodes", {"k2_tp": 12}, "k2_tp", "not a whole number", hosts=2),
    Case("dcp-not-dividing-tp", {"k2_tp": 8, "k2_dcp": 3}, "k2_dcp", "does not divide k2_tp=8"),
    Case("vllm-dp-with-pp", {"k2_tp": 2, "k2_pp": 2, "k2_dp": 2}, "k2_pp", "cannot be combined"),
    Case("headless-hybrid-lb", INSTRUCT | {"k2_tp": 1, "k2_dp": 16, "k2_ep": 16,
                                           "k2_engine_args": {"data-parallel-hybrid-lb": True}},
         "k2_engine_args", "headless", hosts=2),
    Case("too-few-nodes", {"k2_tp": 16}, "inventory", "needs 2 nodes"),
    Case("hosts-not-instances", {"k2_tp": 16}, "inventory", "multiple of 2", hosts=3),
    Case("nvfp4-on-hopper", NVFP4 | {"k2_engine": "trtllm", "k2_gpu": "h200"}, "k2_gpu", "Blackwell"),
    Case("rocm-on-nvidia", {"k2_platform": "rocm"}, "k2_platform", "ROCm engine cannot run on NVIDIA"),
    Case("rocm-image-on-nvidia", {"k2_runtime": "container", "k2_image": "vllm/vllm-openai-rocm:v0.33.0"},
         "k2_image", "ROCm image"),
    Case("image-id-without-container", {"k2_runtime": "venv", "k2_image_id": "sha256:" + "0" * 64},
         "k2_image_id", "needs k2_runtime container"),
    Case("weights-do-not-fit", INSTRUCT | {"k2_tp": 8}, "k2_tp", "spread the weights over at least 16 GPUs"),
    Case("full-context-on-h100", {"k2_gpu": "h100", "k2_max_model_len": 262144}, "k2_tp",
         "70.9 GiB of int4 weights per GPU"),
    Case("context-does-not-fit", {"k2_max_model_len": 262144, "k2_expected_concurrency": 3}, "k2_max_model_len",
         "lower k2_max_model_len to at most"),
    Case("port-clash", {"k2_port": 2233}, "k2_port", "also used by k2_mesh_port"),
    Case("ray-port-clash", INSTRUCT | {"k2_gpu": "h800", "k2_tp": 8, "k2_pp": 2, "k2_multinode_backend": "ray", "k2_max_model_len": 2048,
                                       "k2_ray_port": 8000}, "k2_port", "also used by k2_ray_port", hosts=2),
    Case("pd-without-router", {"k2_engine": "sglang", "k2_tp": 8}, "k2_role", "router",
         hosts=[("p0", {"k2_role": "prefill"}), ("d0", {"k2_role": "decode"})]),
    Case("pd-without-decode", {"k2_engine": "sglang", "k2_tp": 8}, "k2_role", "decode",
         hosts=[("p0", {"k2_role": "prefill"}), ("r0", {"k2_role": "router"})]),
    Case("load-balancer-not-a-host", {"k2_load_balancer": "lb-0"}, "k2_load_balancer", "not a host of this inventory",
         hosts=2),
    Case("load-balancer-port-clash", {"k2_load_balancer": "node-0", "k2_load_balancer_port": 8000}, "k2_load_balancer_port",
         "also used by k2_port", hosts=2),
    Case("load-balancer-with-pd", {"k2_engine": "sglang", "k2_tp": 8, "k2_load_balancer": "r0"}, "k2_load_balancer",
         "PD router already balances",
         hosts=[("p0", {"k2_role": "prefill"}), ("d0", {"k2_role": "decode"}), ("r0", {"k2_role": "router"})]),
    Case("unknown-engine", {"k2_engine": "tgi"}, "k2_engine", "vllm"),
    Case("unknown-version", {"k2_engine_version": "0.1.0"}, "k2_engine_version", "supported pins"),
    Case("missing-revision", {"k2_revision": None}, "k2_revision", "required"),
    Case("branch-revision", {"k2_revision": "main"}, "k2_revision", "not a pinned commit"),
    Case("typo-key", {"k2_tpp": 8}, "k2_tpp", "did you mean k2_tp"),
    Case("simulated-gpus-in-production", {"k2_simulated_gpus": True}, "k2_simulated_gpus", "sandbox"),
    Case("fleet-key-differs", {}, "k2_port", "same on every host",
         hosts=[("a", {"k2_port": 8000}), ("b", {"k2_port": 8001})]),
    Case("unknown-gpu", {"k2_gpu": "rtx4090"}, "k2_gpu", "unknown GPU type"),
    Case("bad-checkpoint-source", {"k2_checkpoint_source": "s3://bucket/k2"}, "k2_checkpoint_source", "neither `hub`"),
    # issue #33: a control: source is a directory of this control machine holding the manifest
    Case("control-source-missing", {"k2_checkpoint_source": "control:/nonexistent/k2fleet/kimi-k2"},
         "k2_checkpoint_source", "/nonexistent/k2fleet/kimi-k2 does not exist on this control machine"),
    Case("control-source-a-file", {"k2_checkpoint_source": f"control:{TOKEN_FILE}"}, "k2_checkpoint_source",
         "is not a directory"),
    Case("control-source-without-manifest", {"k2_checkpoint_source": f"control:{CONTROL_COPY_BARE}"},
         "k2_checkpoint_source", "has no .k2fleet/manifest.json"),
    Case("gguf-source-missing", KT_FLEET | {"k2_gguf_source": "control:/nonexistent/k2fleet/gguf"}, "k2_gguf_source",
         "does not exist on this control machine"),
    # k2_checkpoint_bytes of a catalog model: within ½-2× of its known size (memory fit, disk checks)
    Case("checkpoint-bytes-far-below", {"k2_checkpoint_bytes": 8_000_000}, "k2_checkpoint_bytes",
         "below half the 594 GB checkpoint of moonshotai/Kimi-K2-Thinking"),
    Case("checkpoint-bytes-far-above", INSTRUCT | {"k2_tp": 16, "k2_checkpoint_bytes": 5 * 10**12}, "k2_checkpoint_bytes",
         "over twice", hosts=2),
    Case("fetcher-not-a-host", {"k2_checkpoint_fetcher": "stager"}, "k2_checkpoint_fetcher", "nor a host of this inventory"),
    Case("fetcher-without-hub", {"k2_checkpoint_fetcher": "node-0", "k2_checkpoint_source": "control:/srv/k2"},
         "k2_checkpoint_fetcher", "downloads from the Hub"),
    Case("fetcher-without-hub-gguf", KT_FLEET | {"k2_checkpoint_fetcher": "node-0", "k2_gguf_source": "control:/srv/gguf"},
         "k2_checkpoint_fetcher", "but k2_gguf_source is"),
    Case("bad-gguf-source", KT_FLEET | {"k2_gguf_source": "s3://bucket/gguf"}, "k2_gguf_source", "neither `hub`"),
    Case("fetcher-is-router", {"k2_engine": "sglang", "k2_tp": 8, "k2_checkpoint_fetcher": "r0"},
         "k2_checkpoint_fetcher", "holds no checkpoint",
         hosts=[("p0", {"k2_role": "prefill"}), ("d0", {"k2_role": "decode"}), ("r0", {"k2_role": "router"})]),
    Case("vllm-ep-size", {"k2_tp": 8, "k2_ep": 4}, "k2_ep", "tp×dp = 8"),
    Case("bundle-with-apt", {"k2_bundle": "/srv/k2fleet-bundle"}, "k2_bundle", "set k2_package_source: bundle"),
    Case("bundle-not-made", {"k2_bundle": "/srv/no-such-bundle", "k2_package_source": "bundle"}, "k2_bundle",
         "/srv/no-such-bundle/k2fleet.lock does not exist; make the bundle with `k2fleet bundle INVENTORY"),
    Case("slurm-gpus-differ", _with(SLURM_FLEET, ("k2_slurm", "hardware", "gpus_per_node"), 8),
         "k2_slurm.hardware.gpus_per_node", "differs from k2_gpus_per_node 4"),
    # model shape (catalog: Kimi K2 has 64 attention heads and 384 routed experts)
    Case("tp-not-dividing-heads", {"k2_gpus_per_node": 6, "k2_tp": 6}, "k2_tp", "64 attention heads"),
    Case("tp-24-over-three-hosts", {"k2_tp": 24}, "k2_tp", "64 attention heads", hosts=3),
    Case("ep-not-dividing-experts", {"k2_engine": "sglang", "k2_tp": 8, "k2_ep": 5}, "k2_ep", "384 routed experts"),
    Case("sglang-ep-not-dividing-tp", {"k2_engine": "sglang", "k2_tp": 8, "k2_ep": 3}, "k2_ep",
         "does not divide the tensor parallel size 8"),
    Case("trtllm-ep-not-dividing-tp", B200 | {"k2_ep": 3}, "k2_ep", "does not divide the tensor parallel size 8"),
    Case("disagg-ep-not-dividing-tp", _with(SLURM_FLEET, ("k2_disagg", "gen", "moe_expert_parallel_size"), 3),
         "k2_disagg.gen.moe_expert_parallel_size", "does not divide the tensor parallel size 8"),
    Case("disagg-tp-not-dividing-heads", _with(_with(SLURM_FLEET, ("k2_disagg", "ctx", "tensor_parallel_size"), 12),
                                                ("k2_disagg", "ctx", "moe_expert_parallel_size"), 12),
         "k2_disagg.ctx.tensor_parallel_size", "64 attention heads"),
    Case("kt-instance-over-two-hosts", KT_FLEET | {"k2_tp": 2}, "k2_tp", "KTransformers runs on one host", hosts=2),
    # issue #25: a model on an engine, pin or GPU count that cannot serve it (catalog.Checkpoint)
    Case("issue25-k3-on-ktransformers", KT_FLEET | K3 | {"k2_engine_version": "0.7.2"}, "k2_engine",
         "not served by ktransformers"),
    Case("issue25-k3-trtllm-on-h200", K3 | {"k2_engine": "trtllm", "k2_tp": 16}, "k2_gpu", "Blackwell GPUs only", hosts=2),
    Case("issue25-k3-trtllm-on-h100", K3 | {"k2_engine": "trtllm", "k2_gpu": "h100", "k2_tp": 32}, "k2_gpu",
         "Blackwell GPUs only", hosts=4),
    Case("issue25-k3-vllm-pin-too-old", K3 | {"k2_engine_version": "0.11.0", "k2_tp": 8, "k2_pp": 2}, "k2_engine_version",
         "vllm >= 0.27.0", hosts=2),
    Case("issue25-k3-sglang-pin-too-old", K3 | {"k2_engine": "sglang", "k2_engine_version": "0.5.4", "k2_tp": 16},
         "k2_engine_version", "sglang >= 0.5.17", hosts=2),
    Case("issue25-k3-h200-one-node", K3 | {"k2_engine": "sglang", "k2_tp": 8}, "k2_tp", "needs 16 GPUs per instance"),
    Case("issue25-k3-ep-not-dividing-experts", K3 | {"k2_gpu": "b300", "k2_tp": 8, "k2_dp": 3, "k2_ep": 24}, "k2_ep",
         "896 routed experts", hosts=3),
    Case("issue25-0905-h100-one-node", K0905 | {"k2_gpu": "h100", "k2_tp": 8}, "k2_tp", "less than the 1,030 GB checkpoint"),
    Case("issue25-k25-on-sglang", K25 | {"k2_engine": "sglang", "k2_tp": 8}, "k2_engine", "use vllm"),
    Case("issue25-k25-vllm-pin-too-old", K25 | {"k2_tp": 8, "k2_engine_version": "0.10.0"}, "k2_engine_version",
         "vllm >= 0.15.0"),
    # a parser name the pinned engine does not register (catalog.KIMI_PARSERS): the default's, a named one
    Case("parser-default-reasoning-not-at-pin", {"k2_engine_version": "0.11.0"}, "k2_engine_version",
         "vllm 0.11.0 registers no kimi_k2 reasoning parser"),
    Case("parser-named-reasoning-not-at-pin", {"k2_engine": "sglang", "k2_engine_version": "0.5.4",
                                               "k2_reasoning_parser": "kimi_k2"}, "k2_reasoning_parser",
         "sglang 0.5.4 registers no kimi_k2 reasoning parser (its Kimi reasoning parsers: kimi)"),
    # environment variables that contradict the keys k2fleet derives them from
    Case("env-nccl-ifname-not-nic", {"k2_nic": "eth0", "k2_env": {"NCCL_SOCKET_IFNAME": "eth1"}},
         "k2_env.NCCL_SOCKET_IFNAME", "contradicts k2_nic eth0"),
    Case("env-gloo-ifname-not-nic", {"k2_nic": "eth0", "k2_env": {"GLOO_SOCKET_IFNAME": "^lo"}},
         "k2_env.GLOO_SOCKET_IFNAME", "contradicts k2_nic eth0"),
    Case("env-ib-hca-not-hcas", {"k2_ib_hcas": ["mlx5_0"], "k2_env": {"NCCL_IB_HCA": "mlx5_1"}},
         "k2_env.NCCL_IB_HCA", "contradicts k2_ib_hcas"),
    Case("env-cuda-visible-devices-count", {"k2_env": {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}},
         "k2_env.CUDA_VISIBLE_DEVICES", "planned on 8"),
    Case("env-cuda-visible-devices-repeated", {"k2_env": {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,6"}},
         "k2_env.CUDA_VISIBLE_DEVICES", "lists 7 distinct GPUs"),
])
TOPOLOGY_TWINS = [
    ("topology-shape-sglang-ep", {"k2_engine": "sglang", "k2_tp": 8, "k2_ep": 8}, 1),
    ("topology-shape-trtllm-ep", B200 | {"k2_ep": 4}, 1),
    ("topology-shape-vllm-dp-ep", {"k2_tp": 8, "k2_dp": 2, "k2_ep": 16}, 2),
    ("topology-kt-replicas", KT_FLEET, 2),
    ("topology-issue25-k3-sglang-h200-2x8", K3 | {"k2_engine": "sglang", "k2_tp": 16}, 2),
    ("topology-issue25-k3-trtllm-b200-2x8", K3 | {"k2_engine": "trtllm", "k2_gpu": "b200", "k2_tp": 16}, 2),
    ("topology-issue25-k25-vllm", K25 | {"k2_tp": 8}, 1),
    ("topology-parser-sglang-0.5.4-kimi", {"k2_engine": "sglang", "k2_engine_version": "0.5.4",
                                           "k2_reasoning_parser": "kimi"}, 1),
    ("topology-context-fits-twice", {"k2_max_model_len": 262144, "k2_expected_concurrency": 2}, 1),
    ("topology-load-balancer", {"k2_load_balancer": "node-1", "k2_load_balancer_port": 9090, "k2_rollout": "rolling",
                                "k2_drain_timeout": 600, "k2_reboot": "rolling"}, 2),
    ("topology-all-at-once", {"k2_rollout": "all-at-once"}, 2),
    ("topology-env-agrees", {"k2_nic": "eth0", "k2_ib_hcas": ["mlx5_0", "mlx5_1"],
                             "k2_env": {"NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "=eth0",
                                        "NCCL_IB_HCA": "mlx5_0,mlx5_1", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}}, 1),
]

# --- (e) structure (wrong nested types) ------------------------------------------------------------------
STRUCTURE = family("structure", [
    Case("profile-legacy-kt", KT_FLEET | {"k2_profile": "latency"}, "k2_profile", "legacy server"),
    Case("kt-cpuinfer-string", _with(KT_FLEET, ("k2_kt", "cpuinfer"), "many"), "k2_kt.cpuinfer", "valid integer"),
    Case("kt-unknown-option", _with(KT_FLEET, ("k2_kt", "cpu_infer"), 64), "k2_kt.cpu_infer", "not a known option"),
    Case("kt-method-unknown", _with(KT_FLEET, ("k2_kt", "method"), "AVX2"), "k2_kt.method", "LLAMAFILE"),
    Case("kt-not-a-dict", KT_FLEET | {"k2_kt": ["cache_lens", 30000]}, "k2_kt", "valid dictionary"),
    Case("slurm-gpus-string", _with(SLURM_FLEET, ("k2_slurm", "hardware", "gpus_per_node"), "4"),
         "k2_slurm.hardware.gpus_per_node", "valid integer"),
    Case("slurm-missing-section", SLURM_FLEET | {"k2_slurm": {k: v for k, v in SLURM.items() if k != "benchmark"}},
         "k2_slurm.benchmark", "required"),
    Case("slurm-unknown-section", _with(SLURM_FLEET, ("k2_slurm", "worker_config"), {}), "k2_slurm.worker_config",
         "not a known option"),
    Case("slurm-relative-work-dir", _with(SLURM_FLEET, ("k2_slurm", "environment", "work_dir"), "work"),
         "k2_slurm.environment.work_dir", "absolute"),
    Case("slurm-section-list", _with(SLURM_FLEET, ("k2_slurm", "slurm"), ["gpu"]), "k2_slurm.slurm", "valid dictionary"),
    Case("disagg-side-not-dict", _with(SLURM_FLEET, ("k2_disagg", "ctx"), 4), "k2_disagg.ctx", "valid dictionary"),
    Case("disagg-missing-gen", SLURM_FLEET | {"k2_disagg": {"ctx": DISAGG["ctx"]}}, "k2_disagg.gen", "required"),
    Case("disagg-tp-string", _with(SLURM_FLEET, ("k2_disagg", "gen", "tensor_parallel_size"), "8"),
         "k2_disagg.gen.tensor_parallel_size", "valid integer"),
    Case("trtllm-batch-string", B200 | {"k2_trtllm_config": {"max_batch_size": "128"}},
         "k2_trtllm_config.max_batch_size", "valid integer"),
    Case("trtllm-kv-config-list", B200 | {"k2_trtllm_config": {"kv_cache_config": [0.75]}},
         "k2_trtllm_config.kv_cache_config", "valid dictionary"),
    Case("trtllm-batch-sizes-bool", B200 | {"k2_trtllm_config": {"cuda_graph_config": {"batch_sizes": [1, True]}}},
         "k2_trtllm_config.cuda_graph_config.batch_sizes[1]", "valid integer"),
    Case("trtllm-option-name", B200 | {"k2_trtllm_config": {"max-batch-size": 8}}, "k2_trtllm_config",
         "option name"),
    Case("env-not-a-dict", {"k2_env": ["NCCL_DEBUG=INFO"]}, "k2_env", "valid dictionary"),
    Case("env-value-int", {"k2_env": {"NCCL_DEBUG": 1}}, "k2_env.NCCL_DEBUG", "valid string"),
    Case("engine-arg-dict-value", {"k2_engine_args": {"speculative-config": {"method": "eagle"}}},
         "k2_engine_args.speculative-config", "not dict"),
    Case("engine-arg-nested-list", {"k2_engine_args": {"cuda-graph-sizes": [[1, 2]]}},
         "k2_engine_args.cuda-graph-sizes[0]", "flat"),
    Case("ib-hcas-string", {"k2_ib_hcas": "mlx5_0"}, "k2_ib_hcas", "valid list"),
    # flag smuggling: a value (or list item) that is itself a flag would be a second argv flag
    Case("engine-arg-list-smuggles-flag", {"k2_engine_args": {"max-num-seqs": [256, "--tensor-parallel-size", 4]}},
         "k2_engine_args.max-num-seqs[1]", "looks like a flag"),
    Case("engine-arg-value-smuggles-flag", {"k2_engine_args": {"chat-template": "-tp"}},
         "k2_engine_args.chat-template", "looks like a flag"),
    Case("engine-arg-value-100k", {"k2_engine_args": {"chat-template": "a" * 100_000}},
         "k2_engine_args.chat-template", "at most 4096 characters"),
    Case("engine-arg-value-double-dash", {"k2_engine_args": {"chat-template": "--"}},
         "k2_engine_args.chat-template", "looks like a flag"),
    Case("sglang-list-smuggles-flag", {"k2_engine": "sglang", "k2_tp": 8,
                                       "k2_engine_args": {"max-running-requests": [1, "--tp-size", 4]}},
         "k2_engine_args.max-running-requests[1]", "looks like a flag"),
    Case("trtllm-list-smuggles-flag", B200 | {"k2_engine_args": {"max_batch_size": [1, "--tp_size", 4]}},
         "k2_engine_args.max_batch_size[1]", "looks like a flag"),
    Case("kt-list-smuggles-flag", KT_FLEET | {"k2_engine_args": {"cache_lens": [1, "-tp", 4]}},
         "k2_engine_args.cache_lens[1]", "looks like a flag"),
    Case("smuggled-flag-via-data", {}, "k2_engine_args.max-num-seqs[1]", "looks like a flag",
         cli_data=('k2_engine_args={"max-num-seqs": [256, "--tensor-parallel-size", 4]}',)),
    # group-data files: one line naming the file, on every entry
    Case("group-data-raises", {}, "inventory", "raised RuntimeError: boom in group data",
         group_py='raise RuntimeError("boom in group data")\n'),
    Case("group-data-bare-list", {}, "inventory", "holds a bare list", group_py="['k2_port', 9000]\n"),
    Case("group-data-all-not-a-list", {}, "inventory", "__all__ must be a list", group_py="__all__ = 5\n"),
    Case("group-data-all-names-nothing", {}, "inventory", "__all__ names k2_nope", group_py="__all__ = ['k2_nope']\n"),
    # issue #33: an inventory's groups as pyinfra reads them (pyinfra ended in a traceback on these)
    Case("group-data-is-a-list", {}, "inventory", "group extra's data is a list, not a dict",
         inventory_py="extra = (['node-0'], ['k2_port', 9000])\n"),
    Case("all-group-data-is-a-list", {}, "inventory", "group all's data is a list",
         inventory_py="all = (['node-0'], [('k2_port', 9000)])\n"),
    Case("host-data-is-a-list", {}, "inventory", "host node-0's data in group extra is a list",
         inventory_py="extra = [('node-0', ['k2_port', 9000])]\n"),
    Case("group-is-a-tuple-of-names", {}, "inventory", "group extra is a tuple but not ([hosts], data)",
         inventory_py="extra = ('node-0', 'node-1')\n"),
    Case("host-entry-three-items", {}, "inventory", "which is not a host", inventory_py="extra = [('node-0', {}, 1)]\n"),
    # a host in two groups: pyinfra keeps one group's value silently
    Case("host-in-two-groups-with-other-data", {}, "inventory", "node-0 is in groups nodes and heads with different k2_nic",
         hosts=[("node-0", {"k2_nic": "eth0"})], inventory_py="heads = [('node-0', {'k2_nic': 'eth1'})]\n"),
    Case("host-in-two-role-groups", {"k2_engine": "sglang", "k2_tp": 8}, "inventory",
         "node-0 is in groups prefill and decode, whose data give k2_role different values",
         hosts=[("node-0", {}), ("d0", {}), ("r0", {"k2_role": "router"})],
         inventory_py="prefill = (['node-0'], {'k2_role': 'prefill'})\ndecode = (['node-0', 'd0'], {'k2_role': 'decode'})\n"),
    # pyinfra's own keys, with pyinfra's own types (pyinfra refused them after the gate, exit 1)
    Case("sudo-list", {"_sudo": ["yes"]}, "_sudo", "must be bool"),
    Case("ssh-password-list", {}, "ssh_password", "must be str", hosts=[("node-0", {"ssh_password": ["hunter2hunter2"]})],
         secret="hunter2hunter2"),
    Case("strict-host-key-checking-bool", {"ssh_strict_host_key_checking": True}, "ssh_strict_host_key_checking",
         "must be str"),
    Case("su-user-int", {"_su_user": 0}, "_su_user", "must be str"),
    # flag and option names against the pinned engine's tables (k2fleet.planning.engine_flags)
    Case("engine-flag-typo", {"k2_engine_args": {"tensor-paralel-size": 8}}, "k2_engine_args", "did you mean"),
    Case("trtllm-option-contradicts-key", B200 | {"k2_trtllm_config": {"tensor_parallel_size": 4}},
         "k2_trtllm_config", "contradicts k2_tp=8"),
])

# --- (f) secrets -------------------------------------------------------------------------------------
SECRETS = family("secrets", [
    Case("hf-token-env", {"k2_env": {"HF_TOKEN": HF}}, "k2_env.HF_TOKEN", "k2_hub_token_file", secret=HF),
    Case("hub-token-env", {"k2_env": {"HUGGING_FACE_HUB_TOKEN": "x" * 12}}, "k2_env.HUGGING_FACE_HUB_TOKEN",
         "k2_hub_token_file", secret="x" * 12),
    Case("generic-key-env", {"k2_env": {"WANDB_API_KEY": "0123456789abcdef"}}, "k2_env.WANDB_API_KEY",
         "k2_hub_token_file", secret="0123456789abcdef"),
    Case("generic-password-env", {"k2_env": {"DB_PASSWORD": "hunter2hunter2"}}, "k2_env.DB_PASSWORD",
         "k2_hub_token_file", secret="hunter2hunter2"),
    Case("hf-token-flag", {"k2_engine_args": {"hf-token": "abcdefghijkl"}}, "k2_engine_args.hf-token",
         "k2_hub_token_file", secret="abcdefghijkl"),
    Case("bearer-in-env-value", {"k2_env": {"EXTRA_HEADERS": "Authorization: Bearer abcdefghijklmnop"}},
         "k2_env.EXTRA_HEADERS", "k2_hub_token_file", secret="abcdefghijklmnop"),
    Case("hf-token-as-name", {"k2_served_model_name": HF}, "k2_served_model_name", "k2_hub_token_file", secret=HF),
    Case("hf-token-in-wrong-type", {"k2_port": HF}, "k2_port", "k2_hub_token_file", secret=HF),
    Case("aws-key-in-slurm", _with(SLURM_FLEET, ("k2_slurm", "environment", "worker_env_var"), f"AWS_ID={AWS}"),
         "k2_slurm.environment.worker_env_var", "k2_hub_token_file", secret=AWS),
    Case("github-token-nested", B200 | {"k2_trtllm_config": {"speculative_config": {"speculative_model_dir": GH}}},
         "k2_trtllm_config.speculative_config.speculative_model_dir", "k2_hub_token_file", secret=GH),
    Case("github-pat-in-list", {"k2_engine_args": {"middleware": ["a", GH_PAT]}}, "k2_engine_args.middleware[1]",
         "k2_hub_token_file", secret=GH_PAT),
    Case("credentials-in-endpoint", {"k2_hub_endpoint": "https://user:s3cretpass@hub.example"}, "k2_hub_endpoint",
         "k2_hub_token_file", secret="s3cretpass"),
    Case("token-in-endpoint-query", {"k2_hub_endpoint": "https://hub.example/?access_token=qwertyuiop123"},
         "k2_hub_endpoint", "query", secret="qwertyuiop123"),
    Case("proxy-password-in-env", {"k2_env": {"HTTPS_PROXY": "http://svc:s3cretproxy@proxy.example:3128"}},
         "k2_env.HTTPS_PROXY", "user:password@", secret="s3cretproxy"),
    Case("token-in-mirror-query", {"k2_env": {"PIP_INDEX_URL": "https://pypi.example/simple?sig=abcdef123456xyz"}},
         "k2_env.PIP_INDEX_URL", "query", secret="abcdef123456xyz"),
    Case("access-token-in-env-url", {"k2_env": {"HF_ENDPOINT": "https://m.example/x?a=1&access_token=zxcvbnm98765"}},
         "k2_env.HF_ENDPOINT", "query", secret="zxcvbnm98765"),
    Case("credentials-in-engine-arg-url", {"k2_engine_args": {"chat-template": "https://u:tplsecret99@h.example/t.jinja"}},
         "k2_engine_args.chat-template", "user:password@", secret="tplsecret99"),
    Case("token-over-http", {"k2_hub_endpoint": "http://hub.example:8080", "k2_hub_token_file": TOKEN_FILE},
         "k2_hub_endpoint", "use https://"),
    Case("secret-word-inside-env-name", {"k2_env": {"MY_TOKEN_VALUE": "abcdef123456"}}, "k2_env.MY_TOKEN_VALUE",
         "k2_hub_token_file", secret="abcdef123456"),
    Case("secret-word-first-in-env-name", {"k2_env": {"PASSWORD_X": "hunter2hunter2"}}, "k2_env.PASSWORD_X",
         "k2_hub_token_file", secret="hunter2hunter2"),
    Case("credentials-in-os-mirror", {"k2_os_mirror": "https://u:mirrorpw123@m.example/ubuntu"}, "k2_os_mirror",
         "k2_hub_token_file", secret="mirrorpw123"),
    Case("credentials-in-os-security-mirror", {"k2_os": "debian-12", "k2_os_mirror": "https://m.example/debian",
                                               "k2_os_security_mirror": "https://u:secmirrorpw1@m.example/debian-security"},
         "k2_os_security_mirror", "k2_hub_token_file", secret="secmirrorpw1"),
    Case("security-mirror-on-ubuntu", {"k2_os_mirror": "https://m.example/ubuntu",
                                       "k2_os_security_mirror": "https://m.example/debian-security"},
         "k2_os_security_mirror", "runs ubuntu-22.04"),
    Case("token-in-pypi-index-query", {"k2_pypi_index": "https://pypi.example/simple?token=qwertyuiop123"},
         "k2_pypi_index", "query", secret="qwertyuiop123"),
    Case("nvidia-repo-over-http", {"k2_nvidia_repo": "http://m.example/cuda", "k2_nvidia_repo_keyring": KEYRING_FILE},
         "k2_nvidia_repo", "https"),
    Case("nvidia-repo-without-keyring", {"k2_nvidia_repo": "https://m.example/cuda"}, "k2_nvidia_repo",
         "k2_nvidia_repo_keyring"),
    Case("keyring-missing", {"k2_os_mirror": "https://m.example/ubuntu", "k2_os_mirror_keyring": "/nonexistent/k.gpg"},
         "k2_os_mirror_keyring", "does not exist"),
    Case("keyring-empty", {"k2_os_mirror": "https://m.example/ubuntu", "k2_os_mirror_keyring": _token_file(0o644, b"")},
         "k2_os_mirror_keyring", "empty"),
    Case("keyring-not-a-key", {"k2_os_mirror": "https://m.example/ubuntu",
                               "k2_os_mirror_keyring": _token_file(0o644, b"just text\n")}, "k2_os_mirror_keyring",
         "OpenPGP"),
    Case("egress-without-firewall", {"k2_egress": "mirrors-only", "k2_firewall": False}, "k2_egress", "k2_firewall"),
    Case("egress-without-os-mirror", {"k2_egress": "mirrors-only"}, "k2_egress", "k2_os_mirror"),
    Case("token-file-missing", {"k2_hub_token_file": "/nonexistent/k2fleet/hf-token"}, "k2_hub_token_file",
         "does not exist"),
    Case("token-file-world-readable", {"k2_hub_token_file": _token_file(0o644)}, "k2_hub_token_file", "chmod 600"),
    Case("token-file-empty", {"k2_hub_token_file": _token_file(0o600, b"")}, "k2_hub_token_file", "empty"),
    Case("token-via-data", {}, "k2_served_model_name", "k2_hub_token_file", secret=HF,
         cli_data=(f"k2_served_model_name={HF}",)),
    Case("api-key-flag", {"k2_engine_args": {"api-key": "sk-abcdefghijkl"}}, "k2_engine_args.api-key",
         "k2_api_key_file", secret="sk-abcdefghijkl"),
    Case("api-key-env", {"k2_env": {"VLLM_API_KEY": "sk-abcdefghijkl"}}, "k2_env.VLLM_API_KEY",
         "k2_api_key_file", secret="sk-abcdefghijkl"),
    Case("api-key-file-missing", {"k2_api_key_file": "/nonexistent/k2fleet/api-key"}, "k2_api_key_file",
         "does not exist"),
    Case("api-key-file-world-readable", {"k2_api_key_file": _token_file(0o644)}, "k2_api_key_file", "chmod 600"),
    Case("api-key-file-empty", {"k2_api_key_file": _token_file(0o600, b"")}, "k2_api_key_file", "empty"),
    Case("api-key-file-two-words", {"k2_api_key_file": _token_file(0o600, b"two words\n")}, "k2_api_key_file",
         "visible ASCII", secret="two words"),
    # SGLang, TRT-LLM and KTransformers get the API front (good twins below); only a Slurm
    # submit host, which serves nothing, has nowhere to put it
    Case("api-key-file-slurm-submit", SLURM_FLEET | {"k2_api_key_file": TOKEN_FILE},
         "k2_api_key_file", "slurm-submit"),
    # TLS: the three files or none (the files themselves: tests/test_tls.py, with a real CA)
    Case("tls-without-ca", {"k2_tls_cert_file": TOKEN_FILE, "k2_tls_key_file": TOKEN_FILE}, "k2_tls_ca_file",
         "set all three"),
    Case("tls-cert-missing", {"k2_tls_cert_file": "/nonexistent/k2fleet/server.pem", "k2_tls_key_file": TOKEN_FILE,
                              "k2_tls_ca_file": "/nonexistent/k2fleet/ca.pem"}, "k2_tls_cert_file", "does not exist"),
    Case("tls-cert-not-pem", {"k2_tls_cert_file": TOKEN_FILE, "k2_tls_key_file": TOKEN_FILE,
                              "k2_tls_ca_file": TOKEN_FILE}, "k2_tls_cert_file", "no PEM certificate"),
])
SECRETS_TWIN = {"k2_hub_token_file": TOKEN_FILE, "k2_api_key_file": TOKEN_FILE, "k2_env": {"NCCL_DEBUG": "INFO", "HF_HUB_ENABLE_HF_TRANSFER": "1",
                                                                         "TOKENIZERS_PARALLELISM": "false"},
                "k2_engine_args": {"chat-template": "/srv/templates/kimi.jinja"}}

# --- (g) resource (length, size, depth, alias bombs) ----------------------------------------------------------
DEEP_TRTLLM = "_d = 1\nfor _i in range(2000):\n    _d = {'a': _d}\nk2_trtllm_config = {'kv_cache_config': _d}\n"
DEEP_LIST = "_d = 1\nfor _i in range(2000):\n    _d = [_d]\nk2_engine_args = {'cudagraph-capture-sizes': _d}\n"
# 10**9 strings from nine shared lists of ten: tiny in memory, endless to walk
ALIAS_BOMB = "_a = ['x' * 16] * 10\nfor _i in range(8):\n    _a = [_a] * 10\nk2_trtllm_config = {'kv_cache_config': {'x': _a}}\n"
RESOURCE = family("resource", [
    Case("env-value-200k", {"k2_env": {"NCCL_DEBUG": "a" * 200_000}}, "k2_env.NCCL_DEBUG", "at most 4096 characters"),
    Case("env-name-100k", {"k2_env": {"A" * 100_000: "1"}}, "k2_env", "keys are at most 4096 characters"),
    Case("trtllm-value-100k", B200 | {"k2_trtllm_config": {"kv_cache_config": {"dtype": "a" * 100_000}}},
         "k2_trtllm_config.kv_cache_config.dtype", "at most 4096 characters"),
    Case("model-dir-100k", {"k2_model_dir": "/srv/" + "a" * 100_000}, "k2_model_dir", "at most 4096 characters"),
    Case("env-too-many-entries", {"k2_env": {f"V{i}": "1" for i in range(1025)}}, "k2_env", "at most 1024"),
    Case("engine-arg-list-too-long", {"k2_engine_args": {"cudagraph-capture-sizes": list(range(1, 2001))}},
         "k2_engine_args.cudagraph-capture-sizes", "at most 1024"),
    Case("trtllm-config-2000-deep", B200, "k2_trtllm_config.kv_cache_config" + ".a" * 14, "more than 16 deep",
         group_py=DEEP_TRTLLM),
    Case("engine-arg-2000-deep", {}, "k2_engine_args.cudagraph-capture-sizes" + "[0]" * 14, "more than 16 deep",
         group_py=DEEP_LIST),
    Case("trtllm-config-alias-bomb", B200, "k2_trtllm_config", "more than 65536 values", group_py=ALIAS_BOMB),
    Case("integer-beyond-64-bits", {}, "k2_health_timeout", "beyond 64 bits", group_py="k2_health_timeout = 10**5000\n"),
    Case("not-plain-data", {}, "k2_env.NCCL_DEBUG", "plain data", group_py="k2_env = {'NCCL_DEBUG': b'INFO'}\n"),
])
RESOURCE_TWINS = [
    ("resource-at-the-caps", {"k2_env": {f"V{i}": "a" * 1000 for i in range(1024)},
                              "k2_engine_args": {"chat-template": "/srv/t/" + "a" * 4089}}, 1),
    ("resource-deep-slurm", _with(SLURM_FLEET, ("k2_slurm", "benchmark", "extra"),
                                  {"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": {"i": {"j": {"k": {"l": [1]}}}}}}}}}}}}), 1),
]

FAMILIES = {"types": TYPES, "injection": INJECTION, "identity": IDENTITY, "topology": TOPOLOGY,
            "structure": STRUCTURE, "secrets": SECRETS, "resource": RESOURCE}
EVERY = [c for cases in FAMILIES.values() for c in cases]
assert len({c.id for c in EVERY}) == len(EVERY), "case ids must be unique"
ALL = EVERY


# --- running the entries ---------------------------------------------------------------------------------------
class Listener:
    """A socket where the hosts' sshd would be; every accepted connection is counted and closed."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.count = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.count += 1
            conn.close()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def inventory(directory: Path, case_hosts: int | list, data: dict[str, Any], port: int, group_py: str = "",
              inventory_py: str = "") -> Path:
    """The case's inventory: hosts at 127.0.0.1:port (the listener), each its own k2_address;
    ``group_py`` appended to its group-data file."""
    if isinstance(case_hosts, int):
        case_hosts = [(f"node-{i}", {}) for i in range(case_hosts)]
    hosts = []
    for i, (name, extra) in enumerate(case_hosts):
        base: dict[str, Any] = {"ssh_hostname": "127.0.0.1", "ssh_port": port, "ssh_connect_timeout": 5}
        if len(case_hosts) > 1:
            base["k2_address"] = f"192.0.2.{10 + i}"
        merged = {k: v for k, v in (base | extra).items() if v is not None}
        hosts.append((name, merged))
    inv = write_inventory(directory, hosts=hosts, **data)
    if inventory_py:
        inv.write_text(inv.read_text() + inventory_py)
    if group_py:
        group_data = directory / "group_data" / inv.name
        group_data.write_text(group_data.read_text() + group_py)
    return inv


def entry_argv(entry: str, inv: Path, cli_data: tuple[str, ...]) -> list[str]:
    data = [w for item in cli_data for w in ("--data", item)]
    if entry == "pyinfra":
        return [sys.executable, "-m", "pyinfra", "-y", *data, str(inv), "deploys/kimi.py"]
    if entry == "validate":
        return [sys.executable, "-m", "k2fleet.cli", "validate", str(inv), *data]
    return [sys.executable, "-m", "k2fleet.cli", "plan", str(inv), "--json", *data]


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """One entry as a plain subprocess (``sys.executable -m ...``)."""
    return subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, cwd=REPO, timeout=120)


# A fork server per entry kind: a process that has imported what the entry imports and
# then, per request, forks a child that runs the entry module exactly as ``python -m`` does
# (runpy, ``__main__``, its own argv, cwd, stdin=/dev/null, stdout/stderr to files) and
# reports the child's exit code. The entry's code path is unchanged; only the interpreter
# start and imports (~0.5 CPU-s per process, ~1.5 per case) are paid once. Each family
# also runs one case as plain subprocesses and compares (test_the_fork_server_is_faithful).
ZYGOTE = r"""
import importlib, json, os, runpy, sys, traceback
kind = sys.argv[1]
if kind == "pyinfra":
    import pyinfra_cli.main  # what `python -m pyinfra` imports first (gevent patch included)
    import k2fleet.deploy.gate  # what the repository's config.py imports
else:
    import k2fleet.cli  # its imports stay loaded; the module itself runs afresh as __main__
    # and what its validate and plan import late: pyinfra's inventory loader (without gevent's patch)
    from k2fleet.inventory.loader import _import_pyinfra_cli_inventory
    _import_pyinfra_cli_inventory()
    import pyinfra_cli.util, paramiko, jinja2, packaging.requirements
    del sys.modules["k2fleet.cli"]
    del sys.modules["k2fleet"].cli
reply = os.fdopen(os.dup(1), "w")
devnull = os.open(os.devnull, os.O_RDONLY)
for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.chdir(req["cwd"])
            out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            err = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(devnull, 0); os.dup2(out, 1); os.dup2(err, 2)
            sys.argv = [req["module"], *req["args"]]
            sys.path[0] = req["cwd"]
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            try:
                sys.stdout.flush(); sys.stderr.flush()
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    reply.write(json.dumps(os.waitstatus_to_exitcode(status)) + "\n"); reply.flush()
"""


class Zygote:
    def __init__(self, kind: str) -> None:
        env = dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE, kind], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)

    def run(self, argv: list[str], scratch: Path) -> subprocess.CompletedProcess[str]:
        assert argv[:2] == [sys.executable, "-m"], argv
        out, err = scratch.with_suffix(".out"), scratch.with_suffix(".err")
        req = {"module": argv[2], "args": argv[3:], "cwd": str(REPO), "out": str(out), "err": str(err)}
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        rc = int(self.proc.stdout.readline())
        return subprocess.CompletedProcess(argv, rc, out.read_text(), err.read_text())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


class ZygotePool:
    """One pyinfra and one k2fleet fork server per worker thread."""

    def __init__(self, workers: int) -> None:
        self.free: queue.Queue[dict[str, Zygote]] = queue.Queue()
        for _ in range(workers):
            self.free.put({"pyinfra": Zygote("pyinfra"), "k2fleet": Zygote("k2fleet")})

    def run(self, entry: str, argv: list[str], scratch: Path) -> subprocess.CompletedProcess[str]:
        pair = self.free.get()
        try:
            return pair["pyinfra" if entry == "pyinfra" else "k2fleet"].run(argv, scratch)
        finally:
            self.free.put(pair)

    def close(self) -> None:
        while not self.free.empty():
            for z in self.free.get().values():
                z.close()


@dataclass
class Outcome:
    inv: Path
    listener: Listener
    results: dict[str, subprocess.CompletedProcess[str]]
    connections: int = 0


@pytest.fixture(scope="module")
def outcomes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    """Every entry of every selected case (``-k`` narrows it), run once and concurrently."""
    selected = {
        item.callspec.params["case"].id
        for item in request.session.items
        if getattr(item, "originalname", "") == "test_bad_inventory_is_refused_on_every_entry_before_any_host_is_touched"
    }
    if not selected:
        return {}
    out: dict[str, Outcome] = {}
    jobs = []
    for case in ALL:
        if case.id not in selected:
            continue
        listener = Listener()
        inv = inventory(tmp_path_factory.mktemp(case.id[:40]), case.hosts, case.data, listener.port, case.group_py,
                        case.inventory_py)
        out[case.id] = Outcome(inv, listener, {})
        jobs += [(case.id, entry, entry_argv(entry, inv, case.cli_data)) for entry in ENTRIES]
    # beside the sandbox stream (an xdist worker: ./dev.sh test) one entry at a time, not starving its fleet
    workers = 1 if os.environ.get("PYTEST_XDIST_WORKER") else (os.cpu_count() or 2) + 1
    zygotes = ZygotePool(workers)
    scratch = tmp_path_factory.mktemp("entry-output")
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(zygotes.run, entry, argv, scratch / f"{cid}-{entry}"): (cid, entry)
                       for cid, entry, argv in jobs}
            for future, (cid, entry) in futures.items():
                out[cid].results[entry] = future.result()
    finally:
        zygotes.close()
    for outcome in out.values():
        outcome.connections = outcome.listener.count
        outcome.listener.close()
    return out


def check_refusal(case: Case, outcome: Outcome) -> None:
    for entry in ENTRIES:
        result = outcome.results[entry]
        both = result.stdout + result.stderr
        where = f"[{entry}] {result.args}\nstdout: {result.stdout[-2000:]}\nstderr: {result.stderr[-2000:]}"
        assert "Traceback" not in both, where
        assert result.returncode == 2, where
        lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(lines) == 1, where
        line = lines[0]
        prefix = f"error: {outcome.inv}: "
        assert line.startswith(prefix), where
        assert line[len(prefix):].split(": ", 1)[0] == case.key, where
        assert case.words in line, where
        if entry != "pyinfra":
            assert result.stdout == "" and result.stderr == line + "\n", where
        if case.secret:
            assert case.secret not in both and case.secret[3:15] not in both, where
    assert outcome.connections == 0, f"{outcome.connections} connections to the hosts' sshd"


@pytest.mark.parametrize("case", ALL, ids=[f"{c.family}:{c.id}" for c in ALL])
def test_bad_inventory_is_refused_on_every_entry_before_any_host_is_touched(outcomes, case: Case) -> None:
    check_refusal(case, outcomes[case.id])


FAITHFUL = [next(c for c in ALL if c.family == name) for name in FAMILIES]


@pytest.mark.parametrize("case", FAITHFUL, ids=[f"{c.family}:{c.id}" for c in FAITHFUL])
def test_the_fork_server_is_faithful(tmp_path: Path, outcomes, case: Case) -> None:
    """One case per family through plain ``sys.executable -m`` subprocesses: the same
    refusal as through the fork server, and still no connection."""
    listener = Listener()
    try:
        inv = inventory(tmp_path, case.hosts, case.data, listener.port, case.group_py,
                        case.inventory_py)
        results = {entry: run(entry_argv(entry, inv, case.cli_data)) for entry in ENTRIES}
    finally:
        listener.close()
    check_refusal(case, Outcome(inv, listener, results, listener.count))
    if case.id in outcomes:
        served = outcomes[case.id]
        for entry in ENTRIES:
            assert results[entry].returncode == served.results[entry].returncode
            plain = results[entry].stderr.replace(str(inv), "INV")
            forked = served.results[entry].stderr.replace(str(served.inv), "INV")
            assert plain == forked, (plain, forked)


# --- good twins: the rules do not refuse valid input ------------------------------------------------
def _valid(tmp_path: Path, data: dict[str, Any], hosts: int | list = 1, name: str = "fleet", group_py: str = "") -> None:
    inv = inventory(tmp_path / name, hosts, data, 22, group_py)
    load_plan(inv, resolver=twin_resolver)  # raises SpecError when refused


TWINS: list[tuple[str, dict[str, Any], int | list]] = [
    ("types", TYPES_TWIN, 1),
    ("types-instruct-context", INSTRUCT | {"k2_tp": 16, "k2_max_model_len": 131072}, 2),
    ("types-metrics", {"k2_metrics": True, "k2_node_exporter": True, "k2_metrics_scrapers": ["10.9.0.5", "fd00:9::/64"],
                       "k2_api_clients": ["10.0.0.0/8"]}, 1),
    ("types-profile-trtllm", B200 | {"k2_profile": "throughput"}, 1),
    ("types-profile-sglang", {"k2_engine": "sglang", "k2_tp": 8, "k2_profile": "latency"}, 1),
    ("types-gb200", NVFP4 | {"k2_engine": "trtllm", "k2_gpu": "gb200", "k2_gpus_per_node": 4, "k2_tp": 4}, 1),
    # (k2_tls_*: real certificates of a test CA, in tests/test_tls.py)
    ("injection", {**{f"k2_{k}": v for k, v in GOOD_STRINGS.items()
                      if k not in ("bundle", "os_security_mirror") and not k.startswith("tls_")},
                   "k2_checkpoint_fetcher": "node-0",
                   "k2_runtime": "container", "k2_tp": 8, "k2_metrics": True, "k2_gpu_exporter": True}, 1),
    ("injection-debian-security-mirror", {"k2_os": "debian-12", "k2_os_mirror": GOOD_STRINGS["os_mirror"],
                                          "k2_os_security_mirror": GOOD_STRINGS["os_security_mirror"]}, 1),
    ("injection-control-source", {"k2_checkpoint_source": f"control:{CONTROL_COPY}"}, 1),
    ("topology-checkpoint-bytes-near-catalog", {"k2_checkpoint_bytes": 400_000_000_000}, 1),
    ("topology-checkpoint-bytes-other-quant", KT_FLEET | {"k2_checkpoint_bytes": 10**9}, 1),  # gguf: not the catalog's
    ("injection-slurm", SLURM_FLEET, 1),
    ("injection-kt", KT_FLEET, 1),
    ("identity", IDENTITY_TWIN, IDENTITY_TWIN_HOSTS),
    ("topology", INSTRUCT | {"k2_tp": 16}, 2),
    ("structure-trtllm", B200 | {"k2_trtllm_config": {"max_batch_size": 128, "kv_cache_config": {"free_gpu_memory_fraction": 1},
                                                      "cuda_graph_config": None,
                                                      "speculative_config": {"decoding_type": "Eagle", "max_draft_len": 3,
                                                                             "eagle3_layers_to_capture": [1, 2, -1]}}}, 1),
    ("identity-dns-names", {"k2_tp": 16, "k2_dp": 2, "k2_ep": 32},  # firewall on: its rules get the resolved IPs
     [("gpu-0", {"k2_address": None, "ssh_hostname": "gpu-0.fleet.example"}),  # by ssh_hostname
      ("gpu-1.fleet.example", {"k2_address": None, "ssh_hostname": None}),  # by the host name itself
      ("node-2", {"k2_address": "gpu-2.fleet.example", "ssh_hostname": "bastion-side.example"}),  # k2_address wins
      ("node-3", {"k2_address": "192.0.2.23"})]),
    ("secrets", SECRETS_TWIN, 1),
    ("secrets-api-key-sglang", {"k2_engine": "sglang", "k2_tp": 8, "k2_api_key_file": TOKEN_FILE}, 1),  # the API front
    ("secrets-api-key-trtllm", NVFP4 | {"k2_engine": "trtllm", "k2_gpu": "b200", "k2_api_key_file": TOKEN_FILE}, 1),
    ("secrets-api-key-kt", KT_FLEET | {"k2_api_key_file": TOKEN_FILE}, 1),
    ("structure-engine-arg-values", {"k2_engine_args": {"cudagraph-capture-sizes": [1, 2, 4], "seed": -1,
                                                        "max-logprobs": "-1", "chat-template": "/srv/t/" + "a" * 4080}}, 1),
]


GROUP_DATA_TWIN = (  # a group-data file that is a module of values: docstring, import, a call, __all__
    '"""Kimi fleet."""\nimport os\nprint(end="")\n_extra = {"NCCL_DEBUG": "INFO"}\nk2_env = dict(_extra)\n'
    '__all__ = ["k2_model", "k2_revision", "k2_engine", "k2_gpu", "k2_env", "os"]\n'
)
TWINS += [
    *TOPOLOGY_TWINS,
    *RESOURCE_TWINS,
    ("injection-invisible-free-unicode", {"k2_env": {"SITE": "Zürich – ü ✓"}, "k2_engine_args": {"chat-template": "/srv/t/ü.jinja"}}, 1),
    ("secrets-urls", {"k2_env": {"HTTPS_PROXY": "http://proxy.internal:3128", "NO_PROXY": "localhost,10.0.0.0/8",
                                 "PIP_INDEX_URL": "https://pypi.internal/simple?page=2",
                                 "HF_TOKEN_PATH": "/etc/k2fleet/hf-token", "TOKENIZERS_PARALLELISM": "false"},
                      "k2_hub_endpoint": "http://127.0.0.1:8080", "k2_hub_token_file": TOKEN_FILE}, 1),
    ("structure-group-data", {}, 1),
]


@pytest.mark.parametrize("twin", TWINS, ids=[t[0] for t in TWINS])
def test_the_good_twin_of_each_family_passes(tmp_path: Path, twin) -> None:
    name, data, hosts = twin
    try:
        _valid(tmp_path, data, hosts, group_py=GROUP_DATA_TWIN if name == "structure-group-data" else "")
    except SpecError as exc:
        pytest.fail(f"valid twin {name} refused: {exc}")


def test_a_valid_twin_reaches_the_listener_through_pyinfra(tmp_path: Path) -> None:
    """The listener works: a valid inventory passes the gate and pyinfra connects to it."""
    listener = Listener()
    try:
        inv = inventory(tmp_path, 2, INSTRUCT | {"k2_tp": 16}, listener.port)
        for entry in ("validate", "plan"):
            result = run(entry_argv(entry, inv, ()))
            assert result.returncode == 0, result.stderr
        result = run(entry_argv("pyinfra", inv, ()))
        # the gate let it through (no refusal line); paramiko then logs the listener's non-SSH reply
        assert not [line for line in result.stderr.splitlines() if line.startswith("error:")], result.stderr
        assert "Connecting to hosts" in result.stdout + result.stderr, result.stderr
    finally:
        listener.close()
    assert listener.count > 0, result.stderr


def test_duplicate_host_names_are_refused() -> None:
    """The fleet builder refuses a name twice for any caller (a pyinfra inventory that lists
    one twice is caught by the repeated group, identity:host-name-listed-twice)."""
    data = {"k2_model": "moonshotai/Kimi-K2-Thinking", "k2_revision": THINKING_SHA, "k2_engine": "vllm", "k2_gpu": "h200"}
    a = parse_host("node-0", data | {"k2_address": "192.0.2.1"}, "inv")
    b = parse_host("node-0", data | {"k2_address": "192.0.2.2"}, "inv")
    with pytest.raises(SpecError, match="listed twice"):
        build_fleet("inv", [a, b])
    c = HostEntry(name="bad\nname", settings=a.settings)
    with pytest.raises(SpecError, match="host name"):
        build_fleet("inv", [c])


def test_a_host_in_two_groups_is_one_host_not_a_duplicate(tmp_path: Path) -> None:
    """Listed twice in one group is refused (identity:host-name-listed-twice); named in two
    groups is pyinfra's group membership and stays one host."""
    inv = inventory(tmp_path, [("node-0", {})], {}, 22)
    inv.write_text(inv.read_text() + "heads = ['node-0']\n")
    dep, _ = load_plan(inv)
    assert [h.name for h in dep.fleet.hosts] == ["node-0"]
    # its host data in both groups, agreeing, and two groups whose data agree, or that the host's
    # own data decides: one host, no conflict
    inv = inventory(tmp_path / "agree", [("node-0", {"k2_nic": "eth0"})], {}, 22)
    inv.write_text(inv.read_text() + "heads = [('node-0', {'k2_nic': 'eth0', 'k2_ib_hcas': ['mlx5_0']})]\n"
                   "a = (['node-0'], {'k2_health_timeout': 90})\nb = (['node-0'], {'k2_health_timeout': 90})\n"
                   "c = (['node-0'], {'k2_nic': 'eth1'})\n")
    dep, _ = load_plan(inv)
    (host,) = dep.fleet.hosts
    assert (host.settings.nic, host.settings.ib_hcas, host.settings.health_timeout) == ("eth0", ["mlx5_0"], 90)


def test_every_string_key_has_an_injection_case() -> None:
    injected = {c.key for c in INJECTION if c.id.startswith("newline-in-k2_")}
    assert injected == {f"k2_{k}" for k in STRING_KEYS}
    assert len(STRING_KEYS) >= 20


@pytest.mark.parametrize("entry", ["validate", "plan"])
def test_a_group_data_file_that_raises_is_one_line_naming_it(tmp_path: Path, entry: str) -> None:
    inv = write_inventory(tmp_path, hosts=1)
    group_data = sorted((tmp_path / "group_data").glob("*.py"))[0]
    group_data.write_text(group_data.read_text() + '\nraise RuntimeError("boom in group data")\n')
    out = subprocess.run([sys.executable, "-m", "k2fleet.cli", entry, str(inv)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert f"{group_data} raised RuntimeError: boom in group data" in line
