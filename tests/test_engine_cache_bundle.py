"""A warmed engine cache in the air-gapped bundle (``k2fleet bundle --engine-cache SRC``):
the archive (deterministic; a link, ``../x``, an absolute name, a hard link, an oversize or
doubled member refused on either side), its lock entry, the deploy reading and verifying it
(``k2_bundle``), the engine role planning the unpack only with a bundle that carries a cache,
and the host program unpacking it — run here, from the real host archive, on temporary
directories — only into an empty cache directory, never over a host's own, refusing an
archive whose sha256 is not the lock's.

Placeholders: the bundle parts these tests do not look into (the .deb tar, the engine wheel,
the checkpoint manifest) are a few bytes each, listed in the lock with their real sha256, so
that :func:`k2fleet.control.airgap.read_bundle` verifies them as it verifies real ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from k2fleet.cli import load_plan
from k2fleet.control import ControlError, airgap
from k2fleet.control.addresses import placeholder_resolver
from k2fleet.control.artifacts import read_control_artifacts
from k2fleet.control.lockfile import LOCK_NAME, Artifact, Lock
from k2fleet.hostprogs.cache_archive import CacheArchiveError, pack, unpack
from k2fleet.inventory.loader import data_args
from k2fleet.planning import engine_cache, teardown
from k2fleet.planning.desired import desired_state
from k2fleet.planning.host_archive import ARCHIVE, archive_bytes
from k2fleet.planning.quoting import shell_line
from tests.test_roles_offline import artifacts, control_calls, planned, run_roles, settled_fleet  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
REHEARSAL = data_args(airgap.bundle_overlay(True))[1::2]
H200 = str(REPO / "inventories" / "h200.py")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def warm_cache(root: Path) -> Path:
    """A cache directory as a warmed vLLM leaves it: nested kernels, an executable library, an empty directory."""
    (root / "vllm/torch_compile_cache/abc/rank_0_0").mkdir(parents=True)
    (root / "vllm/torch_compile_cache/abc/rank_0_0/computation_graph.py").write_text("# graph\n")
    (root / "triton/4f/").mkdir(parents=True)
    (root / "triton/4f/kernel.so").write_bytes(b"\x7fELF" + bytes(range(256)) * 40)
    (root / "triton/4f/kernel.so").chmod(0o755)
    (root / "triton/4f/kernel.json").write_text('{"name": "k"}\n')
    (root / "inductor").mkdir()
    return root


def packed(src: Path, **caps: int) -> bytes:
    out = io.BytesIO()
    pack(str(src), out, allowed_top=engine_cache.cache_subdirs("vllm"), **caps)
    return out.getvalue()


def hostile(tmp_path: Path, *members: tuple[tarfile.TarInfo, bytes]) -> Path:
    """A tar.gz written member by member, as an attacker would (no rule applied)."""
    path = tmp_path / "hostile.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return path


def member(name: str, data: bytes = b"x", kind: bytes = tarfile.REGTYPE, link: str = "") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname, info.mode = kind, len(data) if kind == tarfile.REGTYPE else 0, link, 0o4777
    return info, data


# ---------------------------------------------------------------- the archive


def test_the_archive_is_deterministic_whatever_times_owners_and_modes(tmp_path: Path) -> None:
    a = warm_cache(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    for path in [b, *b.rglob("*")]:  # other times, owner and modes, the same tree
        os.utime(path, (1_700_000_000, 1_700_000_000), follow_symlinks=False)
        if os.geteuid() == 0:
            os.chown(path, 65534, 65534)
        path.chmod((path.stat().st_mode & 0o111) | 0o664 if path.is_file() else 0o775)
    first = packed(a)
    assert packed(a) == first and packed(b) == first
    with tarfile.open(fileobj=io.BytesIO(first)) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names == ["inductor", "triton", "triton/4f", "triton/4f/kernel.json", "triton/4f/kernel.so", "vllm",
                     "vllm/torch_compile_cache", "vllm/torch_compile_cache/abc", "vllm/torch_compile_cache/abc/rank_0_0",
                     "vllm/torch_compile_cache/abc/rank_0_0/computation_graph.py"]
    assert {(m.uid, m.gid, m.uname, m.gname, m.mtime) for m in members} == {(0, 0, "root", "root", 0)}
    modes = {m.name: (m.type, m.mode) for m in members}
    assert modes["triton/4f/kernel.so"] == (tarfile.REGTYPE, 0o700) and modes["triton/4f/kernel.json"] == (tarfile.REGTYPE, 0o600)
    assert modes["inductor"] == (tarfile.DIRTYPE, 0o700)
    (b / "triton/4f/kernel.json").write_text('{"name": "other"}\n')
    assert packed(b) != first  # the bytes follow the content


def test_the_archive_refuses_links_specials_strays_and_oversize_sources(tmp_path: Path) -> None:
    src = warm_cache(tmp_path / "src")
    (src / "triton/4f/leak").symlink_to("/etc/shadow")
    with pytest.raises(CacheArchiveError, match=r"triton/4f/leak: a symbolic link"):
        packed(src)
    (src / "triton/4f/leak").unlink()
    os.mkfifo(src / "triton/4f/fifo")
    with pytest.raises(CacheArchiveError, match=r"triton/4f/fifo: not a regular file"):
        packed(src)
    (src / "triton/4f/fifo").unlink()
    link = tmp_path / "link"
    link.symlink_to(src)
    with pytest.raises(CacheArchiveError, match=r"not a directory of its own"):
        packed(link)  # SRC itself is never followed
    (src / "engine-cache").mkdir()  # the root copied instead of the engine's directory
    with pytest.raises(CacheArchiveError, match=r"engine-cache is not a cache the engine is pointed at"):
        packed(src)
    (src / "engine-cache").rmdir()
    size = (src / "triton/4f/kernel.so").stat().st_size
    with pytest.raises(CacheArchiveError, match=rf"kernel.so: {size} bytes, more than the {size - 1} allowed per file"):
        packed(src, max_file=size - 1)
    with pytest.raises(CacheArchiveError, match=r"more than the 1000 bytes allowed in all"):
        packed(src, max_total=1000)
    with pytest.raises(CacheArchiveError, match=r"more than the 3 allowed"):
        packed(src, max_members=3)
    assert packed(src)  # the same tree, rules met


@pytest.mark.parametrize("members, says", [
    ([member("triton/ok"), member("triton/evil", kind=tarfile.SYMTYPE, link="/etc/passwd")], "a symbolic link"),
    ([member("../x")], "not a plain relative path"),
    ([member("/tmp/k2-abs-member")], "not a plain relative path"),
    ([member("triton/../../x")], "not a plain relative path"),
    ([member("triton/ok"), member("triton/hard", kind=tarfile.LNKTYPE, link="triton/ok")], "a hard link"),
    ([member("triton/dev", kind=tarfile.CHRTYPE)], "not a regular file"),
    ([member("triton/big", b"y" * 2000)], "2000 bytes, more than the 1024 allowed per file"),
    ([member("triton/a", b"y" * 1000), member("triton/b", b"y" * 1000), member("triton/c", b"y" * 1000)],
     "more than the 2048 bytes allowed in all"),
    ([member("triton/same"), member("triton/same")], "'triton/same': File exists"),
])
def test_the_unpack_refuses_hostile_members_and_leaves_nothing(tmp_path: Path, members: list, says: str) -> None:
    archive = hostile(tmp_path, *members)
    parent = tmp_path / "engine-cache"
    dest = parent / "vllm"
    with pytest.raises(CacheArchiveError, match=says.replace("(", r"\(")):
        unpack(str(archive), sha256(archive.read_bytes()), str(dest), max_file=1024, max_total=2048)
    assert not dest.exists() and list(parent.iterdir()) == []  # no staging directory left behind
    assert not (tmp_path / "x").exists() and not Path("/tmp/k2-abs-member").exists()


def test_the_unpack_checks_the_digest_first_and_keeps_a_hosts_own_cache(tmp_path: Path) -> None:
    archive = tmp_path / "vllm.tar.gz"
    archive.write_bytes(packed(warm_cache(tmp_path / "src")))
    digest = sha256(archive.read_bytes())
    parent = tmp_path / "engine-cache"
    dest = parent / "vllm"
    with pytest.raises(CacheArchiveError, match=r"is not the bundle lock's"):
        unpack(str(archive), "0" * 64, str(dest))
    assert not parent.exists()  # refused before anything was made
    dest.mkdir(parents=True)  # the ExecStartPre made it; the engine has not written yet: empty
    assert "unpacked the bundle's engine cache, 3 files" in unpack(str(archive), digest, str(dest))
    assert (dest / "triton/4f/kernel.so").read_bytes() == (tmp_path / "src/triton/4f/kernel.so").read_bytes()
    modes = {str(p.relative_to(dest)): stat.S_IMODE(p.lstat().st_mode) for p in [dest, *dest.rglob("*")]}
    assert modes["."] == 0o700 and modes["triton/4f/kernel.so"] == 0o700 and modes["triton/4f/kernel.json"] == 0o600
    assert {m for p, m in modes.items() if (dest / p).is_dir()} == {0o700}
    assert stat.S_IMODE(parent.stat().st_mode) == 0o700
    (dest / "triton/4f/kernel.json").write_text("the host's own\n")
    assert "kept the host's own cache (not empty)" in unpack(str(archive), digest, str(dest))  # nothing extracted
    assert (dest / "triton/4f/kernel.json").read_text() == "the host's own\n"
    (tmp_path / "elsewhere").mkdir()
    shutil.rmtree(dest)
    dest.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CacheArchiveError, match=r"not a directory of its own"):
        unpack(str(archive), digest, str(dest))
    assert list((tmp_path / "elsewhere").iterdir()) == []


# ---------------------------------------------------------------- the bundle and its lock


def test_the_bundle_records_the_cache_in_its_lock_and_keeps_it_on_a_rebuild(tmp_path: Path) -> None:
    dep, plan = load_plan(H200, resolver=placeholder_resolver())
    src = warm_cache(tmp_path / "src")
    out = tmp_path / "bundle"
    said: list[str] = []
    build = dict(inventory="inventories/h200.py", rehearsal=False, caches=airgap.Caches(tmp_path / "cache"),
                 only=["images"], say=said.append)  # a venv fleet: no image, so only the cache is built
    lock, _ = airgap.make_bundle(dep, plan, out, engine_cache_src=src, **build)
    rel = airgap.engine_cache_rel("vllm")
    data = (out / rel).read_bytes()
    assert data == packed(src)
    contents = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    assert lock.part("engine_caches") == [{"engine": "vllm", "files": 3, "bytes": contents, "path": rel}]
    (entry,) = [a for a in lock.artifacts if a.kind == "engine-cache"]
    assert entry == Artifact(rel, "engine-cache", "vllm", dep.version, sha256(data), len(data),
                             f"k2fleet bundle --engine-cache {src}")
    on_disk = Lock.from_text((out / LOCK_NAME).read_text())
    assert on_disk == lock and json.loads((out / LOCK_NAME).read_text())["parts"]["engine_caches"][0]["path"] == rel
    again, _ = airgap.make_bundle(dep, plan, out, **build)  # no --engine-cache: the bundle's stays
    assert again == lock and any("engine cache: kept" in line for line in said)
    (out / rel).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    dropped, _ = airgap.make_bundle(dep, plan, out, **build)  # altered: not carried on
    assert dropped.part("engine_caches") == [] and not (out / rel).exists()
    airgap.make_bundle(dep, plan, out, engine_cache_src=src, **build)
    gone, _ = airgap.make_bundle(dep, plan, out, drop_engine_cache=True, **build)
    assert gone.part("engine_caches") == [] and not (out / rel).exists()
    (src / "triton/4f/leak").symlink_to("/etc/shadow")
    with pytest.raises(airgap.AirgapError, match=r"--engine-cache: .*triton/4f/leak: a symbolic link"):
        airgap.make_bundle(dep, plan, out, engine_cache_src=src, **build)
    assert not list((out / "engine-cache").glob(".*"))  # no half-written archive left


def placeholder_bundle(root: Path, inventory: str, cache: tuple[str, bytes] | None) -> None:
    """A bundle whose lock lists every part the rehearsal fleet needs (placeholder bytes, real
    sha256s: see the module doc) and, with ``cache`` (engine, archive bytes), an engine cache."""
    (root / LOCK_NAME).parent.mkdir(parents=True, exist_ok=True)
    (root / LOCK_NAME).write_text(Lock(inventory, True, {}, ()).to_text())  # validation asks for the lock
    dep, plan = load_plan(REPO / inventory, [*REHEARSAL, f"k2_bundle={root}"])
    needs = airgap.bundle_needs(dep, plan)
    parts: dict[str, list] = {p: [] for p in airgap.PART_KINDS}
    arts = []

    def put(rel: str, data: bytes, kind: str, name: str, version: str) -> None:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        arts.append(Artifact(rel, kind, name, version, sha256(data), len(data), "placeholder"))

    for i, deb in enumerate(needs.debs):
        put(f"debs/bundle-{i}.tar", b"placeholder", "deb-repo", f"bundle-{i}", "1")
        parts["debs"].append({"os": deb.os, "arch": deb.arch, "packages": list(deb.packages), "path": f"debs/bundle-{i}.tar"})
    for ws in needs.wheels:
        put(f"wheels/{ws.key}/placeholder-1-py3-none-any.whl", b"placeholder", "wheel", "placeholder", "1")
        parts["wheels"].append({"use": ws.use, "requirements": list(ws.requirements), "pythons": list(ws.pythons),
                                "archs": list(ws.archs), "path": f"wheels/{ws.key}"})
    for repo, revision, patterns in needs.checkpoints:
        rel = airgap.checkpoint_rel(repo, revision)
        put(f"{rel}/.k2fleet/manifest.json", b"{}", "checkpoint-manifest", repo, revision)
        parts["checkpoints"].append({"repo": repo, "revision": revision, "patterns": patterns, "path": rel})
    if cache is not None:
        engine, data = cache
        put(airgap.engine_cache_rel(engine), data, "engine-cache", engine, "1")
        parts["engine_caches"].append({"engine": engine, "files": 3, "bytes": 0, "path": airgap.engine_cache_rel(engine)})
    (root / LOCK_NAME).write_text(Lock(inventory, True, parts, tuple(arts)).to_text())


def host_archive(tmp_path: Path) -> Path:
    pyz = tmp_path / "k2fleet-host.pyz"
    pyz.write_bytes(archive_bytes())
    return pyz


def test_the_deploy_plans_the_unpack_only_with_a_bundle_that_carries_a_cache_and_the_host_refuses_a_mismatch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K2FLEET_STATE_DIR", str(tmp_path / "state"))
    inventory = "inventories/h800-pp.py"
    data = packed(warm_cache(tmp_path / "src"))
    digest = sha256(data)

    def plan_with(bundle: Path, cache: tuple[str, bytes] | None):
        placeholder_bundle(bundle, inventory, cache)
        dep, plan = load_plan(REPO / inventory, [*REHEARSAL, f"k2_bundle={bundle}"])
        art = read_control_artifacts(dep, plan)
        return dep, art, desired_state(dep, plan, art)

    dep, art, desired = plan_with(tmp_path / "without", None)
    assert art.engine_cache is None
    assert all(d.engine_cache_unpack is None and not d.files.get("engine_cache") for d in desired.values())
    _, art, desired = plan_with(tmp_path / "sglang", ("sglang", data))  # another engine's cache: of no use
    assert art.engine_cache is None and all(d.engine_cache_unpack is None for d in desired.values())

    bundle = tmp_path / "with"
    dep, art, desired = plan_with(bundle, ("vllm", data))
    assert art.engine_cache == (str(bundle / airgap.engine_cache_rel("vllm")), digest)
    engines = [d for d in desired.values() if d.engine_cache_unpack]
    assert engines and len(engines) == len(desired)  # every host of this fleet runs a vLLM rank
    for d in engines:
        spec = d.files["engine_cache"][engine_cache.archive_path("vllm")]
        assert spec.content == data and spec.mode == "600"
        assert d.engine_cache_unpack == ["/usr/bin/python3", ARCHIVE, "cache_archive", "unpack",
                                         engine_cache.archive_path("vllm"), digest, engine_cache.cache_dir("vllm")]
        assert engine_cache.cache_dir("vllm") in d.exists

    # the planned command, run here from the real host archive, on temporary paths
    pyz = host_archive(tmp_path)
    argv = engines[0].engine_cache_unpack
    archive = tmp_path / "host/vllm.tar.gz"
    archive.parent.mkdir()
    archive.write_bytes(spec.content)
    dest = tmp_path / "host/engine-cache/vllm"
    run = [sys.executable, str(pyz), *argv[2:4], str(archive), argv[5], str(dest)]
    bad = subprocess.run([*run[:5], "f" * 64, run[6]], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "is not the bundle lock's" in bad.stderr and not dest.parent.exists(), bad.stderr
    archive.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # the host's copy altered: the lock's digest no longer matches
    bad = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "is not the bundle lock's" in bad.stderr and not dest.parent.exists(), bad.stderr
    archive.write_bytes(data)
    good = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert good.returncode == 0 and "unpacked the bundle's engine cache, 3 files" in good.stdout, good.stderr
    assert (dest / "vllm/torch_compile_cache/abc/rank_0_0/computation_graph.py").read_text() == "# graph\n"
    kept = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert kept.returncode == 0 and "kept the host's own cache" in kept.stdout

    (bundle / airgap.engine_cache_rel("vllm")).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    dep, plan = load_plan(REPO / inventory, [*REHEARSAL, f"k2_bundle={bundle}"])
    with pytest.raises(ControlError, match=r"engine-cache/vllm.tar.gz: sha256 .* is not the lock's"):
        read_control_artifacts(dep, plan)


def test_the_engine_role_ships_and_unpacks_only_into_a_missing_cache_directory(tmp_path: Path,
                                                                              control_calls: list[str]) -> None:
    dep, plan, plain = planned(H200)
    data = packed(warm_cache(tmp_path / "src"))
    archive = tmp_path / "vllm.tar.gz"
    archive.write_bytes(data)
    art = dataclasses.replace(artifacts(dep, plan), engine_cache=(str(archive), sha256(data)))
    desired = desired_state(dep, plan, art)
    facts = settled_fleet(dep, desired)
    out = run_roles(dep, plan, desired, facts, tmp_path, control_calls, every_role=True)
    for host in desired:  # settled: the archive is there, so is the cache directory: neither is planned
        assert out.absent(host, "engine cache archive") and out.absent(host, "engine cache into")
    path, cache_dir = engine_cache.archive_path("vllm"), engine_cache.cache_dir("vllm")
    cold = dataclasses.replace(facts["h200-1"], files={k: v for k, v in facts["h200-1"].files.items() if k != path},
                               exists={**facts["h200-1"].exists, cache_dir: False})
    out = run_roles(dep, plan, desired, {**facts, "h200-1": cold}, tmp_path, control_calls)
    assert f"<upload> {path}" in out.op("h200-1", "engine cache archive").commands
    assert out.op("h200-1", "engine cache into").commands == [shell_line(desired["h200-1"].engine_cache_unpack)]
    assert out.absent("h200-0", "engine cache into")  # its own cache is there
    warm = dataclasses.replace(facts["h200-1"], files={k: v for k, v in facts["h200-1"].files.items() if k != path})
    out = run_roles(dep, plan, desired, {**facts, "h200-1": warm}, tmp_path, control_calls)
    assert out.op("h200-1", "engine cache into").commands == [shell_line(desired["h200-1"].engine_cache_unpack)]
    # (a changed archive is offered to the host program, which keeps a non-empty directory: tested above)
    assert all(d.engine_cache_unpack is None and "engine_cache" not in d.files for d in plain.values())
    cold_plain = dataclasses.replace(settled_fleet(dep, plain)["h200-1"], exists={cache_dir: False})
    out = run_roles(dep, plan, plain, {**settled_fleet(dep, plain), "h200-1": cold_plain}, tmp_path, control_calls)
    assert out.absent("h200-1", "engine cache into")  # no bundle cache: nothing to unpack


def test_down_keeps_the_engine_caches_unless_purged_and_removes_the_archive() -> None:
    dep, plan, desired = planned(H200)
    for name, d in desired.items():
        p = teardown.placed(dep, plan.hosts[name], d)
        assert engine_cache.CACHE_ROOT in p.kept and engine_cache.CACHE_ROOT in p.down_spec(purge=True)["purge"]
        assert engine_cache.CACHE_ROOT in p.down_spec(purge=False)["kept"]
        assert any(engine_cache.ARCHIVE_DIR.startswith(t + "/") for t in p.trees)  # removed with /var/cache/k2fleet
