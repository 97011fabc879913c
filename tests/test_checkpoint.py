"""Checkpoint download → manifest → verify → repair → overlay, against the Hub TEST DOUBLE.

Real huggingface_hub code talks to ``k2sandbox/hub_double.py`` on 127.0.0.1 only
(HF_ENDPOINT and ``endpoint=`` both point at it); nothing leaves loopback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
for p in (str(REPO_ROOT), str(Path(__file__).resolve().parent)):
    if p not in sys.path:
        sys.path.insert(0, p)

from synth_checkpoint import describe_dir, make_checkpoint, manifest_for, shard_name  # noqa: E402

from k2fleet.hostprogs import verify as verify_mod  # noqa: E402
from k2fleet.hostprogs.download import download, fetch_and_verify, repair  # noqa: E402
from k2fleet.hostprogs.manifest import (  # noqa: E402
    UnpinnedRevisionError,
    build_manifest,
    manifest_from_dir,
    save_manifest,
)
from k2fleet.hostprogs.overlay import NotVerifiedError, make_overlay, overlay_problems  # noqa: E402
from k2fleet.hostprogs.verify import load_manifest, marker_path, verify  # noqa: E402
from k2sandbox.hub_double import HubDouble  # noqa: E402

REPO = "moonshotai/Kimi-K2-Thinking"
SHARD_BYTES = 64 * 1024
VERIFY_PY = REPO_ROOT / "k2fleet" / "hostprogs" / "verify.py"


def shard(i: int) -> str:
    return shard_name(i, 62)


@pytest.fixture(scope="session")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic checkpoint the double serves (never modified by tests)."""
    root = tmp_path_factory.mktemp("source")
    make_checkpoint(root, num_shards=62, shard_bytes=SHARD_BYTES)
    return root


@pytest.fixture(autouse=True)
def hf_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Isolate huggingface_hub: private HF_HOME/cache, no ambient token, no progress bars."""
    import huggingface_hub.constants as hfc

    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(hfc, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(hfc, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(hfc, "HF_HUB_DISABLE_PROGRESS_BARS", True)


@pytest.fixture
def hub(source: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubDouble]:
    with HubDouble() as double:
        double.sha = double.add_commit(REPO, source)  # type: ignore[attr-defined]
        monkeypatch.setenv("HF_ENDPOINT", double.url)
        yield double


@pytest.fixture
def fetched(hub: HubDouble, tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A checkpoint downloaded at the pinned sha, verified, with its manifest."""
    target = tmp_path / "ckpt"
    report = fetch_and_verify(REPO, hub.sha, target, endpoint=hub.url)  # type: ignore[attr-defined]
    assert report.ok, report.lines()
    return target, load_manifest(str(target / ".k2fleet" / "manifest.json"))


@pytest.fixture
def local_ckpt(tmp_path: Path) -> Path:
    """A synthetic checkpoint with no Hub involved (mutate it freely)."""
    root = tmp_path / "local"
    make_checkpoint(root, num_shards=62, shard_bytes=4096)
    return root


def local_manifest(root: Path) -> dict[str, Any]:
    return manifest_for(describe_dir(root), REPO, "b" * 40)


def kinds(report: verify_mod.Report) -> list[tuple[str, str]]:
    return sorted((p.path, p.kind) for p in report.problems)


# --------------------------------------------------------------------------- download + verify


def test_download_at_pinned_sha_then_verify_ok(fetched: tuple[Path, dict[str, Any]], source: Path) -> None:
    target, manifest = fetched
    expected = {f.path: f for f in describe_dir(source)}
    assert manifest["revision"] == manifest["revision"].lower() and len(manifest["revision"]) == 40
    assert set(manifest["files"]) == set(expected)
    assert sum(name.endswith(".safetensors") for name in manifest["files"]) == 62
    assert manifest["files"][shard(1)] == {"size": expected[shard(1)].size, "sha256": expected[shard(1)].sha256}
    assert manifest["files"]["config.json"]["sha256"] is None
    assert manifest["files"]["config.json"]["git_blob_sha1"] == expected["config.json"].git_blob_sha1
    marker = json.loads(Path(marker_path(str(target))).read_text())
    assert marker["revision"] == manifest["revision"] and len(marker["files"]) == len(expected)


@pytest.mark.parametrize(
    "mutation, kind",
    [("bitflip", "hash_mismatch"), ("truncate", "size_mismatch"), ("delete", "missing")],
)
def test_damaged_shard_is_named_and_only_it_is_refetched(
    fetched: tuple[Path, dict[str, Any]], hub: HubDouble, mutation: str, kind: str
) -> None:
    target, manifest = fetched
    bad = shard(7)
    path = target / bad
    st = path.stat()
    if mutation == "bitflip":
        with open(path, "r+b") as f:
            f.seek(st.st_size - 100)
            byte = f.read(1)
            f.seek(st.st_size - 100)
            f.write(bytes([byte[0] ^ 0x01]))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # silent corruption: same size, inode, mtime
    elif mutation == "truncate":
        os.truncate(path, st.st_size // 2)
    else:
        path.unlink()

    report = verify(str(target), manifest)  # not --full: the marker must not hide the damage
    assert not report.ok
    assert kinds(report) == [(bad, kind)]
    assert not Path(marker_path(str(target))).exists()

    hub.reset_counters()
    assert repair(target, manifest, [bad], endpoint=hub.url) == [bad]
    assert dict(hub.bytes_served) == {bad: manifest["files"][bad]["size"]}
    assert verify(str(target), manifest).ok


def test_index_naming_absent_shard_is_an_error(local_ckpt: Path) -> None:
    index_path = local_ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.99.extra.weight"] = "model-00063-of-000062.safetensors"
    index_path.write_text(json.dumps(index))
    report = verify(str(local_ckpt), local_manifest(local_ckpt))
    assert kinds(report) == [("model-00063-of-000062.safetensors", "index_unknown_shard")]


def test_shard_missing_from_index_is_an_error(local_ckpt: Path) -> None:
    index_path = local_ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard(5)}
    index_path.write_text(json.dumps(index))
    report = verify(str(local_ckpt), local_manifest(local_ckpt))
    assert kinds(report) == [(shard(5), "not_in_index")]


@pytest.mark.parametrize("damage", ["huge_length", "not_json", "offsets_past_end"])
def test_bad_safetensors_header_is_an_error(local_ckpt: Path, damage: str) -> None:
    path = local_ckpt / shard(3)
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    if damage == "huge_length":
        data[:8] = (len(data) * 2).to_bytes(8, "little")
    elif damage == "not_json":
        data[8:10] = b"\xff\xfe"
    else:
        header = json.loads(data[8 : 8 + n])
        first = next(k for k in header if k != "__metadata__")
        header[first]["data_offsets"][1] = len(data)
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (n - len(raw))
        assert len(raw) == n
        data[8 : 8 + n] = raw
    path.write_bytes(bytes(data))
    report = verify(str(local_ckpt), local_manifest(local_ckpt))  # hashes match: only the header is wrong
    assert kinds(report) == [(shard(3), "bad_header")]


def test_instruct_style_unpadded_shard_names_verify(tmp_path: Path) -> None:
    root = tmp_path / "instruct"
    make_checkpoint(root, num_shards=61, shard_bytes=2048, style="instruct")
    assert (root / "model-1-of-61.safetensors").is_file()
    assert verify(str(root), local_manifest(root)).ok


# --------------------------------------------------------------------------- interrupted downloads


def test_dropped_connection_resumes_with_range(hub: HubDouble, tmp_path: Path) -> None:
    victim, cut = shard(11), 40_000
    hub.cut_next(victim, after_bytes=cut)
    target = tmp_path / "ckpt"
    report = fetch_and_verify(REPO, hub.sha, target, endpoint=hub.url)  # type: ignore[attr-defined]
    assert report.ok, report.lines()

    gets = hub.requests_for(victim, "GET")
    assert [(g.range, g.status) for g in gets] == [(None, 200), (f"bytes={cut}-", 206)]
    assert hub.bytes_served[victim] == (target / victim).stat().st_size  # no byte sent twice


def test_rerun_after_failed_download_fetches_only_what_is_missing(hub: HubDouble, tmp_path: Path) -> None:
    from huggingface_hub.errors import HfHubHTTPError

    victim = shard(9)
    target = tmp_path / "ckpt"
    manifest = build_manifest(REPO, hub.sha, endpoint=hub.url)  # type: ignore[attr-defined]
    hub.fail_next(victim, status=403)
    with pytest.raises(HfHubHTTPError):
        download(REPO, hub.sha, target, manifest["files"], endpoint=hub.url)  # type: ignore[attr-defined]
    finished = {rel for rel in manifest["files"] if (target / rel).is_file()}
    assert finished == set(manifest["files"]) - {victim}  # one failure does not cancel the others
    orphan = target / ".cache" / "huggingface" / "download" / f"x.{'0' * 64}.deadbeef.incomplete"
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(b"partial bytes left by a killed hf_hub_download")

    hub.reset_counters()
    download(REPO, hub.sha, target, manifest["files"], endpoint=hub.url)  # type: ignore[attr-defined]
    assert set(hub.bytes_served) == {victim}  # finished files are not fetched again
    assert not list(target.rglob("*.incomplete")) and not list(target.rglob("*.part"))
    assert verify(str(target), manifest).ok


def _download_cli(hub: HubDouble, target: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "k2fleet.hostprogs.download", REPO, "--revision", hub.sha,  # type: ignore[attr-defined]
         "--dir", str(target), "--max-workers", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
        env={**os.environ, "HF_ENDPOINT": hub.url, "PYTHONPATH": str(REPO_ROOT)},
    )


def test_killed_download_resumes_partial_file_and_skips_finished_ones(hub: HubDouble, tmp_path: Path) -> None:
    import signal
    import time

    victim, cut = shard(30), 40_000
    target = tmp_path / "ckpt"
    stalled = hub.stall_next(victim, after_bytes=cut)
    proc = _download_cli(hub, target)
    try:
        assert stalled.wait(60), "the download never reached the victim shard"
        manifest = build_manifest(REPO, hub.sha, endpoint=hub.url)  # type: ignore[attr-defined]
        others = set(manifest["files"]) - {victim}
        parts = target / ".k2fleet" / "partial"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # everything else lands, the victim hangs at `cut` bytes
            done = {rel for rel in others if (target / rel).is_file()}
            part_bytes = sum(p.stat().st_size for p in parts.glob(f"{victim}.*.part"))
            if done == others and part_bytes == cut:
                break
            time.sleep(0.05)
        assert done == others and part_bytes == cut
        proc.send_signal(signal.SIGKILL)  # no cleanup of any kind
        proc.wait(10)
    finally:
        proc.kill()
        hub.release()
    assert proc.returncode == -signal.SIGKILL and not (target / victim).exists()

    hub.reset_counters()
    rerun = _download_cli(hub, target)
    out, err = rerun.communicate(timeout=120)
    assert rerun.returncode == 0, err
    gets = [r for r in hub.requests if r.method == "GET" and r.rfilename in manifest["files"]]
    assert [(g.rfilename, g.range, g.status) for g in gets] == [(victim, f"bytes={cut}-", 206)]
    size = manifest["files"][victim]["size"]
    assert hub.bytes_served == {victim: size - cut}  # only the missing tail crossed the network
    assert verify(str(target), manifest, full=True).ok and not list(parts.glob("*"))


# --------------------------------------------------------------------------- fast re-verify + CLI


def test_fast_reverify_skips_hashing_and_full_rehashes(
    fetched: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    target, manifest = fetched
    calls: list[int] = []
    real_hash_fd = verify_mod.hash_fd

    def spy(fd: int, hasher: Any, buf: bytearray) -> int:
        calls.append(fd)
        return real_hash_fd(fd, hasher, buf)

    monkeypatch.setattr(verify_mod, "hash_fd", spy)
    total = sum(e["size"] for e in manifest["files"].values())

    quick = verify(str(target), manifest)
    assert quick.ok and calls == [] and quick.bytes_hashed == 0
    assert quick.files_skipped == len(manifest["files"])

    full = verify(str(target), manifest, full=True)
    assert full.ok and len(calls) == len(manifest["files"]) and full.bytes_hashed == total

    (target / "tokenization_kimi.py").write_text("# changed\n")  # touched file: re-hashed, caught
    calls.clear()
    report = verify(str(target), manifest)
    assert kinds(report) == [("tokenization_kimi.py", "size_mismatch")] and calls == []


def test_verify_cli_is_stdlib_only_and_reports_one_line_per_problem(
    fetched: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    target, _ = fetched
    from k2fleet.planning.host_archive import archive_bytes

    archive = tmp_path / "host" / "k2fleet-host.pyz"  # as a fleet host runs it: the archive, no site-packages
    archive.parent.mkdir()
    archive.write_bytes(archive_bytes())
    cmd = [sys.executable, "-I", "-S", str(archive), "verify", str(target)]

    ok = subprocess.run(cmd + ["--full", "--workers", "2"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.strip().splitlines()[-1].startswith("OK revision ")

    (target / shard(2)).unlink()
    with open(target / shard(4), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 0x80]))
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1
    fails = [line for line in bad.stdout.splitlines() if line.startswith("FAIL ")]
    assert [line.split()[1:3] for line in fails] == [
        ["missing", shard(2) + ":"],
        ["hash_mismatch", shard(4) + ":"],
    ]

    as_json = subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=60)
    data = json.loads(as_json.stdout)
    assert as_json.returncode == 1 and data["ok"] is False
    assert {(p["path"], p["kind"]) for p in data["problems"]} == {(shard(2), "missing"), (shard(4), "hash_mismatch")}


# --------------------------------------------------------------------------- tokens and revisions


def test_token_is_used_but_never_in_argv_or_output(hub: HubDouble, tmp_path: Path) -> None:
    token = "hf_k2fleetTestDoubleSecret0123456789"
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    target = tmp_path / "ckpt"
    env = {**os.environ, "HF_ENDPOINT": hub.url, "PYTHONPATH": str(REPO_ROOT)}
    argv = [
        sys.executable, "-m", "k2fleet.hostprogs.download", REPO,
        "--revision", hub.sha, "--dir", str(target), "--token-file", str(token_file),  # type: ignore[attr-defined]
    ]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert token not in " ".join(argv)
    assert token not in run.stdout and token not in run.stderr
    assert {r.authorization for r in hub.requests} == {f"Bearer {token}"}
    for path in target.rglob("*"):
        if path.is_file():
            assert token.encode() not in path.read_bytes(), path

    env_run = subprocess.run(  # same through env HF_TOKEN, with a repair (--only)
        argv[:-2] + ["--only", shard(1)], capture_output=True, text=True, timeout=120,
        env={**env, "HF_TOKEN": token}, cwd=tmp_path,
    )
    assert env_run.returncode == 0, env_run.stdout + env_run.stderr
    assert token not in env_run.stdout + env_run.stderr


def test_moving_branch_is_refused_or_resolved_explicitly(
    hub: HubDouble, source: Path, tmp_path: Path
) -> None:
    first = hub.sha  # type: ignore[attr-defined]
    with pytest.raises(UnpinnedRevisionError, match=first):
        build_manifest(REPO, "main", endpoint=hub.url)
    resolved = build_manifest(REPO, "main", endpoint=hub.url, resolve=True)
    assert resolved["revision"] == first and resolved["resolved_from"] == "main"

    newer = tmp_path / "newer"
    shutil.copytree(source, newer)
    cfg = json.loads((newer / "config.json").read_text())
    (newer / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 131072}))
    second = hub.add_commit(REPO, newer)  # "main" moves
    assert second != first
    assert build_manifest(REPO, "main", endpoint=hub.url, resolve=True)["revision"] == second

    with pytest.raises(ValueError, match="pin"):
        download(REPO, "main", tmp_path / "x", {}, endpoint=hub.url)
    target = tmp_path / "pinned"
    assert fetch_and_verify(REPO, first, target, endpoint=hub.url).ok
    assert (target / "config.json").read_bytes() == (source / "config.json").read_bytes()

    cli = subprocess.run(
        [sys.executable, "-m", "k2fleet.hostprogs.download", REPO, "--revision", "main", "--dir", str(tmp_path / "y")],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "HF_ENDPOINT": hub.url, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert cli.returncode == 2 and "commit sha" in cli.stderr


# --------------------------------------------------------------------------- overlay + air-gapped manifests


def test_overlay_rewrites_model_type_and_leaves_verified_files_alone(
    fetched: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    target, manifest = fetched
    original = (target / "config.json").read_bytes()
    overlay_dir = tmp_path / "overlay"
    record = make_overlay(target, overlay_dir, manifest)

    assert (target / "config.json").read_bytes() == original
    assert json.loads(original)["model_type"] == "kimi_k2"
    cfg = json.loads((overlay_dir / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3"
    assert {k: v for k, v in cfg.items() if k != "model_type"} == {
        k: v for k, v in json.loads(original).items() if k != "model_type"
    }
    assert not (overlay_dir / "config.json").is_symlink()
    assert (overlay_dir / shard(1)).resolve() == (target / shard(1)).resolve()
    assert record["links"] == len(manifest["files"]) - 1
    assert record["source_model_type"] == "kimi_k2" and record["model_type"] == "deepseek_v3"

    manifest["overlay"] = record
    save_manifest(target, manifest)
    again = verify(str(target), manifest)  # the overlay record does not invalidate the marker
    assert again.ok and again.bytes_hashed == 0
    assert overlay_problems(record, manifest) == []

    (target / shard(1)).unlink()
    assert not verify(str(target), manifest).ok
    with pytest.raises(NotVerifiedError):
        make_overlay(target, overlay_dir, manifest)


def test_manifest_from_dir_air_gapped(fetched: tuple[Path, dict[str, Any]], hub: HubDouble, tmp_path: Path) -> None:
    target, manifest = fetched
    assert manifest_from_dir(target) == manifest  # .k2fleet/manifest.json

    from huggingface_hub import snapshot_download

    # what `hf download REPO --revision SHA --local-dir D` leaves: hf's own tree listing
    hf_local = tmp_path / "hf_local_dir"
    snapshot_download(REPO, revision=hub.sha, local_dir=str(hf_local), endpoint=hub.url)  # type: ignore[attr-defined]
    from_tree = manifest_from_dir(hf_local, repo_id=REPO)
    assert from_tree["revision"] == manifest["revision"] and from_tree["files"] == manifest["files"]

    cache = tmp_path / "hf_cache"
    snapshot = snapshot_download(REPO, revision=hub.sha, cache_dir=str(cache), endpoint=hub.url)  # type: ignore[attr-defined]
    repo_folder = cache / "models--moonshotai--Kimi-K2-Thinking"
    for where in (repo_folder, Path(snapshot)):
        from_cache = manifest_from_dir(where)
        assert from_cache["repo_id"] == REPO and from_cache["files"] == manifest["files"]
        assert verify(str(snapshot), from_cache, file_symlinks=True).ok  # its files are symlinks to its blobs
        assert not verify(str(snapshot), from_cache).ok  # never followed unless asked


# --------------------------------------------------------------------------- the downloader as shipped


def test_downloader_as_shipped_to_a_host_imports_from_its_own_files_only(tmp_path: Path) -> None:
    from k2fleet.planning.host_archive import archive_bytes

    lib = tmp_path / "k2fleet-host.pyz"
    lib.write_bytes(archive_bytes())
    code = (f"import sys; sys.path.insert(0, {str(lib)!r}); import k2fleet.hostprogs.download as d; "
            f"cm = d.download_lock({str(tmp_path / 'ckpt')!r})\nwith cm: print(d.__file__)")
    # -I -S: no k2fleet checkout, no site-packages; only what the host archive ships
    run = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(lib / "k2fleet/hostprogs/download.py")
    assert (tmp_path / "ckpt" / ".k2fleet" / "download.lock").exists()


def test_download_lock_taken_twice_in_one_gevent_process_waits_without_deadlock(tmp_path: Path) -> None:
    """pyinfra runs hosts' deploys as greenlets of one process: a second greenlet asking
    for the same directory's lock must wait for the first, not freeze the process."""
    code = f"""
from gevent import monkey; monkey.patch_all()
import gevent, sys, time
sys.path.insert(0, {str(REPO_ROOT)!r})
from k2fleet.hostprogs.download import download_lock
order = []
def take(name, hold):
    with download_lock({str(tmp_path)!r}):
        order.append(name + "+")
        gevent.sleep(hold)
        order.append(name + "-")
a = gevent.spawn(take, "a", 0.3)
gevent.sleep(0.05)
b = gevent.spawn(take, "b", 0)
gevent.joinall([a, b])
print(" ".join(order))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["a+", "a-", "b+", "b-"]


# --------------------------------------------------------------------------- the fetcher's download feeds its relay


def _relay_serve(root: Path) -> tuple[subprocess.Popen[str], str]:
    """A real ``relay serve`` of ``root`` on loopback (no secret: a loopback test), and its URL."""
    root.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "k2fleet.hostprogs.relay", "serve", str(root), "--bind", "127.0.0.1",
                             "--port", "0", "--exit-with-parent"], stdout=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    port = json.loads(proc.stdout.readline())["port"]  # type: ignore[union-attr]
    return proc, f"http://127.0.0.1:{port}"


def _publishing_download(hub: HubDouble, target: Path, sha: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "k2fleet.hostprogs.download", REPO, "--revision", sha, "--dir", str(target),
         "--max-workers", "1", "--publish"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
        env={**os.environ, "HF_ENDPOINT": hub.url, "PYTHONPATH": str(REPO_ROOT)},
    )


def _relay_fetch(target: Path, source: str, give_up: float = 120) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "k2fleet.hostprogs.relay", "fetch", str(target), "--source", source,
                             "--repo", REPO, "--give-up-after", str(give_up), "--dead-after", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})


def test_publishing_download_feeds_its_relay_file_by_file_and_receivers_wait_for_the_rest(
        hub: HubDouble, tmp_path: Path) -> None:
    """The fetcher host's Hub download (``--publish``) and a receiver's relay fetch from the
    fetcher's relay run at once: while the download hangs inside one shard, the receiver
    already holds (verified) every file before it in name order and waits for that one
    rather than failing; after the Hub lets go, both end complete, each byte from the Hub once."""
    import time

    fetcher, receiver = tmp_path / "fetcher", tmp_path / "receiver"
    victim, cut = shard(30), 40_000
    stalled = hub.stall_next(victim, after_bytes=cut)
    serve, url = _relay_serve(fetcher)
    download_proc = _publishing_download(hub, fetcher, hub.sha)  # type: ignore[attr-defined]
    fetch_proc = _relay_fetch(receiver, url)
    try:
        assert stalled.wait(60), "the download never reached the victim shard"
        manifest = build_manifest(REPO, hub.sha, endpoint=hub.url)  # type: ignore[attr-defined]
        before = {rel for rel in manifest["files"] if rel < victim}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            got = {rel for rel in before if (receiver / rel).is_file()}
            if got == before:
                break
            time.sleep(0.05)
        assert got == before  # every earlier file reached the receiver while the download still runs
        assert download_proc.poll() is None and fetch_proc.poll() is None  # the receiver waits, not fails
        assert not (receiver / victim).exists() and not (fetcher / victim).exists()
        for rel in before:  # what the receiver holds is what the manifest names
            assert verify_mod.check_one(str(receiver), manifest, rel)[0] is not None, rel
    finally:
        hub.release()
    out, err = download_proc.communicate(timeout=120)
    assert download_proc.returncode == 0, err
    out, err = fetch_proc.communicate(timeout=120)
    serve.kill()
    assert fetch_proc.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["files"] == len(manifest["files"]) and report["bad_shards"] == [] and report["verified"]
    assert verify(str(receiver), manifest, full=True).ok and verify(str(fetcher), manifest, full=True).ok
    assert hub.bytes_served[victim] == manifest["files"][victim]["size"]  # resumed: no byte twice
    assert sum(hub.bytes_served.values()) == sum(e["size"] for e in manifest["files"].values())


def test_a_file_the_hub_sends_wrong_is_never_served_and_receivers_give_up_naming_it(
        source: Path, tmp_path: Path) -> None:
    """The Hub's bytes for one shard do not match its own metadata (sha256): the publishing
    download fetches it twice, never marks it, exits 1; its relay never serves it (the
    receiver received no bad bytes at all), and the receiver, with no source that has or
    fetches it, fails naming the file instead of waiting forever."""
    served = tmp_path / "served"
    shutil.copytree(source, served)
    victim = shard(5)
    with HubDouble() as hub:
        sha = hub.add_commit(REPO, served)
        data = bytearray((served / victim).read_bytes())
        data[-1] ^= 0xFF  # same size, other bytes: what the Hub says it serves is not what it serves
        (served / victim).write_bytes(bytes(data))
        fetcher, receiver = tmp_path / "fetcher", tmp_path / "receiver"
        serve, url = _relay_serve(fetcher)
        download_proc = _publishing_download(hub, fetcher, sha)
        fetch_proc = _relay_fetch(receiver, url, give_up=3)
        _, err = download_proc.communicate(timeout=120)
        out, ferr = fetch_proc.communicate(timeout=120)
        serve.kill()
        assert download_proc.returncode == 1, err
        assert len(hub.requests_for(victim, "GET")) >= 2  # fetched again at once, then by the final repair
    assert fetch_proc.returncode != 0 and victim in ferr and "fetching it" in ferr, ferr
    assert not (receiver / victim).exists()
    assert not (fetcher / ".k2fleet" / "relay" / f"{victim}.ok").exists()
    partial = receiver / ".k2fleet" / "relay-partial" / victim  # made (sized, empty) before its first byte
    assert not partial.exists() or partial.read_bytes().count(0) == partial.stat().st_size  # no byte of it was sent
