"""Runs ON a host, or on the control machine (standard library only): pipelined
checkpoint distribution — each host passes a shard on as soon as it has verified it.

    python3 relay.py mark  DIR                      # hash every file against the manifest, mark the good ones
    python3 relay.py serve DIR --bind ADDR --port P  # serve the marked files (HTTP, Range), until killed
    python3 relay.py fetch DIR --source URL [--source URL ...] [--streams N] [--log FILE]

A chain: the source (the control machine's verified copy) serves; host 1 fetches from it
while serving what it has verified; host 2 fetches from host 1; and so on. Every host
receives every byte once over its own link and the shards flow down the chain one behind
the other, so the fleet is done about one shard-time per hop after one host's transfer
time S/B (``bench/distribution_bench.py`` measures it against the doubling tree's
1 + ⌈log2 N⌉ full rounds).

Rules it keeps:

- **Never serve unverified.** A file is served only once its marker
  (``DIR/.k2fleet/relay/<file>.ok``, holding its sha256) exists, and a marker is written
  only after the received bytes hashed to the manifest's sha256 (LFS files) or git blob
  sha1 (small files). A shard corrupted in flight fails that check: it is deleted, never
  marked, never served, and fetched again (from the next source if it fails twice).
- **Resume and repair.** A file already in place whose bytes hash right is marked and
  not fetched; a bad one is fetched again. A killed fetch leaves only
  ``.k2fleet/partial/`` files, which the next run discards.
- **Heal around a dead host.** ``--source`` lists the parent first, then its ancestors
  up to the source: when a source stops answering, the fetch moves to the next one.
- **One transfer near the wire.** Each file larger than 2 × ``--chunk`` comes in
  ``--streams`` parallel HTTP range requests (raw TCP on the private mesh: no per-byte
  cipher, unlike one rsync-over-SSH stream; the sha256 check is the integrity guarantee,
  the weights are not secret).

Prints one JSON line at the end of ``fetch`` (files, bytes, seconds, sources used, bad
shards) and appends it to ``--log``.
"""

import argparse
import hashlib
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

MANIFEST = os.path.join(".k2fleet", "manifest.json")
MARKS = os.path.join(".k2fleet", "relay")
PARTIAL = os.path.join(".k2fleet", "partial")
CHUNK = 16 << 20
BLOCK = 1 << 20
POLL_S = 0.1
DEAD_AFTER_S = 10.0  # a source that does not answer this long is skipped


def load_manifest(root):
    with open(os.path.join(root, MANIFEST)) as fh:
        return json.load(fh)


def digest_of(path, entry):
    """(kind, hex) of the file at ``path`` as the manifest ``entry`` records it."""
    if entry.get("sha256"):
        h = hashlib.sha256()
    else:
        h = hashlib.sha1()
        h.update(b"blob %d\0" % os.path.getsize(path))
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def expected(entry):
    return entry.get("sha256") or entry.get("git_blob_sha1")


def mark_path(root, rel):
    return os.path.join(root, MARKS, rel + ".ok")


def is_marked(root, rel, entry):
    try:
        with open(mark_path(root, rel)) as fh:
            return fh.read().strip() == expected(entry) and os.path.getsize(os.path.join(root, rel)) == entry["size"]
    except OSError:
        return False


def write_mark(root, rel, entry):
    path = mark_path(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(expected(entry) + "\n")
    os.replace(tmp, path)


def mark(root):
    """Hash every file against the manifest; mark the good ones. Returns the bad ones."""
    manifest = load_manifest(root)
    bad = []
    for rel, entry in sorted(manifest["files"].items()):
        path = os.path.join(root, rel)
        if os.path.isfile(path) and os.path.getsize(path) == entry["size"] and digest_of(path, entry) == expected(entry):
            write_mark(root, rel, entry)
        else:
            bad.append(rel)
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
                ready = [rel for rel, e in sorted(manifest["files"].items()) if is_marked(root, rel, e)]
                return self._send(200, json.dumps(ready).encode(), [("Content-Type", "application/json")])
            rel = path[len("/file/"):] if path.startswith("/file/") else None
            entry = manifest["files"].get(rel) if rel else None
            if entry is None or ".." in rel.split("/"):
                return self._send(404)
            if not is_marked(root, rel, entry):  # never serve unverified
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


def serve(root, bind, port):
    server = Server((bind, port), make_handler(root))
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


def fetch_file(source, root, rel, entry, streams, chunk):
    """Fetch ``rel`` from ``source`` into a partial file, verify it, move it into place.
    True if it verified; False if the bytes were bad (deleted, not marked)."""
    part = os.path.join(root, PARTIAL, rel + ".relay")
    os.makedirs(os.path.dirname(part), exist_ok=True)
    size = entry["size"]
    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)
        ranges = [(a, min(a + chunk, size) - 1) for a in range(0, size, chunk)] or [(0, -1)]
        if size == 0:
            ranges = []
        with ThreadPoolExecutor(max_workers=max(1, min(streams, len(ranges) or 1))) as pool:
            for f in [pool.submit(source.get_range, rel, fd, a, b) for a, b in ranges]:
                f.result()
    finally:
        os.close(fd)
    if digest_of(part, entry) != expected(entry):
        os.unlink(part)
        return False
    dest = os.path.join(root, rel)
    os.makedirs(os.path.dirname(dest) or root, exist_ok=True)
    os.replace(part, dest)
    write_mark(root, rel, entry)
    return True


def _manifest_from(sources):
    last = None
    for src in sources:
        try:
            status, body = src.request("/manifest", timeout=10)
            if status == 200:
                return body
        except OSError as exc:
            last = exc
    raise SystemExit(f"no source answered with a manifest ({last})")


def fetch(root, urls, streams=4, chunk=CHUNK, log=None, plan=None):
    """Fetch every file of the sources' manifest into ``root``, each from the first live
    source of its list (``plan``: file → source URLs, parent first; default ``urls`` for
    every file), verifying each before it is marked (and so served onward)."""
    by_url = {}

    def source(url):
        if url not in by_url:
            by_url[url] = Source(url)
        return by_url[url]

    for url in urls:
        source(url)
    os.makedirs(os.path.join(root, ".k2fleet"), exist_ok=True)
    shutil.rmtree(os.path.join(root, PARTIAL), ignore_errors=True)  # a killed run's leftovers
    t0 = time.monotonic()
    manifest_bytes = _manifest_from([source(u) for u in urls])
    with open(os.path.join(root, MANIFEST) + ".tmp", "wb") as fh:
        fh.write(manifest_bytes)
    os.replace(os.path.join(root, MANIFEST) + ".tmp", os.path.join(root, MANIFEST))
    manifest = json.loads(manifest_bytes)
    report = {"files": 0, "bytes": 0, "kept": 0, "bad_shards": [], "sources": {}, "failovers": 0}
    todo = []
    for rel, entry in sorted(manifest["files"].items()):  # resume/repair: what is already right stays
        path = os.path.join(root, rel)
        if is_marked(root, rel, entry):
            report["kept"] += 1
        elif os.path.isfile(path) and os.path.getsize(path) == entry["size"] and digest_of(path, entry) == expected(entry):
            write_mark(root, rel, entry)
            report["kept"] += 1
        else:
            todo.append((rel, entry))
    refused = {}  # (file, url) → times its bytes did not verify
    while todo:
        ready_now = {}
        progress = False
        for k, (rel, entry) in enumerate(todo):
            candidates = [source(u) for u in ((plan or {}).get(rel) or urls)]
            live = [c for c in candidates if refused.get((rel, c.url), 0) < 2
                    and not (c.dead_since and time.monotonic() - c.dead_since > DEAD_AFTER_S)]
            if not live:  # every source failed this file: start over with all of them
                if all(refused.get((rel, c.url), 0) >= 2 for c in candidates):
                    raise SystemExit(f"{rel}: no source gave bytes matching the manifest")
                live = candidates[-1:]
            src = live[0]
            if src is not candidates[0]:
                report["failovers"] += 1 if (rel, "failover") not in refused else 0
                refused[(rel, "failover")] = 1
            if src.url not in ready_now:
                try:
                    ready_now[src.url] = src.ready()
                    src.dead_since = None
                except OSError:
                    ready_now[src.url] = set()
                    src.dead_since = src.dead_since or time.monotonic()
            if rel not in ready_now[src.url]:
                continue
            try:
                ok = fetch_file(src, root, rel, entry, streams, chunk)
            except OSError:
                src.dead_since = src.dead_since or time.monotonic()
                ok = None
            if ok:
                todo.pop(k)
                report["files"] += 1
                report["bytes"] += entry["size"]
                report["sources"][src.url] = report["sources"].get(src.url, 0) + 1
                progress = True
            elif ok is False:
                report["bad_shards"].append({"file": rel, "source": src.url})
                refused[(rel, src.url)] = refused.get((rel, src.url), 0) + 1
            break
        if not progress:
            time.sleep(POLL_S)
    report.update(seconds=round(time.monotonic() - t0, 3), dir=root,
                  time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    line = json.dumps(report, sort_keys=True)
    print(line, flush=True)
    if log:
        os.makedirs(os.path.dirname(log), exist_ok=True)
        with open(log, "a") as fh:
            fh.write(line + "\n")
    return report


def main(argv=None):
    p = argparse.ArgumentParser(prog="relay.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("mark")
    m.add_argument("dir")
    s = sub.add_parser("serve")
    s.add_argument("dir")
    s.add_argument("--bind", default="0.0.0.0")
    s.add_argument("--port", type=int, required=True)
    f = sub.add_parser("fetch")
    f.add_argument("dir")
    f.add_argument("--source", action="append", required=True, help="http://HOST:PORT, parent first")
    f.add_argument("--streams", type=int, default=4)
    f.add_argument("--chunk", type=int, default=CHUNK)
    f.add_argument("--log")
    f.add_argument("--plan", help="JSON file: {file: [source URL, ...]} (parent first); default --source for all")
    a = p.parse_args(argv)
    if a.cmd == "mark":
        bad = mark(a.dir)
        print(json.dumps({"bad": bad}))
        return 1 if bad else 0
    if a.cmd == "serve":
        serve(a.dir, a.bind, a.port)
        return 0
    plan = None
    if a.plan:
        with open(a.plan) as fh:
            plan = json.load(fh)
    fetch(a.dir, a.source, a.streams, a.chunk, a.log, plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
