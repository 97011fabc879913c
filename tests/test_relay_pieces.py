"""A file passed on piece by piece while it lands (:mod:`k2fleet.hostprogs.relay`): the control
machine pins a sha256 per piece of its verified copy (``relay pieces``); a receiving host's relay
serves a landing file up to its prefix of pieces that verified against that pin, and not a
byte further. Real relay processes and sockets on loopback; the checkpoint is synthetic
(Kimi-K2-Thinking's layout)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from k2fleet.hostprogs import relay as relay_mod
from k2sandbox.checkpoint_cache import ensure_synthetic_checkpoint

RELAY = [sys.executable, "-m", "k2fleet.hostprogs.relay"]
VERIFY = [sys.executable, "-m", "k2fleet.hostprogs.verify"]
BIG = "model-00002-of-000006.safetensors"
MIB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(root: Path) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([*RELAY, "serve", str(root), "--bind", "127.0.0.1", "--port", "0"], stdout=subprocess.PIPE,
                            text=True)
    return proc, int(json.loads(proc.stdout.readline())["port"])


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(a verified copy whose shards are 6 pieces of 1 MiB each, its pieces pin)."""
    root = ensure_synthetic_checkpoint(tmp_path_factory.mktemp("pieces") / "source", "t/Kimi-K2-Thinking", "d" * 40,
                                       num_shards=6, shard_bytes=6 * MIB)
    assert subprocess.run([*RELAY, "mark", str(root)], capture_output=True).returncode == 0
    made = subprocess.run([*RELAY, "pieces", str(root)], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    digest = json.loads(made.stdout)["pieces_digest"]
    assert digest == hashlib.sha256((root / ".k2fleet/pieces.json").read_bytes()).hexdigest()
    return root, digest


def test_pieces_are_pinned_only_from_a_verified_copy_and_reused_while_it_is_unchanged(source, tmp_path: Path) -> None:
    root, digest = source
    doc = json.loads((root / ".k2fleet/pieces.json").read_bytes())
    size = (root / BIG).stat().st_size
    assert doc["files"][BIG]["piece"] == MIB and len(doc["files"][BIG]["sha256"]) == -(-size // MIB)
    data = (root / BIG).read_bytes()
    assert doc["files"][BIG]["sha256"][1] == hashlib.sha256(data[MIB:2 * MIB]).hexdigest()
    assert "config.json" not in doc["files"]  # one piece or less: passed on whole
    assert set(doc) == {"manifest", "files"}  # nothing of the control machine's own files (stats) goes to hosts
    before = (root / ".k2fleet/pieces.json").stat().st_mtime_ns
    assert json.loads(subprocess.run([*RELAY, "pieces", str(root)], capture_output=True,
                                     text=True).stdout)["pieces_digest"] == digest
    assert (root / ".k2fleet/pieces.json").stat().st_mtime_ns == before  # reused, not hashed again
    copy = tmp_path / "copy"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("relay", "pieces.json"))
    refused = subprocess.run([*RELAY, "pieces", str(copy)], capture_output=True, text=True)
    assert refused.returncode != 0 and "not verified" in refused.stderr  # never pinned from unverified bytes
    assert not (copy / ".k2fleet/pieces.json").exists()


def landing(parent: Path, root: Path, verified: int) -> None:
    """``parent`` as a host whose fetch is landing BIG: manifest and pieces taken, the partial
    file holding BIG's true bytes up to ``verified`` and other bytes after (landed, not checked)."""
    (parent / ".k2fleet").mkdir(parents=True, exist_ok=True)
    for rel in (".k2fleet/manifest.json", ".k2fleet/pieces.json"):
        shutil.copy(root / rel, parent / rel)
    part = parent / relay_mod.PARTIAL / BIG
    part.parent.mkdir(parents=True, exist_ok=True)
    true = (root / BIG).read_bytes()
    part.write_bytes(true[:verified] + b"\xee" * (len(true) - verified))
    vouch(parent, verified)
    (parent / relay_mod.HEARTBEAT).write_text("1")


def vouch(parent: Path, verified: int) -> None:
    """What the landing's hash sets as each piece verifies (relay.land_file)."""
    os.setxattr(parent / relay_mod.PARTIAL / BIG, relay_mod.VERIFIED_XATTR, str(verified).encode())


class Reader:
    """GET /file/BIG on a thread, counting the bytes as they come."""

    def __init__(self, port: int) -> None:
        self.got, self.closed = bytearray(), threading.Event()
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.sendall(f"GET /file/{BIG} HTTP/1.1\r\nHost: x\r\nX-K2-Wait: 30\r\n\r\n".encode())
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                chunk = self.sock.recv(1 << 16)
                if not chunk:
                    break
                self.got += chunk
        except OSError:
            pass
        self.closed.set()

    def body(self) -> bytes:
        head, _, body = bytes(self.got).partition(b"\r\n\r\n")
        return body

    def settle(self, n: int, timeout: float = 10.0) -> bytes:
        deadline = time.monotonic() + timeout
        while len(self.body()) < n and time.monotonic() < deadline and not self.closed.is_set():
            time.sleep(0.02)
        time.sleep(0.3)  # and nothing beyond it comes
        return self.body()


@contextlib.contextmanager
def served_landing(root: Path, parent: Path, verified: int) -> Iterator[Reader]:
    """``parent`` landing BIG with ``verified`` bytes vouched for, its relay serving, and a
    reader that asked it for BIG and got those bytes (and no more)."""
    landing(parent, root, verified)
    proc, port = serve(parent)
    try:
        reader = Reader(port)
        assert reader.settle(verified) == (root / BIG).read_bytes()[:verified]  # nothing landed unchecked
        yield reader
    finally:
        proc.kill()


def test_a_landing_file_is_served_up_to_its_verified_pieces_and_the_rest_once_whole(source, tmp_path: Path) -> None:
    root, _ = source
    true = (root / BIG).read_bytes()
    parent = tmp_path / "parent"
    with served_landing(root, parent, 2 * MIB) as reader:
        part = parent / relay_mod.PARTIAL / BIG
        with open(part, "r+b") as fh:
            fh.seek(2 * MIB)
            fh.write(true[2 * MIB:5 * MIB])  # landed; two more pieces hashed right
        vouch(parent, 4 * MIB)
        assert reader.settle(4 * MIB) == true[:4 * MIB]  # each piece as it verifies, not the landed one after
        with open(part, "r+b") as fh:
            fh.seek(5 * MIB)
            fh.write(true[5 * MIB:])  # landed and hashed: checked whole, moved into place, marked
        os.replace(part, parent / BIG)
        assert subprocess.run([*RELAY, "mark", str(parent)], capture_output=True).returncode == 1  # the rest missing
        assert reader.settle(len(true)) == true
        assert not reader.closed.is_set()  # the connection stays for the next request


def test_a_landing_that_starts_over_is_never_served_beyond_what_was_verified(source, tmp_path: Path) -> None:
    """The landing starts over (another source: the partial file unlinked, a new one): an
    answer streaming the old one ends short at its verified prefix, connection closed, even
    though the new file vouches for more of itself."""
    root, _ = source
    parent = tmp_path / "parent"
    with served_landing(root, parent, 3 * MIB) as reader:
        relay_mod.retract(str(parent), BIG)
        landing(parent, root, 5 * MIB)
        assert reader.closed.wait(5)
        assert reader.body() == (root / BIG).read_bytes()[:3 * MIB]


def test_a_piece_that_does_not_match_its_pin_stops_the_prefix_there(source) -> None:
    """The hash that follows a landing file checks each piece against its pin as it completes:
    the prefix it vouches for stops before the first bad piece, whatever follows it, and the
    landing's next bytes stop it (BadPiece: the rest of that copy is not worth landing)."""
    root, _ = source
    data = bytearray((root / BIG).read_bytes())
    data[2 * MIB + 100] ^= 0xFF  # one byte of the third piece
    pinned = json.loads((root / ".k2fleet/pieces.json").read_bytes())["files"][BIG]["sha256"]
    fd = os.memfd_create("landing")
    try:
        os.write(fd, bytes(data))
        ranges = relay_mod.plan_ranges(len(data), 1)
        seen: list[int] = []
        hashing = relay_mod.LandingHash(fd, hashlib.sha256(), ranges, (MIB, pinned), seen.append)
        for i, (_, b) in enumerate(ranges):
            hashing.landed_at(i)(b + 1)
        assert hashing.result() != hashlib.sha256((root / BIG).read_bytes()).hexdigest()
        with pytest.raises(relay_mod.BadPiece, match="piece 2 does not match"):  # the landing stops there
            hashing.landed_at(0)(len(data))
    finally:
        os.close(fd)
    assert seen == [MIB, 2 * MIB]


def test_a_chain_fetch_with_the_pin_passes_files_on_and_refuses_a_forged_pieces_document(source, tmp_path: Path) -> None:
    """Two hosts in a chain, both pinned: the first asks a peer whose pieces document is forged
    (refused: not the pinned digest) and then takes it from the source; the second
    takes it from the first. Both verify whole; a fetch whose pin no source matches passes
    files on whole instead of failing."""
    root, digest = source
    forger = tmp_path / "forger"
    shutil.copytree(root, forger)
    assert subprocess.run([*RELAY, "mark", str(forger)], capture_output=True).returncode == 0  # serves true files
    doc = json.loads((forger / ".k2fleet/pieces.json").read_bytes())
    doc["files"][BIG]["sha256"][0] = "0" * 64
    (forger / ".k2fleet/pieces.json").write_text(json.dumps(doc))
    for h in ("h1", "h2"):
        (tmp_path / h).mkdir()
    servers = [serve(root), serve(forger), serve(tmp_path / "h1"), serve(tmp_path / "h2")]
    url = [f"http://127.0.0.1:{port}" for _, port in servers]
    try:
        fleet = ",".join(url[2:])
        first = subprocess.Popen([*RELAY, "fetch", "--fleet", fleet, "--position", "0", "--source", url[1], "--source",
                                  url[0], "--pieces-digest", digest, str(tmp_path / "h1")], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        second = subprocess.run([*RELAY, "fetch", "--fleet", fleet, "--position", "1", "--source", url[0],
                                 "--pieces-digest", digest, str(tmp_path / "h2")], capture_output=True, text=True,
                                timeout=120)
        out, err = first.communicate(timeout=120)
        assert first.returncode == 0 and second.returncode == 0, (err, second.stderr)
        assert f"refused the pieces document of {url[1]}" in err
        for h in ("h1", "h2"):
            assert (tmp_path / h / ".k2fleet/pieces.json").read_bytes() == (root / ".k2fleet/pieces.json").read_bytes()
            assert subprocess.run([*VERIFY, "--full", str(tmp_path / h)], capture_output=True).returncode == 0
        assert json.loads(second.stdout)["bytes_from"] == {url[2]: json.loads(out)["bytes"]}
        unpinned = subprocess.run([*RELAY, "fetch", "--source", url[0], "--pieces-digest", "f" * 64,
                                   str(tmp_path / "h3")], capture_output=True, text=True, timeout=180)
        assert unpinned.returncode == 0 and "files pass on once whole" in unpinned.stderr
        assert not (tmp_path / "h3/.k2fleet/pieces.json").exists()
    finally:
        for proc, _ in servers:
            proc.kill()


def test_the_control_copy_is_pinned_once_and_an_unpinnable_one_moves_files_whole(source, tmp_path: Path,
                                                                                 caplog: pytest.LogCaptureFixture,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The deploy's control side (:func:`checkpoint_copy.pieces_pin`): the digest of the copy's
    pieces document; a copy it cannot pin (here: not verified) gives no pin and a warning, and
    the fetch then carries none (files move on once whole) rather than failing the deploy."""
    from k2fleet.control import checkpoint_copy

    root, digest = source
    assert checkpoint_copy.pieces_pin(str(root)) == digest
    unverified = tmp_path / "copy"
    shutil.copytree(root, unverified, ignore=shutil.ignore_patterns("relay", "pieces.json"))
    runs: list[list[str]] = []
    real_run = checkpoint_copy.subprocess.run

    def counted(argv, **kw):
        runs.append(argv)
        return real_run(argv, **kw)

    monkeypatch.setattr(checkpoint_copy.subprocess, "run", counted)
    with caplog.at_level("WARNING"):
        assert checkpoint_copy.pieces_pin(str(unverified)) is None
        assert checkpoint_copy.pieces_pin(str(unverified)) is None  # the next host: not hashed again
    assert "not pinned piece by piece" in caplog.text and "not verified" in caplog.text
    assert len(runs) == 1


def forge_verified(copy: Path, rel: str) -> None:
    """A relay whose own marker for ``rel`` lies: it says the bytes there hashed right."""
    entry = json.loads((copy / ".k2fleet/manifest.json").read_bytes())["files"][rel]
    mark = copy / relay_mod.mark_rel(rel)
    mark.parent.mkdir(parents=True, exist_ok=True)
    mark.write_text(json.dumps({"sha256": entry["sha256"], "stat": relay_mod.verify.stat_beneath(str(copy), rel)}))


def test_a_peer_whose_bytes_fail_a_piece_is_refused_and_the_copy_is_whole_from_an_honest_one(source,
                                                                                          tmp_path: Path) -> None:
    """A hostile peer (its marker lies) serves BIG with one byte changed in the third piece: each
    copy from it counts as bad — twice, then the next source — and the host ends verified."""
    root, digest = source
    forger = tmp_path / "forger"
    shutil.copytree(root, forger)
    assert subprocess.run([*RELAY, "mark", str(forger)], capture_output=True).returncode == 0  # serves true files,
    with open(forger / BIG, "r+b") as fh:  # and BIG with one byte changed
        fh.seek(2 * MIB + 100)
        flipped = fh.read(1)[0] ^ 0xFF
        fh.seek(2 * MIB + 100)
        fh.write(bytes([flipped]))
    forge_verified(forger, BIG)
    servers = [serve(root), serve(forger)]
    url = [f"http://127.0.0.1:{port}" for _, port in servers]
    try:
        out = subprocess.run([*RELAY, "fetch", "--source", url[1], "--source", url[0], "--pieces-digest", digest,
                              str(tmp_path / "h")], capture_output=True, text=True, timeout=120)
    finally:
        for proc, _ in servers:
            proc.kill()
    assert out.returncode == 0, out.stderr
    # stopped at the bad piece, or (loopback outruns the hash) refused by the whole-file check: a bad copy each time
    assert json.loads(out.stdout)["bad_shards"] == [{"file": BIG, "source": url[1]}] * 2
    assert subprocess.run([*VERIFY, "--full", str(tmp_path / "h")], capture_output=True).returncode == 0


def test_a_copy_whose_bytes_no_longer_match_its_manifest_is_not_pinned(source, tmp_path: Path) -> None:
    """Its marker says verified (a stat: bit rot keeps stats), but the pieces pass hashes the
    whole file too and refuses it."""
    root, _ = source
    copy = tmp_path / "copy"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("pieces.json"))
    with open(copy / BIG, "r+b") as fh:
        fh.seek(3 * MIB)
        flipped = fh.read(1)[0] ^ 0xFF
        fh.seek(3 * MIB)
        fh.write(bytes([flipped]))
    subprocess.run([*RELAY, "mark", str(copy)], capture_output=True)
    forge_verified(copy, BIG)
    out = subprocess.run([*RELAY, "pieces", str(copy)], capture_output=True, text=True)
    assert out.returncode != 0 and f"{BIG} in {copy} no longer matches its manifest" in out.stderr, out.stderr
    assert not (copy / ".k2fleet/pieces.json").exists()


def test_two_fetches_into_one_directory_take_turns(source, tmp_path: Path) -> None:
    """A second fetch into a directory (a re-run while the last still runs) waits for the first:
    neither removes nor re-creates the other's landing files, and both end verified."""
    root, digest = source
    proc, port = serve(root)
    argv = [*RELAY, "fetch", "--source", f"http://127.0.0.1:{port}", "--pieces-digest", digest, str(tmp_path / "h")]
    try:
        first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        second = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        out, err = first.communicate(timeout=120)
    finally:
        proc.kill()
    assert first.returncode == 0 and second.returncode == 0, (err, second.stderr)
    reports = [json.loads(out), json.loads(second.stdout)]
    assert sorted(r["kept"] for r in reports) == [0, len(json.loads((root / ".k2fleet/manifest.json").read_bytes())["files"])]
    assert subprocess.run([*VERIFY, "--full", str(tmp_path / "h")], capture_output=True).returncode == 0
