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
    is read (PIP_CONFIG_FILE=/dev/null: pip then loads no config file); PIP_CERT, as the machine
    sets it, names the bundle :meth:`~k2sandbox.package_mirror.PackageMirror.trusting` replaces."""
    env = {k: v for k, v in os.environ.items() if k != "PIP_FIND_LINKS"}
    assert env.get("PIP_CERT") == str(package_mirror.SYSTEM_BUNDLE), "this machine's pip trusts the system bundle"
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
    assert {k.name for k in private.iterdir()} == {"ca.key", "server.key"}
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


def test_apt_updates_from_the_mirror_when_the_company_ca_is_trusted_and_refuses_it_otherwise(mirror, tmp_path) -> None:
    """Real apt (its https method, GnuTLS) in a private configuration: its own lists, cache and
    sources, none of the machine's apt.conf.d hooks; the archive's signatures checked by apt.
    Its methods run as root (APT::Sandbox::User): pytest's tmp_path is closed to ``_apt``."""
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
