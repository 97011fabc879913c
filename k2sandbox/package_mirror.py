"""A company's package mirrors on the sandbox network (issue #22): an apt archive, its security
archive and a PyPI index served over https with a certificate signed by the company's own CA, so
that ``k2fleet bundle INVENTORY --rehearsal --data k2_os_mirror=URL --data
k2_os_security_mirror=URL --data k2_pypi_index=URL`` can build an air-gapped bundle from them
(k2fleet refuses plain http to a mirror that is not on loopback:
:func:`k2fleet.inventory.spec.mirror_url`).

What is real and what is emulated:

- **real**: the packages. ``/debian/...`` is this machine's own Debian archive (the first
  apt source whose URI ends in ``/debian``; apt checks the archive's signatures itself),
  ``/debian-security/...`` its Debian security archive (the first ending in ``/debian-security``),
  ``/pypi/simple/<project>/`` is PyPI's simple index page for the project with its
  ``files.pythonhosted.org`` links pointing back at ``/pypi/files/`` (their ``#sha256=``
  fragments kept, pip checks them), ``/pypi/files/packages/...`` is files.pythonhosted.org's.
  The TLS is real too: clients verify the mirror's certificate.
- **emulated**: the company. Its mirror is a caching reverse proxy in this process
  (:func:`serving`; standard library only); its CA is made here with the ``openssl`` CLI
  (:func:`company_ca`, EC P-256, valid one day, marked TEST); and "the company's machines
  trust the company CA" is a mount namespace (:meth:`PackageMirror.trusting`) whose
  ``/etc/ssl/certs/ca-certificates.crt`` (the bundle apt's GnuTLS reads, and pip, requests and
  OpenSSL through ``PIP_CERT``, ``REQUESTS_CA_BUNDLE`` and ``SSL_CERT_FILE``, which it sets) is
  this machine's bundle plus the CA. The machine's own trust store is not touched. The CA can
  vouch for the mirror alone (X.509 name constraints: its IP address and DNS names), and its
  key is deleted as soon as it has signed the mirror's certificate.

The cache (``cache_dir``, at most ``cache_limit`` bytes: past it bodies are served, not kept):
bodies in files named by the sha256 of their upstream URL, written to a temporary file there
and renamed when complete. Package files (``pool/``, by-hash indices, wheels and sdists) are
kept across servers, those whose path names their content's hash (by-hash indices, PyPI's
files, not PEP 658 ``.metadata``) only when they match it; a release's other indices
(``dists/``, ``InRelease``) are served from the cache only by the server that fetched them;
PyPI's index pages are never cached; a body is cached only when known whole (upstream's
Content-Length reached, or its chunked encoding ended). Clients and upstreams are treated as
hostile: GET and HEAD only, paths checked before anything is fetched, at most
``max_connections`` connections at once (more are closed unanswered), each given
``request_deadline_s`` in all (its sockets, client's and upstream's, are shut down then) as
well as a timeout per socket operation, upstream bodies and index pages capped in size, the
request log bounded (its newest :data:`LOG_ENTRIES`), a body cut short never made to look whole
(with a length: short of it; without: chunked to an HTTP/1.1 client, its last chunk never
sent). Read from disk: the cache directory, and, when the mirror starts, this machine's CA
bundle (copied into the trusted bundle) and its apt sources (:func:`debian_archive` and
:func:`debian_security_archive`, unless ``debian_upstream`` and ``debian_security_upstream`` are given).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import http.server
import ipaddress
import os
import re
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

from k2fleet.control import aptroot

SYSTEM_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
PYPI_SIMPLE = "https://pypi.org/simple"
PYPI_FILES = "https://files.pythonhosted.org"
DEFAULT_DEBIAN = "http://deb.debian.org/debian"
DEFAULT_DEBIAN_SECURITY = "http://deb.debian.org/debian-security"
CA_NAME = "k2fleet sandbox company CA (TEST)"
MAX_BODY = 4 << 30  # bytes of one upstream body
MAX_INDEX_PAGE = 64 << 20  # bytes of one PyPI index page (read whole, to rewrite its links)
UPSTREAM_TIMEOUT_S = 60  # each connect/read from an upstream
CLIENT_TIMEOUT_S = 60  # each read from/write to a client
REQUEST_DEADLINE_S = 900  # a connection's whole life: TLS handshake, request, upstream, body
MAX_CONNECTIONS = 32  # client connections served at once; more are closed unanswered
INDEX_PAGES_AT_ONCE = 4  # PyPI index pages held in memory at once (each up to MAX_INDEX_PAGE)
MAX_CACHE = 32 << 30  # bytes of the cache directory (its files, whole or being written)
LOG_ENTRIES = 100_000  # requests the RequestLog keeps (the newest)
CHUNK = 1 << 16
PATH_RE = re.compile(r"/[A-Za-z0-9._~+@,=:%/-]*")  # a request path: no query, no fragment, no spaces
PROJECT_RE = re.compile(r"[A-Za-z0-9._-]{1,200}")


class MirrorError(RuntimeError):
    """The sandbox mirror or its CA could not be made (one line)."""


def debian_archive() -> str:
    """The Debian archive this machine's apt uses (the first source URI ending in ``/debian``),
    else :data:`DEFAULT_DEBIAN`."""
    return _machine_archive("/debian", DEFAULT_DEBIAN)


def debian_security_archive() -> str:
    """The Debian security archive this machine's apt uses (the first source URI ending in
    ``/debian-security``), else :data:`DEFAULT_DEBIAN_SECURITY`."""
    return _machine_archive("/debian-security", DEFAULT_DEBIAN_SECURITY)


def _machine_archive(suffix: str, default: str) -> str:
    for uri, _ in aptroot.machine_sources():
        if urlsplit(uri).scheme in ("http", "https") and uri.rstrip("/").endswith(suffix):
            return uri.rstrip("/")
    return default


@dataclass(frozen=True)
class CompanyCA:
    """The company CA and a server certificate it signed (PEM; keys 0600 in a 0700 directory)."""

    ca_file: Path
    cert_file: Path
    key_file: Path


def _openssl(*args: str, stdout: int | None = None) -> None:
    done = subprocess.run(["openssl", *args], stdout=stdout if stdout is not None else subprocess.PIPE,
                          stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, timeout=60)
    if done.returncode:
        raise MirrorError(f"openssl {args[0]}: {done.stderr.decode(errors='replace').strip()[-300:]}")


def _new_key(path: Path) -> None:
    """An EC P-256 key written by openssl straight into a new file, mode 0600 from its creation
    (the key is never in argv, nor read by this process)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", stdout=fd)
    finally:
        os.close(fd)


def _checked(address: str, dns_names: Sequence[str]) -> str:
    try:
        address = str(ipaddress.ip_address(address))
    except ValueError:
        raise MirrorError(f"not an IP address: {address!r}") from None
    if not all(re.fullmatch(r"[A-Za-z0-9.-]{1,253}", name) for name in dns_names):
        raise MirrorError(f"not DNS names: {list(dns_names)!r}")
    return address


def _new_ca(work: Path, address: str, dns_names: Sequence[str] = ()) -> tuple[Path, Path]:
    """The CA's certificate (``work``/ca.pem) and key (``work``/private/ca.key, the directory
    made by the caller), valid one day, its name constraints (critical) permitting ``address``
    alone and the ``dns_names`` (none given: only the reserved name ``invalid``, since with no
    DNS constraint at all every DNS name would be permitted)."""
    address = _checked(address, dns_names)
    ca_key, ca_file = work / "private" / "ca.key", work / "ca.pem"
    mask = ipaddress.ip_network(address).netmask
    permitted = [f"permitted;IP:{address}/{mask}",
                 *(f"permitted;DNS:{name}" for name in dns_names or ["invalid"])]
    _new_key(ca_key)
    _openssl("req", "-x509", "-new", "-key", str(ca_key), "-subj", f"/CN={CA_NAME}", "-days", "1",
             "-addext", "basicConstraints=critical,CA:TRUE,pathlen:0",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-addext", f"nameConstraints=critical,{','.join(permitted)}", "-out", str(ca_file))
    return ca_file, ca_key


def company_ca(work: Path, address: str, dns_names: Sequence[str] = ()) -> CompanyCA:
    """Make the sandbox company CA in ``work`` (an empty directory) and a server certificate
    for ``address`` (subjectAltName IP, and the ``dns_names``) signed by it, both valid one day;
    the CA can vouch for nothing else (:func:`_new_ca`) and its key is deleted once it signed."""
    address = _checked(address, dns_names)
    private = work / "private"
    private.mkdir(mode=0o700)
    key = private / "server.key"
    csr, cert = work / "server.csr", work / "server.pem"
    ca_file, ca_key = _new_ca(work, address, dns_names)
    try:
        _sign_server(work, ca_file, ca_key, key, csr, cert, address, dns_names)
    finally:
        ca_key.unlink(missing_ok=True)
    return CompanyCA(ca_file, cert, key)


def _sign_server(work: Path, ca_file: Path, ca_key: Path, key: Path, csr: Path, cert: Path, address: str,
                 dns_names: Sequence[str]) -> None:
    _new_key(key)
    # no commonName: without a DNS subjectAltName, GnuTLS checks a certificate's CN against the
    # CA's DNS constraints (and OpenSSL one that looks like a host name); its names are its SANs
    _openssl("req", "-new", "-key", str(key), "-subj", "/O=k2fleet sandbox mirror (TEST)", "-out", str(csr))
    extensions = work / "server.ext"
    alt = ",".join([f"IP:{address}", *(f"DNS:{name}" for name in dns_names)])
    extensions.write_text(f"subjectAltName={alt}\nbasicConstraints=critical,CA:FALSE\n"
                          "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
                          "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca_file), "-CAkey", str(ca_key), "-days", "1",
             "-set_serial", str(secrets.randbits(120)), "-extfile", str(extensions), "-out", str(cert))


@dataclass
class RequestLog:
    """The requests the mirror answered, the newest ``limit``: (method, path, status, body
    bytes), thread-safe; an entry is added before the body's last bytes are sent."""

    limit: int = LOG_ENTRIES
    _entries: deque[tuple[str, str, int, int]] = field(init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self._entries = deque(maxlen=self.limit)

    def add(self, method: str, path: str, status: int, sent: int) -> None:
        with self._lock:
            self._entries.append((method, path[:300], status, sent))

    def entries(self) -> list[tuple[str, str, int, int]]:
        with self._lock:
            return list(self._entries)


@dataclass
class PackageMirror:
    """A running mirror (see :func:`serving`)."""

    address: str
    port: int
    cache_dir: Path
    ca: CompanyCA
    debian_upstream: str
    debian_security_upstream: str = DEFAULT_DEBIAN_SECURITY
    log: RequestLog = field(default_factory=RequestLog)
    upstream_fetches: int = 0  # requests sent upstream (cache hits send none)
    cache_limit: int = MAX_CACHE  # bytes of cache_dir (past it: served, not cached)
    _fresh: set[str] = field(default_factory=set)  # cache keys of volatile indices this server fetched
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _cache_used: int | None = None  # bytes of cache_dir's files, reserved ones included (None: not counted yet)
    _index_pages: threading.BoundedSemaphore = field(
        default_factory=lambda: threading.BoundedSemaphore(INDEX_PAGES_AT_ONCE))

    @property
    def base(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"https://{host}:{self.port}"

    @property
    def debian_url(self) -> str:
        return f"{self.base}/debian"

    @property
    def debian_security_url(self) -> str:
        return f"{self.base}/debian-security"

    @property
    def pypi_index(self) -> str:
        return f"{self.base}/pypi/simple"

    @property
    def ca_file(self) -> Path:
        return self.ca.ca_file

    @property
    def trusted_bundle(self) -> Path:
        """This machine's CA bundle plus the company CA (what :meth:`trusting` mounts)."""
        return self.ca.ca_file.with_name("ca-certificates.crt")

    def trusting(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run in a mount namespace whose ``/etc/ssl/certs/ca-certificates.crt`` is
        :attr:`trusted_bundle` (the machine's own bundle is left as it is), with ``PIP_CERT``,
        ``SSL_CERT_FILE`` and ``REQUESTS_CA_BUNDLE`` naming that path (pip, OpenSSL and requests
        read it then, whatever the caller's environment says)."""
        names = ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE")
        exports = " ".join(f"{name}={SYSTEM_BUNDLE}" for name in names)
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                f'mount --bind "$0" {SYSTEM_BUNDLE} && export {exports} && exec "$@"', str(self.trusted_bundle),
                *argv]

    def upstream(self, path: str) -> tuple[str, bool, bool] | None:
        """A checked request path → (upstream URL, cached on disk, kept across servers); None
        for a path outside the four prefixes.

        >>> m = PackageMirror("127.0.0.1", 443, Path("cache"), CompanyCA(Path(), Path(), Path()),
        ...                   "http://a/debian", "http://a/debian-security")
        >>> m.upstream("/debian-security/pool/updates/main/o/openssl/libssl3_3.0.15-1~deb12u1_amd64.deb")
        ('http://a/debian-security/pool/updates/main/o/openssl/libssl3_3.0.15-1~deb12u1_amd64.deb', True, True)
        >>> m.upstream("/debian-security/dists/bookworm-security/InRelease"), m.upstream("/debian-security/")
        (('http://a/debian-security/dists/bookworm-security/InRelease', True, False), None)
        """
        for prefix, archive in (("/debian/", self.debian_upstream),
                                ("/debian-security/", self.debian_security_upstream)):
            if path.startswith(prefix) and len(path) > len(prefix):
                rest = path[len(prefix):]
                lasting = rest.startswith("pool/") or "/by-hash/" in rest
                return f"{archive}/{rest}", True, lasting
        if path.startswith("/pypi/files/packages/"):
            return f"{PYPI_FILES}/{path[len('/pypi/files/'):]}", True, True
        if (match := re.fullmatch(r"/pypi/simple/([^/]+)/?", path)) and PROJECT_RE.fullmatch(match[1]):
            return f"{PYPI_SIMPLE}/{re.sub(r'[-_.]+', '-', match[1]).lower()}/", False, False
        return None

    def cached(self, url: str, lasting: bool) -> Path | None:
        """The cache's copy of ``url``, if it has one this server may serve."""
        path = self.cache_dir / hashlib.sha256(url.encode()).hexdigest()
        with self._lock:
            usable = lasting or path.name in self._fresh
        return path if usable and path.is_file() else None

    def stored(self, temp: str, url: str) -> None:
        """A whole body of ``url``, written to ``temp`` in the cache (its bytes reserved: :meth:`reserve`),
        becomes its copy."""
        path = self.cache_dir / hashlib.sha256(url.encode()).hexdigest()
        with self._lock:
            try:
                replaced = path.stat().st_size
            except FileNotFoundError:
                replaced = 0
            os.replace(temp, path)
            self._cache_used = self._counted() - replaced
            self._fresh.add(path.name)

    def _counted(self) -> int:
        """The cache's bytes (counted from disk the first time; the lock held)."""
        if self._cache_used is None:
            self._cache_used = sum(entry.stat().st_size for entry in os.scandir(self.cache_dir)
                                   if entry.is_file(follow_symlinks=False))
        return self._cache_used

    def reserve(self, size: int) -> bool:
        """Room for ``size`` more bytes in the cache, if it has it under :attr:`cache_limit`."""
        with self._lock:
            if self._counted() + size > self.cache_limit:
                return False
            self._cache_used = self._counted() + size
            return True

    def release(self, size: int) -> None:
        """Bytes reserved (:meth:`reserve`) for a body that was not kept."""
        with self._lock:
            self._cache_used = self._counted() - size

    def count_fetch(self) -> None:
        with self._lock:
            self.upstream_fetches += 1


def request_path(raw: str) -> str | None:
    """The request target if it is a plain path (no query, ``..``, ``//``, backslash or NUL,
    raw or percent-decoded), else None.

    >>> request_path("/debian/dists/bookworm/InRelease"), request_path("/debian/../etc/passwd")
    ('/debian/dists/bookworm/InRelease', None)
    >>> request_path("/pypi/files/%2e%2e/x"), request_path("/pypi/simple/six/?x=1")
    (None, None)
    """
    try:
        decoded = unquote(raw, errors="strict")
    except UnicodeDecodeError:
        return None
    if not PATH_RE.fullmatch(raw):
        return None
    bad = ("..", "//", "\\", "\0", "?", "#")
    return None if any(b in raw or b in decoded for b in bad) or not decoded.isprintable() else raw


def content_digest(path: str) -> tuple[hashlib._Hash, str] | None:
    """A fresh hash of the kind ``path`` names its content by, and the digest it names: PyPI's
    files are stored under their BLAKE2b-256, apt's by-hash indices under their SHA256.

    >>> content_digest("/pypi/files/packages/d9/5a/" + "e" * 60 + "/six.whl")[1] == "d95a" + "e" * 60
    True
    >>> content_digest("/debian/pool/main/s/six/python3-six_1.16.0-4_all.deb") is None
    True
    >>> content_digest("/debian-security/dists/bookworm-security/main/binary-amd64/by-hash/SHA256/" + "a" * 64)[1]
    'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa'
    >>> content_digest("/pypi/files/packages/d9/5a/" + "e" * 60 + "/six.whl.metadata") is None
    True
    """
    if path.endswith(".metadata"):  # PEP 658: a wheel's metadata, under the wheel's hash (checked by pip)
        return None
    if match := re.fullmatch(r"/pypi/files/packages/([0-9a-f]{2})/([0-9a-f]{2})/([0-9a-f]{60})/[^/]+", path):
        return hashlib.blake2b(digest_size=32), "".join(match.groups())
    if match := re.fullmatch(r"/debian(?:-security)?/dists/.+/by-hash/SHA256/([0-9a-f]{64})", path):
        return hashlib.sha256(), match[1]
    return None


def _connect(url: str, timeout: float = UPSTREAM_TIMEOUT_S) -> tuple[http.client.HTTPConnection, str]:
    """A connection to ``url``'s host (https verified by the machine's trust store), and its path."""
    parts = urlsplit(url)
    if parts.scheme == "https":
        return http.client.HTTPSConnection(parts.hostname or "", parts.port, timeout=timeout,
                                           context=ssl.create_default_context()), parts.path
    return http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout), parts.path


def _shut(sock: socket.socket) -> None:
    """The socket shut down both ways, whatever thread is blocked in it (an SSLSocket's own
    state left alone: its reader gets an end of file or an error)."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


class _Deadline:
    """One connection's time: when it is up, every socket it watches is shut down."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds
        self.expired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def watch(self, sock: socket.socket | None) -> None:
        with self._lock:
            if sock is not None:
                self._sockets.append(sock)
            if self.expired and sock is not None:
                _shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._sockets:
                _shut(sock)

    def cancel(self) -> None:
        self._timer.cancel()


class _Handler(http.server.BaseHTTPRequestHandler):
    """One client connection: GET/HEAD of the four prefixes, from the cache or upstream."""

    server_version = "k2fleet-sandbox-mirror"
    protocol_version = "HTTP/1.1"  # a body of unknown length chunked to an HTTP/1.1 client; Connection: close
    timeout = CLIENT_TIMEOUT_S
    mirror: PackageMirror  # set on the subclass :func:`serving` makes
    _chunked = False  # this response's body is sent in chunks

    def __init__(self, request: socket.socket, client_address: object, server: _Server,
                 deadline: _Deadline) -> None:
        self.deadline = deadline
        super().__init__(request, client_address, server)

    def __getattr__(self, name: str):
        if name.startswith("do_"):  # any other method: 405, not http.server's 501
            return lambda: self._refuse(405, "GET and HEAD only")
        raise AttributeError(name)

    def log_message(self, format: str, *args: object) -> None:  # the RequestLog is the log
        pass

    def _refuse(self, status: int, why: str) -> None:
        body = f"{status} {why}\n".encode()
        self._headers(status, len(body), "text/plain")
        self.mirror.log.add(self.command or "?", self.path, status, 0)
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        path = request_path(self.path)
        if path is None:
            return self._refuse(400, "bad path")
        route = self.mirror.upstream(path)
        if route is None:
            return self._refuse(404, "not a mirror path")
        url, on_disk, lasting = route
        if on_disk and (hit := self.mirror.cached(url, lasting)) is not None:
            return self._from_cache(path, hit)
        if not on_disk:
            return self._index_page(path, url)
        self._through(path, url)

    def _headers(self, status: int, length: int | None, content_type: str) -> None:
        """The response's head; a GET's body of unknown length is sent chunked to an HTTP/1.1
        client (so it can tell a body cut short: its last chunk never comes), else until the
        connection closes."""
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if length is not None:
            self.send_header("Content-Length", str(length))
        elif self.command == "GET" and self.request_version == "HTTP/1.1":
            self.send_header("Transfer-Encoding", "chunked")
            self._chunked = True
        self.send_header("Connection", "close")
        self.end_headers()

    def _send(self, data: bytes) -> None:
        if data:
            self.wfile.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)

    def _end(self) -> None:
        """The body is whole: its last chunk, if chunked."""
        if self._chunked:
            self.wfile.write(b"0\r\n\r\n")

    def _from_cache(self, path: str, hit: Path) -> None:
        with open(hit, "rb") as body:
            size = os.fstat(body.fileno()).st_size
            self._headers(200, size, "application/octet-stream")
            self.mirror.log.add(self.command, path, 200, size if self.command == "GET" else 0)
            while self.command == "GET" and (chunk := body.read(CHUNK)):
                self._send(chunk)

    def _upstream(self, url: str, method: str, accept: str) -> tuple[http.client.HTTPConnection,
                                                                      http.client.HTTPResponse | None]:
        conn, target = _connect(url, max(0.1, min(UPSTREAM_TIMEOUT_S, self.deadline.left())))
        self.mirror.count_fetch()
        try:
            conn.connect()
            self.deadline.watch(conn.sock)  # shut down with the client's connection when its time is up
            conn.request(method, target, headers={"Accept": accept, "User-Agent": self.server_version})
            answer = conn.getresponse()
        except (OSError, http.client.HTTPException):
            conn.close()
            self._refuse(502, "upstream unreachable")
            return conn, None
        if answer.status != 200:
            conn.close()
            self._refuse(404 if answer.status in (404, 410) else 502, f"upstream answered {answer.status}")
            return conn, None
        return conn, answer

    def _index_page(self, path: str, url: str) -> None:
        """PyPI's page for one project, its file links pointed at this mirror (never cached; at
        most :data:`INDEX_PAGES_AT_ONCE` held in memory at once)."""
        if not self.mirror._index_pages.acquire(timeout=self.deadline.left()):
            return self._refuse(503, "busy")
        try:
            self._index_page_held(path, url)
        finally:
            self.mirror._index_pages.release()

    def _index_page_held(self, path: str, url: str) -> None:
        conn, answer = self._upstream(url, "GET", "text/html")
        if answer is None:
            return
        pieces, size = [], 0
        try:
            while size <= MAX_INDEX_PAGE and (piece := answer.read(CHUNK)):
                pieces.append(piece)
                size += len(piece)
            cut = self.deadline.expired or bool(answer.length)  # upstream's length not reached
        except (OSError, http.client.HTTPException):
            return self._refuse(502, "upstream read failed")
        finally:
            conn.close()
        if size > MAX_INDEX_PAGE:
            return self._refuse(502, "upstream page too large")
        if cut:
            return self._refuse(502, "upstream page cut short")
        page = b"".join(pieces)
        del pieces
        page = page.replace(f"{PYPI_FILES}/".encode(), f"{self.mirror.base}/pypi/files/".encode())
        self._headers(200, len(page), "text/html")
        self.mirror.log.add(self.command, path, 200, len(page) if self.command == "GET" else 0)
        if self.command == "GET":
            self._send(page)

    def _through(self, path: str, url: str) -> None:
        """A package file or archive index, streamed to the client while it is written to the
        cache, kept only when known whole (upstream's Content-Length reached, or its chunked
        encoding ended; under :data:`MAX_BODY`, in time), for a path that names its content's
        hash only when matching it (the client checks what it got too), and only while the
        cache has room. The last chunk is held back until the cache and the log are done, so a
        client holding the whole body finds both; a body cut short (upstream's length not
        reached, its chunks not ended, :data:`MAX_BODY` passed, the deadline met) never gets its
        last chunk: the connection is dropped without it."""
        conn, answer = self._upstream(url, self.command, "*/*")
        if answer is None:
            return
        with contextlib.ExitStack() as cleanup:
            cleanup.callback(conn.close)
            length = answer.getheader("Content-Length")
            chunked = bool(answer.chunked)
            expected = int(length) if length and length.isdigit() and not chunked else None
            if expected is not None and expected > MAX_BODY:
                return self._refuse(502, "upstream body too large")
            self._headers(200, expected, "application/octet-stream")
            if self.command == "HEAD":
                return self.mirror.log.add("HEAD", path, 200, 0)
            fd, temp = tempfile.mkstemp(dir=self.mirror.cache_dir, prefix=".part-")
            cleanup.callback(lambda: os.path.exists(temp) and os.unlink(temp))
            sent, held, named = 0, b"", content_digest(path)
            reserved, keep, ended = 0, True, False
            try:
                with os.fdopen(fd, "wb") as part:
                    while True:
                        chunk = answer.read(min(CHUNK, MAX_BODY + 1 - sent))
                        if not chunk:
                            ended = not self.deadline.expired  # (its shut-down socket reads as an end)
                            break
                        sent += len(chunk)
                        if sent > MAX_BODY:
                            break
                        if keep and not (keep := self.mirror.reserve(len(chunk))):
                            part.truncate(0)  # past the cache's cap: served, not kept
                        if keep:
                            reserved += len(chunk)
                            part.write(chunk)
                        if named:
                            named[0].update(chunk)
                        self._send(held)
                        held = chunk
            except (OSError, http.client.HTTPException):
                ended = False  # the client or upstream went away, or upstream's chunks were cut
            known_whole = ended and (sent == expected if expected is not None else chunked)
            if known_whole and keep and (named is None or named[0].hexdigest() == named[1]):
                self.mirror.stored(temp, url)
            else:
                os.unlink(temp)
                self.mirror.release(reserved)
            self.mirror.log.add("GET", path, 200, sent)
            # a body without length or chunks that ended is as whole as anyone can tell: sent as it came
            if known_whole or (ended and expected is None):
                self._send(held)
                self._end()


class _Server(http.server.ThreadingHTTPServer):
    """A thread per connection, at most ``slots`` at once (a connection past them is closed
    unanswered), each given ``deadline_s`` in all."""

    daemon_threads = True
    slots: threading.BoundedSemaphore  # set on the subclass :func:`serving` makes
    deadline_s: float = REQUEST_DEADLINE_S

    def process_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: socket.socket,  # type: ignore[override]
                               client_address: object) -> None:
        deadline = _Deadline(self.deadline_s)
        deadline.watch(request)
        try:
            self.RequestHandlerClass(request, client_address, self, deadline)  # type: ignore[call-arg]
        except Exception:
            self.handle_error(request, client_address)
        finally:
            deadline.cancel()
            self.shutdown_request(request)
            self.slots.release()

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that failed its TLS handshake, went away or ran out of time (OSError, ssl's
        errors among them): its connection is closed, no traceback. Anything else is a bug:
        reported on stderr."""
        if isinstance(sys.exc_info()[1], OSError):
            return
        super().handle_error(request, client_address)


@contextlib.contextmanager
def serving(address: str, cache_dir: Path, port: int = 0, dns_names: Sequence[str] = (),
            debian_upstream: str | None = None, debian_security_upstream: str | None = None, *,
            max_connections: int = MAX_CONNECTIONS, request_deadline_s: float = REQUEST_DEADLINE_S,
            cache_limit: int = MAX_CACHE) -> Iterator[PackageMirror]:
    """Serve the mirror on ``address`` (an IP this machine holds) and ``port`` (0: a free one)
    over TLS from a new company CA, in a daemon thread, until the block ends; the CA's
    certificate, the server's key and certificate and the trusted bundle live in a fresh
    directory removed then (``cache_dir`` stays; the CA's key is gone once it signed). At most
    ``max_connections`` clients at once, each connection given ``request_deadline_s``, the cache
    kept under ``cache_limit`` bytes."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="k2-mirror-"))
    server: _Server | None = None
    try:
        os.chmod(work, 0o755)  # public: the CA and bundle (apt's https method reads as _apt); keys in private/
        ca = company_ca(work, address, dns_names)
        bundle = SYSTEM_BUNDLE.read_bytes().rstrip(b"\n") + b"\n" + ca.ca_file.read_bytes()
        (work / "ca-certificates.crt").write_bytes(bundle)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(ca.cert_file, ca.key_file)
        mirror = PackageMirror(address, port, cache_dir.resolve(), ca, debian_upstream or debian_archive(),
                               debian_security_upstream or debian_security_archive(), cache_limit=cache_limit)
        handler = type("Handler", (_Handler,), {"mirror": mirror})
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        server = type("Server", (_Server,), {"address_family": family, "deadline_s": request_deadline_s,
                                             "slots": threading.BoundedSemaphore(max_connections)},
                      )((address, port), handler)
        # the TLS handshake happens in each connection's thread, not in the accepting loop
        server.socket = context.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
        mirror.port = server.server_address[1]
        thread = threading.Thread(target=server.serve_forever, args=(0.1,), name=f"k2-mirror-{address}", daemon=True)
        thread.start()
        yield mirror
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        shutil.rmtree(work, ignore_errors=True)
