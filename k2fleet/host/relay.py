"""Runs ON a host, or on the control machine (standard library only, with verify.py and
swarm.py beside it): pipelined checkpoint distribution — each host passes a shard on as
soon as it has verified it.

    python3 relay.py mark  DIR                       # hash every file against the manifest, mark the good ones
    python3 relay.py serve DIR --bind ADDR --port P   # serve the verified files (HTTP, Range), until killed
    python3 relay.py fetch DIR --fleet URL,URL,... --position I [--fanout K] [--source URL] [--log FILE]
    python3 relay.py fetch DIR --source URL [--source URL ...] [--plan FILE]

The deploy (``roles/checkpoint.py``) starts ``serve`` on every host that loads weights and
``fetch --fleet`` on every host whose copy is not verified: per shard, the host at
position I takes it from its parent in :func:`swarm.plan_sources`'s plan over the fleet
order (``--fanout 1``: a chain; k: per-shard k-ary trees), falling back to the parent's
ancestors and last to ``--source`` (the control machine's verified copy). Every host
receives every byte once over its own link and the shards flow down the fleet one behind
the other, so the fleet is done a few shard-times after one host's transfer time S/B
(``bench/distribution_bench.py`` measures it against the doubling tree's 1 + ⌈log2 N⌉
full rounds).

Rules it keeps:

- **Never serve unverified.** A file is served only if this relay hashed it right
  (``DIR/.k2fleet/relay/<file>.ok``: its sha256 and the file's stat then) or verify.py's
  ``verified.json`` for this manifest lists it, in both cases with the file's size, mtime,
  ctime and inode unchanged since. Received bytes go through verify.py's checks of one file
  (size, safetensors header, sha256 or git blob sha1) before they get their final name. A
  shard corrupted in flight fails them: it is deleted, never marked, never served, and
  fetched again (from the next source if it fails twice).
- **Resume and repair.** ``fetch`` first drops every marker (its own and verified.json)
  and hashes what is in place: a file that passes is kept and marked (bit rot keeps sizes
  and mtimes, so markers alone are not trusted); the others are fetched. A killed fetch
  leaves only ``.k2fleet/relay-partial/``, which the next run discards. When every file is
  in, the index is checked and verify.py's ``verified.json`` written, so the checkpoint
  gate passes without hashing anything twice.
- **Heal around a dead host.** Each file's list is its parent, then the parent's ancestors,
  then the source: a source that has not answered for ``--dead-after`` seconds is skipped.
- **One transfer near the wire.** Each file comes in ``--chunk`` ranges over ``--streams``
  parallel HTTP connections (raw TCP on the private mesh: no per-byte cipher, unlike one
  rsync-over-SSH stream; the checks above are the integrity guarantee, the weights are
  not secret).

Prints one JSON line at the end of ``fetch`` (files, bytes, kept, seconds — of them
``transfer_seconds`` receiving and ``verify_seconds`` hashing —, files and bytes per
source, failovers, bad shards) and appends it to ``--log``.
"""

import argparse
import http.client
import http.server
import json
import os
import shutil
import socketserver
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

try:  # on hosts: beside this file in /opt/k2fleet/lib (shipped with it)
    import swarm
    import verify
except ImportError:  # in the repository
    from k2fleet.checkpoint import swarm, verify

MANIFEST = os.path.join(".k2fleet", "manifest.json")
MARKS = os.path.join(".k2fleet", "relay")
PARTIAL = os.path.join(".k2fleet", "relay-partial")
CHUNK = 16 << 20
BLOCK = 1 << 20
POLL_S = 0.1
DEAD_AFTER_S = 10.0  # a source that does not answer this long is skipped


def load_manifest(root):
    with open(os.path.join(root, MANIFEST)) as fh:
        return json.load(fh)


def mark_path(root, rel):
    return os.path.join(root, MARKS, rel + ".ok")


def is_verified_here(root, manifest, rel, verified=None):
    """True if ``rel`` may be served: this relay hashed it right (its marker), or verify.py's
    ``verified.json`` for this manifest lists it (``verified``: that marker's records,
    read once by the caller) — either way with the file's stat unchanged since."""
    now = verify.stat_record(os.path.join(root, rel))
    if now is None:
        return False
    try:
        with open(mark_path(root, rel)) as fh:
            if json.load(fh) == {"sha256": expected(manifest["files"][rel]), "stat": now}:
                return True
    except (OSError, ValueError):
        pass
    if verified is None:
        verified = verify.load_marker(root, manifest)
    return verified.get(rel) == now


def expected(entry):
    return entry.get("sha256") or entry.get("git_blob_sha1")


def write_mark(root, rel, entry, stat):
    """Record that ``rel`` hashed right while its file had ``stat``: from now on it is served."""
    path = mark_path(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump({"sha256": expected(entry), "stat": stat}, fh)
    os.replace(tmp, path)


def drop_marks(root, manifest):
    """Nothing here is served until hashed again: every relay marker and verified.json go."""
    verify.remove_marker(root)
    for rel in manifest["files"]:
        try:
            os.unlink(mark_path(root, rel))
        except OSError:
            pass


def mark(root):
    """Hash every file against the manifest; mark the good ones. Returns the bad ones."""
    manifest = load_manifest(root)
    bad = []
    for rel, entry in sorted(manifest["files"].items()):
        stat, _ = verify.check_one(root, manifest, rel)
        if stat is None:
            bad.append(rel)
        else:
            write_mark(root, rel, entry, stat)
    return bad


# --------------------------------------------------------------------------- serving


def make_handler(root):
    manifest_path = os.path.join(root, MANIFEST)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet
            pass

        def _send(self, code, body=b"", headers=()):
            self.send_response(code)
            for k, v in headers:
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if body and self.command != "HEAD":
                self.wfile.write(body)

        def do_GET(self):
            path = urllib.parse.unquote(self.path)
            if path == "/manifest":
                try:
                    with open(manifest_path, "rb") as fh:
                        return self._send(200, fh.read(), [("Content-Type", "application/json")])
                except OSError:
                    return self._send(404)
            try:
                manifest = load_manifest(root)
            except (OSError, ValueError):
                return self._send(503)
            if path == "/ready":
                verified = verify.load_marker(root, manifest)
                ready = [rel for rel in sorted(manifest["files"]) if is_verified_here(root, manifest, rel, verified)]
                return self._send(200, json.dumps(ready).encode(), [("Content-Type", "application/json")])
            rel = path[len("/file/"):] if path.startswith("/file/") else None
            entry = manifest["files"].get(rel) if rel else None
            if entry is None or ".." in rel.split("/"):
                return self._send(404)
            if not is_verified_here(root, manifest, rel):  # never serve unverified
                return self._send(409, b"not verified here yet")
            size = entry["size"]
            start, end = 0, size - 1
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes="):
                a, _, b = rng[6:].partition("-")
                start, end = int(a), min(int(b) if b else size - 1, size - 1)
            length = max(0, end - start + 1)
            self.send_response(206 if rng else 200)
            self.send_header("Content-Length", str(length))
            if rng:
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            self.end_headers()
            with open(os.path.join(root, rel), "rb") as fh:
                fh.seek(start)
                left = length
                while left > 0:
                    block = fh.read(min(BLOCK, left))
                    if not block:
                        break
                    self.wfile.write(block)
                    left -= len(block)

    return Handler


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def serve(root, bind, port, exit_with_parent=False):
    """Serve ``root`` on ``bind:port`` (0: any free port) until killed; prints
    ``{"port": N}`` once listening. ``exit_with_parent``: stop when the process that
    started this one is gone (the control machine's relay outlives no deploy)."""
    server = Server((bind, port), make_handler(root))
    print(json.dumps({"port": server.server_address[1]}), flush=True)
    if exit_with_parent:
        parent = os.getppid()

        def watch():
            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(0)

        threading.Thread(target=watch, daemon=True).start()
    server.serve_forever()


# --------------------------------------------------------------------------- fetching


class Source:
    """One upstream relay (``http://HOST:PORT``)."""

    def __init__(self, url):
        parsed = urllib.parse.urlsplit(url)
        self.url, self.host, self.port = url, parsed.hostname, parsed.port or 80
        self.dead_since = None

    def request(self, path, headers=None, timeout=30):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request("GET", urllib.parse.quote(path), headers=headers or {})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def ready(self):
        status, body = self.request("/ready", timeout=5)
        return set(json.loads(body)) if status == 200 else set()

    def get_range(self, rel, fd, start, end):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        try:
            conn.request("GET", urllib.parse.quote("/file/" + rel), headers={"Range": f"bytes={start}-{end}"})
            resp = conn.getresponse()
            if resp.status not in (200, 206):
                raise OSError(f"{self.url} answered {resp.status} for {rel}")
            offset = start
            while True:
                block = resp.read(BLOCK)
                if not block:
                    break
                os.pwrite(fd, block, offset)
                offset += len(block)
            if offset != end + 1:
                raise OSError(f"{self.url}: short read of {rel} ({offset - start} of {end - start + 1} bytes)")
        finally:
            conn.close()


def fetch_file(source, root, manifest, rel, streams, chunk, clock=None):
    """Fetch ``rel`` from ``source`` into a partial file, verify it (verify.py's checks of
    one file), move it into place and mark it. True if it verified; False if the bytes
    were bad (deleted, not marked). ``clock``: dict whose ``transfer`` and ``verify``
    seconds grow by this file's."""
    clock = clock if clock is not None else {}
    t0 = time.monotonic()
    partial_root = os.path.join(root, PARTIAL)
    part = os.path.join(partial_root, rel)
    os.makedirs(os.path.dirname(part), exist_ok=True)
    size = manifest["files"][rel]["size"]
    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)
        ranges = [(a, min(a + chunk, size) - 1) for a in range(0, size, chunk)]
        with ThreadPoolExecutor(max_workers=max(1, min(streams, len(ranges) or 1))) as pool:
            for f in [pool.submit(source.get_range, rel, fd, a, b) for a, b in ranges]:
                f.result()
    finally:
        os.close(fd)
    t1 = time.monotonic()
    stat, _ = verify.check_one(partial_root, manifest, rel)
    clock["transfer"] = clock.get("transfer", 0.0) + t1 - t0
    clock["verify"] = clock.get("verify", 0.0) + time.monotonic() - t1
    if stat is None:
        os.unlink(part)
        return False
    dest = os.path.join(root, rel)
    os.makedirs(os.path.dirname(dest) or root, exist_ok=True)
    os.replace(part, dest)
    moved = verify.stat_record(dest)  # a rename changes ctime only
    if moved is None or {k: moved[k] for k in ("size", "mtime_ns", "ino")} != {k: stat[k] for k in ("size", "mtime_ns", "ino")}:
        return False
    write_mark(root, rel, manifest["files"][rel], moved)
    return True


def _manifest_from(sources, wait_s=600.0):
    """The manifest from the first source that has one; sources that answer without one
    yet (a peer still fetching it) are waited for, up to ``wait_s`` seconds."""
    deadline, last = time.monotonic() + wait_s, None
    while time.monotonic() < deadline:
        for src in sources:
            try:
                status, body = src.request("/manifest", timeout=10)
                if status == 200:
                    return body
                last = f"{src.url} answered {status}"
            except OSError as exc:
                last = exc
        time.sleep(POLL_S)
    raise SystemExit(f"no source answered with a manifest ({last})")


def fleet_plan(files, fleet, position, fanout, sources):
    """file → URLs to try, parent first (:func:`swarm.plan_sources` over the fleet's relay
    URLs, this host at ``position``); the plan's source is ``sources`` (none: skipped)."""
    plan = swarm.plan_sources(list(range(len(fleet))), sorted(files), fanout)[position]
    return {rel: [u for p in chain for u in ([fleet[p]] if p is not None else sources)] for rel, chain in plan.items()}


def fetch(root, urls, streams=4, chunk=CHUNK, log=None, plan=None, dead_after=DEAD_AFTER_S, fleet=None,
          position=None, fanout=1):
    """Fetch every file of the sources' manifest into ``root``, each from the first live
    source of its list, verifying each before it is marked (and so served onward).
    The lists: ``plan`` (file → URLs, parent first), or the fleet's per-shard plan
    (``fleet``: every host's relay URL in fleet order, this host at ``position``; the
    source is ``urls``), or ``urls`` for every file."""
    by_url = {}

    def source(url):
        if url not in by_url:
            by_url[url] = Source(url)
        return by_url[url]

    os.makedirs(os.path.join(root, ".k2fleet"), exist_ok=True)
    shutil.rmtree(os.path.join(root, PARTIAL), ignore_errors=True)  # a killed run's leftovers
    t0 = time.monotonic()
    ancestors = fleet[:position] if fleet else []
    manifest_bytes = _manifest_from([source(u) for u in [*reversed(ancestors), *urls]])
    manifest = json.loads(manifest_bytes)
    if fleet:
        plan = fleet_plan(manifest["files"], fleet, position, fanout, urls)
    try:
        old_files = load_manifest(root)["files"]
    except (OSError, ValueError, KeyError):
        old_files = {}
    # nothing is served until hashed again (bit rot keeps sizes and mtimes): the markers of
    # the old manifest's files and the new one's, and verify.py's marker, go
    drop_marks(root, {"files": {**old_files, **manifest["files"]}})
    with open(os.path.join(root, MANIFEST) + ".tmp", "wb") as fh:
        fh.write(manifest_bytes)
    os.replace(os.path.join(root, MANIFEST) + ".tmp", os.path.join(root, MANIFEST))
    report = {"files": 0, "bytes": 0, "kept": 0, "bad_shards": [], "sources": {}, "bytes_from": {}, "failovers": 0}
    todo = []
    for rel, entry in sorted(manifest["files"].items()):  # resume/repair: what hashes right stays
        stat, _ = verify.check_one(root, manifest, rel)
        if stat is not None:
            write_mark(root, rel, entry, stat)
            report["kept"] += 1
        else:
            todo.append((rel, entry))
    refused = {}  # (file, url) → times its bytes did not verify
    clock = {"transfer": 0.0, "verify": 0.0}  # seconds receiving bytes, hashing them
    ready = {}  # url → what it served as verified when last asked (asked again only for a file not in it)
    while todo:
        asked = set()  # sources asked in this pass
        progress = False
        for k, (rel, entry) in enumerate(todo):
            candidates = [source(u) for u in ((plan or {}).get(rel) or urls)]
            if not candidates:
                raise SystemExit(f"{rel}: no source to fetch it from")
            live = [c for c in candidates if refused.get((rel, c.url), 0) < 2
                    and not (c.dead_since and time.monotonic() - c.dead_since > dead_after)]
            if not live:  # every source failed this file: start over with all of them
                if all(refused.get((rel, c.url), 0) >= 2 for c in candidates):
                    raise SystemExit(f"{rel}: no source gave bytes matching the manifest")
                live = candidates[-1:]
            src = live[0]
            if src is not candidates[0] and (rel, "failover") not in refused:
                report["failovers"] += 1
                refused[(rel, "failover")] = 1
            if rel not in ready.get(src.url, ()) and src.url not in asked:
                asked.add(src.url)
                try:
                    ready[src.url] = src.ready()
                    src.dead_since = None
                except (OSError, ValueError):
                    src.dead_since = src.dead_since or time.monotonic()
            if rel not in ready.get(src.url, ()):
                continue
            try:
                ok = fetch_file(src, root, manifest, rel, streams, chunk, clock)
            except OSError:
                src.dead_since = src.dead_since or time.monotonic()
                ready.get(src.url, set()).discard(rel)  # ask again before trying it there
                ok = None
            if ok:
                todo.pop(k)
                report["files"] += 1
                report["bytes"] += entry["size"]
                report["sources"][src.url] = report["sources"].get(src.url, 0) + 1
                report["bytes_from"][src.url] = report["bytes_from"].get(src.url, 0) + entry["size"]
                progress = True
            elif ok is False:
                report["bad_shards"].append({"file": rel, "source": src.url})
                refused[(rel, src.url)] = refused.get((rel, src.url), 0) + 1
            break
        if not progress:
            time.sleep(POLL_S)
    shutil.rmtree(os.path.join(root, PARTIAL), ignore_errors=True)
    # every file verified and marked: verify.py's marker too (index and headers checked,
    # nothing hashed twice), so the deploy's checkpoint gate passes without re-hashing
    stats = {rel: verify.stat_record(os.path.join(root, rel)) for rel in manifest["files"]}
    problems = verify.index_problems(root, manifest)
    if not problems and all(is_verified_here(root, manifest, rel, {}) for rel in manifest["files"]):
        verify.write_marker(root, manifest, stats)
    report.update(seconds=round(time.monotonic() - t0, 3), dir=root, verified=not problems,
                  transfer_seconds=round(clock["transfer"], 3), verify_seconds=round(clock["verify"], 3),
                  time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    line = json.dumps(report, sort_keys=True)
    print(line, flush=True)
    if log:
        os.makedirs(os.path.dirname(log), exist_ok=True)
        with open(log, "a") as fh:
            fh.write(line + "\n")
    if problems:
        raise SystemExit("index problems: " + "; ".join(p.line() for p in problems))
    return report


def main(argv=None):
    p = argparse.ArgumentParser(prog="relay.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("mark")
    m.add_argument("dir")
    s = sub.add_parser("serve")
    s.add_argument("dir")
    s.add_argument("--bind", default="0.0.0.0")
    s.add_argument("--port", type=int, required=True, help="0: any free port (printed)")
    s.add_argument("--exit-with-parent", action="store_true")
    f = sub.add_parser("fetch")
    f.add_argument("dir")
    f.add_argument("--source", action="append", default=[], help="http://HOST:PORT of the source's copy")
    f.add_argument("--fleet", help="comma-separated relay URLs of every host in fleet order (with --position)")
    f.add_argument("--position", type=int, help="this host's index in --fleet")
    f.add_argument("--fanout", type=int, default=1, help="1: a chain; k: per-shard k-ary trees")
    f.add_argument("--streams", type=int, default=4)
    f.add_argument("--chunk", type=int, default=CHUNK)
    f.add_argument("--log")
    f.add_argument("--dead-after", type=float, default=DEAD_AFTER_S,
                   help="seconds a source may not answer before the next one is used")
    f.add_argument("--plan", help="JSON file: {file: [source URL, ...]} (parent first); default --source for all")
    a = p.parse_args(argv)
    if a.cmd == "mark":
        bad = mark(a.dir)
        print(json.dumps({"bad": bad}))
        return 1 if bad else 0
    if a.cmd == "serve":
        serve(a.dir, a.bind, a.port, a.exit_with_parent)
        return 0
    plan = None
    if a.plan:
        with open(a.plan) as fh:
            plan = json.load(fh)
    fleet = a.fleet.split(",") if a.fleet else None
    if fleet and not (a.position is not None and 0 <= a.position < len(fleet)):
        p.error("--fleet needs --position, an index into it")
    if not (a.source or plan or fleet):
        p.error("fetch needs --source, --plan or --fleet")
    fetch(a.dir, a.source, a.streams, a.chunk, a.log, plan, a.dead_after, fleet, a.position, a.fanout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
