"""Every validation rule: a bad inventory fails `k2fleet validate` with one clear message
naming the key, and no host is contacted (a listener stands in for the hosts' sshd)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.inventory_factory import write_inventory

INSTRUCT = {"k2_model": "moonshotai/Kimi-K2-Instruct", "k2_revision": "fd1984e2b7a3350dbf7305fe73a4ede25c14de50"}
NVFP4 = {"k2_model": "nvidia/Kimi-K2-Thinking-NVFP4", "k2_revision": "1" * 40}

# (id, hosts, data, key named in the error, words the message must contain)
CASES: list[tuple[str, int | list, dict[str, Any], str, str]] = [
    ("sizes-not-gpus", 1, {"k2_tp": 6}, "k2_tp", "multiply to 6 GPUs but each node has 8"),
    ("sizes-not-whole-nodes", 2, {"k2_tp": 12}, "k2_tp", "not a whole number"),
    ("dcp-not-dividing-tp", 1, {"k2_tp": 8, "k2_dcp": 3}, "k2_dcp", "does not divide k2_tp=8"),
    ("vllm-dp-with-pp", 1, {"k2_tp": 2, "k2_pp": 2, "k2_dp": 2}, "k2_pp", "cannot be combined"),
    ("headless-hybrid-lb", 2, INSTRUCT | {"k2_tp": 1, "k2_dp": 16, "k2_ep": 16,
                                          "k2_engine_args": {"data-parallel-hybrid-lb": True}},
     "k2_engine_args", "headless"),
    ("too-few-nodes", 1, {"k2_tp": 16}, "inventory", "needs 2 nodes"),
    ("hosts-not-instances", 3, {"k2_tp": 16}, "inventory", "multiple of 2"),
    ("nvfp4-on-hopper", 1, NVFP4 | {"k2_engine": "trtllm", "k2_gpu": "h200"}, "k2_gpu", "Blackwell"),
    ("rocm-on-nvidia", 1, {"k2_platform": "rocm"}, "k2_platform", "ROCm engine cannot run on NVIDIA"),
    ("rocm-image-on-nvidia", 1, {"k2_runtime": "container", "k2_image": "vllm/vllm-openai-rocm:v0.33.0"},
     "k2_image", "ROCm image"),
    ("weights-do-not-fit", 1, INSTRUCT | {"k2_tp": 8}, "k2_tp", "spread the weights over at least 16 GPUs"),
    ("port-clash", 1, {"k2_port": 2233}, "k2_port", "also used by k2_mesh_port"),
    ("ray-port-clash", 2, INSTRUCT | {"k2_gpu": "h800", "k2_tp": 8, "k2_pp": 2, "k2_multinode_backend": "ray",
                                      "k2_ray_port": 8000}, "k2_port", "also used by k2_ray_port"),
    ("pd-without-router", [("p0", {"k2_role": "prefill"}), ("d0", {"k2_role": "decode"})],
     {"k2_engine": "sglang", "k2_tp": 8}, "k2_role", "router"),
    ("pd-without-decode", [("p0", {"k2_role": "prefill"}), ("r0", {"k2_role": "router"})],
     {"k2_engine": "sglang", "k2_tp": 8}, "k2_role", "decode"),
    ("unknown-engine", 1, {"k2_engine": "tgi"}, "k2_engine", "vllm"),
    ("unknown-version", 1, {"k2_engine_version": "0.1.0"}, "k2_engine_version", "supported pins"),
    ("missing-revision", 1, {"k2_revision": None}, "k2_revision", "required"),
    ("branch-revision", 1, {"k2_revision": "main"}, "k2_revision", "not a pinned commit"),
    ("typo-key", 1, {"k2_tpp": 8}, "k2_tpp", "did you mean k2_tp"),
    ("simulated-gpus-in-production", 1, {"k2_simulated_gpus": True}, "k2_simulated_gpus", "sandbox"),
    ("fleet-key-differs", [("a", {"k2_port": 8000}), ("b", {"k2_port": 8001})], {}, "k2_port", "same on every host"),
    ("unknown-gpu", 1, {"k2_gpu": "rtx4090"}, "k2_gpu", "unknown GPU type"),
    ("bad-checkpoint-source", 1, {"k2_checkpoint_source": "s3://bucket/k2"}, "k2_checkpoint_source", "neither `hub`"),
    ("fetcher-not-a-host", 1, {"k2_checkpoint_fetcher": "stager"}, "k2_checkpoint_fetcher", "neither `control` nor a host"),
    ("fetcher-without-hub", 1, {"k2_checkpoint_fetcher": "node-0", "k2_checkpoint_source": "control:/srv/k2"},
     "k2_checkpoint_fetcher", "downloads from the Hub"),
    ("fetcher-is-router", [("p0", {"k2_role": "prefill"}), ("d0", {"k2_role": "decode"}), ("r0", {"k2_role": "router"})],
     {"k2_engine": "sglang", "k2_tp": 8, "k2_checkpoint_fetcher": "r0"}, "k2_checkpoint_fetcher", "holds no checkpoint"),
    ("vllm-ep-size", 1, {"k2_tp": 8, "k2_ep": 4}, "k2_ep", "tp×dp = 8"),
]


@pytest.fixture
def fake_sshd():
    """A listening socket where the hosts' sshd would be: any connection is recorded."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    yield sock
    sock.close()


def accepted(sock: socket.socket) -> int:
    count = 0
    while True:
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            return count
        conn.close()
        count += 1


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_inventory_is_refused_before_any_host_is_touched(tmp_path: Path, fake_sshd, case) -> None:
    _, hosts, data, key, words = case
    port = fake_sshd.getsockname()[1]
    if isinstance(hosts, int):
        hosts = [(f"node-{i}", {}) for i in range(hosts)]
    hosts = [(name, {"ssh_hostname": "127.0.0.1", "ssh_port": port} | extra) for name, extra in hosts]
    inv = write_inventory(tmp_path, hosts=hosts, **data)
    result = subprocess.run([sys.executable, "-m", "k2fleet.cli", "validate", str(inv)],
                            capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {inv}: {key}: "), lines[0]
    assert words in lines[0], lines[0]
    assert result.stdout == ""
    assert accepted(fake_sshd) == 0


def test_the_good_twin_of_a_bad_case_passes(tmp_path: Path) -> None:
    """Guard against rules that refuse everything: fixing the key makes it valid."""
    inv = write_inventory(tmp_path, hosts=2, **INSTRUCT, k2_tp=16)
    result = subprocess.run([sys.executable, "-m", "k2fleet.cli", "validate", str(inv)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok: ")
