"""Runs ON a host from the host archive, or on the control machine as
``python -m k2fleet.hostprogs.relay`` (standard library only, with its siblings ``verify`` and ``swarm``):
pipelined checkpoint distribution — each host passes a shard on as soon as it has verified it.

    python3 k2fleet-host.pyz relay mark  DIR                      # hash every file, mark the good ones
    python3 k2fleet-host.pyz relay pieces DIR                     # pin a verified copy piece by piece (prints the digest)
    python3 k2fleet-host.pyz relay serve DIR --bind ADDR --port P [--secret-file F] [--idle-exit S]
    python3 k2fleet-host.pyz relay fetch DIR --fleet URL,URL,... --position I [--fanout K] [--source URL]
        [--repo R --revision V] [--manifest-digest D] [--pieces-digest P] [--secret-file F] [--log FILE]
    python3 k2fleet-host.pyz relay fetch DIR --source URL [--source URL ...] [--plan FILE]

The deploy (``k2fleet/deploy/roles/checkpoint.py``) starts ``serve`` on every host that loads weights and
``fetch --fleet`` on every host whose copy is not verified: per shard, the host at position I takes it from
its parent in :func:`swarm.plan_sources`'s plan over the fleet order (``--fanout 1``: a chain; k: per-shard
k-ary trees), falling back to the parent's ancestors and last to ``--source`` (the control machine's
verified copy). Every host receives every byte once over its own link and the shards flow down the fleet
one behind the other, so the fleet is done a few shard-times after one host's transfer time S/B
(``bench/distribution_bench.py`` measures it against the doubling tree's 1 + ⌈log2 N⌉ full rounds).

Rules it keeps:

- **Never serve unverified.** A file is served only if this relay hashed it right
  (``DIR/.k2fleet/relay/<file>.ok``: its sha256 and the file's stat then) or verify.py's ``verified.json``
  for this manifest lists it, in both cases with the file's size, mtime, ctime and inode unchanged since.
  Received bytes go through verify.py's checks of one file (size, safetensors header, sha256 or git blob
  sha1) before they get their final name. A shard corrupted in flight fails them: it is deleted, never
  marked, never served, and fetched again (from the next source if it fails twice). The one exception is
  a file landing with pinned pieces (``--pieces-digest``: the sha256 of the control machine's
  ``.k2fleet/pieces.json``, :func:`make_pieces`): the hash that follows it checks each piece against the
  pin as it completes, and the relay serves the landing file up to the last piece that matched, not a byte
  further (:func:`open_growing`), so each hop of the chain adds one piece's time, not one file's; a piece
  that fails its pin stops the landing there (:class:`BadPiece`: a bad copy from that source).
- **Resume and repair.** ``fetch`` first drops every marker (its own and verified.json) and hashes what is
  in place: a file that passes is kept and marked (bit rot keeps sizes and mtimes, so markers alone are not
  trusted); the others are fetched. A killed fetch leaves only ``.k2fleet/relay-partial/``, which the next
  run discards. One fetch into a directory at a time (``.k2fleet/relay-fetch.lock``): a second waits. When every file is in, the index is checked and verify.py's ``verified.json`` written, so
  the checkpoint gate passes without hashing anything twice.
- **Wait for what is coming.** A peer whose fetch — or whose Hub download feeding it (``download.py
  --publish`` on the fetcher host: each file marked here once it passed its check) — is running keeps a
  heartbeat (``.k2fleet/relay-fetching``); for a file it has not verified yet it holds the request, then
  answers 409 with ``X-K2-Fetching: 1`` and receivers wait (a file landing with pinned pieces is streamed
  instead as soon as its first piece verified). When no source of a file has it and none is fetching for
  ``--give-up-after`` seconds (the download failed), the fetch fails naming the file.
- **Heal around a dead host.** Each file's list is its parent, then the parent's ancestors, then the
  source: a source that has not answered for ``--dead-after`` seconds is skipped.
- **One transfer near the wire.** Plain HTTP/1.1 range requests on kept-alive TCP connections over the
  private mesh (no per-byte cipher, unlike one rsync-over-SSH stream; the checks above are the integrity
  guarantee, the weights are not secret). A receiver asks for its next file while the current one streams
  (HTTP/1.1 pipelining); the source holds that request until the file (with pinned pieces: its first piece)
  is verified there and sends it at once, so a file leaves each host within milliseconds of its check and the link does not idle between
  files. The bytes never pass through Python: the server ``sendfile``s them, the receiver ``splice``s
  socket → pipe → file, and a thread hashes the landed prefix meanwhile, so a file is verified a moment
  after its last byte. The next file starts landing at once: up to ``--verify-behind`` landed files
  (default 4) are still hashed and checked, each on a thread of its own, so a link faster than one core's
  sha256 is not held to it. ``--streams`` range streams per file (default 1: on the sandbox one spliced
  stream got more than four); files of different lanes move at once.

Prints one JSON line at the end of ``fetch`` (files, bytes, kept, seconds — and, summed over files,
``transfer_seconds`` landing bytes and ``verify_seconds`` finishing checks, which overlap —, files and bytes per
source, failovers, bad shards, when it ``started`` (epoch seconds), each file's ``ready_at`` — verified, marked
and served from then —, and ``landed_at`` — its last byte in —, seconds after that) and appends it to ``--log``.
"""

import argparse
import collections
import contextlib
import errno
import fcntl
import hashlib
import hmac
import http.server
import json
import mmap
import os
import re
import shutil
import socket
import socketserver
import struct
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

from k2fleet.hostprogs import swarm, verify  # in the host archive beside it; never a same-named module of the host's

MANIFEST = os.path.join(".k2fleet", "manifest.json")
MARKS = os.path.join(".k2fleet", "relay")
PARTIAL = os.path.join(".k2fleet", "relay-partial")
PIECES = os.path.join(".k2fleet", "pieces.json")  # per file: a sha256 per piece, pinned by the control machine
PIECES_MADE = os.path.join(".k2fleet", "pieces-made.json")  # the copy's file stats it was made from (reused while equal)
# on a landing file (root's, 0644: no other user may set it): the bytes of its prefix of pieces verified so far
VERIFIED_XATTR = "user.k2fleet.verified"
PIECE_MIN = 1 << 20
PIECE_MAX = 16 << 20  # a receiver's answer moves at least a piece at a time: under SLOW_MIN_BYTES per slow_after only
                      # below ~1.7 MB/s (a 594 GB checkpoint: ~35k pieces, a 2.4 MB pieces document)
PIECES_PER_FILE = 64  # a file's piece: the smallest power of two >= PIECE_MIN giving at most this many, up to PIECE_MAX
FETCH_LOCK = os.path.join(".k2fleet", "relay-fetch.lock")  # one fetch into a directory at a time
PIECES_MAX_BYTES = 16 << 20  # a 1 TB checkpoint's pieces document is well under 1 MiB
HEARTBEAT = os.path.join(".k2fleet", "relay-fetching")  # touched every HEARTBEAT_S while a fetch runs
HEARTBEAT_S = 1.0
FETCHING_FRESH_S = 5.0
CHUNK = 64 << 20  # the largest range one stream asks for at once
MIN_CHUNK = 1 << 20
BLOCK = 1 << 20
PIPE_BYTES = 1 << 20
SOCKET_BUFFER = 16 << 20  # a data connection's send/receive buffer: bytes keep flowing while a busy host's relay waits for a core
HASH_STEP = 8 << 20
SENDFILE_BLOCK = 8 << 20
POLL_S = 0.1
WAIT_S = 5.0  # how long a peer is asked to hold a request for a file it has not verified yet (X-K2-Wait)
WAIT_POLL_S = 0.005  # how often a held request looks for its file's marker (one stat: a trigger, never a verdict)
WAIT_RECHECK_S = 0.25  # and re-checks in full (the marker's record, the fetch's heartbeat) at least this often
DATA_TIMEOUT_S = 20.0  # a data connection silent this long is dropped (its source is treated as dead)
DEAD_AFTER_S = 10.0  # a source that does not answer (or idles without the file) this long is skipped
GIVE_UP_S = 300.0  # no source of a file answered this long: the fetch fails (it does not hang a deploy)
VERIFY_BEHIND = 4  # landed files of a lane still hashing while the next lands (sha256: ~1.5 GB/s a core)
STREAMS = 1  # range streams per file: one spliced stream beat four on the sandbox (bench/distribution_bench.py)


def mark_rel(rel):
    return MARKS + "/" + rel + ".ok"


def is_verified_here(root, manifest, rel, verified=None):
    """True if ``rel`` may be served: this relay hashed it right (its marker), or verify.py's
    ``verified.json`` for this manifest lists it (``verified``: that marker's records,
    read once by the caller) — either way with the file's stat unchanged since."""
    now = verify.stat_beneath(root, rel)  # None behind a symlink: never served through one
    if now is None:
        return False
    marked = {"sha256": verify.expected_hash(manifest["files"][rel]), "stat": now}
    with contextlib.suppress(OSError, ValueError):
        if json.loads(verify.read_beneath(root, mark_rel(rel), 1 << 16)) == marked:
            return True
    if verified is None:
        verified = verify.load_marker(root, manifest)
    return verified.get(rel) == now


def write_mark(root, rel, entry, stat):
    """Record that ``rel`` hashed right while its file had ``stat``: from now on it is served.
    Atomic but not fsynced: it is on every file's path down the fleet (an fsync here waited for
    the journal, with every host's dirty shards in it), and it never made the file's bytes
    durable, only the record; a record lost in a crash costs a re-hash (a fetch re-hashes every
    marker anyway), and one that outlives the file's bytes no longer matches the file's stat."""
    marked = {"sha256": verify.expected_hash(entry), "stat": stat}
    verify.write_beneath(root, mark_rel(rel), json.dumps(marked).encode(), durable=False)


def drop_marks(root, manifest):
    """Nothing here is served until hashed again: every relay marker and verified.json go."""
    verify.remove_marker(root)
    for rel in manifest["files"]:
        verify.unlink_beneath(root, mark_rel(rel))


def mark(root):
    """Hash every file against the manifest; mark the good ones. Returns the bad ones."""
    manifest = verify.load_manifest_in(root)
    bad = []
    for rel, entry in sorted(manifest["files"].items()):
        stat, _ = verify.check_one(root, manifest, rel)
        if stat is None:
            bad.append(rel)
        else:
            write_mark(root, rel, entry, stat)
    return bad


# --------------------------------------------------------------------------- pieces


def piece_size(size):
    """The piece a file of ``size`` bytes is pinned by: the smallest power of two of at least
    :data:`PIECE_MIN` that cuts it into at most :data:`PIECES_PER_FILE` pieces, at most :data:`PIECE_MAX`.

    >>> piece_size(16 << 20) >> 20, piece_size(256 << 20) >> 20, piece_size(9_600_000_000) >> 20
    (1, 4, 16)
    """
    piece = PIECE_MIN
    while piece * PIECES_PER_FILE < size and piece < PIECE_MAX:
        piece <<= 1
    return piece


def _piece_hashes(root, rel, entry, piece):
    """sha256 (hex) of each ``piece``-byte piece of ``rel`` (read without following a symlink), its whole
    hash checked against the manifest ``entry`` in the same pass (SystemExit otherwise: a marker is a stat,
    and bit rot keeps stats)."""
    size, whole = entry["size"], verify.new_hasher(entry)
    fd = verify.open_beneath(root, rel)
    try:
        if hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        out, view = [], memoryview(bytearray(min(piece, HASH_STEP)))
        for start in range(0, size, piece):
            h, at, stop = hashlib.sha256(), start, min(start + piece, size)
            while at < stop:
                n = os.preadv(fd, [view[: min(len(view), stop - at)]], at)
                if n <= 0:
                    raise SystemExit(f"relay pieces: {rel} is shorter than its manifest's {size} bytes")
                h.update(view[:n])
                whole.update(view[:n])
                at += n
            out.append(h.hexdigest())
    finally:
        os.close(fd)
    if not hmac.compare_digest(whole.hexdigest(), verify.expected_hash(entry)):
        raise SystemExit(f"relay pieces: {rel} in {root} no longer matches its manifest: nothing is pinned from it")
    return out


def make_pieces(root):
    """Pin each file of a verified copy piece by piece: write ``DIR/.k2fleet/pieces.json`` (the manifest's
    digest, and per file larger than one piece its :func:`piece_size` and a sha256 per piece) and return the
    sha256 of those bytes — the ``--pieces-digest`` a fetch from this copy carries, so a receiver serves a file
    onward piece by piece while it lands, each piece checked against this pin (never a byte of one that is not).
    Only a copy whose every file is verified here (:func:`is_verified_here`) is pinned, and each pinned file's
    whole hash is checked against the manifest in the same pass; the document is reused while every file's
    stat is the one recorded beside it (``.k2fleet/pieces-made.json``, not served)."""
    manifest = verify.load_manifest_in(root)
    digest = verify.manifest_digest(manifest)
    verified, stats = verify.load_marker(root, manifest), {}
    for rel in sorted(manifest["files"]):
        if not is_verified_here(root, manifest, rel, verified):
            raise SystemExit(f"relay pieces: {rel} is not verified in {root}: nothing is pinned from an unverified copy")
        stats[rel] = verify.stat_beneath(root, rel)
    with contextlib.suppress(OSError, ValueError):
        made = json.loads(verify.read_beneath(root, PIECES_MADE, PIECES_MAX_BYTES))
        pinned = hashlib.sha256(verify.read_beneath(root, PIECES, PIECES_MAX_BYTES)).hexdigest()
        if made == {"pieces": pinned, "manifest": digest, "stat": stats}:
            return pinned
    big = [(rel, e, piece_size(e["size"])) for rel, e in sorted(manifest["files"].items())
           if e["size"] > piece_size(e["size"])]
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        hashes = list(pool.map(lambda one: _piece_hashes(root, *one), big))
    if any(verify.stat_beneath(root, rel) != stats[rel] for rel, _, _ in big):
        raise SystemExit(f"relay pieces: files in {root} changed while they were hashed")
    doc = {"manifest": digest, "files": {rel: {"piece": piece, "sha256": h} for (rel, _, piece), h in zip(big, hashes)}}
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    pinned = hashlib.sha256(raw).hexdigest()
    verify.write_beneath(root, PIECES, raw)
    verify.write_beneath(root, PIECES_MADE, json.dumps({"pieces": pinned, "manifest": digest, "stat": stats}).encode())
    return pinned


def pieces_problem(raw, manifest, digest):
    """(None, {file: (piece size, [sha256, ...])}) when ``raw`` is the pieces document the pin ``digest``
    names, for ``manifest``; else (why not, None)."""
    if len(raw) > PIECES_MAX_BYTES:
        return f"pieces document too large ({len(raw)} bytes)", None
    if not hmac.compare_digest(hashlib.sha256(raw).hexdigest(), digest):
        return "pieces document is not the pinned one (digest differs)", None
    try:
        doc = verify.manifest_from_bytes(raw)
        if doc["manifest"] != verify.manifest_digest(manifest):
            return "pieces document is of another manifest", None
        table = {}
        for rel, entry in doc["files"].items():
            size, piece, hashes = manifest["files"][rel]["size"], entry["piece"], entry["sha256"]
            if (not isinstance(piece, int) or isinstance(piece, bool) or piece < 4096 or not isinstance(hashes, list)
                    or len(hashes) != -(-size // piece)
                    or not all(isinstance(h, str) and verify.is_hex(h, 64) for h in hashes)):
                return f"pieces document: a bad entry for {rel}", None
            table[rel] = (piece, hashes)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"pieces document unusable ({exc!r})", None
    return None, table


def verified_prefix(fd):
    """Bytes of the landing file ``fd``'s prefix of pieces verified against the pin (its
    :data:`VERIFIED_XATTR`, which :func:`land_file`'s hash sets on that very inode), or 0.
    Read from the open file, so it is always this inode's: a landing that starts over is a
    new file, and what this one vouched for stays as it was."""
    try:
        value = os.getxattr(fd, VERIFIED_XATTR)
    except OSError:
        return 0
    return int(value) if value.isdigit() and len(value) <= 15 else 0


def open_growing(root, rel, size):
    """(fd, verified bytes) of ``rel``'s partial file while it lands here with a prefix of
    verified pieces, or None."""
    try:
        fd = verify.open_beneath(root, PARTIAL + "/" + rel)  # never read through a symlink
    except OSError:
        return None
    verified = verified_prefix(fd)
    if not 0 < verified <= size or os.fstat(fd).st_size != size:
        os.close(fd)
        return None
    return fd, verified


# --------------------------------------------------------------------------- serving


def is_fetching(root):
    """True while a ``fetch`` into ``root`` is running (its heartbeat file is fresh): what
    this host lacks now it will have, so peers wait for it rather than go elsewhere."""
    st = verify.stat_beneath(root, HEARTBEAT)
    return st is not None and time.time() - st["mtime_ns"] / 1e9 < FETCHING_FRESH_S


NONCE_HEADER, PROOF_HEADER, AUTH_HEADER = "X-K2-Nonce", "X-K2-Proof", "X-K2-Auth"
AUTH_LABEL = b"k2fleet relay auth v1"
IDLE_TIMEOUT_S = 20  # a connection gets this long for the whole of its next request head (idle wait included)
SEND_TIMEOUT_S = 20  # and this long for each SENDFILE_BLOCK of an answer (a reader slower than ~400 KB/s is dropped)
MAX_CONNECTIONS = 256  # connections served at once; more are closed at once (threads are bounded)
MAX_UNAUTHENTICATED = 128  # of them not (yet) authenticated: authenticated peers always find room
MAX_UNAUTHENTICATED_PER_SOURCE = 16  # of those from one source address
RANGE_RE = re.compile(r"bytes=([0-9]{1,15})-([0-9]{0,15})")


def read_secret(path):
    """The deployment's relay secret from a root-only file (None: no file given)."""
    if path is None:
        return None
    with open(path, "rb") as fh:
        secret = fh.read(4096).strip()
    if len(secret) < 16:
        raise SystemExit(f"relay: the secret in {path} is too short")
    return secret.decode("ascii", "strict")


def auth_proof(secret, role, client_nonce, server_nonce):
    """HMAC-SHA256 (hex) by which one end of a connection proves it holds ``secret``:
    ``role`` b"server" (the relay's answer to ``/hello``) or b"client" (every later request
    of that connection, header ``X-K2-Auth``), bound to both ends' nonces. Neither the
    secret nor anything that answers another connection's challenge crosses the wire.

    >>> len(auth_proof(b"s" * 16, b"server", "a" * 32, "b" * 32))
    64
    >>> auth_proof(b"s" * 16, b"server", "a" * 32, "b" * 32) != auth_proof(b"s" * 16, b"client", "a" * 32, "b" * 32)
    True
    """
    secret = secret.encode() if isinstance(secret, str) else secret
    msg = b"\0".join([AUTH_LABEL, role, client_nonce.encode("ascii"), server_nonce.encode("ascii")])
    return hmac.new(secret, msg, "sha256").hexdigest()


def _nonce_ok(value):
    return isinstance(value, str) and verify.is_hex(value, 32)


def make_handler(root, secret=None):
    """The request handler serving ``root``. With ``secret``, mutual authentication per connection: the client's
    first request is ``GET /hello`` with its nonce (``X-K2-Nonce``); the relay answers with its own nonce and
    :func:`auth_proof` (role server), which the client checks before it sends anything else; every later request
    of the connection carries the client's proof (``X-K2-Auth``, role client) or gets a 403 and the connection
    is closed. Without ``secret`` nothing is asked (and ``/hello`` proves nothing, so a client that holds a
    secret refuses this relay)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # a head then a small body: no wait for a delayed ACK
        timeout = IDLE_TIMEOUT_S  # per read; the server's watchdog bounds the whole head (Server.watch)
        session = None  # the client proof this connection's requests must carry (after /hello)

        def log_message(self, fmt, *args):  # quiet
            pass

        def handle(self):
            try:
                super().handle()
            except OSError:  # a timeout, a peer gone, or the watchdog shut the connection down mid-answer
                self.close_connection = True

        def handle_one_request(self):
            # one deadline for the whole next request head (the wait for it included),
            # however slowly its bytes come
            self.server.watch(self.connection, time.monotonic() + IDLE_TIMEOUT_S)
            try:
                super().handle_one_request()
            finally:
                self.server.watch(self.connection, None)

        def _send(self, code, body=b"", headers=()):
            self.server.watch(self.connection, time.monotonic() + SEND_TIMEOUT_S + len(body) / 1e5)
            self.send_response(code)
            for k, v in headers:
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if body and self.command != "HEAD":
                self.wfile.write(body)
            self.wfile.flush()
            self.server.watch(self.connection, None)

        def _authorized(self):
            if secret is None:
                return True
            got = (self.headers.get(AUTH_HEADER) or "").encode("latin-1", "replace")
            return self.session is not None and hmac.compare_digest(got, self.session.encode())

        def _hello(self):
            if secret is None:
                return self._send(200)
            cn = self.headers.get(NONCE_HEADER) or ""
            if not _nonce_ok(cn):
                self.close_connection = True
                return self._send(400, b"X-K2-Nonce: 32 lower-case hex digits")
            sn = os.urandom(16).hex()
            self.session = auth_proof(secret, b"client", cn, sn)
            return self._send(200, b"", [(NONCE_HEADER, sn), (PROOF_HEADER, auth_proof(secret, b"server", cn, sn))])

        def do_GET(self):
            if self.headers.get("Transfer-Encoding") or (self.headers.get("Content-Length") or "0").strip() != "0":
                self.close_connection = True
                return self._send(400, b"no request bodies")
            path = urllib.parse.unquote(self.path.partition("?")[0])
            if path == "/hello":
                return self._hello()
            if not self._authorized():
                self.close_connection = True
                return self._send(403, b"authenticate first (GET /hello; X-K2-Auth)")
            self.server.authenticated(self.connection)  # off the unauthenticated caps; keeps the relay up
            document = {"/manifest": (MANIFEST, MANIFEST_MAX_BYTES), "/pieces": (PIECES, PIECES_MAX_BYTES)}.get(path)
            if document is not None:
                try:
                    return self._send(200, verify.read_beneath(root, *document), [("Content-Type", "application/json")])
                except OSError:
                    return self._send(404)
            try:
                manifest = verify.load_manifest_in(root)
            except (OSError, ValueError):
                return self._send(503)
            rel = path[len("/file/"):] if path.startswith("/file/") else None
            entry = manifest["files"].get(rel) if rel else None
            if entry is None or ".." in rel.split("/"):
                return self._send(404)
            try:
                wait = max(0.0, min(float(self.headers.get("X-K2-Wait") or 0), 60.0))
            except ValueError:
                wait = 0.0
            deadline = time.monotonic() + wait
            while not is_verified_here(root, manifest, rel):  # never serve unverified
                fetching = is_fetching(root)
                growing = open_growing(root, rel, entry["size"]) if fetching else None
                if growing is not None:  # landing here, its first pieces verified against the pin
                    try:
                        return self._send_growing(manifest, rel, entry["size"], *growing)
                    finally:
                        os.close(growing[0])
                if time.monotonic() >= deadline or not fetching:
                    return self._send(409, b"not verified here yet", [("X-K2-Fetching", "1" if fetching else "0")])
                _await_marker(root, rel, min(deadline, time.monotonic() + WAIT_RECHECK_S))
            try:
                fd = verify.open_beneath(root, rel)  # never read through a symlink
            except OSError:
                return self._send(409, b"not verified here", [("X-K2-Fetching", "0")])
            try:
                asked = self._send_head(entry["size"])
                if asked is not None:
                    self._send_bytes(fd, asked[0], asked[1] + 1)
            finally:
                os.close(fd)

        def _send_head(self, size):
            """(start, end) the request asks for, once its answer's head is sent; or None once a 400/416 answered it."""
            start, end = 0, size - 1
            rng = self.headers.get("Range")
            if rng is not None:
                found = RANGE_RE.fullmatch(rng.strip())
                if not found:
                    self._send(400, b"one Range: bytes=START-[END] only")
                    return None
                start = int(found.group(1))
                end = min(int(found.group(2)) if found.group(2) else size - 1, size - 1)
                if start > end or start >= size:
                    self._send(416, b"", [("Content-Range", f"bytes */{size}")])
                    return None
            big_buffer(self.connection, socket.SO_SNDBUF)
            self.server.watch(self.connection, time.monotonic() + SEND_TIMEOUT_S)
            self.send_response(206 if rng is not None else 200)
            self.send_header("Content-Length", str(max(0, end - start + 1)))
            if rng is not None:
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            self.end_headers()
            self.wfile.flush()
            self.server.watch(self.connection, None)
            return start, end

        def _send_bytes(self, fd, offset, stop):
            """sendfile ``fd``'s bytes ``offset..stop-1`` (the kernel copies file to socket); each block within
            SEND_TIMEOUT_S, or the watchdog shuts the connection. Returns the offset reached."""
            self.connection.settimeout(None)  # sendfile wants a blocking socket (a timeout makes it non-blocking)
            try:
                while offset < stop:
                    self.server.watch(self.connection, time.monotonic() + SEND_TIMEOUT_S)
                    sent = os.sendfile(self.connection.fileno(), fd, offset, min(stop - offset, SENDFILE_BLOCK))
                    if sent == 0:
                        break
                    offset += sent
            finally:
                self.server.watch(self.connection, None)
                self.connection.settimeout(self.timeout)
            return offset

        def _send_growing(self, manifest, rel, size, fd, verified):
            """Serve a file while it lands here, never a byte beyond its prefix of pieces verified against the
            pin: what is verified goes at once, the rest as its pieces verify (:func:`verified_prefix` of this
            very inode, read every :data:`WAIT_POLL_S`), or all of it once the whole file is verified and in
            place (the same inode). A landing that starts over (this inode unlinked), shrinks, or stalls for
            :data:`GROWING_STALL_S` ends the answer short, connection closed: the receiver takes the file elsewhere
            (a receiver's own pace check may end it first)."""
            asked = self._send_head(size)
            if asked is None:
                return
            start, end = asked
            offset, moved, looked = start, time.monotonic(), time.monotonic()
            while offset <= end:
                if offset < verified:
                    reached = self._send_bytes(fd, offset, min(verified, end + 1))
                    if reached == offset:
                        break  # the file is shorter than what it vouched for: nothing more is sent
                    offset, moved = reached, time.monotonic()
                    continue
                if time.monotonic() - moved > GROWING_STALL_S:
                    break
                time.sleep(WAIT_POLL_S)
                now = verified_prefix(fd)
                if now < verified:
                    break  # a prefix only grows within one landing: this inode is not what was vouched for
                verified = min(now, size)
                if verified > offset or time.monotonic() - looked < WAIT_RECHECK_S:
                    continue
                looked, st = time.monotonic(), os.fstat(fd)
                if st.st_nlink == 0:
                    break  # the landing started over: nobody vouches for this inode's other bytes
                if is_verified_here(root, manifest, rel) and (verify.stat_beneath(root, rel) or {}).get("ino") == st.st_ino:
                    verified = size  # the whole file checked and moved into place: this very inode
            if offset <= end:
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)

    return Handler


def big_buffer(sock, option):
    """Give ``sock`` a :data:`SOCKET_BUFFER` send or receive buffer (``option``), past ``net.core.[rw]mem_max``
    (SO_*BUFFORCE: root, as the deploy's relay runs); nothing when that is refused (a plain SO_*BUF would be
    capped at [rw]mem_max, below what the kernel's autotuning may reach) or the kernel already gave it as much.
    On a link at its limit the bytes already queued carry it through the moments this process waits for a core
    or the disk instead of idling it."""
    force = {socket.SO_RCVBUF: 33, socket.SO_SNDBUF: 32}[option]  # SO_RCVBUFFORCE, SO_SNDBUFFORCE (Linux)
    with contextlib.suppress(OSError):
        if sock.getsockopt(socket.SOL_SOCKET, option) < 2 * SOCKET_BUFFER:  # the kernel reports twice the size set
            sock.setsockopt(socket.SOL_SOCKET, force, SOCKET_BUFFER)


def _await_marker(root, rel, until):
    """Sleep until ``rel``'s relay marker, verify.py's marker or ``rel``'s landing file's verified prefix appears or changes, or
    ``until`` (monotonic). One ``stat`` of each every :data:`WAIT_POLL_S`: only a trigger to
    look again — whether the file may be served is :func:`is_verified_here`'s call alone
    (which follows no symlink), so a file is passed on within milliseconds of being verified."""
    paths = (os.path.join(root, mark_rel(rel)), os.path.join(root, verify.STATE_DIR, verify.MARKER_NAME))
    landing = os.path.join(root, PARTIAL, rel)  # its verified prefix (not its writes, which come every moment)

    def seen():
        out = []
        for path in paths:
            try:
                st = os.stat(path, follow_symlinks=False)
                out.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except OSError:
                out.append(None)
        try:
            out.append(os.getxattr(landing, VERIFIED_XATTR, follow_symlinks=False))
        except OSError:
            out.append(None)
        return out

    before = seen()
    while time.monotonic() < until:
        time.sleep(WAIT_POLL_S)
        if seen() != before:
            return


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    """One thread per connection, at most :data:`MAX_CONNECTIONS` at once, of which at most
    :data:`MAX_UNAUTHENTICATED` (:data:`MAX_UNAUTHENTICATED_PER_SOURCE` from one address)
    before their first authenticated request: a connection over a bound is closed at once.
    A watchdog shuts down every connection past its deadline (:meth:`watch`): the whole
    request head, each block of an answer. So connections trickling a byte at a time hold a
    thread no longer than :data:`IDLE_TIMEOUT_S`, and cannot crowd out the fleet's own."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, *args, **kwargs):
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.last_request = time.monotonic()  # of the last authenticated request (the idle exit's clock)
        self._lock = threading.Lock()
        self._deadlines = {}  # connection → monotonic deadline
        self._unauthenticated = {}  # connection → source address, until its first authenticated request
        super().__init__(*args, **kwargs)
        threading.Thread(target=self._watchdog, daemon=True).start()

    def watch(self, conn, deadline):
        """Shut ``conn`` down at ``deadline`` (None: no deadline now)."""
        with self._lock:
            if deadline is None:
                self._deadlines.pop(conn, None)
            else:
                self._deadlines[conn] = deadline

    def authenticated(self, conn):
        with self._lock:
            self._unauthenticated.pop(conn, None)
        self.last_request = time.monotonic()

    def _watchdog(self):
        while True:
            time.sleep(0.2)
            now = time.monotonic()
            with self._lock:
                late = [c for c, t in self._deadlines.items() if t <= now]
                for c in late:
                    del self._deadlines[c]
            for c in late:
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)  # a blocked read sees EOF, a blocked send (sendfile too) fails

    def process_request(self, request, client_address):
        source = client_address[0] if isinstance(client_address, tuple) else client_address
        with self._lock:
            unauth = list(self._unauthenticated.values())
            crowded = len(unauth) >= MAX_UNAUTHENTICATED or unauth.count(source) >= MAX_UNAUTHENTICATED_PER_SOURCE
            if not crowded:
                self._unauthenticated[request] = source
        if crowded or not self.slots.acquire(blocking=False):
            with self._lock:
                self._unauthenticated.pop(request, None)
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._unauthenticated.pop(request, None)
                self._deadlines.pop(request, None)
            self.slots.release()

    def handle_error(self, request, client_address):
        """A peer that hangs up mid-answer (it failed over, or was killed) is routine."""
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


def serve(root, bind, port, exit_with_parent=False, secret=None, idle_exit=0.0):
    """Serve ``root`` on ``bind:port`` (0: any free port) until killed; prints ``{"port": N}`` once listening.
    ``exit_with_parent``: stop when the process that started this one is gone (the control machine's relay
    outlives no deploy). ``secret``: mutual authentication of every connection (:func:`make_handler`).
    ``idle_exit``: stop when no authenticated request came for that many seconds (a relay a failed deploy left
    behind ends soon, not at its unit's RuntimeMaxSec; requests that do not authenticate do not keep it up; 0:
    never)."""
    server = Server((bind, port), make_handler(root, secret))
    print(json.dumps({"port": server.server_address[1]}), flush=True)
    if idle_exit > 0:
        _exit_when(lambda: time.monotonic() - server.last_request >= idle_exit, min(1.0, idle_exit / 4))
    if exit_with_parent:
        parent = os.getppid()
        _exit_when(lambda: os.getppid() != parent, 0.5)
    server.serve_forever()


def _exit_when(done, poll, code=0, why=""):
    """End this process (exit ``code``, ``why`` on stderr) once ``done()`` holds, asked every ``poll``
    seconds by a daemon thread, whatever the rest of the process waits on."""

    def watch():
        while not done():
            time.sleep(poll)
        sys.stderr.write(why)
        sys.stderr.flush()
        os._exit(code)

    threading.Thread(target=watch, daemon=True).start()


# --------------------------------------------------------------------------- fetching


class NotReady(Exception):
    """The source has not verified the file (yet): ``fetching`` says whether it will."""

    def __init__(self, url, rel, fetching):
        super().__init__(f"{url} has not verified {rel}{' yet' if fetching else ''}")
        self.fetching = fetching


class Impostor(OSError):
    """A listener that did not prove it holds the relay secret: never asked again."""


class Slow(OSError):
    """A source whose bytes came slower than :data:`SLOW_MIN_BYTES` per ``slow_after`` seconds."""


class BadPiece(OSError):
    """A piece of a landing file did not match its pin: the file's bytes from this source are bad."""


SLOW_AFTER_S = 10.0  # a range body with less than SLOW_MIN_BYTES in this many seconds: its source is dead
GROWING_STALL_S = SLOW_AFTER_S  # a landing file served while it lands whose prefix grew not at all this long
SLOW_MIN_BYTES = 1 << 20
CONNECT_TIMEOUT_S = 10.0
MANIFEST_TIMEOUT_S = 30.0  # the whole manifest answer (head and body)


class Source:
    """One upstream relay (``http://HOST:PORT``): its idle data connections (kept alive between ranges, each
    authenticated both ways: :func:`make_handler`), and since when it has not answered (``dead_since``) or has
    answered without a file while no fetch runs there (``idle_since``). A source that fails to prove it holds
    the secret, or drips its bytes, is dead at once. Shared by the lanes of one fetch."""

    def __init__(self, url, secret=None, slow_after=SLOW_AFTER_S):
        self.secret = secret.encode() if isinstance(secret, str) else secret
        self.slow_after = slow_after
        parsed = urllib.parse.urlsplit(url)
        self.url, self.host, self.port = url, parsed.hostname, parsed.port or 80
        self.dead_since = None
        self.idle_since = {}  # file → since when it answered without it, no fetch running there
        self._idle = []
        self._lock = threading.Lock()

    def connect(self, deadline):
        """A new connection, authenticated both ways (the relay proves it holds the secret
        before anything but a nonce is sent to it): (socket, this connection's client proof
        or None without a secret). Raises :class:`Impostor` when the listener cannot prove it."""
        sock = socket.create_connection((self.host, self.port), timeout=CONNECT_TIMEOUT_S)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not self.secret:
                return sock, None
            cn = os.urandom(16).hex()
            sock.sendall(f"GET /hello HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{NONCE_HEADER}: {cn}\r\n\r\n".encode())
            status, length, headers = read_head(sock, deadline)
            sn = headers.get(NONCE_HEADER.lower(), "")
            proof = headers.get(PROOF_HEADER.lower(), "").encode("latin-1", "replace")
            if status != 200 or length != 0 or not _nonce_ok(sn) or sn == cn or not hmac.compare_digest(
                    proof, auth_proof(self.secret, b"server", cn, sn).encode()):
                raise Impostor(f"{self.url} did not prove it holds the relay secret (nothing else was sent to it)")
            return sock, auth_proof(self.secret, b"client", cn, sn)
        except BaseException:
            sock.close()
            raise

    def request(self, path, headers=None, timeout=MANIFEST_TIMEOUT_S, limit=None):
        """(status, body) of one GET on a new authenticated connection, all of it within
        ``timeout`` seconds; a body over ``limit`` bytes is refused unread (OSError)."""
        deadline = time.monotonic() + timeout
        sock, auth = self.connect(deadline)
        try:
            extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
            if auth:
                extra += f"{AUTH_HEADER}: {auth}\r\n"
            sock.sendall(f"GET {urllib.parse.quote(path)} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                         f"Connection: close\r\n{extra}\r\n".encode())
            status, length, _ = read_head(sock, deadline)
            body = b""
            if limit is not None and length > limit:
                raise OSError(f"{self.url}: an answer of {length} bytes, over {limit}: too large, refused unread")
            while len(body) < length:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                got = sock.recv(min(1 << 20, length - len(body)))
                if not got or time.monotonic() > deadline:
                    raise OSError(f"{self.url}: the answer to {path} did not arrive within {timeout:.0f}s")
                body += got
            return status, body[:length]
        finally:
            sock.close()

    def note_dead(self, at_once=False):
        """It did not answer; ``at_once`` (it dripped, or is an impostor): skipped from now on."""
        with self._lock:
            self.dead_since = -1e12 if at_once else (self.dead_since or time.monotonic())

    def note_alive(self):
        with self._lock:
            self.dead_since = None

    def note_idle(self, rel, idle):
        """``idle``: it answered without ``rel`` and no fetch runs there (it may start late)."""
        with self._lock:
            if idle:
                self.idle_since.setdefault(rel, time.monotonic())
            else:
                self.idle_since.pop(rel, None)

    def gone_for(self, rel, now):
        """Seconds it has been silent, or idle without ``rel`` while no fetch runs there (0: neither)."""
        with self._lock:
            since = [t for t in (self.dead_since, self.idle_since.get(rel)) if t is not None]
        return now - min(since) if since else 0.0

    def _take(self, want=None):
        """An authenticated data connection: the idle one whose request already sent is
        ``want`` (a range asked ahead), else an idle one with nothing asked, else a new one.
        (socket, client proof, the request it carries or None). An idle connection whose
        request ahead has been waiting longer than the source holds one is closed."""
        stale = []
        try:
            with self._lock:
                now = time.monotonic()
                stale = [c for c in self._idle if c[2] is not None and c[2] != want and now - c[3] > WAIT_S + 1]
                self._idle = [c for c in self._idle if c not in stale]
                for asked in (want, None):
                    for c in reversed(self._idle):
                        if c[2] == asked:
                            self._idle.remove(c)
                            return c[:3]
        finally:
            for c in stale:
                c[0].close()
        sock, auth = self.connect(time.monotonic() + DATA_TIMEOUT_S)
        big_buffer(sock, socket.SO_RCVBUF)
        sock.settimeout(None)  # blocking (splice needs it); a silent peer still times out:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(min(self.slow_after, DATA_TIMEOUT_S)))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(DATA_TIMEOUT_S))
        return sock, auth, None

    def _ask(self, sock, proof, rel, start, end, wait):
        auth = f"{AUTH_HEADER}: {proof}\r\n" if proof else ""
        sock.sendall((f"GET {urllib.parse.quote('/file/' + rel)} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                      f"Range: bytes={start}-{end}\r\nX-K2-Wait: {wait}\r\n{auth}\r\n").encode())

    def get_range(self, rel, fd, start, end, landed=None, wait=WAIT_S, ahead=None):
        """Write bytes ``start..end`` of ``rel`` at the same offsets of ``fd``, calling ``landed(offset)`` as
        they land (in order within the range). One HTTP/1.1 request on a kept-alive connection: the source holds
        it up to ``wait`` seconds until it has verified the file (then :class:`NotReady`). ``ahead`` (file,
        start, end): the range this lane wants next, asked at once on the same connection (HTTP/1.1 pipelining),
        so the source, which answers in order, starts on it the moment this body is out and the file is verified
        there — no round trip, no idle link between files. The body goes socket → pipe → file inside the kernel
        (splice), or through one buffer where splice is missing (Python < 3.10). The head must come within
        ``wait`` + DATA_TIMEOUT_S seconds, the body at least :data:`SLOW_MIN_BYTES` every ``slow_after`` seconds
        (:class:`Slow` otherwise)."""
        (sock, proof, asked), ok = self._take((rel, start, end)), False
        try:
            if asked is None:
                self._ask(sock, proof, rel, start, end, wait)
            if ahead is not None:
                self._ask(sock, proof, *ahead, wait)
            status, length, headers = read_head(sock, time.monotonic() + wait + DATA_TIMEOUT_S)
            if status == 409:
                raise NotReady(self.url, rel, headers.get("x-k2-fetching", "1") == "1")
            if status not in (200, 206) or length != end - start + 1:
                raise OSError(f"{self.url} answered {status} ({length} bytes) for {rel} {start}-{end}")
            move = splice_into if hasattr(os, "splice") else copy_into
            offset = move(sock, fd, start, end + 1, landed, self.slow_after)
            if offset != end + 1:
                raise OSError(f"{self.url}: short read of {rel} ({offset - start} of {end - start + 1} bytes)")
            ok = True
        except ValueError as exc:
            raise OSError(f"{self.url}: {exc!r} for {rel}") from exc
        finally:
            if ok:
                with self._lock:
                    self._idle.append((sock, proof, ahead, time.monotonic()))
            else:
                sock.close()


def _timeval(seconds):
    return struct.pack("ll", int(seconds), int((seconds - int(seconds)) * 1e6))


HEAD_MAX = 64 << 10


def read_head(sock, deadline):
    """Read an HTTP/1.1 response head from ``sock``, all of it by ``deadline`` (monotonic; OSError after it,
    however slowly the bytes come): (status, Content-Length, the headers by lower-case name). The head is read
    to its end and not a byte beyond, so a body, and the answers pipelined behind it, stay in the socket. The
    socket is left blocking."""
    data = b""
    try:
        while not data.endswith(b"\r\n\r\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise OSError("no complete response head in time")
            sock.settimeout(left)
            seen = sock.recv(HEAD_MAX, socket.MSG_PEEK)  # look, then take the head's bytes only
            if not seen or len(data) > HEAD_MAX:
                raise OSError("connection closed before a response head")
            end = (data[-3:] + seen).find(b"\r\n\r\n")
            data += sock.recv(len(seen) if end < 0 else end + 4 - len(data[-3:]))
    finally:
        sock.settimeout(None)
    lines = data[:-4].decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
    except (IndexError, ValueError) as exc:
        raise OSError(f"not an HTTP response head ({exc})") from None
    return status, length, headers


class _Pace:
    """Raises :class:`Slow` when fewer than :data:`SLOW_MIN_BYTES` came in ``slow_after`` seconds."""

    def __init__(self, slow_after, offset):
        self.slow_after, self.since, self.at = slow_after, time.monotonic(), offset

    def check(self, offset):
        now = time.monotonic()
        if now - self.since >= self.slow_after:
            if offset - self.at < SLOW_MIN_BYTES:
                raise Slow(f"{offset - self.at} bytes in {now - self.since:.1f}s: too slow")
            self.since, self.at = now, offset


def splice_into(sock, fd, offset, stop, landed, slow_after=SLOW_AFTER_S):
    """Move bytes from ``sock`` to ``fd`` at ``offset`` until ``stop`` (or EOF) in the
    kernel: socket → pipe → page cache, no copy through this process. Returns the offset
    reached. A sender slower than :data:`SLOW_MIN_BYTES` per ``slow_after`` seconds raises :class:`Slow`."""
    pace = _Pace(slow_after, offset)
    r, w = os.pipe()
    try:
        with contextlib.suppress(OSError):
            fcntl.fcntl(w, 1031, PIPE_BYTES)  # F_SETPIPE_SZ: fewer, larger moves
        while offset < stop:
            n = os.splice(sock.fileno(), w, min(PIPE_BYTES, stop - offset))
            if n == 0:
                break
            while n:
                moved = os.splice(r, fd, n, offset_dst=offset)
                offset += moved
                n -= moved
            if landed:
                landed(offset)
            pace.check(offset)
    except BlockingIOError as exc:  # SO_RCVTIMEO ran out
        raise Slow(f"no bytes for {slow_after:.0f}s") from exc
    finally:
        os.close(r)
        os.close(w)
    return offset


def copy_into(sock, fd, offset, stop, landed, slow_after=SLOW_AFTER_S):
    """:func:`splice_into` through one buffer (no os.splice)."""
    pace = _Pace(slow_after, offset)
    view = memoryview(bytearray(BLOCK))
    try:
        while offset < stop:
            n = sock.recv_into(view[: min(BLOCK, stop - offset)])
            if n == 0:
                break
            os.pwrite(fd, view[:n], offset)
            offset += n
            if landed:
                landed(offset)
            pace.check(offset)
    except BlockingIOError as exc:
        raise Slow(f"no bytes for {slow_after:.0f}s") from exc
    return offset


class LandingHash:
    """Hashes a file while range streams write it: a thread follows the contiguous prefix
    that has landed (read back from the file, so what is hashed is what is on disk), so
    the file's hash is ready a moment after its last byte rather than a full re-read later."""

    def __init__(self, fd, hasher, ranges, pieces=None, on_verified=None):
        self.fd, self.hasher, self.ranges = fd, hasher, ranges
        self.pieces, self.on_verified = pieces, on_verified  # (piece size, [sha256]); called with each verified prefix
        self.bad_piece = None  # the index of the first piece that failed its pin
        self.size = ranges[-1][1] + 1 if ranges else 0
        self.landed = [a for a, _ in ranges]  # per range: the offset its bytes reached
        self.hashed = 0
        self.stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def landed_at(self, i):
        """The callback range ``i``'s stream calls with the offset its bytes reached; it raises
        :class:`BadPiece` once a piece failed its pin (the rest of the file is not worth landing)."""
        def note(offset):
            if self.bad_piece is not None:
                raise BadPiece(f"piece {self.bad_piece} does not match its pinned sha256")
            with self._cond:
                self.landed[i] = offset
                self._cond.notify()
        return note

    def _frontier(self):
        for (_, b), reached in zip(self.ranges, self.landed):
            if reached <= b:
                return reached
        return self.size

    def _run(self):
        """Hash from a read-only map of the file: the landed bytes go from the page cache
        to sha256 with no copy through a buffer (one less pass over memory per byte). With
        ``pieces``, each piece is also checked against its pinned sha256 as it completes, and
        ``on_verified`` told the prefix of good pieces (never past a piece that failed)."""
        mapped = mmap.mmap(self.fd, self.size, prot=mmap.PROT_READ) if self.size else None
        view = memoryview(mapped) if mapped is not None else memoryview(b"")
        piece, pinned = self.pieces if self.pieces else (0, None)
        piece_hash = hashlib.sha256() if pinned else None
        try:
            while self.hashed < self.size:
                with self._cond:
                    while self._frontier() <= self.hashed and not self.stop:
                        self._cond.wait(0.5)
                    if self.stop:
                        return
                    frontier = self._frontier()
                while self.hashed < frontier:
                    step = min(HASH_STEP, frontier - self.hashed)
                    if piece_hash is not None:
                        step = min(step, (self.hashed // piece + 1) * piece - self.hashed)
                    block = view[self.hashed:self.hashed + step]
                    self.hasher.update(block)
                    if piece_hash is not None:
                        piece_hash.update(block)
                    block.release()
                    self.hashed += step
                    if piece_hash is not None and (self.hashed % piece == 0 or self.hashed == self.size):
                        if not hmac.compare_digest(piece_hash.hexdigest(), pinned[(self.hashed - 1) // piece]):
                            piece_hash = None  # a bad piece: nothing of this landing is vouched for beyond it,
                            self.bad_piece = (self.hashed - 1) // piece  # and the landing stops (landed_at)
                            continue
                        piece_hash = hashlib.sha256()
                        try:
                            self.on_verified(self.hashed)
                        except OSError:
                            piece_hash = None  # the record cannot be written: the file is served once whole
        finally:
            view.release()
            if mapped is not None:
                mapped.close()

    def result(self):
        """The hex digest once every byte is hashed (call after the ranges completed)."""
        self._thread.join()
        return self.hasher.hexdigest() if self.hashed == self.size else None

    def abandon(self):
        with self._cond:
            self.stop = True
            self._cond.notify()
        self._thread.join()


def plan_ranges(size, streams, chunk=CHUNK):
    """Byte ranges of one file for ``streams`` parallel streams, taken in order: a quarter
    of a stream's share each (so the landed prefix, which is hashed, advances steadily),
    between :data:`MIN_CHUNK` and ``chunk`` bytes.

    >>> plan_ranges(10, 4)
    [(0, 9)]
    >>> len(plan_ranges(16 << 20, 4)), len(plan_ranges(10 << 30, 4)), len(plan_ranges(10 << 30, 1))
    (16, 160, 160)
    """
    # one stream: the landed prefix is the stream's own progress
    step = max(MIN_CHUNK, chunk if streams <= 1 else min(chunk, -(-size // (4 * streams))))
    return [(a, min(a + step, size) - 1) for a in range(0, size, step)]


DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)  # writing a landed file: only this host's disk says these


def disk_error(root, rel, exc):
    """The fetch's one line for a write this host's disk refused (``exc``: ENOSPC, EDQUOT, EROFS).

    >>> disk_error("/nonexistent", "model-3.safetensors", OSError(errno.ENOSPC, "No space left on device"))
    'model-3.safetensors: No space left on device writing under /nonexistent (free: unknown); free space there and deploy again: the files already verified stay'
    """
    try:
        st = os.statvfs(root)
        free = f"{st.f_bavail * st.f_frsize / (1 << 30):.2f} GiB"
    except OSError:
        free = "unknown"
    return (f"{rel}: {exc.strerror} writing under {root} (free: {free}); free space there and deploy again: "
            "the files already verified stay")


# a file whose bytes have all landed in its partial file: its hash may still be catching up
# (:class:`LandingHash`), its checks are still to come (:func:`finish_file`)
Landed = collections.namedtuple("Landed", "fd hashing seconds")


def retract(root, rel):
    """Withdraw ``rel``'s partial file from serving: unlinked, so a relay still streaming it sees no link left and
    stops at what it verified (the next landing creates a new inode: ``O_EXCL``, and one fetch per directory)."""
    with verify.parent_beneath(root, PARTIAL + "/" + rel, create=True) as (parent, name):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=parent)


def land_file(source, root, manifest, rel, streams, chunk, after=None, pieces=None):
    """Receive ``rel`` from ``source`` into a partial file over ``streams`` range streams, hashing it as it
    lands; return once its last byte landed (the hash may lag behind). ``after``: the file this lane takes next
    from the same source; with one stream, each range asks for the one after it ahead
    (:meth:`Source.get_range`), the last for ``after``'s first. ``pieces`` (piece size, [sha256]: the pinned
    pieces of ``rel``): each verified piece extends the landing file's :data:`VERIFIED_XATTR`, up to which
    this host's relay serves the file before it is whole (:func:`open_growing`)."""
    t0 = time.monotonic()
    size = manifest["files"][rel]["size"]
    retract(root, rel)  # a new inode each landing (O_EXCL): a relay still serving the last one keeps its verified bytes
    fd = verify.open_beneath(root, PARTIAL + "/" + rel, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644, create_dirs=True)
    try:
        os.ftruncate(fd, size)
        ranges = plan_ranges(size, streams, chunk)

        def publish(verified):  # with pieces, this host's relay serves the file while it lands, up to its verified
            # pieces: on this inode, no rename, no other file (a filesystem without xattrs: whole)
            os.setxattr(fd, VERIFIED_XATTR, str(verified).encode())

        hashing = LandingHash(fd, verify.new_hasher(manifest["files"][rel]), ranges, pieces, publish)
        try:
            if streams <= 1 or len(ranges) <= 1:
                following = [(rel, a, b) for a, b in ranges[1:]]
                if after is not None and streams <= 1:
                    following += [(after, a, b) for a, b in plan_ranges(manifest["files"][after]["size"], 1, chunk)[:1]]
                for i, (a, b) in enumerate(ranges):
                    source.get_range(rel, fd, a, b, hashing.landed_at(i), ahead=following[i] if i < len(following) else None)
            else:
                with ThreadPoolExecutor(max_workers=min(streams, len(ranges))) as pool:
                    for f in [pool.submit(source.get_range, rel, fd, a, b, hashing.landed_at(i))
                              for i, (a, b) in enumerate(ranges)]:
                        f.result()
        except BaseException:
            hashing.abandon()
            raise
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            retract(root, rel)  # withdrawn at once: a relay serving it stops where it was
        raise
    return Landed(fd, hashing, time.monotonic() - t0)


def finish_file(landed, root, manifest, rel):
    """Wait for ``landed``'s hash, verify it (verify.py's checks of one file, with that hash), move it into
    place and mark it. True if it verified; False if the bytes were bad (deleted, not marked)."""
    try:
        digest = landed.hashing.result()
        hashed_stat = verify.stat_beneath(root, PARTIAL + "/" + rel)
    finally:
        os.close(landed.fd)
    stat, _ = verify.check_one(os.path.join(root, PARTIAL), manifest, rel,
                               (digest, hashed_stat) if digest else None)
    if stat is None:
        retract(root, rel)
        return False
    with verify.parent_beneath(root, PARTIAL + "/" + rel) as (src_dir, name), \
            verify.parent_beneath(root, rel, create=True) as (dest_dir, _):  # never into a symlinked directory
        os.replace(name, name, src_dir_fd=src_dir, dst_dir_fd=dest_dir)
    moved = verify.stat_beneath(root, rel)  # a rename changes ctime only
    if moved is None or {k: moved[k] for k in ("size", "mtime_ns", "ino")} != {k: stat[k] for k in ("size", "mtime_ns", "ino")}:
        return False
    write_mark(root, rel, manifest["files"][rel], moved)
    return True


MANIFEST_MAX_BYTES = 64 << 20  # a 1 TB checkpoint's manifest is well under 1 MiB


class Pin:
    """What the control machine proved about the checkpoint: its repository, its pinned revision and (when the
    control machine holds a verified copy) the digest of that copy's manifest (:func:`verify.manifest_digest`).
    A manifest any peer serves is taken only if it matches all three."""

    def __init__(self, repo=None, revision=None, digest=None):
        self.repo, self.revision, self.digest = repo, revision, digest

    def problem(self, body):
        """None when ``body`` is a usable manifest of the pinned checkpoint; else why not."""
        if len(body) > MANIFEST_MAX_BYTES:
            return f"manifest too large ({len(body)} bytes)"
        try:
            manifest = verify.manifest_from_bytes(body)  # the bytes as they will be stored, read strictly
        except ValueError as exc:
            return f"manifest is not strict UTF-8 JSON ({exc})"
        problems = verify.manifest_problems(manifest)
        if problems:
            return "manifest: " + "; ".join(p.line() for p in problems[:3])
        return verify.pin_problem(manifest, self.repo, self.revision, self.digest)  # the digest of these very bytes


def _document_from(sources, path, problem, limit, wait_s, what):
    """(body, why not) of the first source whose ``path`` answer ``problem`` takes (None: taken); sources that
    answer without one yet (a peer still fetching it) are waited for, up to ``wait_s`` seconds; a source whose
    answer is refused is not asked again. body None: no source gave one."""
    deadline, last, refused = time.monotonic() + wait_s, None, {}
    while time.monotonic() < deadline:
        for src in sources:
            if src.url in refused:
                continue
            try:
                status, body = src.request(path, limit=limit)
                if status == 200:
                    why = problem(body)
                    if why is None:
                        return body, None
                    refused[src.url] = why
                    sys.stderr.write(f"relay: refused the {what} of {src.url}: {why}\n")
                    continue
                last = f"{src.url} answered {status}"
            except Impostor as exc:
                refused[src.url] = str(exc)
                sys.stderr.write(f"relay: {exc}\n")
            except OSError as exc:
                last = f"{src.url}: {exc}"
                if "too large" in str(exc):
                    refused[src.url] = str(exc)
                    sys.stderr.write(f"relay: refused the {what} of {src.url}: {exc}\n")
        if len(refused) == len(sources):
            break
        time.sleep(POLL_S)
    return None, "; ".join(f"{url}: {reason}" for url, reason in refused.items()) or last


PIECES_WAIT_S = 30.0  # a pieces document none of the sources gives in this long: files are passed on whole


def _pieces_from(sources, manifest, digest, wait_s=PIECES_WAIT_S):
    """(raw, {file: (piece size, [sha256])}) of the pieces document pinned by ``digest`` from the first source
    that has it; (None, {}) when none gives it in ``wait_s`` (every file is then passed on once whole)."""
    taken = {}

    def problem(raw):  # the table of the document taken is kept: it is parsed and checked once
        why, taken["table"] = pieces_problem(raw, manifest, digest)
        return why

    body, why = _document_from(sources, "/pieces", problem, PIECES_MAX_BYTES, wait_s, "pieces document")
    if body is None:
        sys.stderr.write(f"relay: no source gave the pinned pieces document ({why}); files pass on once whole\n")
        return None, {}
    return body, taken["table"]


def fleet_plan(files, fleet, position, fanout, sources):
    """file → URLs to try, parent first (:func:`swarm.plan_sources` over the fleet's relay
    URLs, this host at ``position``); the plan's source is ``sources`` (none: skipped)."""
    plan = swarm.plan_sources(list(range(len(fleet))), sorted(files), fanout)[position]
    return {rel: [u for p in chain for u in ([fleet[p]] if p is not None else sources)] for rel, chain in plan.items()}


class _Fetch:
    """State the lanes of one fetch share (under ``lock``)."""

    def __init__(self, root, manifest, urls, plan, streams, chunk, dead_after, give_up_after, t0, verify_behind,
                 secret=None, slow_after=SLOW_AFTER_S, pieces=None):
        self.root, self.manifest, self.urls, self.plan = root, manifest, urls, plan or {}
        self.pieces = pieces or {}  # file → (piece size, [sha256]): pinned pieces, served onward as they verify
        self.secret, self.slow_after = secret, slow_after
        self.streams, self.chunk, self.dead_after, self.give_up_after = streams, chunk, dead_after, give_up_after
        self.verify_behind = max(0, verify_behind)
        self.lock = threading.Lock()
        self.sources = {}
        self.refused = {}  # (file, url) → times its bytes did not verify
        self.failed_over = set()
        self.clock = {"transfer": 0.0, "verify": 0.0}  # seconds receiving bytes, finishing checks
        self.report = {"files": 0, "bytes": 0, "kept": 0, "bad_shards": [], "sources": {}, "bytes_from": {},
                       "failovers": 0, "ready_at": {}, "landed_at": {}}
        self.t0 = t0  # the fetch's start: ready_at counts from it
        self.abort = threading.Event()

    def source(self, url):
        with self.lock:
            if url not in self.sources:
                self.sources[url] = Source(url, self.secret, self.slow_after)
            return self.sources[url]

    def pick(self, rel, count=True):
        """The source to take ``rel`` from now: the first of its list not skipped
        (``count``: a failover is recorded when that is not its first)."""
        candidates = [self.source(u) for u in (self.plan.get(rel) or self.urls)]
        if not candidates:
            raise SystemExit(f"{rel}: no source to fetch it from")
        with self.lock:
            refused = dict(self.refused)
        now = time.monotonic()  # skipped: silent, or idle without rel, for dead_after seconds
        live = [c for c in candidates
                if refused.get((rel, c.url), 0) < 2 and not c.gone_for(rel, now) > self.dead_after]
        if not live:  # every source failed this file: start over with the last (the source)
            if all(refused.get((rel, c.url), 0) >= 2 for c in candidates):
                raise SystemExit(f"{rel}: no source gave bytes matching the manifest")
            if all(c.dead_since and now - c.dead_since > self.give_up_after for c in candidates):
                raise SystemExit(f"{rel}: no source answered for {self.give_up_after:.0f}s "
                                 f"({', '.join(c.url for c in candidates)})")
            if all(c.gone_for(rel, now) > self.give_up_after for c in candidates):  # e.g. the fetcher's download failed
                raise SystemExit(f"{rel}: no source has it or is fetching it for {self.give_up_after:.0f}s "
                                 f"({', '.join(c.url for c in candidates)})")
            live = candidates[-1:]
        if live[0] is not candidates[0] and count:
            with self.lock:
                if rel not in self.failed_over:
                    self.failed_over.add(rel)
                    self.report["failovers"] += 1
        return live[0]

    def lane(self, files):
        """Take ``files`` in order, each as soon as its source has verified it. Bytes land one file at a time;
        while the next one lands, up to ``verify_behind`` landed files are still hashed and checked, each on a
        thread of its own (0: one file at a time). On a link faster than one core's sha256, the hashing spreads
        over cores instead of holding the link."""
        behind = threading.BoundedSemaphore(self.verify_behind + 1)  # + the file landing
        with ThreadPoolExecutor(max_workers=self.verify_behind + 1) as finishers:
            checks = []
            for i, (rel, entry) in enumerate(files):
                behind.acquire()
                got = self.land(rel, files[i + 1][0] if i + 1 < len(files) else None)
                if got is None:  # the fetch was aborted
                    behind.release()
                    break
                checks.append(finishers.submit(self.finish, rel, entry, *got, behind))
            for check in checks:
                check.result()

    def land(self, rel, after=None):
        """(source, :class:`Landed`) of ``rel``, from the first source :meth:`pick` allows
        that has verified it; None once the fetch is aborted. ``after``: the lane's next
        file, asked for ahead when it would come from the same source."""
        while not self.abort.is_set():
            src = self.pick(rel)
            try:
                nxt = after if after is not None and self.pick(after, count=False) is src else None
            except SystemExit:
                nxt = None
            try:
                landed = land_file(src, self.root, self.manifest, rel, self.streams, self.chunk, nxt,
                                   self.pieces.get(rel))
            except NotReady as exc:  # held for WAIT_S: ask again, or go on if no fetch runs there
                src.note_idle(rel, not exc.fetching)
                if not exc.fetching:
                    time.sleep(POLL_S)
                continue
            except BadPiece as exc:  # bytes that do not match the pin: as a shard that fails its check
                sys.stderr.write(f"relay: {rel} from {src.url}: {exc}\n")
                with self.lock:
                    self.report["bad_shards"].append({"file": rel, "source": src.url})
                    self.refused[(rel, src.url)] = self.refused.get((rel, src.url), 0) + 1
                continue
            except (Slow, Impostor) as exc:  # dripping, or not holding the secret: routed around at once
                sys.stderr.write(f"relay: {src.url} is skipped from now on: {exc}\n")
                src.note_dead(at_once=True)
                continue
            except OSError as exc:
                if exc.errno in DISK_ERRORS:  # this host's disk, not the source: no other source helps
                    raise SystemExit(disk_error(self.root, rel, exc)) from None
                src.note_dead()
                time.sleep(POLL_S)
                continue
            src.note_idle(rel, False)
            src.note_alive()
            with self.lock:
                self.report["landed_at"][rel] = round(time.monotonic() - self.t0, 3)
            return src, landed
        return None

    def finish(self, rel, entry, src, landed, behind):
        """Check a landed file and mark it. Bytes that do not verify count against their
        source and the file is landed again (from the source :meth:`pick` allows then)."""
        try:
            while True:
                t = time.monotonic()
                ok = finish_file(landed, self.root, self.manifest, rel)
                with self.lock:
                    self.clock["transfer"] += landed.seconds
                    self.clock["verify"] += time.monotonic() - t
                    if ok:
                        self.report["ready_at"][rel] = round(time.monotonic() - self.t0, 3)
                        self.report["files"] += 1
                        self.report["bytes"] += entry["size"]
                        self.report["sources"][src.url] = self.report["sources"].get(src.url, 0) + 1
                        self.report["bytes_from"][src.url] = self.report["bytes_from"].get(src.url, 0) + entry["size"]
                        return
                    self.report["bad_shards"].append({"file": rel, "source": src.url})
                    self.refused[(rel, src.url)] = self.refused.get((rel, src.url), 0) + 1
                got = self.land(rel)
                if got is None:
                    return
                src, landed = got
        finally:
            behind.release()


def heartbeat(root):
    """Keep ``root``'s heartbeat file fresh from a thread; returns the function that stops it
    (and removes the file)."""
    stop = threading.Event()

    def beat():
        try:
            fd = verify.open_beneath(root, HEARTBEAT, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        except OSError:
            return
        try:
            os.write(fd, str(os.getpid()).encode())
            while not stop.wait(HEARTBEAT_S):
                with contextlib.suppress(OSError):
                    os.utime(fd)
        finally:
            os.close(fd)
            verify.unlink_beneath(root, HEARTBEAT)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    return lambda: (stop.set(), thread.join())


def _remove_partial(root):
    """Remove ``.k2fleet/relay-partial`` (a symlink there is removed, never followed)."""
    with verify.parent_beneath(root, PARTIAL, create=True) as (state, name):
        try:
            st = os.stat(name, dir_fd=state, follow_symlinks=False)
        except FileNotFoundError:
            return
        if (st.st_mode & 0o170000) == 0o040000:
            shutil.rmtree(os.path.join(root, PARTIAL))  # .k2fleet checked above; rmtree follows no symlink below
        else:
            os.unlink(name, dir_fd=state)


FETCH_BASE_S = 1800.0  # the overall deadline of a fetch: this, plus its bytes at FETCH_MIN_RATE
FETCH_MIN_RATE = 50e6


def default_deadline(manifest):
    """Seconds a whole fetch of ``manifest`` may take: :data:`FETCH_BASE_S` plus every byte
    at :data:`FETCH_MIN_RATE` (a 594 GB checkpoint: about 3.8 h).

    >>> default_deadline({"files": {"a": {"size": 50 * 10**9}}})
    2800.0
    """
    return FETCH_BASE_S + sum(e["size"] for e in manifest["files"].values()) / FETCH_MIN_RATE


def _deadline_watch(seconds):
    """End this process (exit 4, a line on stderr) after ``seconds``: a fetch that would
    outlive its deadline is stopped, whatever it waits on (a dripping source, a blocked
    splice). What it verified stays marked; the next run resumes."""
    end = time.monotonic() + seconds
    _exit_when(lambda: time.monotonic() >= end, 0.2, 4,
               f"relay: the fetch ran past its deadline ({seconds:.0f}s); stopped\n")


def fetch(root, urls, streams=STREAMS, chunk=CHUNK, log=None, plan=None, dead_after=DEAD_AFTER_S, fleet=None,
          position=None, fanout=1, give_up_after=GIVE_UP_S, verify_behind=VERIFY_BEHIND, pin=None, secret=None,
          slow_after=SLOW_AFTER_S, deadline=0.0, pieces_digest=None):
    """Fetch every file of the sources' manifest into ``root``, each from the first live source of its list,
    verifying each before it is marked (and so served onward). The lists: ``plan`` (file → URLs, parent first),
    or the fleet's per-shard plan (``fleet``: every host's relay URL in fleet order, this host at ``position``;
    the source is ``urls``), or ``urls`` for every file. Files are taken in ``fanout`` lanes at once (shard j in
    lane j mod fanout: one lane per tree of the plan, each fed by its own parent), in order within a lane.
    ``pin`` (:class:`Pin`): the only manifest taken is one of the pinned repository and revision (and digest);
    names are checked before anything is written (no absolute path, ``..`` or empty part; no name both a file
    and a directory). Nothing below ``root`` is written or read through a symlink. A source that drips (under
    :data:`SLOW_MIN_BYTES` per ``slow_after`` seconds) or cannot prove it holds the secret is skipped at once.
    ``deadline``: the whole fetch ends (exit 4) after that many seconds (0: :func:`default_deadline` of the
    manifest's size), so a deploy waiting on it gives up rather than hangs. ``pieces_digest``: the pin of the
    control machine's pieces document (:func:`make_pieces`), taken from the first source that has it and kept
    here: each file is then served onward piece by piece as its pieces verify against it, not only once whole."""
    os.makedirs(root, exist_ok=True)
    os.close(verify.open_dir_beneath(root, ".k2fleet", create=True))  # a symlinked .k2fleet is refused here
    lock = verify.open_beneath(root, FETCH_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second fetch waits: none removes or re-creates another's landing files
        _remove_partial(root)  # a killed run's leftovers
        t0, started = time.monotonic(), time.time()
        if deadline > 0:
            _deadline_watch(deadline)
        stop_beat = heartbeat(root)
        try:
            ancestors = fleet[:position] if fleet else []
            upstream = [Source(u, secret, slow_after) for u in [*reversed(ancestors), *urls]]
            manifest_bytes, why = _document_from(upstream, "/manifest", (pin or Pin()).problem, MANIFEST_MAX_BYTES,
                                                 give_up_after, "manifest")
            if manifest_bytes is None:
                raise SystemExit(f"no source answered with a manifest of the pinned checkpoint ({why}); "
                                 "refused manifests are never used")
            manifest = verify.manifest_from_bytes(manifest_bytes)  # what the pin took, and what is stored
            verify.unlink_beneath(root, PIECES)  # another fetch's: served by nobody until this one pins its own
            pieces_bytes, pieces = _pieces_from(upstream, manifest, pieces_digest) if pieces_digest else (None, {})
            if deadline <= 0:
                _deadline_watch(default_deadline(manifest) - (time.monotonic() - t0))
            if fleet:
                plan = fleet_plan(manifest["files"], fleet, position, fanout, urls)
            try:
                old_files = verify.load_manifest_in(root)["files"]
            except (OSError, ValueError, KeyError):
                old_files = {}
            # nothing is served until hashed again (bit rot keeps sizes and mtimes): the markers of
            # the old manifest's files and the new one's, and verify.py's marker, go
            drop_marks(root, {"files": {**old_files, **manifest["files"]}})
            verify.write_beneath(root, MANIFEST, manifest_bytes)
            if pieces_bytes is not None:
                verify.write_beneath(root, PIECES, pieces_bytes)  # the hosts after this one take it from here
            run = _Fetch(root, manifest, urls, plan, streams, chunk, dead_after, give_up_after, t0, verify_behind,
                         secret, slow_after, pieces)
            lanes = [[] for _ in range(max(1, fanout if fleet else 1))]
            todo = set(mark(root))  # resume/repair: what hashes right stays (and is served at once)
            run.report["kept"] = len(manifest["files"]) - len(todo)
            for j, (rel, entry) in enumerate(sorted(manifest["files"].items())):
                if rel in todo:
                    lanes[j % len(lanes)].append((rel, entry))
            with ThreadPoolExecutor(max_workers=len(lanes)) as pool:
                futures = [pool.submit(run.lane, files) for files in lanes if files]
                try:
                    for f in futures:
                        f.result()
                finally:
                    run.abort.set()
        finally:
            stop_beat()
        _remove_partial(root)
        report = run.report
        # every file verified and marked: verify.py's marker too (index and headers checked,
        # nothing hashed twice), so the deploy's checkpoint gate passes without re-hashing
        stats = {rel: verify.stat_beneath(root, rel) for rel in manifest["files"]}
        problems = verify.index_problems(root, manifest)
        if not problems and all(is_verified_here(root, manifest, rel, {}) for rel in manifest["files"]):
            verify.write_marker(root, manifest, stats)
        report.update(seconds=round(time.monotonic() - t0, 3), started=round(started, 3), dir=root,
                      verified=not problems, transfer_seconds=round(run.clock["transfer"], 3),
                      verify_seconds=round(run.clock["verify"], 3),
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
    finally:
        os.close(lock)


def main(argv=None):
    p = argparse.ArgumentParser(prog="relay.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m, s, f, pc = (sub.add_parser(name) for name in ("mark", "serve", "fetch", "pieces"))
    for one in (m, s, f, pc):
        one.add_argument("dir")
    s.add_argument("--bind", default="0.0.0.0")
    s.add_argument("--port", type=int, required=True, help="0: any free port (printed)")
    s.add_argument("--exit-with-parent", action="store_true")
    s.add_argument("--secret-file", help="a root-only file holding the deployment's relay secret (every connection "
                   "authenticates both ways with it)")
    s.add_argument("--idle-exit", type=float, default=0.0,
                   help="stop after this many seconds without an authenticated request (0: never)")
    f.add_argument("--source", action="append", default=[], help="http://HOST:PORT of the source's copy")
    f.add_argument("--fleet", help="comma-separated relay URLs of every host in fleet order (with --position)")
    f.add_argument("--position", type=int, help="this host's index in --fleet")
    f.add_argument("--fanout", type=int, default=1, help="1: a chain; k: per-shard k-ary trees")
    f.add_argument("--streams", type=int, default=STREAMS, help="parallel range streams per file")
    f.add_argument("--chunk", type=int, default=CHUNK)
    f.add_argument("--log")
    f.add_argument("--dead-after", type=float, default=DEAD_AFTER_S,
                   help="seconds a source may not answer before the next one is used")
    f.add_argument("--give-up-after", type=float, default=GIVE_UP_S,
                   help="seconds without any source of a file answering before the fetch fails")
    f.add_argument("--verify-behind", type=int, default=VERIFY_BEHIND,
                   help="landed files of a lane still being hashed and checked while the next lands (0: none)")
    f.add_argument("--plan", help="JSON file: {file: [source URL, ...]} (parent first); default --source for all")
    f.add_argument("--repo", help="the pinned repository: a manifest of another is refused")
    f.add_argument("--revision", help="the pinned revision: a manifest of another is refused")
    f.add_argument("--manifest-digest", help="the control machine's verified copy's manifest digest: any other is refused")
    f.add_argument("--pieces-digest", help="sha256 of the control machine's pieces document (relay pieces): files are "
                   "passed on piece by piece as each piece verifies against it")
    f.add_argument("--secret-file", help="a root-only file holding the deployment's relay secret (each source must "
                   "prove it holds it; the secret itself is never sent)")
    f.add_argument("--slow-after", type=float, default=SLOW_AFTER_S,
                   help=f"seconds in which a source must send {SLOW_MIN_BYTES >> 20} MiB of a file, or it is skipped")
    f.add_argument("--deadline", type=float, default=0.0,
                   help="seconds the whole fetch may take (exit 4 after; 0: 30 min + the checkpoint at 50 MB/s)")
    a = p.parse_args(argv)
    if a.cmd == "mark":
        bad = mark(a.dir)
        print(json.dumps({"bad": bad}))
        return 1 if bad else 0
    if a.cmd == "pieces":
        try:
            print(json.dumps({"pieces_digest": make_pieces(a.dir)}))
        except OSError as exc:  # e.g. a read-only copy: one line, no traceback
            raise SystemExit(f"relay pieces: {exc}") from None
        return 0
    if a.cmd == "serve":
        serve(a.dir, a.bind, a.port, a.exit_with_parent, read_secret(a.secret_file), a.idle_exit)
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
    try:
        fetch(a.dir, a.source, a.streams, a.chunk, a.log, plan, a.dead_after, fleet, a.position, a.fanout,
              a.give_up_after, a.verify_behind, Pin(a.repo, a.revision, a.manifest_digest), read_secret(a.secret_file),
              a.slow_after, a.deadline, a.pieces_digest)
    except OSError as exc:  # e.g. a symlink in the way: one line, no traceback
        raise SystemExit(f"relay fetch: {exc}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
