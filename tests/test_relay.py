"""Pipelined checkpoint distribution (:mod:`k2fleet.hostprogs.relay`, :mod:`k2fleet.hostprogs.swarm`):
real relay processes on loopback and on the sandbox fleet (shaped links, a host crashed by
killing its container's init). Test doubles: the checkpoint (synthetic, Kimi-K2-Thinking's
layout) and, for corruption in flight, a proxy that flips one byte of one shard.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from k2sandbox import nspawn as sandbox
from k2fleet.hostprogs import swarm
from k2sandbox.checkpoint_cache import ensure_synthetic_checkpoint
from k2sandbox.harness import SandboxFleet
from k2sandbox.relay_fleet import HOST_DIR, RELAY, RelayFleet, url

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox fleet needs root")
VERIFY = Path(__file__).resolve().parents[1] / "k2fleet/hostprogs/verify.py"
VICTIM = "model-00002-of-000062.safetensors"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def relay(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RELAY), *args], capture_output=True, text=True, timeout=300, **kw)


def serve(root: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(RELAY), "serve", str(root), "--bind", "127.0.0.1", "--port", str(port)])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    raise AssertionError("relay server did not start")


def status_of(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", path)
    resp = conn.getresponse()
    resp.read()
    return resp.status


SANDBOX_HOSTS = 3  # the sandbox fixture's fleet (tests/conftest.py): bare hosts, no Docker, no simulated GPUs
SANDBOX_DOCKER = False
SANDBOX_GPUS = None


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = ensure_synthetic_checkpoint(tmp_path_factory.mktemp("relay") / "source", "t/Kimi-K2-Thinking", "c" * 40,
                                       num_shards=62, shard_bytes=256 << 10)
    assert relay("mark", str(root)).returncode == 0
    return root


def test_plans_chain_and_per_shard_trees_route_around_dead_hosts() -> None:
    hosts = [f"h{i}" for i in range(7)]
    shards = [f"s{j}" for j in range(6)]
    chain = swarm.plan_sources(hosts, shards, 1)
    assert chain["h3"]["s5"] == ["h2", "h1", "h0", None]  # parent, its ancestors, then the source
    trees = swarm.plan_sources(hosts, shards, 2)
    for shard in shards:
        roots = [h for h in hosts if trees[h][shard] == [None]]
        assert len(roots) == 1  # one transfer of each shard leaves the source
        assert all(len(trees[h][shard]) <= swarm.depth(7, 2) for h in hosts)
    interior = {s: {trees[h][s][0] for h in hosts} - {None} for s in shards}
    assert interior["s0"] != interior["s1"]  # consecutive shards are forwarded by different hosts


@pytest.mark.parametrize("n", [5, 9, 16, 64])
def test_trees_have_disjoint_interiors_fixed_parents_and_balanced_uploads(n: int) -> None:
    """SplitStream's property, which the relay's lanes rely on: with k trees every host
    forwards for one tree only, gets each tree's shards from one parent, and uploads
    about one checkpoint in all."""
    hosts = [f"h{i}" for i in range(n)]
    shards = [f"s{j}" for j in range(62)]
    for k in [k for k in swarm.FANOUTS[1:] if swarm.disjoint(n, k)]:
        plan = swarm.plan_sources(hosts, shards, k)
        forwarders = [{plan[h][s][0] for h in hosts for s in shards[t::k]} - {None} for t in range(k)]
        assert sum(map(len, forwarders)) == len(set().union(*forwarders)), (k, forwarders)  # disjoint
        for h in hosts:
            for t in range(k):
                assert len({plan[h][s][0] for s in shards[t::k]}) == 1  # one parent per tree
        uploads = {h: sum(plan[c][s][0] == h for c in hosts for s in shards) for h in hosts}
        assert max(uploads.values()) <= k * -(-len(shards) // k), (k, uploads)
    assert [swarm.fanout_for(m) for m in (2, 5, 8, 9, 64)] == [1, 1, 1, 2, 2]


def test_a_parent_holds_the_request_until_it_has_verified_the_file(source: Path, tmp_path: Path) -> None:
    """The next shard is asked for before the parent has it: while a fetch runs there the
    parent holds the request and answers the moment the file is verified (no poll, no
    round trip); where no fetch runs it answers 409 at once, saying so."""
    parent = tmp_path / "parent"
    (parent / ".k2fleet").mkdir(parents=True)
    shutil.copy(source / ".k2fleet/manifest.json", parent / ".k2fleet/manifest.json")
    heartbeat = parent / ".k2fleet/relay-fetching"
    port = free_port()
    server = serve(parent, port)
    try:
        assert status_of(port, "/file/" + VICTIM) == 409  # no fetch runs there: at once
        heartbeat.write_text("1")  # a fetch runs there now
        got: dict[str, float] = {}

        def ask() -> None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", "/file/" + VICTIM, headers={"X-K2-Wait": "20"})
            resp = conn.getresponse()
            got["status"], got["bytes"], got["at"] = resp.status, len(resp.read()), time.monotonic()

        asker = threading.Thread(target=ask)
        asker.start()
        time.sleep(1.0)
        assert asker.is_alive()  # held
        shutil.copy(source / VICTIM, parent / VICTIM)
        assert status_of(port, "/file/" + VICTIM) == 409  # in place but not verified: still not served
        assert relay("mark", str(parent)).returncode == 1  # marks the one file it holds (the rest are missing)
        marked = time.monotonic()
        asker.join(timeout=10)
        assert got["status"] == 200 and got["bytes"] == (source / VICTIM).stat().st_size
        assert got["at"] - marked < 0.5, got["at"] - marked
    finally:
        server.kill()


def test_the_next_file_asked_ahead_on_one_connection_is_served_only_once_verified(source: Path, tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A receiver asks for its next file while the current one streams, on the same
    connection (HTTP/1.1 pipelining): the current file's bytes come whole (the head is read
    to its end and not a byte beyond, so nothing of the answer behind it is taken for them),
    and the next one comes on that connection — no second connection — only once the
    parent has verified it, not before."""
    from k2fleet.hostprogs import relay as relay_mod

    first, second = "config.json", VICTIM
    parent = tmp_path / "parent"
    (parent / ".k2fleet").mkdir(parents=True)
    for rel in (".k2fleet/manifest.json", first, second):
        shutil.copy(source / rel, parent / rel)
    assert relay("mark", str(parent)).returncode == 1  # marks the two files it holds (the rest are missing)
    os.unlink(parent / f".k2fleet/relay/{second}.ok")  # the second: landed, not verified yet
    (parent / ".k2fleet/relay-fetching").write_text("1")  # a fetch runs there: requests are held
    connects: list[float] = []
    real_connect = relay_mod.Source.connect

    def counted(self, deadline):  # the real handshake, counted
        connects.append(time.monotonic())
        return real_connect(self, deadline)

    monkeypatch.setattr(relay_mod.Source, "connect", counted)
    port = free_port()
    server = serve(parent, port)
    try:
        src = relay_mod.Source(f"http://127.0.0.1:{port}")
        size1, size2 = (source / first).stat().st_size, (source / second).stat().st_size
        fd1 = os.open(tmp_path / "one", os.O_RDWR | os.O_CREAT, 0o644)
        fd2 = os.open(tmp_path / "two", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            real_head = relay_mod.read_head

            def late_head(*args, **kw):  # read only once both answers sit in the socket, back to back
                time.sleep(0.5)
                return real_head(*args, **kw)

            monkeypatch.setattr(relay_mod, "read_head", late_head)
            for ahead in ((first, 0, size1 - 1), (second, 0, size2 - 1)):  # the first, answered twice
                os.ftruncate(fd1, 0)
                src.get_range(first, fd1, 0, size1 - 1, ahead=ahead)
                assert os.pread(fd1, size1 + 10, 0) == (source / first).read_bytes()
            monkeypatch.setattr(relay_mod, "read_head", real_head)

            def verify_later() -> None:
                time.sleep(1.0)
                relay("mark", str(parent))

            marking = threading.Thread(target=verify_later)
            started = time.monotonic()
            marking.start()
            src.get_range(second, fd2, 0, size2 - 1)
            took = time.monotonic() - started
            marking.join()
            assert os.pread(fd2, size2 + 10, 0) == (source / second).read_bytes()
        finally:
            os.close(fd1)
            os.close(fd2)
    finally:
        server.kill()
    assert len(connects) == 1, connects  # both files on one connection
    assert took >= 1.0, took  # held until verified: not a byte before


def test_a_fetch_whose_sources_never_answer_fails_instead_of_hanging(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    out = relay("fetch", str(tmp_path / "h"), "--source", dead, "--dead-after", "0.5", "--give-up-after", "2")
    assert out.returncode != 0 and "no source answered" in out.stderr, out.stderr
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("behind", [0, 4])
def test_files_land_one_after_another_while_earlier_ones_are_still_checked(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, behind: int
) -> None:
    """The next file lands while up to ``--verify-behind`` landed ones are still hashed and
    checked (0: strictly one at a time). Finishing a file is slowed by a double (0.1 s a
    file, standing in for a link faster than a core's sha256); the bytes, sockets and checks are real."""
    from k2fleet.hostprogs import relay as relay_mod

    events: list[tuple[float, str, str]] = []
    real_land, real_finish = relay_mod.land_file, relay_mod.finish_file

    def land(src, root, manifest, rel, streams, chunk, after=None, pieces=None):
        events.append((time.monotonic(), "land", rel))
        return real_land(src, root, manifest, rel, streams, chunk, after, pieces)

    def slow_finish(landed, root, manifest, rel):  # double: slow hashing and checks
        time.sleep(0.1)
        out = real_finish(landed, root, manifest, rel)
        events.append((time.monotonic(), "checked", rel))
        return out

    monkeypatch.setattr(relay_mod, "land_file", land)
    monkeypatch.setattr(relay_mod, "finish_file", slow_finish)
    port = free_port()
    server = serve(source, port)
    try:
        t0 = time.monotonic()
        report = relay_mod.fetch(str(tmp_path / "h"), [f"http://127.0.0.1:{port}"], verify_behind=behind)
        seconds = time.monotonic() - t0
    finally:
        server.kill()
    assert report["files"] == 72 and report["bad_shards"] == [] and report["verified"]
    monkeypatch.undo()
    assert subprocess.run([sys.executable, str(VERIFY), "--full", str(tmp_path / "h")]).returncode == 0
    in_flight, most = 0, 0  # files landing or landed and not yet checked
    for _, kind, _ in sorted(events):
        in_flight += 1 if kind == "land" else -1
        most = max(most, in_flight)
    assert most == behind + 1, (most, behind)
    if behind:
        assert seconds < 72 * 0.1 / 2, seconds  # the checks overlapped
    else:
        assert seconds >= 72 * 0.1, seconds


def test_chain_on_loopback_verifies_every_shard_and_resumes_only_what_is_wrong(source: Path, tmp_path: Path) -> None:
    p0, p1 = free_port(), free_port()
    servers = [serve(source, p0), serve(tmp_path / "h1", p1)]
    try:
        (tmp_path / "h1").mkdir(exist_ok=True)
        first = subprocess.Popen([sys.executable, str(RELAY), "fetch", str(tmp_path / "h1"), "--source",
                                  f"http://127.0.0.1:{p0}"], stdout=subprocess.PIPE, text=True)
        second = relay("fetch", str(tmp_path / "h2"), "--source", f"http://127.0.0.1:{p1}", "--source",
                       f"http://127.0.0.1:{p0}")  # chained behind h1, at the same time
        assert first.wait(timeout=120) == 0 and second.returncode == 0, second.stderr
        report = json.loads(second.stdout)
        assert report["sources"] == {f"http://127.0.0.1:{p1}": 72} and report["bad_shards"] == []
        assert subprocess.run([sys.executable, str(VERIFY), "--full", str(tmp_path / "h2")]).returncode == 0
        shard = tmp_path / "h2" / VICTIM
        data = bytearray(shard.read_bytes())
        data[4096] ^= 1  # bit rot: same size, same mtime
        shard.write_bytes(bytes(data))
        (tmp_path / "h2" / "config.json").unlink()
        again = json.loads(relay("fetch", str(tmp_path / "h2"), "--source", f"http://127.0.0.1:{p1}").stdout)
        assert (again["files"], again["kept"]) == (2, 70), again  # the rotten shard and the missing file
        assert subprocess.run([sys.executable, str(VERIFY), "--full", str(tmp_path / "h2")]).returncode == 0
    finally:
        for s in servers:
            s.kill()


def test_a_full_disk_stops_the_fetch_at_once_in_one_line_and_the_source_is_not_blamed(source: Path, tmp_path: Path) -> None:
    """The fault drill's disk, on loopback: the receiver's directory is a 3 MiB tmpfs (its own
    mount namespace) for a 15.5 MiB checkpoint. The write's ENOSPC is this host's, so the fetch
    ends at once naming the disk (no source is marked dead, nothing waits for give-up-after),
    and no file it could not land is marked verified."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("a tmpfs in a private mount namespace needs root and unshare")
    port = free_port()
    server = serve(source, port)
    target = tmp_path / "small"
    target.mkdir()
    script = (f"mount -t tmpfs -o size=3m k2-drill {target} && {sys.executable} {RELAY} fetch {target} "
              f"--source http://127.0.0.1:{port}; code=$?; ls {target}/.k2fleet/relay 2>/dev/null | wc -l >&2; exit $code")
    try:
        started = time.monotonic()
        proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _, stderr = proc.communicate(timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # a fetch still waiting for a source, if any
        took = time.monotonic() - started
    finally:
        server.kill()
    lines = stderr.strip().splitlines()
    assert proc.returncode != 0 and took < 30, (took, stderr[-2000:])
    assert any("No space left on device writing under" in line and str(target) in line for line in lines), lines
    assert not any("skipped from now on" in line or "no source answered" in line for line in lines), lines
    assert 0 < int(lines[-1]) < 72  # what fit is marked (each one verified), the rest is not: 72 files in all


def test_fleet_mode_chain_serves_a_gated_peer_and_leaves_the_gate_marker(source: Path, tmp_path: Path) -> None:
    """The deploy's form: ``fetch --fleet URLS --position I``. The root holds a copy only
    verify.py checked (its ``verified.json``, no relay markers) and serves it; hosts 1 and
    2 receive at once, each from the one before it; afterwards verify.py's gate passes
    on host 2 without hashing a byte (the relay hashed each file as it arrived)."""
    root = tmp_path / "h0"
    shutil.copytree(source, root, ignore=shutil.ignore_patterns("relay"))
    assert subprocess.run([sys.executable, str(VERIFY), "--full", str(root)], capture_output=True).returncode == 0
    assert not (root / ".k2fleet/relay").exists() and (root / ".k2fleet/verified.json").is_file()
    ports = [free_port() for _ in range(3)]
    fleet = ",".join(f"http://127.0.0.1:{p}" for p in ports)
    for name in ("h1", "h2"):
        (tmp_path / name).mkdir()
    servers = [serve(tmp_path / f"h{i}", p) for i, p in enumerate(ports)]
    try:
        first = subprocess.Popen([sys.executable, str(RELAY), "fetch", "--fleet", fleet, "--position", "1",
                                  str(tmp_path / "h1")], stdout=subprocess.PIPE, text=True)
        second = relay("fetch", "--fleet", fleet, "--position", "2", str(tmp_path / "h2"))
        out, _ = first.communicate(timeout=120)
        assert first.returncode == 0 and second.returncode == 0, second.stderr
        total = sum(e["size"] for e in json.loads((source / ".k2fleet/manifest.json").read_text())["files"].values())
        assert json.loads(out)["bytes_from"] == {f"http://127.0.0.1:{ports[0]}": total}
        assert json.loads(second.stdout)["bytes_from"] == {f"http://127.0.0.1:{ports[1]}": total}
        gate = subprocess.run([sys.executable, str(VERIFY), "--json", str(tmp_path / "h2")], capture_output=True,
                              text=True)
        report = json.loads(gate.stdout)
        assert gate.returncode == 0 and report["ok"] and report["bytes_hashed"] == 0, report
        # a file changed after it was verified (same size) is no longer served by the root
        shard = root / VICTIM
        shard.write_bytes(shard.read_bytes())
        assert status_of(ports[0], f"/file/{VICTIM}") == 409
        assert status_of(ports[0], "/file/config.json") == 200
    finally:
        for s in servers:
            s.kill()


class CorruptingProxy(http.server.ThreadingHTTPServer):
    """TEST DOUBLE of a bad link: forwards to ``upstream``, flipping one byte of VICTIM's
    body; before answering VICTIM a second time it records what ``watch`` (the relay that
    received the first, corrupted copy) answers for VICTIM at that moment."""

    daemon_threads = True

    def __init__(self, upstream: int, watch: int) -> None:
        self.upstream, self.watch, self.victim_requests, self.watched = upstream, watch, 0, []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                victim = self.path.endswith(VICTIM)
                if victim:
                    proxy.victim_requests += 1
                    if proxy.victim_requests == 2:
                        proxy.watched.append(status_of(proxy.watch, f"/file/{VICTIM}"))
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream, timeout=30)
                conn.request("GET", self.path, headers={k: v for k, v in self.headers.items() if k == "Range"})
                resp = conn.getresponse()
                body = bytearray(resp.read())
                if victim and len(body) > 100:
                    body[100] ^= 0xFF
                self.send_response(resp.status)
                for key in ("Content-Type", "Content-Range"):
                    if resp.getheader(key):
                        self.send_header(key, resp.getheader(key))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(bytes(body))

        super().__init__(("127.0.0.1", 0), Handler)


def test_a_shard_corrupted_in_flight_is_never_verified_served_or_passed_on(source: Path, tmp_path: Path) -> None:
    p0, p1 = free_port(), free_port()
    (tmp_path / "h1").mkdir()
    servers = [serve(source, p0), serve(tmp_path / "h1", p1)]
    proxy = CorruptingProxy(p0, p1)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        downstream = subprocess.Popen([sys.executable, str(RELAY), "fetch", str(tmp_path / "h2"), "--source",
                                       f"http://127.0.0.1:{p1}"], stdout=subprocess.PIPE, text=True)
        h1 = relay("fetch", str(tmp_path / "h1"), "--source", f"http://127.0.0.1:{proxy.server_port}",
                   "--source", f"http://127.0.0.1:{p0}")
        assert h1.returncode == 0, h1.stderr
        report = json.loads(h1.stdout)
        bad = [b["file"] for b in report["bad_shards"]]
        assert bad == [VICTIM, VICTIM]  # refused twice over the bad link, then taken from the next source
        assert proxy.watched == [409]  # between the two corrupted copies, h1 served nothing for it
        out, _ = downstream.communicate(timeout=120)
        assert downstream.returncode == 0 and json.loads(out)["bad_shards"] == []  # h2 never saw the bad bytes
        for root in ("h1", "h2"):
            assert subprocess.run([sys.executable, str(VERIFY), "--full", str(tmp_path / root)]).returncode == 0
    finally:
        proxy.shutdown()
        for s in servers:
            s.kill()


@pytest.mark.sandbox
@needs_root
def test_a_crashed_host_mid_distribution_is_routed_around_and_the_rerun_repairs_it(tmp_path: Path,
                                                                                   fleet: SandboxFleet) -> None:
    src = ensure_synthetic_checkpoint(tmp_path / "source", "t/Kimi-K2-Thinking", "d" * 40, num_shards=62,
                                      shard_bytes=2 << 20)
    files = json.loads((src / ".k2fleet/manifest.json").read_text())["files"]
    relays = None
    hosts = fleet.sandbox_hosts  # the one sandbox fixture and lock (tests/conftest.py): 3 bare hosts, no Docker
    try:
        relays = RelayFleet(src, hosts)
        relays.start()
        sandbox.shape("100mbit")  # 130 MB: ~10 s per link
        h1, h2, h3 = hosts
        lines = {h1.name: relays.fetch_argv(h1, None, [url(sandbox.BRIDGE_ADDRESS)]),
                 h2.name: relays.fetch_argv(h2, None, [url(h1.address), url(sandbox.BRIDGE_ADDRESS)]),
                 h3.name: relays.fetch_argv(h3, None, [url(h2.address), url(h1.address),
                                                      url(sandbox.BRIDGE_ADDRESS)], dead_after=3)}
        procs = {h.name: subprocess.Popen(sandbox.ssh_command(h, lines[h.name]), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
                 for h in hosts}
        deadline, had = time.monotonic() + 60, 0
        while time.monotonic() < deadline:  # crash h2 once it has passed shards on to h3
            out = sandbox.ssh(h3, f"ls {HOST_DIR}/.k2fleet/relay 2>/dev/null | wc -l").stdout.strip()
            had = int(out or 0)
            if had >= 10:
                break
            time.sleep(0.2)
        assert 10 <= had < len(files), had
        sandbox.crash_host(2)  # the fault drill: h2's container init, not only its nspawn
        sandbox.shape("off")  # the crash came mid-distribution; the rest need not crawl at 100mbit
        reports = {}
        for h in (h1, h3):
            out, err = procs[h.name].communicate(timeout=300)
            assert procs[h.name].returncode == 0, (h.name, err[-2000:])
            reports[h.name] = json.loads(out.strip().splitlines()[-1])
            marks = sandbox.ssh(h, f"ls -A {HOST_DIR}/.k2fleet/relay | wc -l").stdout.strip()
            assert int(marks) == len(files), (h.name, marks)
        procs[h2.name].communicate(timeout=60)
        assert procs[h2.name].returncode != 0  # its host is gone
        assert reports[h3.name]["failovers"] > 0 and url(h1.address) in reports[h3.name]["sources"]
        assert reports[h3.name]["bad_shards"] == []
        h2 = sandbox.start_again(2)
        relays.restart_server(h2)
        again = relays.run_fetches({h2.name: relays.fetch_argv(h2, None, [url(h1.address)])})[h2.name]
        assert again["kept"] > 0 and again["kept"] + again["files"] == len(files), again
        assert again["bad_shards"] == []
    finally:
        if relays is not None:
            relays.stop()
        sandbox.shape("off")
        fleet.forget()  # a host was crashed and started again by hand
