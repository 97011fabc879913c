#!/usr/bin/env python3
"""k2fleet health gate, run ON a host: a service is healthy when its readiness route
(``/health``, or ``--ready-path``) answers 200 AND a real chat completion returns a
non-empty answer, within a timeout.

    k2fleet-host.pyz health --base http://127.0.0.1:8000 --model NAME --unit k2-vllm.service --timeout 600 \
        [--api-key-file /etc/k2fleet/api-key] [--ca-file /etc/k2fleet/tls/ca.pem --tls-name 10.0.0.1]

With ``--api-key-file`` every request carries ``Authorization: Bearer KEY``, the key read from that root-only
file (never from argv, never printed). An ``https://`` base is called over TLS, the server's certificate
verified against ``--ca-file`` alone and for ``--tls-name`` (the address clients call; default: the base's
host): a certificate that does not verify fails the gate at once (:class:`Untrusted`), the key never sent.

On failure it exits 1 naming the host and unit, with the unit's last log lines. Standard library only (hosts
have only python3), and ``ss`` (iproute2) for the owner of the socket that answers (:func:`check_server`).
"""

from __future__ import annotations

import argparse
import functools
import json
import socket
import subprocess
import sys
import time

MAX_BODY = 8 << 20  # bytes of an answer read at most (a larger one is refused, not buffered)


class Untrusted(Exception):
    """An ``https://`` server whose certificate does not verify against the CA file for the
    expected name: not the fleet's endpoint (nothing was sent to it). Neither OSError nor
    ValueError, so no retry loop takes it for a server still starting."""


@functools.lru_cache(maxsize=None)
def tls_context(ca_file: str | None):
    """A client context trusting ``ca_file`` alone (None: the system's CAs), TLS 1.2 at least,
    the certificate and the server's name always checked; one per CA file."""
    import ssl
    ctx = ssl.create_default_context(cafile=ca_file)  # with cafile: that CA only, not the system's
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


class Impostor(Exception):
    """The socket that answers is not root's: another local user holds the port (nothing was sent)."""


LISTENER_UID = 0  # k2fleet's units (engines, the API front, the router, the relay) run as root
SS_TIMEOUT_S = 5


def _ss_address(text: str) -> tuple[str, int] | None:
    """(address, port) of one of ``ss -n``'s address columns; an IPv4-mapped IPv6 address as
    its IPv4 form (a dual-stack listener's sockets), a scope (``%eth0``) left out.

    >>> _ss_address("127.0.0.1:8000"), _ss_address("[::ffff:10.0.0.1]:443"), _ss_address("[fe80::1]%eth0:80")
    (('127.0.0.1', 8000), ('10.0.0.1', 443), ('fe80::1', 80))
    >>> _ss_address("*:*") is None
    True
    """
    host, _, port = text.rpartition(":")
    if not port.isdigit():
        return None
    host = host.split("%", 1)[0].strip("[]")
    if host.startswith("::ffff:") and "." in host:
        host = host[7:]
    return host, int(port)


def _ss_uid(details: list[str]) -> int | None:
    """The socket owner's uid among ``ss -e``'s details: its ``uid:N``; none printed is root's
    (ss prints the uid only when it is not 0), told apart from details not shown at all by the
    ``ino:`` ss always prints with them.

    >>> _ss_uid(["uid:65534", "ino:0", "sk:1"]), _ss_uid(["ino:0", "sk:1"]), _ss_uid([])
    (65534, 0, None)
    """
    for field in details:
        if field.startswith("uid:") and field[4:].isdigit():
            return int(field[4:])
    return 0 if any(field.startswith("ino:") for field in details) else None


def is_local(address: str) -> bool:
    """Is ``address`` one of this host's own (``ip route get`` routes it as ``local``)?"""
    out = subprocess.run(["ip", "-j", "route", "get", address], stdin=subprocess.DEVNULL, capture_output=True,
                         text=True, timeout=SS_TIMEOUT_S).stdout
    try:
        return any(route.get("type") == "local" for route in json.loads(out or "[]"))
    except (ValueError, AttributeError):
        return False


def listeners(port: int) -> list[tuple[str, int | None]]:
    """(address, owner's uid: :func:`_ss_uid`) of every TCP socket listening on ``port`` here, as
    ``ss -Htne state listening`` lists them (the kernel walks its listening sockets only)."""
    found = []
    for line in _ss("e", port, check=True):
        fields = line.split()  # Recv-Q Send-Q Local Peer details... (one state asked: no State column)
        local = _ss_address(fields[2]) if len(fields) >= 4 else None
        if local and local[1] == port:
            found.append((local[0], _ss_uid(fields[4:])))
    return found


WILDCARDS = {socket.AF_INET: ("0.0.0.0", "*"), socket.AF_INET6: ("::", "*")}  # "*": a dual-stack listener


def server_uid(sock) -> int | None:
    """The uid owning the listener that the connected TCP socket ``sock`` reached (an SO_PEERCRED for TCP): the
    listener on its peer's port bound to its peer's address, else the wildcard one the kernel hands the
    connection to (``ss`` names the owners: :func:`listeners`); a listener not root's among several is the
    answer. None when the peer is not an address of this host (the server is elsewhere) or no listener there is
    told (no ``ss`` details). Raises OSError when ``ip`` or ``ss`` cannot answer."""
    try:
        host, port = _ss_address(f"[{sock.getpeername()[0]}]:{sock.getpeername()[1]}") or ("", 0)
        if not is_local(host):
            return None
        found = listeners(port)
    except subprocess.SubprocessError as exc:
        raise OSError(f"ss: {exc}") from None
    family = socket.AF_INET if "." in host else socket.AF_INET6
    owners = [uid for address, uid in found if address == host] \
        or [uid for address, uid in found if address in WILDCARDS[family]]
    if not owners or None in owners:
        return None
    return next((uid for uid in owners if uid != LISTENER_UID), LISTENER_UID)


def listener_process(port: int) -> str:
    """Who listens on TCP ``port`` here, as ``ss -p`` names the processes (its ``users:(...)``), or ""."""
    try:
        lines = _ss("p", port)
    except (OSError, subprocess.SubprocessError):
        return ""
    return " ".join(sorted({f for line in lines for f in line.split() if f.startswith("users:")}))


def _ss(details: str, port: int, check: bool = False) -> list[str]:
    """The lines of ``ss -Htn<details> state listening`` for TCP ``port``."""
    return subprocess.run(["ss", f"-Htn{details}", "state", "listening", f"( sport = :{port} )"], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=SS_TIMEOUT_S, check=check).stdout.splitlines()


def check_server(sock, host: str, port: int, required: bool) -> None:
    """Raise :class:`Impostor` unless root (:data:`LISTENER_UID`) owns the listener ``sock`` is connected to:
    nothing (no key, no request) is sent to another local user's socket. ``required``: the server must be on
    this host (the health gate runs where its service does); otherwise a server elsewhere (not in this host's
    tables), or a host without ss, passes."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        uid = server_uid(sock)
    except OSError as exc:
        if required:
            raise Impostor(f"port {where}: cannot tell the owner of the socket that answers ({exc}); "
                           "nothing was sent") from None
        return
    if uid is None and required:
        raise Impostor(f"port {where}: no socket of this host answers (cannot tell its owner); nothing was sent")
    if uid is not None and uid != LISTENER_UID:
        held_by = listener_process(port)
        raise Impostor(f"port {where} is held by uid {uid}{f' ({held_by})' if held_by else ''}, not root: another "
                       f"local user's listener, not k2fleet's unit; nothing was sent to it (no API key). Stop that "
                       f"process and make ports below net.ipv4.ip_unprivileged_port_start privileged (k2fleet's "
                       f"sysctl drop-in does)")


def check_listener(base: str, timeout: float = 5) -> None:
    """Raise :class:`Impostor` when ``base`` (``http[s]://HOST:PORT``) is served on this machine by
    a socket that is not root's (a client about to hand it the key: ``k2fleet bench``/``eval``
    when the control machine is a fleet host); a server elsewhere passes. OSError: no answer."""
    scheme, _, rest = base.partition("://")
    host, port = _host_port(rest.partition("/")[0], 443 if scheme == "https" else 80)
    sock = socket.create_connection((host, port), timeout)
    try:
        check_server(sock, host, port, required=False)
    finally:
        sock.close()


def _host_port(hostport: str, default: int = 80) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) of a URL → (host, port); ``default`` when none.

    >>> _host_port("[::1]:8000"), _host_port("10.0.0.1:80"), _host_port("gpu-1"), _host_port("[::1]", 443)
    (('::1', 8000), ('10.0.0.1', 80), ('gpu-1', 80), ('::1', 443))
    """
    if hostport.startswith("["):  # [v6]:port
        host, _, rest = hostport[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else default
    if ":" in hostport:
        host, _, p = hostport.rpartition(":")
        return host, int(p)
    return hostport, default


def request(url: str, body: bytes | None = None, timeout: float = 30, key: str | None = None,
            tls: tuple[str | None, str | None] | None = None, owner: str | None = None) -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.1 request (POST with a JSON ``body``, else GET) on a fresh connection, on a
    plain socket: the owner check (:func:`check_server`) comes between the connection and the first byte sent,
    which ``urllib`` has no place for. ``http://`` or ``https://`` (``ssl`` imported only then); at most
    :data:`MAX_BODY` bytes; chunked or length-delimited answers; ``key``: sent as ``Authorization: Bearer KEY``.
    ``tls``: (CA file, the name the certificate must hold: an IP address or DNS name; None: the URL's host) for
    ``https://``, which it requires; a plain ``http://`` URL is refused with it (no silent downgrade).
    ``owner``: ``"required"`` (the server is on this host and root's), ``"local"`` (root's when it is on this
    host) or None (not checked): :func:`check_server` before the TLS handshake and before anything is sent.
    Raises OSError, ValueError, :class:`Untrusted` or :class:`Impostor` (no retry can help: a server not
    root's)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("http", "https"):
        raise ValueError(f"not an http:// or https:// URL: {url!r}")
    if (scheme == "https") != (tls is not None):
        raise ValueError(f"{url}: TLS expected (a CA file is given)" if tls else f"{url}: https:// needs a CA file")
    hostport, _, path = rest.partition("/")
    host, port = _host_port(hostport, 443 if scheme == "https" else 80)
    head = [f"{'POST' if body is not None else 'GET'} /{path} HTTP/1.1", f"Host: {hostport}", "Connection: close",
            "Accept: application/json", "User-Agent: k2fleet-health"]
    if key is not None:
        head.append(f"Authorization: Bearer {key}")
    if body is not None:
        head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    deadline = time.monotonic() + timeout
    sock = socket.create_connection((host, port), timeout)
    try:
        if owner is not None:
            check_server(sock, host, port, owner == "required")
        if tls is not None:
            sock = _wrap(sock, tls, host, url)
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + (body or b""))
        data = b""
        while True:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
            if len(data) > MAX_BODY + 65536:
                raise ValueError(f"answer from {url} larger than {MAX_BODY} bytes")
    finally:
        sock.close()
    header, sep, rest = data.partition(b"\r\n\r\n")
    if not sep:
        raise ValueError(f"no HTTP answer from {url}")
    lines = header.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise ValueError(f"not an HTTP status line from {url}: {lines[0][:80]!r}")
    fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if fields.get("transfer-encoding", "").lower() == "chunked":
        out = b""
        while True:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0] or b"0", 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2:]
        rest = out
    elif "content-length" in fields:
        rest = rest[:int(fields["content-length"])]
    return int(parts[1]), rest


def _wrap(sock, tls: tuple[str | None, str | None], host: str, url: str):
    """``sock`` after a TLS handshake verified against ``tls`` (CA file, name); :class:`Untrusted`
    when the certificate does not verify (before any request byte; the caller closes ``sock``)."""
    import ssl
    ca_file, name = tls
    try:
        return tls_context(ca_file).wrap_socket(sock, server_hostname=name or host)
    except ssl.SSLCertVerificationError as exc:
        raise Untrusted(f"{url}: the server's certificate does not verify against {ca_file or 'the system CAs'} "
                        f"for {name or host}: {exc.verify_message or exc.reason}") from None


def get_status(url: str, tls: tuple[str | None, str | None] | None = None, owner: str | None = None) -> int | None:
    try:
        return request(url, timeout=5, tls=tls, owner=owner)[0]
    except (OSError, ValueError):
        return None


def get_json(url: str, timeout: float = 30, key: str | None = None, tls: tuple[str | None, str | None] | None = None,
             owner: str | None = None):
    status, body = request(url, timeout=timeout, key=key, tls=tls, owner=owner)
    if status != 200:
        raise ValueError(f"{url} answered {status}")
    return json.loads(body)


def chat(base: str, model: str, key: str | None = None, timeout: float = 120,
         tls: tuple[str | None, str | None] | None = None, owner: str | None = "local") -> str:
    """One chat completion's answer (``tls``, ``owner``: :func:`request`'s; by default a server
    on this machine must be root's before the key goes to it)."""
    body = json.dumps({
        "model": model,
        "messages": [{"role": "user", "content": "Reply with one word: ready?"}],
        "max_tokens": 16,
        "temperature": 0,
    }).encode()
    status, answer = request(f"{base}/v1/chat/completions", body, timeout=timeout, key=key, tls=tls, owner=owner)
    if status != 200:
        raise ValueError(f"chat completion answered {status}: {answer[:200]!r}")
    message = json.loads(answer)["choices"][0]["message"]
    # a thinking model may spend its tokens thinking: vLLM returns that as ``reasoning``
    # (``reasoning_content`` in older releases and in SGLang), with ``content`` null
    return (message.get("content") or message.get("reasoning") or message.get("reasoning_content") or "").strip()


def counter(text: str, family: str) -> float | None:
    """The sum of ``family``'s samples in Prometheus text exposition (every label set; a
    trailing timestamp ignored), or None when the text has no sample of it.

    >>> counter('# TYPE vllm:request_success_total counter\\nvllm:request_success_total{reason="stop"} 3.0\\n'
    ...         'vllm:request_success_total{reason="length"} 1 1700000000\\nvllm:request_success_totalx 9\\n',
    ...         "vllm:request_success_total")
    4.0
    >>> counter("other 1\\n", "vllm:request_success_total") is None
    True
    """
    total, seen = 0.0, False
    for line in text.splitlines():
        if not line.startswith(family) or line[len(family):len(family) + 1] not in ("{", " "):
            continue
        rest = line[len(family):]
        value = (rest.rsplit("}", 1)[1] if rest.startswith("{") else rest).split()
        try:
            total += float(value[0])
            seen = True
        except (IndexError, ValueError):
            continue
    return total if seen else None


def read_counter(base: str, family: str, key: str | None = None, tls: tuple[str | None, str | None] | None = None,
                 owner: str | None = "required") -> float | None:
    """``family``'s total in the service's ``/metrics`` (None: no /metrics, or not in it)."""
    try:
        status, body = request(f"{base}/metrics", timeout=10, key=key, tls=tls, owner=owner)
    except (OSError, ValueError):
        return None
    return counter(body.decode("utf-8", "replace"), family) if status == 200 else None


COUNTER_WAIT_S = 5.0  # how long the counter may lag the completion's answer


class NotHealthy(Exception):
    """The service did not prove it serves the planned topology."""


def world_mismatch(base: str, expected: dict, key: str | None = None, timeout: float = 30,
                   tls: tuple[str | None, str | None] | None = None) -> str | None:
    """Compare the topology the engine reports in ``/v1/models`` metadata (k2fleet's
    engine test doubles report their parallel sizes there) with the planned one."""
    data = get_json(f"{base}/v1/models", timeout=timeout, key=key, tls=tls, owner="required")
    reported = (data.get("data") or [{}])[0].get("metadata") or {}
    for key, want in sorted(expected.items()):
        if key not in reported:
            return f"topology: the engine does not report {key} (planned {want})"
        if reported[key] != want:
            return f"topology: planned {key}={want}, the engine reports {reported[key]}"
    return None


def pd_mismatch(pools: dict) -> str | None:
    """Did one completion through the PD router reach a prefill AND a decode server?
    ``pools``: {"prefill": [base URL], "decode": [base URL]}; k2fleet's SGLang test doubles
    list the bootstrap fields of the requests they answered at ``/k2fleet/pd_requests``."""
    rooms = {}
    for pool, bases in sorted(pools.items()):
        rooms[pool] = set()
        for base in bases:
            rooms[pool] |= {r.get("bootstrap_room") for r in get_json(f"{base}/k2fleet/pd_requests").get("requests", [])}
    common = set.intersection(*rooms.values()) if rooms else set()
    if not common:
        seen = ", ".join(f"{pool}: {len(r)} request(s)" for pool, r in sorted(rooms.items()))
        return f"PD: no request reached both prefill and decode with one bootstrap_room ({seen})"
    return None


def journal_tail(unit: str, lines: int = 30) -> str:
    try:
        return subprocess.run(["journalctl", "-u", unit, "-n", str(lines), "--no-pager", "-o", "cat"],
                              capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"(no journal: {exc})"


def read_key(path: str) -> str:
    """The API key in ``path`` (its one line): visible ASCII only, so it cannot break the header."""
    with open(path, encoding="ascii") as fh:
        key = fh.read(4098).strip()
    if not key or any(not ("!" <= ch <= "~") for ch in key):
        raise ValueError(f"{path}: not one key of visible ASCII characters")
    return key


def counter_moved(base: str, family: str, before: float | None, key: str | None = None,
                  tls: tuple[str | None, str | None] | None = None) -> str | None:
    """None when ``family`` went past ``before`` in /metrics within :data:`COUNTER_WAIT_S` (or the
    service does not expose it: ``before`` None); else why not."""
    if before is None:
        return None
    deadline, after = time.monotonic() + COUNTER_WAIT_S, None
    while True:
        after = read_counter(base, family, key, tls)
        if after is not None and after >= before + 1:
            return None
        if time.monotonic() >= deadline:
            return f"the engine's {family} did not move after the gate's completion ({before:g} -> {after})"
        time.sleep(0.25)


def wait_healthy(base: str, model: str, timeout: float, expected: dict | None = None,
                 ready_path: str = "/health", pd: dict | None = None, key: str | None = None,
                 counted: str | None = None, tls: tuple[str | None, str | None] | None = None) -> str:
    """The completion's answer once the service is healthy (``counted``: a request counter of
    the engine's /metrics that must move with the gate's completion; ``tls``: see
    :func:`request`); raises NotHealthy, at once for a certificate that does not verify."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    try:
        while time.monotonic() < deadline:
            status = get_status(f"{base}{ready_path}", tls, owner="required")  # the service runs here, as root
            if status == 200:
                try:
                    before = read_counter(base, counted, key, tls) if counted else None
                    # each request within the gate's own timeout (the fact's quick look: 5 s, 30 for a CPU build; not 120)
                    answer = chat(base, model, key, timeout=min(120.0, max(1.0, deadline - time.monotonic())), tls=tls,
                                  owner="required")
                    if answer:
                        # the first of: the answer did not come from the engine's request path, the topology that
                        # formed is not the plan's, the router answered without both pools
                        problem = ((counted and counter_moved(base, counted, before, key, tls))
                                   or (expected and world_mismatch(base, expected, key, tls=tls, timeout=min(
                                       30.0, max(1.0, deadline - time.monotonic()))))
                                   or (pd and pd_mismatch(pd)))
                        if problem:
                            raise NotHealthy(problem)
                        return answer
                    last = "chat completion returned an empty answer"
                except (OSError, ValueError, KeyError, IndexError) as exc:
                    last = f"chat completion failed: {exc}"
            else:
                last = f"{ready_path} answered {status}"
            time.sleep(POLL_S)
    except Untrusted as exc:
        raise NotHealthy(f"TLS: {exc}") from None
    raise NotHealthy(f"not healthy after {timeout:.0f}s: {last}")


POLL_S = 0.5  # between looks at a server that is not ready yet (a local GET: an engine just started is seen within 0.5 s)
PROBE_PORT = 22  # a rank host's sshd: answered (accepted or refused) when the network between the hosts carries packets
PROBE_TIMEOUT_S = 3.0


def answers(address: str, port: int = PROBE_PORT, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when ``address`` answers a TCP connect on ``port`` (accepted, or refused: either way
    packets flow between the hosts), else why not (timed out, unreachable)."""
    try:
        socket.create_connection((address, port), timeout=timeout).close()
    except ConnectionRefusedError:
        return None
    except socket.timeout:
        return f"TCP to port {port} timed out after {timeout:.0f}s"
    except OSError as exc:
        return f"TCP to port {port}: {exc.strerror or exc}"
    return None


def rendezvous_problems(port: int, members: list[str], connected=None, probe=answers) -> list[str]:
    """For an instance's head whose gate failed: each rank host (``NAME=ADDRESS``) that holds no
    connection to the rendezvous ``port`` (:func:`groupwatch.held_peers`, as the head's watchdog
    reads it), and whether the network reaches it at all (``probe``).

    >>> rendezvous_problems(29500, ["h1=10.0.0.2", "h2=10.0.0.3"], connected={"10.0.0.2"},
    ...                     probe=lambda a: "TCP to port 22 timed out after 3s")
    ['rank host h2 (10.0.0.3) never connected to the rendezvous port 29500 and does not answer from here (TCP to port 22 timed out after 3s): the network between the hosts is cut']
    >>> rendezvous_problems(29500, ["h2=10.0.0.3"], connected=set(), probe=lambda a: None)
    ['rank host h2 (10.0.0.3) never connected to the rendezvous port 29500 (it answers from here: is its rank running?)']
    """
    if connected is None:
        from k2fleet.hostprogs import groupwatch  # beside it in the host archive

        connected = groupwatch.held_peers(port)
    out = []
    for member in members:
        name, _, address = member.rpartition("=")
        if address in connected:
            continue
        who = f"rank host {name} ({address})" if name else f"rank host {address}"
        why = probe(address)
        out.append(f"{who} never connected to the rendezvous port {port} and does not answer from here ({why}): the "
                   "network between the hosts is cut" if why else
                   f"{who} never connected to the rendezvous port {port} (it answers from here: is its rank running?)")
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="health")
    ap.add_argument("--base", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--unit", required=True)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--ready-path", default="/health",
                    help="readiness route that must answer 200 before the chat completion (default /health)")
    ap.add_argument("--expect-world", type=json.loads, default=None,
                    help="JSON {key: value} the engine must report in /v1/models metadata (the planned topology)")
    ap.add_argument("--expect-pd", type=json.loads, default=None,
                    help='JSON {"prefill": [URL], "decode": [URL]}: the completion must reach both pools')
    ap.add_argument("--api-key-file", default=None,
                    help="root-only file holding the API key to send as Authorization: Bearer (never the key itself)")
    ap.add_argument("--expect-counter", default=None, metavar="FAMILY",
                    help="a request counter of /metrics (Prometheus text) that must move with the completion")
    ap.add_argument("--rendezvous-port", type=int, default=None,
                    help="an instance's head: the port its rank hosts stay connected to (torch's TCPStore)")
    ap.add_argument("--member", action="append", default=[], metavar="NAME=ADDRESS",
                    help="a rank host of the instance (repeat): named on failure when it holds no connection")
    ap.add_argument("--ca-file", default=None,
                    help="an https:// base: the CA file its certificate must verify against (that CA alone)")
    ap.add_argument("--tls-name", default=None,
                    help="the address or DNS name the certificate must hold (default: the base's host)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    tls = (args.ca_file, args.tls_name) if args.ca_file or args.base.startswith("https://") else None
    try:
        key = read_key(args.api_key_file) if args.api_key_file else None
        answer = wait_healthy(args.base, args.model, args.timeout, args.expect_world, args.ready_path,
                              args.expect_pd, key, args.expect_counter, tls)
    except (OSError, ValueError) as exc:  # the key file itself
        print(f"{socket.gethostname()}: {args.unit}: API key: {exc}", file=sys.stderr)
        return 1
    except Impostor as exc:  # loudly, at once: one line naming the host, the port and the squatter's uid
        print(f"{socket.gethostname()}: {args.unit}: {exc}", file=sys.stderr)
        return 1
    except NotHealthy as exc:
        why = rendezvous_problems(args.rendezvous_port, args.member) if args.rendezvous_port else []
        print(f"{socket.gethostname()}: {args.unit}: {'; '.join([*why, str(exc)])}", file=sys.stderr)  # the cause first
        print(f"--- last log lines of {args.unit} ---", file=sys.stderr)
        print(journal_tail(args.unit), file=sys.stderr)
        return 1
    print(f"{socket.gethostname()}: {args.unit} healthy; completion: {answer[:60]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
