"""Air-gapped bundles (``k2fleet bundle``, ``k2fleet.lock``, ``k2_bundle``) with real parts:
Debian's archive for the fleet's release (bookworm, and trixie as a release other than
the control machine's), real ``pip download`` wheelhouses (Ray) and a real venv install of
the engine TEST DOUBLE wheel, the sandbox fleet deploying from the bundle alone with the
control side in a network namespace whose only link is the sandbox bridge, a real
``docker load`` / ``docker save`` of the double image on a sandbox host.

Test doubles: the engines (the TEST DOUBLE wheel and image), the GPUs and NVIDIA's
packages (:mod:`k2sandbox.driver_doubles`), the checkpoint (synthetic, like the Hub's).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from k2fleet.control import airgap
from k2sandbox import engine_double_wheel as engine_wheel, nspawn as sandbox
from k2fleet.cli import load_plan
from k2fleet.control import ControlError
from k2fleet.control.checkpoint_copy import manifest_pins
from k2fleet.control.artifacts import prepare_control_artifacts, read_control_artifacts
from k2fleet.control.stand_ins import engine_doubles_for
from k2fleet.planning.relay_plan import RELAY_SECRET
from k2fleet.planning.desired import ControlArtifacts, desired_state
from k2fleet.deploy.gate import check_hosts
from k2fleet.inventory.loader import inventory_host_data
from k2fleet.control.lockfile import LOCK_NAME, Lock
from k2fleet.inventory.loader import data_args
from k2sandbox.rehearse import bundle_data, connection_overlay
from k2sandbox.harness import ROOT, tool
from tests.test_rehearse import check_serving

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox fleet needs root")
REHEARSAL = data_args(airgap.bundle_overlay(True))[1::2]
TIMEOUT_S = 900


def k2fleet(*args: str, timeout: float = TIMEOUT_S, lock=None) -> subprocess.CompletedProcess:
    """``k2fleet ARGS``; with ``lock`` (the sandbox lock this test holds) the command uses the
    sandbox under it, so no other run takes the kept hosts away before the test has looked."""
    held = {"env": {**os.environ, **sandbox.lock_env(lock)}, "pass_fds": (lock.fileno(),)} if lock is not None else {}
    return subprocess.run([tool("k2fleet"), *args], cwd=ROOT, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout, **held)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def lock_of(bundle: Path) -> Lock:
    return Lock.from_text((bundle / LOCK_NAME).read_text())


def with_bundle(bundle: Path) -> list[str]:
    return [*REHEARSAL, f"k2_bundle={bundle}"]


# ---------------------------------------------------------------- offline (pure, and a local venv)


def test_engine_double_wheel_installs_into_a_real_venv_and_runs_the_doubles(tmp_path: Path) -> None:
    name, data = engine_wheel.build_wheel()
    assert engine_wheel.build_wheel() == (name, data)  # byte-reproducible: --locked compares sha256s
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / name).write_bytes(data)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin/python"), "install", "--quiet",
                    "--no-index", "--find-links", str(tmp_path / "wheels"), engine_wheel.requirement()], check=True)
    assert (venv / "bin/vllm").read_text().startswith(f"#!{venv}/bin/python")
    out = subprocess.run([str(venv / "bin/vllm"), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "k2fleet-test-double" in out.stdout
    probe = subprocess.run([str(venv / "bin/python"), "-c", "import sglang.launch_server, ktransformers.server.main, "
                            "k2fleet_doubles.trtllm; from importlib.metadata import version; "
                            "print(version('k2fleet-engine-doubles'))"], capture_output=True, text=True)
    assert probe.stdout.strip() == engine_wheel.version(), probe.stderr


@pytest.mark.parametrize("inventory, engine_pin, image", [
    ("inventories/h800-pp.py", True, False),  # vLLM venv + Ray
    ("inventories/h200-sglang-pd.py", True, False),  # + the real sglang-router
    ("inventories/ktransformers.py", True, False),  # GGUF weights: a second checkpoint
    ("inventories/b200-trtllm.py", False, True),
    ("inventories/mi300x.py", False, True),
])
def test_what_a_bundle_holds_follows_the_inventory(inventory: str, engine_pin: bool, image: bool) -> None:
    dep, plan = load_plan(ROOT / inventory, REHEARSAL)
    needs = airgap.bundle_needs(dep, plan)
    assert needs.debs and all(d.os == "debian-12" and d.simulated for d in needs.debs)
    engine_sets = [w for w in needs.wheels if w.use == "engine"]
    assert bool(engine_sets) == engine_pin
    assert all(engine_wheel.requirement() in w.requirements and w.pythons == ("3.11",) for w in engine_sets)
    assert needs.images == ((dep.image,) if image else ())
    assert [c[0] for c in needs.checkpoints] == [ws.repo for ws in dep.weight_sets]
    real, real_plan = load_plan(ROOT / inventory)  # the production inventory: the engine's own pin
    real_sets = [w for w in airgap.bundle_needs(real, real_plan).wheels if w.use == "engine"]
    assert all(f"=={real.version}" in " ".join(w.requirements) for w in real_sets)
    assert not any(engine_wheel.PROJECT in " ".join(w.requirements) for w in real_sets)


def test_k2_bundle_deploys_the_engine_and_the_checkpoint_from_the_bundle(tmp_path: Path) -> None:
    (tmp_path / LOCK_NAME).write_text(Lock("inventories/h800-pp.py", True, {}, ()).to_text())
    dep, plan = load_plan(ROOT / "inventories/h800-pp.py", with_bundle(tmp_path))
    assert dep.weight_sets[0].source == f"control:{tmp_path}/{airgap.checkpoint_rel(dep.s.model, dep.s.revision)}"
    desired = desired_state(dep, plan, ControlArtifacts(engine_doubles=engine_doubles_for(dep)))  # as the control step reads them
    for d in desired.values():
        assert d.venv_install is None and engine_wheel.requirement() in " ".join(d.engine_side_install or [])
        assert not any(p.startswith("/opt/k2fleet/doubles/") for p in d.files["engine"])  # the wheel brings them
    with pytest.raises(ControlError, match=r"k2_bundle: bundle .* has no debian-12 amd64 packages"):
        prepare_control_artifacts(dep, plan)


# ---------------------------------------------------------------- building (Debian's archive, PyPI)


@pytest.fixture(scope="module")
def h800_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The rehearsal bundle of the Ray inventory: debs, Ray + the engine double wheel, checkpoint."""
    out = tmp_path_factory.mktemp("bundle") / "h800-pp"
    proc = k2fleet("bundle", "inventories/h800-pp.py", "--rehearsal", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_bundle_lock_names_every_artifact_with_its_sha256_and_origin(h800_bundle: Path) -> None:
    lock = lock_of(h800_bundle)
    for artifact in lock.artifacts:
        if not artifact.inside and artifact.kind != "checkpoint-file":
            assert sha256(h800_bundle / artifact.path) == artifact.sha256, artifact.path
    by = {(a.kind, a.name): a for a in lock.artifacts}
    driver = by[("deb", "nvidia-open:amd64")]
    assert driver.version == "580.95.05-1" and "file:repo-" in driver.origin and driver.inside.startswith("debs/")
    assert by[("deb", "rsync:amd64")].origin.startswith("deb http://") and "bookworm" in by[("deb", "rsync:amd64")].origin
    assert by[("wheel", "ray")].version == "2.60.0" and by[("wheel", "ray")].origin.startswith("pypi:ray[cgraph]==2.60.0")
    assert by[("wheel", engine_wheel.PROJECT)].version == engine_wheel.version()
    files = [a for a in lock.artifacts if a.kind == "checkpoint-file"]
    assert len(files) > 61 and all(len(a.sha256) == 64 for a in files)
    with tarfile.open(h800_bundle / lock.part("debs")[0]["path"]) as tar:  # the tar is a flat apt repository
        assert {"Packages", "Release", "manifest.json"} <= set(tar.getnames())


def test_rebuilding_an_unchanged_bundle_copies_nothing(h800_bundle: Path) -> None:
    before = (h800_bundle / LOCK_NAME).read_text()
    proc = k2fleet("bundle", "inventories/h800-pp.py", "--rehearsal", "--out", str(h800_bundle))
    assert proc.returncode == 0, proc.stderr
    assert "copied 0," in proc.stdout and "removed 0 stale" in proc.stdout, proc.stdout
    assert (h800_bundle / LOCK_NAME).read_text() == before


def test_an_inventory_that_names_its_bundle_can_be_bundled(h800_bundle: Path) -> None:
    """#22: an inventory that already says ``k2_bundle: DIR`` (how the air-gapped fleet will
    take it) is bundled like any other — the same artifacts, the same lock — instead of
    being refused because DIR has no lock yet."""
    proc = k2fleet("bundle", "inventories/h800-pp.py", "--rehearsal", "--out", str(h800_bundle),
                   "--data", f"k2_bundle={h800_bundle / 'not-made-yet'}", "--data", "k2_package_source=bundle",
                   "--locked", str(h800_bundle / "k2fleet.lock"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "identical to" in proc.stdout


def test_an_inventory_whose_names_resolve_only_behind_its_bastion_can_be_bundled(tmp_path: Path) -> None:
    """#22: ``k2fleet bundle`` looks up no host name (a bundle holds no address), so the company
    inventory, whose ``*.fleet.corp.example`` names this machine cannot resolve, is bundled;
    ``plan`` of it still refuses the unresolvable name with one line."""
    plan = k2fleet("plan", "inventories/corp-dp-ep.py")
    assert plan.returncode == 2 and "gpu-0.fleet.corp.example does not resolve" in plan.stderr, plan.stderr
    proc = k2fleet("bundle", "inventories/corp-dp-ep.py", "--rehearsal", "--out", str(tmp_path / "corp"),
                   "--only", "checkpoints")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [a.kind for a in lock_of(tmp_path / "corp").artifacts if a.kind == "checkpoint-file"]


def test_an_altered_wheel_or_deb_is_refused_by_name(h800_bundle: Path, tmp_path: Path) -> None:
    copy = tmp_path / "bundle"
    shutil.copytree(h800_bundle, copy)
    lock = lock_of(copy)
    ray = next(a for a in lock.artifacts if a.kind == "wheel" and a.name == "ray")
    data = bytearray((copy / ray.path).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / ray.path).write_bytes(bytes(data))
    proc = k2fleet("plan", "inventories/h800-pp.py", "--json", *[f"--data={d}" for d in with_bundle(copy)])
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert f"{copy / ray.path}: sha256" in proc.stderr and "altered or corrupted; refusing it" in proc.stderr
    shutil.copyfile(h800_bundle / ray.path, copy / ray.path)
    tar_rel = lock.part("debs")[0]["path"]  # flip one byte of nvidia-open's .deb inside the tar
    deb = next(a for a in lock.artifacts if a.kind == "deb" and a.name == "nvidia-open:amd64")
    with tarfile.open(copy / tar_rel) as tar:
        member = tar.getmember(deb.path.rsplit("!", 1)[1])
    with open(copy / tar_rel, "r+b") as fh:
        fh.seek(member.offset_data + member.size // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))
    dep, plan = load_plan(ROOT / "inventories/h800-pp.py", with_bundle(copy))
    with pytest.raises(ControlError, match=r"\(nvidia-open:amd64 580\.95\.05-1 inside\): sha256 .* refusing it"):
        prepare_control_artifacts(dep, plan)


def test_locked_rebuild_from_empty_caches_is_identical_and_drift_is_named(h800_bundle: Path, tmp_path: Path) -> None:
    lock_file = h800_bundle / LOCK_NAME
    rebuilt = tmp_path / "rebuilt"
    proc = k2fleet("bundle", "inventories/h800-pp.py", "--locked", str(lock_file), "--out", str(rebuilt),
                   "--cache", str(tmp_path / "cache"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"identical to {lock_file}" in proc.stdout
    assert (rebuilt / LOCK_NAME).read_text() == lock_file.read_text()
    for artifact in lock_of(rebuilt).artifacts:  # the same bytes, fetched again
        if not artifact.inside and artifact.kind != "checkpoint-file":
            assert sha256(rebuilt / artifact.path) == sha256(h800_bundle / artifact.path), artifact.path
    doc = json.loads(lock_file.read_text())  # a lock from an older archive: rsync was another version
    entry = next(a for a in doc["artifacts"] if a["kind"] == "deb" and a["name"] == "rsync:amd64")
    real_version, entry["version"] = entry["version"], "3.2.3-4+deb11u1"
    older = tmp_path / "older.lock"
    older.write_text(json.dumps(doc))
    proc = k2fleet("bundle", "inventories/h800-pp.py", "--locked", str(older), "--out", str(tmp_path / "again"))
    assert proc.returncode == 1
    assert f"drifted: deb rsync:amd64: 3.2.3-4+deb11u1 sha256 {entry['sha256'][:12]}… → {real_version}" in proc.stdout
    assert proc.stdout.count("drifted:") == 1, proc.stdout


def test_bundle_for_another_debian_release_than_the_control_machines(tmp_path: Path) -> None:
    own = Path("/etc/os-release").read_text()
    assert 'VERSION_CODENAME=bookworm' in own  # the control machine (and the sandbox hosts) are bookworm
    out = tmp_path / "trixie"
    proc = k2fleet("bundle", "inventories/h200.py", "--rehearsal", "--data", "k2_os=debian-13", "--only", "debs",
                   "--only", "wheels", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lock = lock_of(out)
    assert [p["os"] for p in lock.part("debs")] == ["debian-13"]
    assert [p["pythons"] for p in lock.part("wheels")] == [["3.13"]]  # trixie's python3
    by = {a.name: a for a in lock.artifacts if a.kind == "deb"}
    assert by["libc6:amd64"].version.startswith("2.41-"), by["libc6:amd64"]  # bookworm has 2.36
    assert by["python3:amd64"].version.startswith("3.13."), by["python3:amd64"]
    assert " trixie " in by["libc6:amd64"].origin and by["nvidia-open:amd64"].version == "580.95.05-1"


# ---------------------------------------------------------------- the sandbox fleet, from the bundle alone


def managed_files(inventory: str, bundle: Path) -> dict[str, dict[str, str]]:
    """Host → path → sha256 of every file the deploy put there, as read on the sandbox
    hosts (mesh keys, known_hosts and the relay secret left out: secrets made per deployment,
    not bundled)."""
    hosts = inventory_host_data(ROOT / inventory, {})
    dep, _ = check_hosts(inventory, hosts)
    overlay = bundle_data(dep, bundle)
    sb_hosts = sandbox.load_hosts()
    conn = connection_overlay([n for n, _, _ in hosts], sb_hosts)
    dep, plan = check_hosts(inventory, [(n, {**d, **conn[n], **overlay}, g) for n, d, g in hosts])
    dep = dep.pinned(manifest_pins(dep, fetch=False))  # the bundle's checkpoint manifest: the deploy's pin
    desired = desired_state(dep, plan, read_control_artifacts(dep, plan))  # the bundle's artifacts, verified
    found: dict[str, dict[str, str]] = {}
    for (name, _, _), sb in zip(hosts, sb_hosts):
        d = desired[name]
        paths = sorted(p for group, files in d.files.items() if group != "mesh" for p in files
                       if not p.endswith("/") and p != RELAY_SECRET)
        paths += sorted(p for files in d.service_files.values() for p in files)
        out = sandbox.ssh(sb, "sha256sum " + " ".join(paths), timeout=60)
        assert out.returncode == 0, out.stderr
        found[name] = {line.split()[1]: line.split()[0] for line in out.stdout.splitlines()}
        assert set(found[name]) == set(paths)
        unexpected = {p for p, spec in [(p, s) for files in (*d.files.values(), *d.service_files.values())
                                        for p, s in files.items()] if p in found[name] and spec.sha256 != found[name][p]}
        assert not unexpected, f"{name}: differ from the desired state: {sorted(unexpected)}"
    return found


@pytest.mark.sandbox
@needs_root
def test_offline_rehearsal_from_the_bundle_alone(tmp_path: Path) -> None:
    """K2.5 on one host (its only rehearsal: tests/test_rehearse.py leaves it to this one), from
    its rehearsal bundle alone, the deploy in a network namespace with no route out; the test
    calls the kept fleet itself. (Ray installed on the hosts from the control machine's wheelhouse,
    and its token-authenticated cluster: the h800-pp rehearsal of tests/test_rehearse_restart.py.)"""
    inventory, bundle = "inventories/h200-k25.py", tmp_path / "h200-k25"
    built = k2fleet("bundle", inventory, "--rehearsal", "--out", str(bundle))
    assert built.returncode == 0, built.stdout + built.stderr
    held = sandbox.hold_sandbox_lock()  # for the rehearsal and the looks at its kept hosts
    try:
        proc = k2fleet("rehearse", inventory, "--bundle", str(bundle), "--offline", "--keep", lock=held)
        check_serving(proc, inventory, 1)
        assert f"--offline: the deploy runs in netns {sandbox.OFFLINE_NS}" in proc.stdout
        routes = subprocess.run(["ip", "-n", sandbox.OFFLINE_NS, "route"], capture_output=True, text=True).stdout
        assert routes.strip().splitlines() == [line for line in routes.strip().splitlines() if f"{sandbox.SUBNET}.0/24" in line]
        unreachable = subprocess.run(["ip", "netns", "exec", sandbox.OFFLINE_NS, "ip", "route", "get", "151.101.0.223"],
                                     capture_output=True, text=True)  # PyPI's address: no route (nothing is sent)
        assert unreachable.returncode != 0 and "unreachable" in unreachable.stderr.lower()
        links = subprocess.run(["ip", "-n", sandbox.OFFLINE_NS, "-o", "link", "show"], capture_output=True,
                               text=True, check=True).stdout
        names = sorted(line.split(":")[1].strip().split("@")[0] for line in links.splitlines())
        assert names == sorted(["lo", sandbox.veth_names(0)[1]]), names  # loopback and the bridge's veth, nothing else
        for host in sandbox.load_hosts():  # pyinfra ran inside it: every host saw the deploy's SSH from its address
            seen = sandbox.ssh(host, "journalctl --no-pager -o cat -t sshd -t sshd-session | grep 'Accepted publickey'")
            assert f" from {sandbox.OFFLINE_ADDRESS} " in seen.stdout, seen.stdout[-2000:] + seen.stderr
        lock = lock_of(bundle)
        for host in sandbox.load_hosts():
            out = sandbox.ssh(host, "/opt/k2fleet/venv/vllm-0.33.0/bin/python -c 'from importlib.metadata import version as v; "
                                    "print(v(\"k2fleet-engine-doubles\"))'; test -e /opt/k2fleet/doubles; "
                                    "echo doubles-dir=$?; head -1 /opt/k2fleet/venv/vllm-0.33.0/bin/vllm")
            assert out.stdout.split() == [engine_wheel.version(), "doubles-dir=1",
                                          "#!/opt/k2fleet/venv/vllm-0.33.0/bin/python3"], out.stdout + out.stderr
            installed = sandbox.ssh(host, "dpkg-query -W -f '${Version}' nvidia-open").stdout
            assert installed == next(a.version for a in lock.artifacts if a.name == "nvidia-open:amd64")
    finally:
        sandbox.down()
        held.close()


@pytest.mark.sandbox
@needs_root
def test_two_fresh_deploys_from_one_lock_leave_identical_files_and_a_real_docker_save_keeps_the_image(
        tmp_path: Path) -> None:
    bundle = tmp_path / "b200"
    proc = k2fleet("bundle", "inventories/b200-trtllm.py", "--rehearsal", "--out", str(bundle))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    image = lock_of(bundle).part("images")[0]
    runs = []
    held = sandbox.hold_sandbox_lock()  # for both rehearsals and the looks at their kept hosts
    try:
        for _ in range(2):  # each rehearsal boots bare hosts and a fresh control state
            proc = k2fleet("rehearse", "inventories/b200-trtllm.py", "--bundle", str(bundle), "--offline", "--keep",
                           lock=held)
            # the test calls the fleet (b200-trtllm's only rehearsal: tests/test_rehearse.py leaves it to this one)
            check_serving(proc, "inventories/b200-trtllm.py", 1)
            runs.append(managed_files("inventories/b200-trtllm.py", bundle))
        assert runs[0] == runs[1] and len(runs[0]["b200-0"]) > 20
        host = sandbox.load_hosts()[0]
        ref, image_id = image["ref"], image["image_id"]
        script = (f"set -e; docker image inspect --format '{{{{.Id}}}}' {ref}; docker save {ref} | gzip > /tmp/saved.tar.gz; "
                  f"docker rmi -f {ref} >/dev/null; docker load -i /tmp/saved.tar.gz >/dev/null; "
                  f"docker image inspect --format '{{{{.Id}}}}' {ref}")
        out = sandbox.ssh(host, script, timeout=120)
        assert out.returncode == 0 and out.stdout.split() == [image_id, image_id], out.stdout + out.stderr
    finally:
        sandbox.down()
        held.close()
