"""Checkpoint fetched once per fleet, relayed host to host shard by shard (each verified
before it is passed on), repaired file by file.

Unit tests: the fan-out plan, the control-side cache against the Hub TEST DOUBLE
(k2sandbox/hub_double.py, loopback only); the relay itself is tested in
tests/test_relay.py.

Sandbox tests (``@pytest.mark.sandbox``): the real 3-host sandbox fleet (the ``fleet``
fixture of tests/conftest.py), the real CLI on the ``hub`` source through pyinfra's
``--data`` (the double on 127.0.0.1: only the control machine downloads)::

    pyinfra -y --json --data k2_checkpoint_source=hub --data k2_hub_endpoint=http://127.0.0.1:PORT \
        --data k2_checkpoint_cache=DIR inventories/sandbox.py deploys/kimi.py

plus ``--data k2_shared_storage=true --data k2_model_dir=/mnt/k2shared/models`` (shared
storage) or ``--data k2_checkpoint_fetcher=k2sb-2`` with the double on the bridge
address (a host downloads).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest

from k2fleet.control import checkpoint_copy as fanout
from k2fleet.planning import relay_plan
from k2fleet.hostprogs.verify import load_manifest
from k2sandbox.synthetic_checkpoint import describe_dir, make_checkpoint, shard_name
from k2sandbox.harness import SandboxFleet, data_args, http_json, ssh, start_deploy, tool
from k2sandbox import nspawn as sandbox
from k2sandbox.hub_double import HubDouble

REPO_ROOT = Path(__file__).resolve().parents[1]

VERIFY_PY = str(REPO_ROOT / "k2fleet" / "hostprogs" / "verify.py")
REPO = "k2fleet-test/Kimi-K2-Thinking-synthetic"
SECRET = "hf_k2fleet_sandbox_secret_token"


def shard(i: int) -> str:
    return shard_name(i, 62)


# --------------------------------------------------------------------------- planning


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 13, 64])
def test_fanout_plan_one_control_transfer_parents_before_children(n: int) -> None:
    hosts = [f"h{i}" for i in range(1, n + 1)]
    plan = relay_plan.plan_fanout(hosts)
    assert plan.root == "h1" and plan.parents["h1"] is None
    assert plan.control_transfers() == 1
    assert sorted(h for r in plan.rounds for h in r) == sorted(hosts)  # everyone exactly once
    assert len(plan.rounds) == 1 + math.ceil(math.log2(n))
    for h in hosts[1:]:
        parent = plan.parents[h]
        assert parent in hosts and plan.round_of(parent) < plan.round_of(h)
    # a source serves at most one peer per round
    for r in plan.rounds:
        sources = [plan.parents[h] for h in r]
        assert len(sources) == len(set(sources))


def test_fanout_plan_shared_storage_only_root_fetches() -> None:
    plan = relay_plan.plan_fanout(["a", "b", "c"], shared_storage=True)
    assert plan.rounds == (("a",),)
    assert plan.round_of("b") is None and plan.round_of("a") == 0
    assert relay_plan.plan_fanout([]).root is None


def flip_bit_keep_stat(path: Path, offset: int = 4096) -> None:
    ref = path.with_name(path.name + ".ref")
    shutil.copy2(path, ref)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))
    subprocess.run(["touch", "-r", str(ref), str(path)], check=True)
    ref.unlink()


# --------------------------------------------------------------------------- control-side cache (Hub double)


@pytest.fixture
def hf_isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)


def get_counts(hub: HubDouble) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in hub.requests:
        if r.method == "GET" and r.rfilename is not None and r.sent:
            counts[r.rfilename] = counts.get(r.rfilename, 0) + 1
    return counts


def test_control_cache_downloads_once_then_repairs_one_file(tmp_path: Path, hf_isolated: None) -> None:
    src = tmp_path / "served"
    make_checkpoint(src, num_shards=62, shard_bytes=8192)
    token_file = tmp_path / "token"
    token_file.write_text("hf_test_secret_token\n")
    with HubDouble() as hub:
        sha = hub.add_commit(REPO, src)
        root = relay_plan.control_dir(str(tmp_path / "cache"), REPO, sha)
        first = fanout.ensure_control_copy(REPO, sha, root, hub=True, endpoint=hub.url, token_file=str(token_file))
        assert first["action"] == "download"
        files = {f.path for f in describe_dir(src)}
        assert get_counts(hub) == {f: 1 for f in files}  # every file fetched exactly once
        assert all(r.authorization == "Bearer hf_test_secret_token" for r in hub.requests if r.rfilename)
        hub.reset_counters()
        assert fanout.ensure_control_copy(REPO, sha, root, hub=True, endpoint=hub.url)["action"] == "none"
        assert hub.requests == []  # a verified cache asks the Hub nothing
        flip_bit_keep_stat(Path(root) / shard(3))
        fixed = fanout.ensure_control_copy(REPO, sha, root, hub=True, endpoint=hub.url, token_file=str(token_file))
        assert fixed["action"] == "repair" and get_counts(hub) == {shard(3): 1}
    with pytest.raises(RuntimeError, match="no .k2fleet/manifest.json"):
        fanout.ensure_control_copy(REPO, sha, str(tmp_path / "empty"), hub=False)


# --------------------------------------------------------------------------- the real sandbox fleet


CONTROL_RELAY = "http://127.0.0.1:29700"  # the control machine's copy, as hosts reach it (k2_relay_port)


def relay_url(host: dict[str, Any]) -> str:
    return f"http://{host['address']}:29700"


def _bridge_tx() -> int:
    """Bytes the control machine sent into the sandbox bridge (its own IP stack only:
    frames forwarded host-to-host by the bridge are not counted on the bridge device)."""
    return int(Path(f"/sys/class/net/{sandbox.BRIDGE}/statistics/tx_bytes").read_text())


@dataclasses.dataclass
class Fleet:
    """The sandbox fleet on the Hub source: the double on loopback, the control cache."""

    sandbox: SandboxFleet
    hub: HubDouble
    data: dict[str, Any]  # the --data putting inventories/sandbox.py on the hub source
    state: Path
    cache: Path
    served: Path
    size: int

    @property
    def hosts(self) -> list[dict[str, Any]]:
        return self.sandbox.hosts

    def deploy(self, **data: Any):
        """``pyinfra -y --json`` + this fleet's --data (+ ``data``) inventories/sandbox.py deploys/kimi.py."""
        return self.sandbox.deploy(self.data | data)

    def ensure_deployed(self) -> None:
        """Deployed from the Hub double through the control cache (no other --data)."""
        self.sandbox.ensure_deployed(self.data)

    def control_log(self, step: str = "relay") -> list[dict[str, Any]]:
        """Records of the control machine's steps: ``relay`` (a host's relay fetch, its
        report), ``control-copy``."""
        lines = [line for f in sorted(self.state.glob("*/checkpoint-transfers.jsonl")) for line in f.read_text().splitlines()]
        return [r for r in map(json.loads, lines) if r.get("step") == step]

    def relays(self, since: int) -> dict[str, dict[str, Any]]:
        """Host address → its relay report, of the records after the first ``since``."""
        return {r["target"].split("@")[1]: r for r in self.control_log()[since:]}

    def host_log(self, host: dict[str, Any]) -> list[dict[str, Any]]:
        out = ssh(host, f"cat {relay_plan.HOST_LOG} 2>/dev/null || true").stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]


@dataclasses.dataclass
class HubSource:
    hub: HubDouble
    served: Path  # the sandbox checkpoint the double serves
    cache: Path  # the module's control cache (k2_checkpoint_cache)


@pytest.fixture(scope="module")
def hub_source(sandbox_fleet: SandboxFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubSource]:
    """The Hub double on loopback serving the sandbox checkpoint; the module's fleet gets
    the HF_* environment of the Hub source (the token only ever in the environment)."""
    from k2sandbox.checkpoint_cache import SANDBOX_MODEL, SANDBOX_REVISION, ensure_sandbox_checkpoint

    served = ensure_sandbox_checkpoint()
    sandbox_fleet.env |= {
        "HF_HOME": str(tmp_path_factory.mktemp("hf_home")),
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_TOKEN": SECRET,  # read by the download process from its environment only
    }
    with HubDouble() as hub:
        assert hub.add_commit(SANDBOX_MODEL, served, sha=SANDBOX_REVISION) == SANDBOX_REVISION
        yield HubSource(hub, served, tmp_path_factory.mktemp("k2cache"))


@pytest.fixture
def hubfleet(fleet: SandboxFleet, hub_source: HubSource) -> Fleet:
    """The sandbox fleet, up, with the --data of the Hub source (nothing deployed by it)."""
    size = sum(e["size"] for e in load_manifest(str(hub_source.served / ".k2fleet" / "manifest.json"))["files"].values())
    data = {"k2_checkpoint_source": "hub", "k2_hub_endpoint": hub_source.hub.url,
            "k2_checkpoint_cache": str(hub_source.cache)}
    return Fleet(fleet, hub_source.hub, data, Path(fleet.env["K2FLEET_STATE_DIR"]), hub_source.cache,
                 hub_source.served, size)


@pytest.fixture
def hub_deployed(hubfleet: Fleet) -> Fleet:
    """The fleet deployed from the Hub double through the control cache."""
    hubfleet.ensure_deployed()
    return hubfleet


def _healthy(fleet: Fleet, model_dir: str = "/srv/k2fleet/models") -> None:
    for host in fleet.hosts:
        status, _ = http_json(f"http://{host['address']}:8000/health")
        assert status == 200, host["name"]
        status, models = http_json(f"http://{host['address']}:8000/v1/models")
        body = {"model": models["data"][0]["id"], "messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 16}
        status, answer = http_json(f"http://{host['address']}:8000/v1/chat/completions", body)
        assert status == 200 and answer["choices"][0]["message"]["content"].strip(), answer
        gate = ssh(host, f"python3 /opt/k2fleet/lib/k2fleet-host.pyz verify {model_dir}/*/*/", check=False)
        assert gate.returncode == 0, gate.stdout + gate.stderr


def _inodes(host: dict[str, Any]) -> dict[str, int]:
    out = ssh(host, "cd /srv/k2fleet/models/*/*/ && stat -c '%i %n' *").stdout
    return {name: int(ino) for ino, name in (line.split(" ", 1) for line in out.splitlines())}


def manifest_revision(fleet: Fleet) -> str:
    return load_manifest(str(fleet.served / ".k2fleet" / "manifest.json"))["revision"]


def _kill_control_download_midway(fleet: Fleet, victim: str, cut: int) -> None:
    """Start the deploy, let the control machine's Hub download stall ``cut`` bytes into
    ``victim`` once every other file is in, then SIGKILL pyinfra's whole process group."""
    import signal
    import time

    files = set(load_manifest(str(fleet.served / ".k2fleet" / "manifest.json"))["files"]) - {victim}
    root = Path(relay_plan.control_dir(str(fleet.cache), REPO, manifest_revision(fleet)))
    stalled = fleet.hub.stall_next(victim, after_bytes=cut)
    fleet.sandbox.forget()  # a killed deploy leaves the hosts in no known state
    proc = start_deploy(fleet.data, env=fleet.sandbox.env)
    try:
        assert stalled.wait(600), "the deploy never reached the Hub download"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done = {rel for rel in files if (root / rel).is_file()}
            part = sum(p.stat().st_size for p in (root / ".k2fleet" / "partial").glob(f"{victim}.*.part"))
            if done == files and part == cut:
                break
            time.sleep(0.05)
        assert done == files and part == cut, (len(done), len(files), part)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        fleet.hub.release()
    assert not (root / victim).exists()


@pytest.mark.sandbox
def test_hub_deploy_killed_midway_resumes_then_fans_out_over_the_mesh(hubfleet: Fleet) -> None:
    fleet = hubfleet
    fleet.sandbox.ensure_bare()  # nothing on the hosts
    for entry in fleet.cache.iterdir():  # nothing in the control cache
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    n_push, n_copy = len(fleet.control_log()), len(fleet.control_log("control-copy"))
    victim, cut = shard(17), 40_000
    manifest = load_manifest(str(fleet.served / ".k2fleet" / "manifest.json"))
    fleet.hub.reset_counters()
    _kill_control_download_midway(fleet, victim, cut)
    result = fleet.deploy()
    assert result.returncode == 0, result.tail()
    _healthy(fleet)
    files = set(manifest["files"])
    # across the killed run and the re-run, the double served every file's bytes exactly once
    assert dict(fleet.hub.bytes_served) == {f: manifest["files"][f]["size"] for f in files}
    assert [(g.range, g.status) for g in fleet.hub.requests_for(victim, "GET")] == [(None, 200), (f"bytes={cut}-", 206)]
    assert get_counts(fleet.hub) == {f: 1 for f in files} | {victim: 2}
    # the token reached the Hub and nothing else: not the output, the plan, the transfer logs
    assert {r.authorization for r in fleet.hub.requests} == {f"Bearer {SECRET}"}
    assert SECRET not in result.output
    assert not any(SECRET in f.read_text() for f in fleet.state.rglob("*.jsonl"))
    plan = subprocess.run([tool("k2fleet"), "plan", "inventories/sandbox.py", "--json", *data_args(fleet.data)],
                          cwd=REPO_ROOT, env=os.environ | fleet.sandbox.env, capture_output=True, text=True)
    assert plan.returncode == 0 and SECRET not in plan.stdout + plan.stderr, plan.stderr
    relays = fleet.relays(n_push)
    assert set(relays) == {h["address"] for h in fleet.hosts}
    # the root's whole copy came from the control machine's (through its SSH connection),
    # each other host's from the host before it in the chain, shard by shard
    assert relays[fleet.hosts[0]["address"]]["bytes_from"] == {CONTROL_RELAY: fleet.size}
    for parent, host in zip(fleet.hosts, fleet.hosts[1:]):
        assert relays[host["address"]]["bytes_from"] == {relay_url(parent): fleet.size}, host["name"]
    for host in fleet.hosts:
        (report,) = fleet.host_log(host)
        assert report["bad_shards"] == [] and report["kept"] == 0 and report["verified"]
    # the killed run logged nothing; the re-run found the manifest and every file but the
    # victim verified, and fetched the victim alone (resuming its partial file)
    assert [r["action"] for r in fleet.control_log("control-copy")[n_copy:]] == ["repair"]


@pytest.mark.sandbox
def test_second_deploy_resends_nothing(hub_deployed: Fleet) -> None:
    fleet = hub_deployed
    fleet.hub.reset_counters()
    before = (len(fleet.control_log()), [len(fleet.host_log(h)) for h in fleet.hosts])
    result = fleet.deploy()
    assert result.returncode == 0 and result.changed == 0, result.changed_operations or result.tail()
    assert fleet.hub.requests == []
    assert (len(fleet.control_log()), [len(fleet.host_log(h)) for h in fleet.hosts]) == before


@pytest.mark.sandbox
def test_damaged_files_are_the_only_ones_resent(hub_deployed: Fleet) -> None:
    fleet = hub_deployed
    h1, h2, h3 = fleet.hosts
    d = "/srv/k2fleet/models/*/*"
    inodes = {h["name"]: _inodes(h) for h in fleet.hosts}
    flip = ("python3 -c \"import sys; f=open(sys.argv[1],'r+b'); f.seek(5000); b=f.read(1); f.seek(5000); "
            "f.write(bytes([b[0]^1])); f.close()\" {p}")
    ssh(h3, f"p=$(echo {d}/{shard(11)}); cp -p $p /tmp/ref && " + flip.format(p="$p") + " && touch -r /tmp/ref $p")
    ssh(h2, f"truncate -s 1000 {d}/{shard(22)}")
    ssh(h1, f"rm {d}/{shard(33)}")
    cache_root = Path(relay_plan.control_dir(str(fleet.cache), REPO, manifest_revision(fleet)))
    flip_bit_keep_stat(cache_root / shard(44), offset=5000)  # the control cache has a bad file too
    fleet.hub.reset_counters()
    n_control = len(fleet.control_log())
    tx0 = _bridge_tx()

    result = fleet.deploy()
    egress = _bridge_tx() - tx0
    assert result.returncode == 0, result.tail()
    assert get_counts(fleet.hub) == {shard(44): 1}  # only the cache's bad file, re-fetched alone
    assert fleet.control_log("control-copy")[-1]["action"] == "repair"
    relays = fleet.relays(n_control)
    size = {s: (fleet.served / s).stat().st_size for s in (shard(33), shard(22), shard(11))}
    assert relays[h1["address"]]["bytes_from"] == {CONTROL_RELAY: size[shard(33)]}  # the root's source
    assert relays[h2["address"]]["bytes_from"] == {relay_url(h1): size[shard(22)]}  # each from its parent
    assert relays[h3["address"]]["bytes_from"] == {relay_url(h2): size[shard(11)]}
    total = len(load_manifest(str(fleet.served / ".k2fleet" / "manifest.json"))["files"])
    for host in fleet.hosts:  # every other file hashed right where it was and stayed
        report = relays[host["address"]]
        assert (report["files"], report["kept"], report["bad_shards"]) == (1, total - 1, []), report
    for host, bad in ((h1, shard(33)), (h2, shard(22)), (h3, shard(11))):
        now = _inodes(host)
        assert {f for f in now if now[f] != inodes[host["name"]].get(f)} == {bad}, host["name"]
    _healthy(fleet)
    print(f"repair: control egress {egress} bytes; shard {(fleet.served / shard(33)).stat().st_size} bytes; "
          f"control relay sent {size[shard(33)]}")
    assert size[shard(33)] <= egress < fleet.size / 4  # one shard (it did cross) and pyinfra's traffic, not the checkpoint


@pytest.mark.sandbox
def test_control_egress_is_one_checkpoint_for_three_hosts(hub_deployed: Fleet) -> None:
    fleet = hub_deployed
    tx0 = _bridge_tx()
    noop = fleet.deploy()
    baseline = _bridge_tx() - tx0
    assert noop.returncode == 0 and noop.changed == 0, noop.changed_operations or noop.tail()
    for host in fleet.hosts:
        ssh(host, "rm -rf /srv/k2fleet/models/*/*/")
    tx0 = _bridge_tx()
    result = fleet.deploy()
    egress = _bridge_tx() - tx0
    assert result.returncode == 0, result.tail()
    _healthy(fleet)
    ratio = egress / fleet.size
    print(f"egress: {egress} bytes for a {fleet.size}-byte checkpoint on 3 hosts, ratio {ratio:.3f} "
          f"(no-op deploy baseline {baseline} bytes; ratio without it {(egress - baseline) / fleet.size:.3f})")
    relays = fleet.relays(-3)
    from_control = sum(r["bytes_from"].get(CONTROL_RELAY, 0) for r in relays.values())
    assert relays[fleet.hosts[0]["address"]]["bytes_from"] == {CONTROL_RELAY: fleet.size}
    assert from_control == fleet.size  # hosts 2 and 3 got nothing from the control machine
    assert 1.0 <= ratio <= 1.05  # one copy leaves the control machine (the counter saw it), not three


SHARED = "/mnt/k2shared/models"  # sandbox shared storage: one directory bound into every host


@pytest.mark.sandbox
def test_shared_storage_is_fetched_and_verified_once_not_per_host(hubfleet: Fleet) -> None:
    fleet = hubfleet
    shared = {"k2_shared_storage": True, "k2_model_dir": SHARED}
    h1, h2, h3 = fleet.hosts
    ssh(h1, f"rm -rf {SHARED}")  # nothing on the shared storage yet (seen by every host)
    n_control, n_hosts = len(fleet.control_log()), {h["name"]: len(fleet.host_log(h)) for h in fleet.hosts}
    tx0 = _bridge_tx()
    result = fleet.deploy(**shared)
    egress = _bridge_tx() - tx0
    assert result.returncode == 0, result.tail()
    _healthy(fleet, SHARED)
    (push,) = fleet.control_log()[n_control:]
    assert push["target"].endswith(h1["address"]) and push["dir"].startswith(SHARED)
    assert push["bytes_from"] == {CONTROL_RELAY: fleet.size}
    n_hosts[h1["name"]] += 1  # its relay report; no other host received anything
    assert {h["name"]: len(fleet.host_log(h)) for h in fleet.hosts} == n_hosts
    print(f"shared storage: control egress {egress} bytes for a {fleet.size}-byte checkpoint, 3 hosts")
    assert fleet.size <= egress < 1.05 * fleet.size
    marker = [ssh(h, f"stat -c %i {SHARED}/*/*/.k2fleet/verified.json").stdout.strip() for h in fleet.hosts]
    assert len(set(marker)) == 1 and marker[0], marker  # the same marker file on every host
    for host in fleet.hosts:  # every engine serves from the shared path
        unit = ssh(host, "systemctl cat k2-vllm.service").stdout
        assert f"{SHARED}/" in unit and "/srv/k2fleet/models" not in unit, host["name"]

    # a shard broken on the shared storage (seen by every host) is re-sent once, to host 1 only
    ssh(h3, f"truncate -s 1000 {SHARED}/*/*/{shard(40)}")
    n_control, n_hosts = len(fleet.control_log()), {h["name"]: len(fleet.host_log(h)) for h in fleet.hosts}
    result = fleet.deploy(**shared)
    assert result.returncode == 0, result.tail()
    (push,) = fleet.control_log()[n_control:]
    assert push["files"] == 1 and push["target"].endswith(h1["address"])
    assert push["bytes_from"] == {CONTROL_RELAY: (fleet.served / shard(40)).stat().st_size}
    n_hosts[h1["name"]] += 1
    assert {h["name"]: len(fleet.host_log(h)) for h in fleet.hosts} == n_hosts
    _healthy(fleet, SHARED)
    again = fleet.deploy(**shared)
    assert again.returncode == 0 and again.changed == 0, again.changed_operations or again.tail()


@pytest.mark.sandbox
def test_fetcher_host_downloads_from_the_hub_and_the_control_machine_sends_no_checkpoint(hubfleet: Fleet) -> None:
    """``--data k2_checkpoint_fetcher=k2sb-2``: host 2 downloads from the Hub double
    (listening on the sandbox bridge, the one address besides its peers a sandbox host can
    reach), with huggingface_hub installed from the control machine's offline wheelhouse;
    hosts 1 and 3 receive from it through the relay (the chain h2 → h1 → h3); the token
    exists on host 2 only while it downloads."""
    fleet = hubfleet
    h1, h2, h3 = fleet.hosts
    with HubDouble(host=sandbox.BRIDGE_ADDRESS) as hub:
        hub.add_commit(REPO, fleet.served, sha=manifest_revision(fleet))
        fetcher = {"k2_hub_endpoint": hub.url, "k2_checkpoint_fetcher": h2["name"]}
        for host in fleet.hosts:  # nothing on any host: the whole checkpoint must come from the Hub
            ssh(host, "rm -rf /srv/k2fleet/models/*/*/")
        fleet.sandbox.forget()
        n_control, n_hosts = len(fleet.control_log()), {h["name"]: len(fleet.host_log(h)) for h in fleet.hosts}
        n_copy = len(fleet.control_log("control-copy"))
        fleet.hub.reset_counters()
        result = fleet.deploy(**fetcher)
        assert result.returncode == 0, result.tail()
        _healthy(fleet)
        manifest = load_manifest(str(fleet.served / ".k2fleet" / "manifest.json"))
        # only the fetcher fetched files; the control machine asked for the pinned revision's metadata alone
        assert {r.client for r in hub.requests if r.rfilename is not None} == {h2["address"]}
        assert all(r.path.startswith("/api/") for r in hub.requests if r.client != h2["address"])
        assert dict(hub.bytes_served) == {f: e["size"] for f, e in manifest["files"].items()}  # once each
        assert {r.authorization for r in hub.requests} == {f"Bearer {SECRET}"} and SECRET not in result.output
        assert fleet.hub.requests == [] and fleet.control_log("control-copy")[n_copy:] == []  # no control download
        relays = fleet.relays(n_control)
        assert set(relays) == {h1["address"], h3["address"]}  # the fetcher received nothing
        assert relays[h1["address"]]["bytes_from"] == {relay_url(h2): fleet.size}
        assert relays[h3["address"]]["bytes_from"] == {relay_url(h1): fleet.size}  # nothing from the control machine
        assert fleet.host_log(h2)[n_hosts[h2["name"]]:] == []
        for host in fleet.hosts:
            assert ssh(host, "ls /run/k2fleet/hf_token", check=False).returncode != 0, host["name"]
        assert ssh(h1, "test -e /opt/k2fleet/hubenv", check=False).returncode != 0  # the client is on h2 only
        hub.reset_counters()
        again = fleet.deploy(**fetcher)
        assert again.returncode == 0 and again.changed == 0, again.changed_operations or again.tail()
        assert hub.requests == []
    fleet.sandbox.forget()  # deployed from a Hub that is gone now
