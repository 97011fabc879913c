"""Issue #24, rolling changes on the sandbox: two vLLM replicas (``inventories/sandbox.py`` on
two hosts, one TP8 replica each) behind k2fleet's HAProxy load balancer (``k2_load_balancer``);
a flag change rolls one replica at a time — drained at the load balancer, restarted, health
gated, put back — while a client loop through the load balancer sends chat completions, and
not one of them fails (counted). A re-run changes nothing.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request

import pytest

from k2sandbox.harness import SandboxFleet, main_pid

pytestmark = pytest.mark.sandbox
SANDBOX_HOSTS = 2
SANDBOX_DOCKER = False
LB_PORT = 8080


class ClientLoop(threading.Thread):
    """Chat completions through the load balancer, one after another, until stopped; each
    answered 200 with a non-empty answer counts as ok, anything else as failed."""

    def __init__(self, base: str, model: str) -> None:
        super().__init__(daemon=True)
        self.base, self.model = base, model
        self.ok, self.failed, self.errors = 0, 0, []
        self.stop = threading.Event()

    def run(self) -> None:
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": "Hi"}],
                           "max_tokens": 8}).encode()
        while not self.stop.is_set():
            request = urllib.request.Request(f"{self.base}/chat/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=30) as answer:
                    text = json.load(answer)["choices"][0]["message"]["content"]
                if text.strip():
                    self.ok += 1
                else:
                    self.failed += 1
                    self.errors.append("empty answer")
            except Exception as exc:  # noqa: BLE001 - every failure is counted
                self.failed += 1
                self.errors.append(repr(exc)[:200])
            time.sleep(0.05)

    def answered(self, more: int = 2, within: float = 60) -> None:
        """Wait until ``more`` further requests have been answered ok (the loop is serving
        before a deploy, and again after it); fail after ``within`` seconds."""
        target, deadline = self.ok + more, time.monotonic() + within
        while self.ok < target:
            assert time.monotonic() < deadline and self.is_alive(), (self.ok, self.failed, self.errors[:5])
            time.sleep(0.05)


def test_a_flag_change_rolls_one_replica_at_a_time_and_no_request_fails(sandbox_fleet: SandboxFleet) -> None:
    fleet = sandbox_fleet
    head = fleet.hosts[0]
    data = {"k2_load_balancer": head["name"]}
    first = fleet.deploy(data)
    assert first.returncode == 0, first.tail()
    base = f"http://{head['address']}:{LB_PORT}/v1"
    assert f" at {base} (plain HTTP)\n" in first.log and f"k2fleet: try: curl -s {base}/chat/completions" in first.log, first.tail()
    with urllib.request.urlopen(f"{base}/models", timeout=30) as answer:
        model = json.load(answer)["data"][0]["id"]
    before = {h["name"]: main_pid(h, "k2-vllm.service") for h in fleet.hosts}
    loop = ClientLoop(base, model)
    loop.start()
    loop.answered()
    try:
        changed = fleet.deploy({**data, "k2_engine_args": {"max-num-seqs": 64}})
    finally:
        try:
            loop.answered()  # it serves after the change too
        finally:
            loop.stop.set()
            loop.join(60)
    assert changed.returncode == 0, changed.tail()
    after = {h["name"]: main_pid(h, "k2-vllm.service") for h in fleet.hosts}
    assert all(after[n] != before[n] and after[n] > 0 for n in before), (before, after)  # both replicas restarted
    # one replica at a time: every op of step 1 (drain ... put back) starts before step 2's first
    steps = [int(m.group(1)) for m in re.finditer(r"Starting (?:\w+ )?operation: k2fleet: [^\n]*rolling (\d)/2",
                                                  changed.log)]
    assert steps and steps == sorted(steps) and set(steps) == {1, 2}, steps
    print(f"rolling change through the load balancer: {loop.ok} requests ok, {loop.failed} failed; steps {steps}")
    assert loop.ok >= 10, (loop.ok, loop.failed)
    assert loop.failed == 0, (loop.failed, loop.errors[:5])
    again = fleet.deploy({**data, "k2_engine_args": {"max-num-seqs": 64}})
    assert again.returncode == 0 and again.changed == 0, again.changed_operations or again.tail()
