"""Issue #36 item 1 on the sandbox: upgrades with no failed request. Two vLLM replicas
(``inventories/sandbox.py`` on two hosts, engine TEST DOUBLES) behind k2fleet's HAProxy load
balancer (``k2_load_balancer``), a client loop through it during each change, every request
counted:

1. a ``k2_revision`` change: the new revision (a second synthetic checkpoint: same layout,
   other bytes) is fetched and verified beside the old one while the old serves, then the
   replicas roll one at a time onto it — 0 failed requests;
2. a ``k2_engine_version`` change: the new release's venv (``k2_venv/vllm-<version>``) is
   installed beside the old one, then the roll only switches — 0 failed requests;
3. back to the previous revision: re-pinned from the copy each host kept — 0 failed
   requests and not one byte received by any host's relay (the hosts' own transfer logs)
   or sent by the control machine (its transfer log);
4. ``k2_keep_revisions: 1``: the revision and the venv no longer pinned are removed, nothing
   restarts; a re-run changes nothing.

One booted fleet, in sequence (each step starts from the last one's state).
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest

from k2sandbox.checkpoint_cache import SANDBOX_MODEL, SANDBOX_REVISION, ensure_sandbox_checkpoint
from k2sandbox.harness import SandboxFleet, main_pid, ssh
from k2fleet.planning.relay_plan import HOST_LOG
from tests.test_rolling_sandbox import ClientLoop

pytestmark = pytest.mark.sandbox
SANDBOX_HOSTS = 2
SANDBOX_DOCKER = False
LB_PORT = 8080
NEW_REVISION = "7e57c0de0000000000000000000000000000a2b2"  # the synthetic checkpoint's second revision
OLD_ENGINE, NEW_ENGINE = "0.33.0", "0.10.0"  # the catalog's default vLLM pin, and another it supports
# 0.10.0 is a CUDA 12.6 build, which would pick the 570 driver branch: the fleet keeps the 580 the
# default pin chose (a newer driver serves an older CUDA build), so the change is the engine alone
SAME_DRIVER = {"k2_driver_branch": 580}
MODELS = f"/srv/k2fleet/models/{SANDBOX_MODEL.replace('/', '--')}"
UNIT = "k2-vllm.service"


def received_bytes(fleet: SandboxFleet) -> dict[str, int]:
    """Bytes each host's relay received, summed over its transfer log (one JSON line per fetch)."""
    out = {}
    for h in fleet.hosts:
        text = ssh(h, f"cat {HOST_LOG} 2>/dev/null || true").stdout
        out[h["name"]] = sum(json.loads(line)["bytes"] for line in text.splitlines() if line.strip())
    return out


def control_records(fleet: SandboxFleet) -> list[dict]:
    """The control machine's checkpoint transfer records (every deployment's, this module's state dir)."""
    logs = sorted(Path(fleet.env["K2FLEET_STATE_DIR"]).glob("*/checkpoint-transfers.jsonl"))
    return [json.loads(line) for p in logs for line in p.read_text().splitlines() if line.strip()]


def exec_start(host: dict) -> str:
    return ssh(host, f"systemctl show -p ExecStart --value {UNIT}").stdout


def driver_package(host: dict) -> str:
    """The installed NVIDIA driver package (the TEST DOUBLE repository's) and its version."""
    return ssh(host, "dpkg-query -W -f '${Package} ${Version}\\n' 'nvidia-open*'").stdout


def listing(host: dict, path: str) -> list[str]:
    return sorted(ssh(host, f"ls -A {path}").stdout.split())


def roll(fleet: SandboxFleet, data: dict, base: str, model: str):
    """Deploy ``data`` with the client loop running through the load balancer; (result, loop,
    MainPIDs before, after)."""
    before = {h["name"]: main_pid(h, UNIT) for h in fleet.hosts}
    loop = ClientLoop(base, model)
    loop.start()
    loop.answered()
    try:
        result = fleet.deploy(data)
    finally:
        try:
            loop.answered()  # it serves after the change too
        finally:
            loop.stop.set()
            loop.join(60)
    after = {h["name"]: main_pid(h, UNIT) for h in fleet.hosts}
    return result, loop, before, after


def first(log: str, pattern: str) -> int:
    found = re.search(pattern, log)
    assert found, pattern
    return found.start()


def rolled_one_at_a_time(log: str) -> None:
    steps = [int(m.group(1)) for m in re.finditer(r"Starting (?:\w+ )?operation: k2fleet: [^\n]*rolling (\d)/2", log)]
    assert steps and steps == sorted(steps) and set(steps) == {1, 2}, steps


def test_revision_and_engine_changes_roll_with_no_failed_request_and_going_back_downloads_nothing(
        sandbox_fleet: SandboxFleet) -> None:
    fleet = sandbox_fleet
    head = fleet.hosts[0]
    new_source = f"control:{ensure_sandbox_checkpoint(NEW_REVISION)}"
    lb = {"k2_load_balancer": head["name"]}
    first_deploy = fleet.deploy(lb)
    assert first_deploy.returncode == 0, first_deploy.tail()
    base = f"http://{head['address']}:{LB_PORT}/v1"
    with urllib.request.urlopen(f"{base}/models", timeout=30) as answer:
        model = json.load(answer)["data"][0]["id"]
    figures = {}

    # 1. the revision: fetched and verified beside the old one, then rolled onto
    got_before = received_bytes(fleet)
    new_rev = {**lb, "k2_revision": NEW_REVISION, "k2_checkpoint_source": new_source}
    result, loop, before, after = roll(fleet, new_rev, base, model)
    assert result.returncode == 0, result.tail()
    figures["revision"] = (loop.ok, loop.failed)
    assert all(after[n] != before[n] and after[n] > 0 for n in before), (before, after)
    rolled_one_at_a_time(result.log)
    # every file of the new revision checked on every host before the first replica was drained
    assert first(result.log, r"operation: k2fleet: checkpoint[^\n]*check every file") < \
        first(result.log, r"operation: k2fleet: [^\n]*rolling 1/2")
    got = received_bytes(fleet)
    for h in fleet.hosts:
        assert got[h["name"]] > got_before[h["name"]], (got_before, got)  # the new revision travelled
        assert f"{MODELS}/{NEW_REVISION} " in exec_start(h)
        assert listing(h, MODELS) == sorted([".k2fleet-served", NEW_REVISION, SANDBOX_REVISION])  # the old one kept
    assert loop.ok >= 10 and loop.failed == 0, (loop.ok, loop.failed, loop.errors[:5])

    # 2. the engine release: its venv installed beside the serving one, then the roll switches
    new_engine = {**new_rev, "k2_engine_version": NEW_ENGINE, **SAME_DRIVER}
    drivers = {h["name"]: driver_package(h) for h in fleet.hosts}
    result, loop, before, after = roll(fleet, new_engine, base, model)
    assert result.returncode == 0, result.tail()
    figures["engine"] = (loop.ok, loop.failed)
    assert all(after[n] != before[n] and after[n] > 0 for n in before), (before, after)
    rolled_one_at_a_time(result.log)
    assert first(result.log, r"operation: k2fleet: engine runtime") < first(result.log, r"operation: k2fleet: [^\n]*rolling 1/2")
    assert {h["name"]: driver_package(h) for h in fleet.hosts} == drivers  # the driver stayed as it was
    for h in fleet.hosts:
        assert f"/opt/k2fleet/venv/vllm-{NEW_ENGINE}/bin/vllm " in exec_start(h)
        assert listing(h, "/opt/k2fleet/venv") == sorted([".k2fleet-served", f"vllm-{OLD_ENGINE}", f"vllm-{NEW_ENGINE}"])
    assert loop.ok >= 10 and loop.failed == 0, (loop.ok, loop.failed, loop.errors[:5])

    # 3. back to the previous revision: re-pinned from each host's kept copy, nothing downloaded
    got_before, sent_before = received_bytes(fleet), control_records(fleet)
    back = {**lb, "k2_engine_version": NEW_ENGINE, **SAME_DRIVER}
    result, loop, before, after = roll(fleet, back, base, model)
    assert result.returncode == 0, result.tail()
    got, sent = received_bytes(fleet), control_records(fleet)
    figures["back"] = (loop.ok, loop.failed, sum(got.values()) - sum(got_before.values()), len(sent) - len(sent_before))
    assert all(after[n] != before[n] and after[n] > 0 for n in before), (before, after)
    rolled_one_at_a_time(result.log)
    assert got == got_before and sent == sent_before, (got_before, got, sent[len(sent_before):])
    for h in fleet.hosts:
        assert f"{MODELS}/{SANDBOX_REVISION} " in exec_start(h)
        assert listing(h, MODELS) == sorted([".k2fleet-served", NEW_REVISION, SANDBOX_REVISION])
    assert loop.ok >= 10 and loop.failed == 0, (loop.ok, loop.failed, loop.errors[:5])

    # 4. keep one: what is no longer pinned goes, nothing restarts; then the fleet is settled
    keep_one = {**back, "k2_keep_revisions": 1}
    before = {h["name"]: main_pid(h, UNIT) for h in fleet.hosts}
    result = fleet.deploy(keep_one)
    assert result.returncode == 0, result.tail()
    assert {h["name"]: main_pid(h, UNIT) for h in fleet.hosts} == before
    for h in fleet.hosts:
        assert listing(h, MODELS) == sorted([".k2fleet-served", SANDBOX_REVISION])
        assert listing(h, "/opt/k2fleet/venv") == sorted([".k2fleet-served", f"vllm-{NEW_ENGINE}"])
    again = fleet.deploy(keep_one)
    assert again.returncode == 0 and again.changed == 0, again.changed_operations or again.tail()
    print(f"upgrade rolls through the load balancer: revision {figures['revision'][0]} ok / {figures['revision'][1]} "
          f"failed; engine {figures['engine'][0]} ok / {figures['engine'][1]} failed; back to the previous revision "
          f"{figures['back'][0]} ok / {figures['back'][1]} failed, {figures['back'][2]} bytes received by the hosts, "
          f"{figures['back'][3]} control-machine transfers")
