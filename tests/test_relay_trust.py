"""The relay trusts no peer beyond what the pin proves (exploit tests, real sockets, loopback).

A hostile peer serves the relay's ``/manifest`` route with a manifest that names files
outside the checkpoint (an absolute path, ``..``), another revision or repository, or a
checkpoint of other bytes under the pinned revision; a receiving ``relay fetch`` must refuse
that manifest, write nothing outside its directory (an existing file there keeps its bytes),
mark nothing (so serve nothing onward) and fail when no honest source is left. A manifest
too large to be one is refused unread.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from k2fleet.hostprogs import verify
from k2sandbox.checkpoint_cache import ensure_synthetic_checkpoint

RELAY_ARGV = [sys.executable, "-m", "k2fleet.hostprogs.relay"]
REPO, REV = "t/Kimi-K2-Thinking", "e" * 40


class FakePeer:
    """A loopback HTTP server answering ``/manifest`` with ``body`` and any file with ``payload``."""

    def __init__(self, body: bytes, payload: bytes = b"pwned\n") -> None:
        self.requests: list[str] = []
        peer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                peer.requests.append(self.path)
                data = body if self.path == "/manifest" else payload
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def fetch(root: Path, *sources: str, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    argv = [*RELAY_ARGV, "fetch", str(root), "--give-up-after", "3", "--dead-after", "1",
            "--repo", REPO, "--revision", REV, *extra]
    for url in sources:
        argv += ["--source", url]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def manifest(files: dict[str, dict], revision: str = REV, repo: str = REPO) -> bytes:
    return json.dumps({"repo_id": repo, "revision": revision, "files": files}).encode()


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path]:
    """(the checkpoint directory two levels down, a file outside it that must keep its bytes)."""
    root = tmp_path / "models" / "ckpt"
    root.mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("original\n")
    return root, victim


def outside(tmp_path: Path, root: Path) -> set[Path]:
    return {p for p in tmp_path.rglob("*") if p.is_file() and root not in p.parents}


SHA = hashlib.sha256(b"pwned\n").hexdigest()


@pytest.mark.parametrize("name", ["/ABS/victim.txt", "../../victim.txt", "../escaped.txt", "a/../../victim.txt",
                                  "./x", ".k2fleet/manifest.json", ""])
def test_a_manifest_naming_files_outside_the_checkpoint_is_refused(layout: tuple[Path, Path], tmp_path: Path,
                                                                   name: str) -> None:
    root, victim = layout
    name = name.replace("/ABS/", f"{tmp_path}/")
    peer = FakePeer(manifest({name: {"size": 6, "sha256": SHA}, "config.json": {"size": 6, "sha256": SHA}}))
    before = outside(tmp_path, root)
    try:
        out = fetch(root, peer.url)
    finally:
        peer.close()
    assert out.returncode != 0, out.stdout
    assert "refused" in out.stderr and "manifest" in out.stderr, out.stderr
    assert victim.read_text() == "original\n"
    assert outside(tmp_path, root) == before  # nothing written outside (escaped.txt two levels up included)
    assert not (root / ".k2fleet" / "relay").exists() or not any((root / ".k2fleet" / "relay").iterdir())
    assert [r for r in peer.requests if r != "/manifest"] == []  # not one file asked for


@pytest.mark.parametrize("body, reason", [
    (manifest({}, revision="f" * 40), "revision"),
    (manifest({}, repo="evil/Kimi-K2-Thinking"), "repo"),
    (b"[1, 2]", "manifest"),
    (b"{not json", "manifest"),
    (json.dumps({"repo_id": REPO, "revision": REV, "files": {"x": {"size": -1, "sha256": SHA}}}).encode(), "manifest"),
])
def test_a_manifest_of_another_revision_or_malformed_is_refused(layout: tuple[Path, Path], body: bytes,
                                                                reason: str) -> None:
    root, _ = layout
    peer = FakePeer(body)
    try:
        out = fetch(root, peer.url)
    finally:
        peer.close()
    assert out.returncode != 0 and reason in out.stderr, out.stderr
    assert not (root / ".k2fleet" / "manifest.json").exists()


def test_a_manifest_too_large_to_be_one_is_refused(layout: tuple[Path, Path]) -> None:
    root, _ = layout
    peer = FakePeer(b"{" + b" " * (65 << 20) + b"}")
    try:
        out = fetch(root, peer.url)
    finally:
        peer.close()
    assert out.returncode != 0 and "too large" in out.stderr, out.stderr[-500:]


def test_a_peer_serving_other_bytes_under_the_pinned_revision_is_refused(tmp_path: Path) -> None:
    """The pinned revision is not enough: another checkpoint with a consistent manifest of
    its own (other sha256s) passes every per-file check; the control copy's manifest digest
    handed to the fetch (``--manifest-digest``) is what refuses it."""
    honest = ensure_synthetic_checkpoint(tmp_path / "honest", REPO, REV, num_shards=3, shard_bytes=4096)
    forged = ensure_synthetic_checkpoint(tmp_path / "forged", REPO, REV, num_shards=3, shard_bytes=5000)
    pinned = verify.manifest_digest(verify.load_manifest(str(honest / ".k2fleet" / "manifest.json")))
    peer = FakePeer((forged / ".k2fleet" / "manifest.json").read_bytes())
    root = tmp_path / "dest"
    try:
        out = fetch(root, peer.url, extra=("--manifest-digest", pinned))
    finally:
        peer.close()
    assert out.returncode != 0 and "digest" in out.stderr, out.stderr
    assert [r for r in peer.requests if r != "/manifest"] == []


def test_a_refused_peer_is_skipped_for_an_honest_one(tmp_path: Path) -> None:
    """A hostile first source cannot stop the fetch: the next source's manifest is taken."""
    honest = ensure_synthetic_checkpoint(tmp_path / "honest", REPO, REV, num_shards=3, shard_bytes=4096)
    assert subprocess.run([*RELAY_ARGV, "mark", str(honest)], capture_output=True).returncode == 0
    server = subprocess.Popen([*RELAY_ARGV, "serve", str(honest), "--bind", "127.0.0.1", "--port", "0"],
                              stdout=subprocess.PIPE, text=True)
    port = json.loads(server.stdout.readline())["port"]  # type: ignore[union-attr]
    evil = FakePeer(manifest({"../../escaped.txt": {"size": 6, "sha256": SHA}}))
    pinned = verify.manifest_digest(verify.load_manifest(str(honest / ".k2fleet" / "manifest.json")))
    try:
        out = fetch(tmp_path / "dest", evil.url, f"http://127.0.0.1:{port}", extra=("--manifest-digest", pinned))
    finally:
        evil.close()
        server.kill()
        server.wait()
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["verified"] and report["bad_shards"] == [] and not (tmp_path / "escaped.txt").exists()


def test_the_start_gate_refuses_a_verified_checkpoint_of_another_revision(tmp_path: Path) -> None:
    """A copy whose manifest (and marker) say another revision is verified as itself, but
    the units' start gate and the fact's check are pinned: they fail on it."""
    other = ensure_synthetic_checkpoint(tmp_path / "other", REPO, "f" * 40, num_shards=2, shard_bytes=4096)
    verify_argv = [*RELAY_ARGV[:2], "k2fleet.hostprogs.verify"]
    assert subprocess.run([*verify_argv, str(other)], capture_output=True).returncode == 0  # verified as itself
    for extra in ((), ("--marker-only",)):
        pinned = subprocess.run([*verify_argv, *extra, "--repo", REPO, "--revision", REV, str(other)],
                                capture_output=True, text=True)
        assert pinned.returncode == 1, (extra, pinned.stdout)
        same = subprocess.run([*verify_argv, *extra, "--repo", REPO, "--revision", "f" * 40, str(other)],
                              capture_output=True, text=True)
        assert same.returncode == 0, (extra, same.stdout)
    moved = subprocess.run([*verify_argv, "--repo", "evil/x", "--revision", "f" * 40, str(other)], capture_output=True,
                           text=True)
    assert moved.returncode == 1 and "pinned evil/x" in moved.stdout


# ---------------------------------------------------------------- the relay server: authenticated and bounded


@pytest.fixture
def served(tmp_path: Path):
    """A relay serving a marked synthetic checkpoint on loopback with a secret file:
    (port, the secret, the checkpoint)."""
    root = ensure_synthetic_checkpoint(tmp_path / "served", REPO, REV, num_shards=3, shard_bytes=64 << 10)
    assert subprocess.run([*RELAY_ARGV, "mark", str(root)], capture_output=True).returncode == 0
    secret = tmp_path / "relay.secret"
    fd = __import__("os").open(secret, __import__("os").O_WRONLY | __import__("os").O_CREAT, 0o600)
    __import__("os").write(fd, b"s3cret-relay-token-0123456789abcdef\n")
    __import__("os").close(fd)
    server = subprocess.Popen([*RELAY_ARGV, "serve", str(root), "--bind", "127.0.0.1", "--port", "0",
                               "--secret-file", str(secret)], stdout=subprocess.PIPE, text=True)
    port = json.loads(server.stdout.readline())["port"]  # type: ignore[union-attr]
    yield port, secret, root
    server.kill()
    server.wait()


def _get(port: int, path: str, headers: dict[str, str] | None = None, secret: Path | None = None) -> tuple[int, bytes]:
    """One GET; with ``secret``, on a connection authenticated both ways (relay.Source)."""
    import http.client

    if secret is not None:
        from k2fleet.hostprogs import relay

        return relay.Source(f"http://127.0.0.1:{port}", secret.read_text().strip()).request(path, headers)

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_a_request_without_the_deployments_secret_is_refused(served, tmp_path: Path) -> None:
    port, secret, root = served
    token = secret.read_text().strip()
    shard = sorted(p.name for p in root.glob("*.safetensors"))[0]
    wrong = tmp_path / "wrong.secret"
    wrong.write_text(token[:-1] + "x\n")
    for path in ("/manifest", f"/file/{shard}"):
        assert _get(port, path)[0] == 403
        assert _get(port, path, {"X-K2-Relay-Secret": token})[0] == 403  # the secret itself is no longer taken
        assert _get(port, path, {"X-K2-Auth": "0" * 64})[0] == 403
        with pytest.raises(OSError, match="prove"):  # a relay of another secret cannot prove it holds ours
            _get(port, path, secret=wrong)
        status, body = _get(port, path, secret=secret)
        assert status == 200 and body, path


@pytest.mark.parametrize("rng", ["bytes=abc-", "bytes=5-2", "bytes=-", "bytes=99999999999-", "bytes=1-2,4-5", "items=0-1"])
def test_a_malformed_range_gets_a_clean_4xx(served, rng: str) -> None:
    port, secret, root = served
    shard = sorted(p.name for p in root.glob("*.safetensors"))[0]
    status, _ = _get(port, f"/file/{shard}", {"Range": rng}, secret=secret)
    assert 400 <= status < 500, (rng, status)
    assert _get(port, "/manifest", secret=secret)[0] == 200  # still serving


def _fetch_through_idle_connections(port: int, secret: Path, dest: Path, sources: list[str],
                                    count: int = 1000) -> tuple[int, float, str]:
    """Hold up to ``count`` idle connections to the relay from ``sources`` (loopback addresses, in
    turn), then fetch from it: (connections made, seconds the fetch took, its stdout)."""
    import socket
    import time

    idle = []
    try:
        for i in range(count):
            try:
                idle.append(socket.create_connection(("127.0.0.1", port), timeout=5,
                                                     source_address=(sources[i % len(sources)], 0)))
            except OSError:
                break  # the server may refuse some at once: that is fine too
        started = time.monotonic()
        out = subprocess.run([*RELAY_ARGV, "fetch", str(dest), "--source", f"http://127.0.0.1:{port}",
                              "--secret-file", str(secret), "--repo", REPO, "--revision", REV, "--give-up-after", "60"],
                             capture_output=True, text=True, timeout=120)
        took = time.monotonic() - started
    finally:
        for s in idle:
            s.close()
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["verified"]
    return len(idle), took, out.stdout


def test_a_thousand_idle_connections_from_other_addresses_do_not_delay_a_real_fetch(served, tmp_path: Path) -> None:
    """Idle connections from seven other addresses (16 held from each: relay.MAX_UNAUTHENTICATED_PER_SOURCE)
    take no room from the fleet's peer: its fetch starts at once."""
    port, secret, _ = served
    held, took, _ = _fetch_through_idle_connections(port, secret, tmp_path / "dest", [f"127.0.0.{i}" for i in range(2, 9)])
    assert held >= 100 and took < 10, (held, took)  # the connections were really held open


def test_idle_connections_from_the_peers_own_address_are_reclaimed_after_the_idle_timeout(tmp_path: Path) -> None:
    """The same flood from the fetching peer's own address fills its per-address room; the
    server's watchdog closes them after relay.IDLE_TIMEOUT_S (2 s in this server, 20 s shipped)
    and the real fetch goes through. (40 connections, made at once: 16 held, the rest closed.)"""
    root = ensure_synthetic_checkpoint(tmp_path / "served", REPO, REV, num_shards=3, shard_bytes=64 << 10)
    assert subprocess.run([*RELAY_ARGV, "mark", str(root)], capture_output=True).returncode == 0
    secret = tmp_path / "relay.secret"
    secret.write_text("s3cret-relay-token-0123456789abcdef\n")
    secret.chmod(0o600)
    program = ("import sys; from k2fleet.hostprogs import relay; relay.IDLE_TIMEOUT_S = 2; "
               "sys.exit(relay.main(sys.argv[1:]))")
    server = subprocess.Popen([sys.executable, "-c", program, "serve", str(root), "--bind", "127.0.0.1", "--port", "0",
                               "--secret-file", str(secret)], stdout=subprocess.PIPE, text=True)
    try:
        port = json.loads(server.stdout.readline())["port"]  # type: ignore[union-attr]
        held, took, _ = _fetch_through_idle_connections(port, secret, tmp_path / "dest", ["127.0.0.1"], count=40)
    finally:
        server.kill()
        server.wait()
    assert held >= 16 and 1.5 <= took < 30, (held, took)  # the flood held the fetch until the watchdog closed it


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o1777])
def test_a_control_cache_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    """Exploit: a world-writable cache (say under /tmp) lets another local user plant a
    manifest the control machine would trust and hand to the whole fleet."""
    from k2fleet.control.checkpoint_copy import ensure_control_copy, owned_cache

    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(mode)
    root = cache / "t--Kimi-K2-Thinking" / REV
    with pytest.raises(RuntimeError, match="another user could plant a manifest"):
        ensure_control_copy(REPO, REV, str(root), hub=True, endpoint="http://127.0.0.1:9")
    assert not root.exists()  # nothing made inside it
    cache.chmod(0o700)
    owned_cache(root)  # a directory of its own: accepted, the rest made 0700
    assert (root.stat().st_mode & 0o777) == 0o700 and (root.parent.stat().st_mode & 0o777) == 0o700


def test_a_relay_nobody_asks_stops_by_itself(tmp_path: Path) -> None:
    """A failed deploy leaves no relay serving for hours: ``--idle-exit`` ends it once no
    request came for that long, and requests keep it up."""
    import time

    root = ensure_synthetic_checkpoint(tmp_path / "served", REPO, REV, num_shards=1, shard_bytes=4096)
    server = subprocess.Popen([*RELAY_ARGV, "serve", str(root), "--bind", "127.0.0.1", "--port", "0",
                               "--idle-exit", "2"], stdout=subprocess.PIPE, text=True)
    port = json.loads(server.stdout.readline())["port"]  # type: ignore[union-attr]
    try:
        for _ in range(6):  # asked every 0.5 s for 3 s: still up
            assert _get(port, "/manifest")[0] == 200
            time.sleep(0.5)
        assert server.poll() is None
        started = time.monotonic()
        server.wait(timeout=10)  # then nobody asks: gone within the idle time (+ a poll)
        assert time.monotonic() - started < 5
    finally:
        server.kill()
        server.wait()
