"""The sandbox's company package mirror (k2sandbox/package_mirror.py), on loopback: real pip
and real TLS through it to the real PyPI, the real Debian archive's InRelease through it and
its cache, and what a hostile client tries. Contacts only 127.0.0.1, PyPI and the machine's
Debian archive; no sandbox fleet."""

from __future__ import annotations

import hashlib
import http.client
import http.server
import os
import socket
import ssl
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from k2sandbox import package_mirror

LOOPBACK = "127.0.0.1"


@pytest.fixture
def mirror(tmp_path: Path):
    with package_mirror.serving(LOOPBACK, tmp_path / "cache", dns_names=["mirror.corp.example"]) as running:
        yield running


@pytest.fixture(params=[("mirror.corp.example",), ()], ids=["dns-name", "ip-only"])
def either_mirror(tmp_path: Path, request):
    """A mirror whose CA permits a DNS name, and one whose CA permits its IP alone (and the DNS
    name ``invalid``), as the sandbox's is."""
    with package_mirror.serving(LOOPBACK, tmp_path / "cache", dns_names=request.param) as running:
        yield running


def _raw(mirror: package_mirror.PackageMirror, method: str, target: str) -> tuple[int, bytes]:
    """``method target`` sent as written (http.client does not normalise the path), the CA trusted."""
    context = ssl.create_default_context(cafile=str(mirror.ca_file))
    conn = http.client.HTTPSConnection(LOOPBACK, mirror.port, timeout=30, context=context)
    try:
        conn.putrequest(method, target, skip_accept_encoding=True)
        conn.endheaders()
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def _pip_env() -> dict[str, str]:
    """pip asking the mirror alone: this machine's pip config files also name local indexes and
    wheel directories (find-links /opt/wheels, extra-index-url file:///opt/pypi/simple), so none
    is read (PIP_CONFIG_FILE=/dev/null: pip then loads no config file); and no outer PIP_CERT,
    SSL_CERT_FILE or REQUESTS_CA_BUNDLE: :meth:`~k2sandbox.package_mirror.PackageMirror.trusting`
    sets them itself, to the bundle it replaces."""
    unset = {"PIP_FIND_LINKS", "PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"}
    env = {k: v for k, v in os.environ.items() if k not in unset}
    return env | {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_CACHE_DIR": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def _pip_download(mirror: package_mirror.PackageMirror, dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "six==1.16.0", "--no-deps",
            "--index-url", mirror.pypi_index, "-d", str(dest)]


# -- what a hostile client tries (written first) --------------------------------------------


@pytest.mark.parametrize(("method", "target", "status"), [
    ("GET", "/debian/../../etc/passwd", 400),
    ("GET", "/debian/dists/../../../etc/passwd", 400),
    ("GET", "/pypi/files/%2e%2e/x", 400),
    ("GET", "/pypi/files/packages/%2E%2E%2f%2e%2e/etc/passwd", 400),
    ("GET", "/debian//etc/passwd", 400),
    ("GET", "/debian/pool\\..\\x", 400),
    ("GET", "/debian/%00", 400),
    ("GET", "/debian/%0aX-Injected:%20yes", 400),
    ("GET", "/pypi/simple/six/?url=http://evil/", 400),
    ("GET", "http://evil.example/debian/x", 400),
    ("GET", "/etc/passwd", 404),
    ("GET", "/pypi/simple/", 404),
    ("GET", "/debian/", 404),
    ("GET", "/debian-security/../../etc/passwd", 400),
    ("GET", "/debian-security/", 404),
    ("POST", "/debian-security/dists/bookworm-security/InRelease", 405),
    ("POST", "/debian/dists/bookworm/InRelease", 405),
    ("PUT", "/pypi/files/packages/x", 405),
    ("DELETE", "/debian/x", 405),
    ("BREW", "/debian/x", 405),
])
def test_a_hostile_request_is_refused_before_anything_is_read_or_fetched(mirror, method, target, status) -> None:
    got, body = _raw(mirror, method, target)
    assert got == status, (got, body)
    assert b"root:" not in body
    assert mirror.upstream_fetches == 0  # refused before upstream was asked
    assert mirror.log.entries()[-1][2] == status
    assert not any(mirror.cache_dir.iterdir())  # and nothing stored


def test_the_ca_and_server_keys_are_private_and_the_certificate_names_the_address(mirror) -> None:
    private = mirror.ca.key_file.parent
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    for key in private.iterdir():
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    assert {k.name for k in private.iterdir()} == {"server.key"}  # the CA's key deleted once it signed
    text = subprocess.run(["openssl", "x509", "-noout", "-text", "-in", str(mirror.ca.cert_file)],
                          capture_output=True, text=True, check=True).stdout
    assert "IP Address:127.0.0.1" in text and "DNS:mirror.corp.example" in text, text
    assert "k2fleet sandbox company CA (TEST)" in text
    ca = subprocess.run(["openssl", "x509", "-noout", "-text", "-in", str(mirror.ca_file)],
                        capture_output=True, text=True, check=True).stdout
    assert "CA:TRUE" in ca and "ASN1 OID: prime256v1" in ca, ca
    # the server's certificate is not one the machine trusts
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(f"{mirror.debian_url}/dists/bookworm/InRelease", timeout=30,
                               context=ssl.create_default_context())
    assert mirror.upstream_fetches == 0


def test_the_server_stops_and_its_keys_go_when_the_block_ends(tmp_path) -> None:
    with package_mirror.serving(LOOPBACK, tmp_path / "cache") as running:
        port, work = running.port, running.ca_file.parent
        assert work.is_dir()
    assert not work.exists()
    with pytest.raises(OSError):
        socket.create_connection((LOOPBACK, port), timeout=3).close()


class _HostileArchive(http.server.BaseHTTPRequestHandler):
    """An upstream that lies: a body that is not the one its path names, and error statuses."""

    def do_GET(self) -> None:
        status = 200 if "/by-hash/" in self.path else 404 if self.path.endswith("/gone") else 500
        body = b"not what the hash says" if status == 200 else b"root:x:0:0"
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_what_a_hostile_upstream_sends_is_never_cached(tmp_path) -> None:
    upstream = http.server.ThreadingHTTPServer((LOOPBACK, 0), _HostileArchive)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    try:
        with package_mirror.serving(LOOPBACK, tmp_path / "cache",
                                    debian_upstream=f"http://{LOOPBACK}:{upstream.server_port}/debian") as running:
            lie = "/debian/dists/bookworm/main/binary-amd64/by-hash/SHA256/" + "0" * 64
            assert _raw(running, "GET", lie) == (200, b"not what the hash says")  # apt checks it and refuses it
            assert _raw(running, "GET", "/debian/pool/gone")[0] == 404
            assert _raw(running, "GET", "/debian/pool/broken")[0] == 502
            assert not any(running.cache_dir.iterdir())
            assert _raw(running, "GET", lie)[0] == 200 and running.upstream_fetches == 4  # asked again
    finally:
        upstream.shutdown()
        upstream.server_close()


# -- the real packages through it --------------------------------------------------------------


def test_apt_side_the_debian_release_file_comes_through_the_mirror_and_then_from_its_cache(mirror) -> None:
    context = ssl.create_default_context(cafile=str(mirror.ca_file))  # the company CA alone
    url = f"{mirror.debian_url}/dists/bookworm/InRelease"
    started = time.monotonic()
    with urllib.request.urlopen(url, timeout=60, context=context) as answer:
        assert answer.status == 200
        first = answer.read()
    assert first.startswith(b"-----BEGIN PGP SIGNED MESSAGE-----"), first[:200]
    assert b"\nCodename: bookworm\n" in first
    assert mirror.upstream_fetches == 1
    assert len([p for p in mirror.cache_dir.iterdir() if p.read_bytes() == first]) == 1  # whole, in the cache
    assert not [p for p in mirror.cache_dir.iterdir() if p.name.startswith(".part-")]
    with urllib.request.urlopen(url, timeout=60, context=context) as answer:
        second = answer.read()
    assert second == first and mirror.upstream_fetches == 1  # upstream not asked again
    assert [e for e in mirror.log.entries() if e[1] == "/debian/dists/bookworm/InRelease"] == \
        [("GET", "/debian/dists/bookworm/InRelease", 200, len(first))] * 2
    print(f"InRelease twice through the mirror: {time.monotonic() - started:.2f}s")


def test_apt_updates_from_the_mirror_when_the_company_ca_is_trusted_and_refuses_it_otherwise(either_mirror,
                                                                                            tmp_path) -> None:
    """Real apt (its https method, GnuTLS) in a private configuration: its own lists, cache and
    sources, none of the machine's apt.conf.d hooks; the archive's signatures checked by apt.
    Its methods run as root (APT::Sandbox::User): pytest's tmp_path is closed to ``_apt``.
    GnuTLS accepts the CA's name constraints, with and without a DNS name."""
    mirror = either_mirror
    for d in ("etc/apt.conf.d", "lists/partial", "aptcache/archives/partial"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "status").write_text("")
    (tmp_path / "etc/sources.list").write_text(
        f"deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] {mirror.debian_url} bookworm main\n")
    config = tmp_path / "apt.conf"
    config.write_text(f'Dir::Etc "{tmp_path}/etc/"; Dir::Etc::main "apt.conf"; Dir::Etc::parts "apt.conf.d";\n'
                      'Dir::Etc::sourcelist "sources.list"; Dir::Etc::sourceparts "-";\n'
                      f'Dir::State::lists "{tmp_path}/lists/"; Dir::State::status "{tmp_path}/status";\n'
                      f'Dir::Cache "{tmp_path}/aptcache/"; Dir::Log "{tmp_path}/"; APT::Sandbox::User "root";\n')
    env = dict(os.environ, APT_CONFIG=str(config), DEBIAN_FRONTEND="noninteractive")
    plain = subprocess.run(["apt-get", "-o", "Acquire::Retries=0", "update"], capture_output=True, text=True,
                           env=env, timeout=300)
    assert "Certificate verification failed" in plain.stdout + plain.stderr, plain.stdout + plain.stderr
    assert mirror.upstream_fetches == 0
    started = time.monotonic()
    done = subprocess.run(mirror.trusting(["apt-get", "update"]), capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0 and "W:" not in done.stderr, done.stdout + done.stderr
    assert any(p.name.endswith("_bookworm_main_binary-amd64_Packages") for p in (tmp_path / "lists").iterdir())
    assert ("GET", "/debian/dists/bookworm/InRelease", 200) in [e[:3] for e in mirror.log.entries()]
    by_hash = [e[1].rsplit("/", 1)[1] for e in mirror.log.entries() if "/by-hash/SHA256/" in e[1]]
    cached = {hashlib.sha256(p.read_bytes()).hexdigest() for p in mirror.cache_dir.iterdir()}
    assert by_hash and set(by_hash) <= cached  # the indices apt asked for by hash, kept after their check
    print(f"apt-get update through the mirror: {time.monotonic() - started:.2f}s")


def test_a_release_index_is_not_served_from_an_earlier_servers_cache(tmp_path) -> None:
    cache = tmp_path / "cache"
    target = "/debian/dists/bookworm/InRelease"
    for run in range(2):
        with package_mirror.serving(LOOPBACK, cache) as running:
            assert _raw(running, "GET", target)[0] == 200
            assert running.upstream_fetches == 1, run  # each server asks upstream once for it


def test_pip_downloads_through_the_mirror_when_the_company_ca_is_trusted(mirror, tmp_path) -> None:
    dest = tmp_path / "wheels"
    started = time.monotonic()
    done = subprocess.run(mirror.trusting(_pip_download(mirror, dest)), capture_output=True, text=True,
                          env=_pip_env(), timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert [p.name for p in dest.iterdir()] == ["six-1.16.0-py2.py3-none-any.whl"]
    log = mirror.log.entries()
    assert ("GET", "/pypi/simple/six/") in [(m, p) for m, p, _, _ in log], log
    wheel = [e for e in log if e[0] == "GET" and e[1].startswith("/pypi/files/packages/")
             and e[1].endswith("/six-1.16.0-py2.py3-none-any.whl")]
    got = (dest / "six-1.16.0-py2.py3-none-any.whl").read_bytes()
    assert wheel and wheel[0][2] == 200 and wheel[0][3] == len(got)
    assert [p.read_bytes() == got for p in mirror.cache_dir.iterdir()] == [True]  # the wheel alone is cached
    print(f"pip download through the mirror: {time.monotonic() - started:.2f}s")


def test_pip_refuses_the_mirror_without_the_company_ca(mirror, tmp_path) -> None:
    done = subprocess.run(_pip_download(mirror, tmp_path / "wheels") + ["--retries", "0"], capture_output=True,
                          text=True, env=_pip_env(), timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "CERTIFICATE_VERIFY_FAILED" in out or "certificate verify failed" in out, out[-2000:]
    assert not any(p == "/pypi/simple/six/" for _, p, _, _ in mirror.log.entries())  # no request got through


def test_trusting_changes_nothing_outside_its_namespace(mirror) -> None:
    before = package_mirror.SYSTEM_BUNDLE.read_bytes()
    inside = subprocess.run(mirror.trusting(["cat", str(package_mirror.SYSTEM_BUNDLE)]), capture_output=True,
                            check=True).stdout
    assert inside.startswith(before.rstrip(b"\n")) and inside.endswith(mirror.ca_file.read_bytes())
    assert package_mirror.SYSTEM_BUNDLE.read_bytes() == before
    assert str(package_mirror.SYSTEM_BUNDLE) not in Path("/proc/self/mountinfo").read_text()


# -- caps, deadlines, truncation and the CA's reach (review fixes, written before them) ---------


class _Upstream(http.server.BaseHTTPRequestHandler):
    """A local plain-http upstream whose answers the test gives: ``routes`` maps a path to a
    function writing the raw response to the handler's ``wfile`` (then the connection closes)."""

    routes: dict = {}
    hits: list = []

    def do_GET(self) -> None:
        type(self).hits.append(self.path)
        answer = self.routes.get(self.path)
        if answer is None:
            self.send_error(404)
            return
        try:
            answer(self)
        except OSError:
            pass

    def log_message(self, *args: object) -> None:
        pass


class _upstream:
    """``with _upstream({path: writer}) as base:`` a local upstream on loopback, base its URL."""

    def __init__(self, routes: dict) -> None:
        handler = type("Routes", (_Upstream,), {"routes": routes, "hits": []})
        self.server = http.server.ThreadingHTTPServer((LOOPBACK, 0), handler)
        self.server.daemon_threads = True
        self.hits = handler.hits

    def __enter__(self) -> str:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://{LOOPBACK}:{self.server.server_port}"

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _raw_head(status_line: bytes, headers: dict[str, str]) -> bytes:
    return status_line + b"\r\n" + b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items()) + b"\r\n"


def _with_length(body: bytes):
    return lambda h: h.wfile.write(_raw_head(b"HTTP/1.1 200 OK", {"Content-Length": str(len(body)),
                                                                     "Connection": "close"}) + body)


def _no_length(body: bytes):
    return lambda h: h.wfile.write(_raw_head(b"HTTP/1.0 200 OK", {}) + body)


def _chunked(body: bytes, *, ends: bool):
    def write(h) -> None:
        h.wfile.write(_raw_head(b"HTTP/1.1 200 OK", {"Transfer-Encoding": "chunked", "Connection": "close"}))
        h.wfile.write(f"{len(body):x}\r\n".encode() + body + b"\r\n" + (b"0\r\n\r\n" if ends else b""))
    return write


def _get(mirror: package_mirror.PackageMirror, target: str, timeout: float = 30) -> tuple[int, bytes]:
    """GET over HTTP/1.1 through http.client; an incomplete body raises IncompleteRead."""
    context = ssl.create_default_context(cafile=str(mirror.ca_file))
    conn = http.client.HTTPSConnection(LOOPBACK, mirror.port, timeout=timeout, context=context)
    try:
        conn.request("GET", target)
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def _tls(mirror: package_mirror.PackageMirror, timeout: float = 10) -> ssl.SSLSocket:
    context = ssl.create_default_context(cafile=str(mirror.ca_file))
    return context.wrap_socket(socket.create_connection((LOOPBACK, mirror.port), timeout=timeout),
                               server_hostname=LOOPBACK)


def _cache_files(mirror: package_mirror.PackageMirror) -> list[Path]:
    return [p for p in mirror.cache_dir.iterdir() if not p.name.startswith(".")]


def test_connections_past_the_cap_are_refused_promptly_and_served_again_once_one_ends(tmp_path) -> None:
    with package_mirror.serving(LOOPBACK, tmp_path / "cache", max_connections=3) as running:
        idle = [_tls(running) for _ in range(3)]  # handshakes done, no request: each holds a thread
        try:
            started = time.monotonic()
            with pytest.raises(OSError) as refused:
                extra = _tls(running, timeout=10)
                extra.sendall(b"GET /etc/passwd HTTP/1.0\r\n\r\n")
                assert extra.recv(100) == b"", "a fourth connection was served"
                raise ConnectionResetError("closed")
            assert not isinstance(refused.value, TimeoutError), refused.value
            assert time.monotonic() - started < 3
        finally:
            for sock in idle:
                sock.close()
        deadline = time.monotonic() + 5
        while True:  # the idle connections' threads end (their peers went), and their slots are free
            try:
                assert _raw(running, "GET", "/etc/passwd")[0] == 404
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.1)


def test_a_dripping_upstream_hits_the_requests_deadline_and_nothing_is_cached(tmp_path) -> None:
    stop = threading.Event()

    def drip(h) -> None:
        h.wfile.write(_raw_head(b"HTTP/1.1 200 OK", {"Content-Length": "1000", "Connection": "close"}))
        for _ in range(1000):
            if stop.wait(0.2):
                return
            h.wfile.write(b"x")
            h.wfile.flush()

    try:
        with _upstream({"/debian/pool/slow.deb": drip}) as base, \
                package_mirror.serving(LOOPBACK, tmp_path / "cache", debian_upstream=f"{base}/debian",
                                       request_deadline_s=2) as running:
            started = time.monotonic()
            with pytest.raises((http.client.IncompleteRead, OSError)) as cut:
                _get(running, "/debian/pool/slow.deb", timeout=8)
            elapsed = time.monotonic() - started
            assert not isinstance(cut.value, TimeoutError) and elapsed < 5, (cut.value, elapsed)
            assert not _cache_files(running)
            while any(running.cache_dir.iterdir()):  # its handler removes its part file
                assert time.monotonic() - started < 8
                time.sleep(0.05)
            print(f"dripping upstream cut after {elapsed:.2f}s")
    finally:
        stop.set()


def test_a_dripping_client_hits_the_requests_deadline(tmp_path) -> None:
    with package_mirror.serving(LOOPBACK, tmp_path / "cache", request_deadline_s=2) as running:
        sock = _tls(running)
        started = time.monotonic()
        try:
            with pytest.raises(OSError):
                for byte in b"GET /debian/pool/x HTTP/1.1\r\nHost: x\r\n" * 10:
                    sock.sendall(bytes([byte]))
                    time.sleep(0.2)
            # the server closed it: a send failed (or the bytes ran out, which is a failure too)
            elapsed = time.monotonic() - started
            assert elapsed < 5, elapsed
        finally:
            sock.close()


def test_the_cache_stops_growing_at_its_cap_and_what_is_past_it_is_still_served(tmp_path) -> None:
    bodies = {f"/debian/pool/f{i}.deb": bytes([65 + i]) * 1000 for i in range(3)}
    with _upstream({p: _with_length(b) for p, b in bodies.items()}) as base, \
            package_mirror.serving(LOOPBACK, tmp_path / "cache", debian_upstream=f"{base}/debian",
                                   cache_limit=2500) as running:
        for path, body in bodies.items():
            assert _get(running, path) == (200, body)
        cached = _cache_files(running)
        assert len(cached) == 2 and sum(p.stat().st_size for p in cached) <= 2500
        assert not [p for p in running.cache_dir.iterdir() if p.name.startswith(".part-")]
        for path, body in bodies.items():  # the third is still served, from upstream again
            assert _get(running, path) == (200, body)
        assert running.upstream_fetches == 4
    with package_mirror.serving(LOOPBACK, tmp_path / "cache", debian_upstream=f"{base}/debian",
                                cache_limit=2500) as again:  # what is on disk counts against the cap
        with _upstream({p: _with_length(b) for p, b in bodies.items()}) as base2:
            again.debian_upstream = f"{base2}/debian"
            assert _get(again, "/debian/pool/f2.deb") == (200, bodies["/debian/pool/f2.deb"])
        assert len(_cache_files(again)) == 2


def test_a_body_is_cached_only_when_it_is_known_to_be_whole(tmp_path) -> None:
    body = b"deb" * 1000
    routes = {"/debian/pool/length.deb": _with_length(body),
              "/debian/pool/chunked.deb": _chunked(body, ends=True),
              "/debian/pool/no-length.deb": _no_length(body),
              "/debian/pool/chunked-cut.deb": _chunked(body, ends=False),
              "/debian/pool/short.deb": lambda h: h.wfile.write(
                  _raw_head(b"HTTP/1.1 200 OK", {"Content-Length": "9000", "Connection": "close"}) + body)}
    with _upstream(routes) as base, \
            package_mirror.serving(LOOPBACK, tmp_path / "cache", debian_upstream=f"{base}/debian") as running:
        assert _get(running, "/debian/pool/length.deb") == (200, body)
        assert _get(running, "/debian/pool/chunked.deb") == (200, body)
        assert sorted(p.read_bytes() for p in _cache_files(running)) == [body, body]
        assert _get(running, "/debian/pool/no-length.deb") == (200, body)  # served as upstream sent it
        for cut in ("/debian/pool/chunked-cut.deb", "/debian/pool/short.deb"):
            with pytest.raises(http.client.IncompleteRead):  # the client can tell it is cut
                _get(running, cut)
        assert len(_cache_files(running)) == 2  # neither the length-less nor the cut ones
        assert not [p for p in running.cache_dir.iterdir() if p.name.startswith(".part-")]


def test_a_body_past_the_cap_without_a_length_is_cut_visibly_and_not_cached(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(package_mirror, "MAX_BODY", 200_000)
    body = os.urandom(500_000)
    with _upstream({"/debian/pool/big.deb": _no_length(body), "/debian/pool/bigc.deb": _chunked(body, ends=True)}) \
            as base, package_mirror.serving(LOOPBACK, tmp_path / "cache", debian_upstream=f"{base}/debian") as running:
        for path in ("/debian/pool/big.deb", "/debian/pool/bigc.deb"):
            with pytest.raises(http.client.IncompleteRead) as cut:  # over HTTP/1.1: chunked, never ended
                _get(running, path)
            assert len(cut.value.partial) <= 200_000
            with _tls(running) as sock:  # over HTTP/1.0: no chunks; the last piece held back, then closed
                sock.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
                answer = b""
                while piece := sock.recv(1 << 16):
                    answer += piece
            head, _, got = answer.partition(b"\r\n\r\n")
            assert head.split(b" ")[1] == b"200" and b"content-length" not in head.lower(), head
            assert len(got) < 200_000 and body.startswith(got), len(got)
        assert not any(running.cache_dir.iterdir())


def test_pep658_metadata_is_served_and_cached_without_the_wheels_hash_check(tmp_path, monkeypatch) -> None:
    wheel_hash = hashlib.blake2b(b"the wheel", digest_size=32).hexdigest()
    path = f"/packages/{wheel_hash[:2]}/{wheel_hash[2:4]}/{wheel_hash[4:]}/six-1.16.0-py2.py3-none-any.whl"
    assert package_mirror.content_digest("/pypi/files" + path + ".metadata") is None
    assert package_mirror.content_digest("/pypi/files" + path)[1] == wheel_hash
    metadata = b"Metadata-Version: 2.1\nName: six\n"
    with _upstream({path + ".metadata": _with_length(metadata), path: _with_length(b"the wheel")}) as base:
        monkeypatch.setattr(package_mirror, "PYPI_FILES", base)
        with package_mirror.serving(LOOPBACK, tmp_path / "cache") as running:
            for _ in range(2):
                assert _get(running, "/pypi/files" + path + ".metadata") == (200, metadata)
                assert _get(running, "/pypi/files" + path) == (200, b"the wheel")
            assert running.upstream_fetches == 2  # each fetched once, then from the cache
            assert sorted(p.read_bytes() for p in _cache_files(running)) == [metadata, b"the wheel"]


def test_the_security_archive_comes_from_its_own_upstream_under_the_same_cache_rules(tmp_path) -> None:
    """``/debian-security/...`` is proxied from the security archive (never the main one): its
    InRelease fetched once per server, its pool files and by-hash indices kept across servers,
    a by-hash index only when it matches its hash."""
    release = b"-----BEGIN PGP SIGNED MESSAGE-----\nSuite: bookworm-security\n"
    deb, index = b"a security update", b"Package: libssl3\n"
    inrelease = "/debian-security/dists/bookworm-security/InRelease"
    pool = "/debian-security/pool/updates/main/o/openssl/libssl3.deb"
    by_hash = "/debian-security/dists/bookworm-security/main/binary-amd64/by-hash/SHA256/"
    good, lie = by_hash + hashlib.sha256(index).hexdigest(), by_hash + "0" * 64
    security = _upstream({inrelease: _with_length(release), pool: _with_length(deb), good: _with_length(index),
                          lie: _with_length(b"not what the hash says")})
    archive = _upstream({})
    with security as security_base, archive as archive_base:
        for run in range(2):
            with package_mirror.serving(LOOPBACK, tmp_path / "cache", debian_upstream=f"{archive_base}/debian",
                                        debian_security_upstream=f"{security_base}/debian-security") as running:
                assert running.debian_security_url == f"{running.base}/debian-security"
                for _ in range(2):
                    assert _get(running, inrelease) == (200, release)
                    assert _get(running, pool) == (200, deb)
                    assert _get(running, good) == (200, index)
                    assert _get(running, lie) == (200, b"not what the hash says")  # apt checks it and refuses it
                assert running.upstream_fetches == (5 if run == 0 else 3), run
    assert security.hits == [inrelease, pool, good, lie, lie] + [inrelease, lie, lie]
    assert archive.hits == []
    assert sorted(p.read_bytes() for p in tmp_path.joinpath("cache").iterdir()) == sorted([release, deb, index])


def _openssl_leaf(ca_file: Path, ca_key: Path, san: str, out: Path) -> None:
    key = out.with_suffix(".key")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", str(key), "-subj", "/CN=leaf (TEST)", "-days", "1", "-CA", str(ca_file),
                    "-CAkey", str(ca_key), "-addext", f"subjectAltName={san}", "-addext", "basicConstraints=CA:FALSE",
                    "-out", str(out)], check=True, capture_output=True)


def _verifies(ca_file: Path, leaf: Path) -> tuple[bool, str]:
    done = subprocess.run(["openssl", "verify", "-CAfile", str(ca_file), str(leaf)], capture_output=True, text=True)
    return done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("dns_names", [(), ("mirror.corp.example",)])
def test_the_company_ca_vouches_only_for_the_mirrors_address_and_names(tmp_path, dns_names) -> None:
    (tmp_path / "private").mkdir(mode=0o700)
    ca_file, ca_key = package_mirror._new_ca(tmp_path, "127.0.0.1", dns_names)
    text = subprocess.run(["openssl", "x509", "-noout", "-text", "-in", str(ca_file)], capture_output=True,
                          text=True, check=True).stdout
    assert "X509v3 Name Constraints: critical" in text and "IP:127.0.0.1/255.255.255.255" in text, text
    mine = ["IP:127.0.0.1", *(f"DNS:{name}" for name in dns_names)]
    others = ["IP:127.0.0.2", "IP:10.0.0.1", "DNS:pypi.org", "DNS:deb.debian.org", "DNS:evil.mirror.corp.example.com"]
    for i, san in enumerate(mine + others):
        leaf = tmp_path / f"leaf{i}.pem"
        _openssl_leaf(ca_file, ca_key, san, leaf)
        ok, why = _verifies(ca_file, leaf)
        assert ok == (san in mine), (san, why)
        if not ok:
            assert "subtree" in why, why


def test_the_served_certificate_verifies_and_the_ca_key_is_gone_once_serving(tmp_path) -> None:
    for dns_names in ((), ("mirror.corp.example",)):
        with package_mirror.serving(LOOPBACK, tmp_path / f"cache{len(dns_names)}", dns_names=dns_names) as running:
            assert not (running.ca.key_file.parent / "ca.key").exists()
            assert not list(running.ca_file.parent.rglob("ca.key"))
            assert _verifies(running.ca_file, running.ca.cert_file)[0]
            assert _raw(running, "GET", "/etc/passwd")[0] == 404  # python's OpenSSL accepts it too


def test_trusting_points_pip_requests_and_openssl_at_the_mounted_bundle(mirror) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE")}
    env |= {"SSL_CERT_FILE": "/nonexistent", "PIP_CERT": "/nonexistent"}
    inside = subprocess.run(mirror.trusting(["sh", "-c", 'echo "$PIP_CERT|$SSL_CERT_FILE|$REQUESTS_CA_BUNDLE"']),
                            capture_output=True, text=True, check=True, env=env).stdout.strip()
    bundle = str(package_mirror.SYSTEM_BUNDLE)
    assert inside == f"{bundle}|{bundle}|{bundle}"


def test_the_request_log_keeps_its_newest_entries_only() -> None:
    log = package_mirror.RequestLog(limit=5)
    for i in range(12):
        log.add("GET", f"/{i}", 200, i)
    assert [e[1] for e in log.entries()] == [f"/{i}" for i in range(7, 12)]
    assert package_mirror.RequestLog()._entries.maxlen >= 100_000


def test_an_unexpected_error_in_a_handler_is_reported_on_stderr(tmp_path, monkeypatch, capfd) -> None:
    def broken(self, path: str) -> None:
        raise ValueError("a bug, not a peer")

    with package_mirror.serving(LOOPBACK, tmp_path / "cache") as running:
        monkeypatch.setattr(package_mirror.PackageMirror, "upstream", broken)
        with pytest.raises(OSError):
            _raw(running, "GET", "/debian/pool/x")
        _tls(running).close()  # a peer that goes away: no report
        time.sleep(0.3)
    err = capfd.readouterr().err
    assert "ValueError: a bug, not a peer" in err, err
    assert err.count("Traceback") == 1, err
