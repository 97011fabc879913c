"""One manifest pin in every mode (exploit tests, real sockets on loopback, the Hub TEST DOUBLE).

The finding: with ``k2_checkpoint_fetcher: HOST`` there was no control copy, so the receivers'
relay fetch carried no ``--manifest-digest``; a hostile parent (or a local user holding its
relay port) served a manifest of the right repository and revision naming its own files (a
``tokenization_kimi.py`` that runs a command), the fetch took it and marked it, and the units'
gate (repository and revision only) let the engine load it with ``--trust-remote-code``.

Now the control machine holds the manifest digest before any host receives a byte
(:func:`k2fleet.control.checkpoint_copy.manifest_pins`: the control copy's, or the Hub's own
file metadata for the pinned revision — nothing downloaded) and every fetch, the fetcher's
Hub download, the units' start gate and the fact's check compare with it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k2fleet.cli import load_plan
from k2fleet.control import ControlError
from k2fleet.control.artifacts import read_control_artifacts
from k2fleet.control.checkpoint_copy import manifest_pins
from k2fleet.deploy.roles.checkpoint import download_argv
from k2fleet.hostprogs import verify
from k2fleet.hostprogs.manifest import save_manifest
from k2fleet.planning import relay_plan
from k2fleet.planning.desired import desired_state
from k2fleet.planning.units import gate_argv
from k2sandbox.checkpoint_cache import ensure_synthetic_checkpoint
from k2sandbox.hub_double import HubDouble
from k2sandbox.synthetic_checkpoint import describe_dir, manifest_for
from tests.inventory_factory import write_inventory
from tests.test_relay_trust import FakePeer

REPO, REV = "moonshotai/Kimi-K2-Thinking", "c" * 40
PY = [sys.executable, "-m"]
EVIL = "import os\nos.system('touch /tmp/k2fleet-pwned')\n"


def _hub_copy(src: Path, dst: Path) -> Path:
    """``src``'s files without k2fleet's own ``.k2fleet/`` (what a Hub repository holds)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".k2fleet"))
    return dst


def _forged(honest: Path, dst: Path) -> Path:
    """The honest checkpoint plus a hostile ``tokenization_kimi.py``, with a consistent
    manifest of its own under the SAME repository and revision (every per-file check passes)."""
    forged = _hub_copy(honest, dst)
    (forged / "tokenization_kimi.py").write_text(EVIL)
    manifest = manifest_for(describe_dir(forged), REPO, REV)
    save_manifest(forged, manifest)
    assert verify.verify(str(forged), manifest).ok  # verified as itself
    return forged


@pytest.fixture(scope="module")
def honest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_synthetic_checkpoint(tmp_path_factory.mktemp("honest") / "ckpt", REPO, REV, num_shards=3,
                                       shard_bytes=8192)


@pytest.fixture
def hub(honest: Path, tmp_path: Path):
    with HubDouble() as double:
        double.add_commit(REPO, _hub_copy(honest, tmp_path / "hub-repo"), sha=REV)
        yield double


def _fetcher_fleet(tmp_path: Path, hub_url: str) -> tuple:
    inv = write_inventory(tmp_path / "inv", 3, k2_revision=REV, k2_hub_endpoint=hub_url,
                          k2_checkpoint_fetcher="node-0", k2_checkpoint_cache=str(tmp_path / "cache"),
                          k2_runtime="venv")
    return load_plan(inv)


def _pinned_digest(honest: Path) -> str:
    return verify.manifest_digest(verify.load_manifest(str(honest / ".k2fleet" / "manifest.json")))


def test_a_fetcher_hosts_fleet_is_pinned_to_the_hubs_own_metadata(hub: HubDouble, honest: Path, tmp_path: Path) -> None:
    """Fetcher-host mode: the control machine asks the Hub for the pinned revision's file
    metadata only (no file), and that digest is in every fetch, download, gate and check."""
    dep, plan = _fetcher_fleet(tmp_path, hub.url)
    assert dep.weight_sets[0].manifest_sha256 is None  # before the control step: nothing pinned
    assert manifest_pins(dep, fetch=False) == {}  # plan/--dry/status ask no Hub
    assert hub.requests == []
    pins = manifest_pins(dep, fetch=True)
    want = _pinned_digest(honest)
    assert pins == {"checkpoint-verified": want}
    assert any(r.path.startswith(f"/api/models/{REPO}/revision/{REV}") for r in hub.requests)
    assert all(r.path.startswith("/api/") and r.rfilename is None for r in hub.requests)  # metadata, no file
    assert sum(hub.bytes_served.values()) == 0
    hub.requests.clear()
    assert manifest_pins(dep, fetch=True) == pins and hub.requests == []  # cached: no second Hub request
    assert manifest_pins(dep, fetch=False) == pins

    pinned = dep.pinned(pins)
    ws = pinned.weight_sets[0]
    assert ws.manifest_sha256 == want
    desired = desired_state(pinned, plan, read_control_artifacts(pinned, plan))
    for name, d in desired.items():
        check = d.checks["checkpoint-verified"]
        assert check[check.index("--manifest-digest") + 1] == want, name
        units = [f.content.decode() for files in d.service_files.values() for path, f in files.items()
                 if path.endswith(".service") and f.content]
        gates = [line for text in units for line in text.splitlines() if " verify " in line and "ExecStartPre" in line]
        assert gates and all(f"--manifest-digest {want}" in line for line in gates), (name, gates)
    down = download_argv(pinned, False, ws)
    assert down[down.index("--manifest-digest") + 1] == want
    fetch = relay_plan.relay_fetch_argv(ws.path, ["http://a:1"], 1, 1, [], pin=(ws.repo, ws.revision),
                                        digest=ws.manifest_sha256)
    assert fetch[fetch.index("--manifest-digest") + 1] == want


def test_a_forged_parent_is_refused_and_nothing_is_marked_or_served(hub: HubDouble, honest: Path, tmp_path: Path) -> None:
    """The exploit as reported: a parent serving a manifest of the right repository and
    revision with a hostile ``tokenization_kimi.py``. With the fetch argv the deploy builds
    for a fetcher-host fleet, the receiver refuses it, marks nothing and fails (no honest
    source left); the forged copy, even verified as itself on a host, fails the units' gate
    and the fact's check."""
    dep, _ = _fetcher_fleet(tmp_path, hub.url)
    ws = dep.pinned(manifest_pins(dep, fetch=True)).weight_sets[0]
    forged = _forged(honest, tmp_path / "forged")
    peer = FakePeer((forged / ".k2fleet" / "manifest.json").read_bytes(), payload=EVIL.encode())
    dest = tmp_path / "dest"
    argv = relay_plan.relay_fetch_argv(str(dest), [peer.url, "http://127.0.0.1:9"], 1, 1, [], pin=(ws.repo, ws.revision),
                                       digest=ws.manifest_sha256, secret_file=None, log_file=str(tmp_path / "log"))
    i = argv.index("relay")
    try:
        out = subprocess.run([*PY, "k2fleet.hostprogs.relay", *argv[i + 1:], "--give-up-after", "3", "--dead-after", "1"],
                             capture_output=True, text=True, timeout=120)
    finally:
        peer.close()
    assert out.returncode != 0 and "digest" in out.stderr, out.stderr
    assert [r for r in peer.requests if r != "/manifest"] == []  # no file of it was even asked for
    assert not (dest / "tokenization_kimi.py").exists() and not (dest / ".k2fleet" / "verified.json").exists()
    assert (honest / "tokenization_kimi.py").read_text() != EVIL

    # a host that holds the forged copy, verified as itself: the pinned check and gate refuse it
    unpinned = subprocess.run([*PY, "k2fleet.hostprogs.verify", "--marker-only", "--repo", REPO, "--revision", REV,
                               str(forged)], capture_output=True, text=True)
    assert unpinned.returncode == 0  # what the check was before the pin: it let the forgery through
    for argv in ([*gate_argv(ws)[:-1], "--marker-only", gate_argv(ws)[-1]], gate_argv(ws)):
        args = argv[argv.index("verify") + 1:-1] + [str(forged)]
        got = subprocess.run([*PY, "k2fleet.hostprogs.verify", *args], capture_output=True, text=True)
        assert got.returncode == 1 and ("--marker-only" in args or "not the pinned" in got.stdout), (args, got.stdout)
    assert not (forged / ".k2fleet" / "verified.json").exists()  # the refused copy is marked no more


def test_the_fetchers_download_refuses_a_hub_answer_other_than_the_pin(hub: HubDouble, honest: Path,
                                                                       tmp_path: Path) -> None:
    """The fetcher host's own path to the Hub is not trusted beyond the pin: a Hub (or a proxy
    on the way) answering another manifest for the pinned revision gets no byte downloaded;
    a manifest already planted in the fetcher's directory is not taken either."""
    pin = _pinned_digest(honest)
    forged = _forged(honest, tmp_path / "forged")
    with HubDouble() as evil:
        evil.add_commit(REPO, _hub_copy(forged, tmp_path / "evil-repo"), sha=REV)
        dest = tmp_path / "fetcher"
        env = {"HF_ENDPOINT": evil.url, "HF_HUB_DISABLE_XET": "1", "PATH": "/usr/bin:/bin",
               "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        got = subprocess.run([*PY, "k2fleet.hostprogs.download", REPO, "--revision", REV, "--dir", str(dest),
                              "--manifest-digest", pin], capture_output=True, text=True, env=env, timeout=120)
        assert got.returncode == 1 and "not the control machine's pin" in got.stderr, got.stderr
        assert sum(evil.bytes_served.values()) == 0 and not (dest / "tokenization_kimi.py").exists()
        assert not (dest / ".k2fleet" / "manifest.json").exists()  # the refused manifest is not saved
    # a planted manifest of the right repository and revision: replaced by the honest Hub's, which has the pin
    shutil.copytree(forged / ".k2fleet", dest / ".k2fleet", dirs_exist_ok=True)
    env["HF_ENDPOINT"] = hub.url
    got = subprocess.run([*PY, "k2fleet.hostprogs.download", REPO, "--revision", REV, "--dir", str(dest),
                          "--manifest-digest", pin], capture_output=True, text=True, env=env, timeout=120)
    assert got.returncode == 0, got.stderr
    assert verify.manifest_digest(verify.load_manifest(str(dest / ".k2fleet" / "manifest.json"))) == pin
    assert (dest / "tokenization_kimi.py").read_bytes() == (honest / "tokenization_kimi.py").read_bytes() != EVIL.encode()


def test_a_pin_that_cannot_be_had_stops_the_deploy_in_one_line(tmp_path: Path, honest: Path) -> None:
    """No Hub answer (nothing listens): the deploy's control step stops with one line naming
    the checkpoint; a ``control:`` directory of another revision is no pin either."""
    dep, _ = _fetcher_fleet(tmp_path, "http://127.0.0.1:9")
    with pytest.raises(ControlError) as exc:
        manifest_pins(dep, fetch=True)
    assert f"{REPO}@{REV} cannot be pinned" in str(exc.value) and "\n" not in str(exc.value)
    inv = write_inventory(tmp_path / "inv2", 2, k2_revision="d" * 40, k2_checkpoint_source=f"control:{honest}")
    dep, _ = load_plan(inv)
    with pytest.raises(ControlError, match="manifest revision c+ is not the pinned d+"):
        manifest_pins(dep, fetch=True)
    assert manifest_pins(dep, fetch=False) == {}


def test_a_planted_cache_manifest_is_no_pin(hub: HubDouble, tmp_path: Path) -> None:
    """The control cache another local user can write is refused as the pin's source."""
    dep, _ = _fetcher_fleet(tmp_path, hub.url)
    directory, _ = relay_plan.control_source(dep)
    Path(directory).mkdir(parents=True)
    Path(directory).chmod(0o777)
    with pytest.raises(ControlError, match="another user could plant"):
        manifest_pins(dep, fetch=True)
    assert manifest_pins(dep, fetch=False) == {} and hub.requests == []
