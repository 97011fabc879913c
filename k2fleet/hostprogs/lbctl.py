#!/usr/bin/env python3
"""k2fleet's load balancer control, run ON the load balancer's host: drain one replica before
a rolling change restarts it, and put it back after its health gate passed — through
HAProxy's runtime API on the root-only admin socket (k2fleet.planning.load_balancer).

    k2fleet-host.pyz lbctl --socket /run/k2fleet-lb/admin.sock drain k2-replicas/h200-0 --timeout 300
    k2fleet-host.pyz lbctl --socket /run/k2fleet-lb/admin.sock ready k2-replicas/h200-0 --timeout 120
    k2fleet-host.pyz lbctl --socket /run/k2fleet-lb/admin.sock show k2-replicas/h200-0

``drain``: ``set server B/S state drain`` (no new request goes there; the ones in flight go on), then waits
until the server has no session and nothing queued, at most ``--timeout`` seconds; past that it says how many
are still in flight and exits 0 (the change goes on: the wait is capped). ``ready``: ``set server B/S state
ready``, then waits until HAProxy's own health checks see the server ``UP`` (traffic reaches it again before the
next replica is drained); not UP within ``--timeout``: exit 1 naming its status. A server the running config
does not have (a replica added by this change) has nothing to drain or put back: exit 0, said. No socket:
``drain`` exits 0 (no load balancer running, nothing to drain), ``ready`` exits 1. Standard library only (hosts
have only python3).
"""

from __future__ import annotations

import argparse
import socket
import sys
import time

POLL_S = 0.5
MAX_ANSWER = 4 << 20  # bytes of one runtime API answer (`show stat` of a few replicas is a few KiB)
ABSENT = ("No such backend", "No such server")


class Absent(Exception):
    """The running config has no such backend or server."""


def command(path: str, line: str, timeout: float = 10) -> str:
    """One runtime API command on the admin socket (non-interactive: HAProxy answers and closes);
    the answer is capped at :data:`MAX_ANSWER` bytes and ``timeout`` seconds in all (OSError past either)."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        sock.sendall(line.encode() + b"\n")
        data = bytearray()
        while True:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                raise OSError(f"{path}: no end of answer within {timeout:g}s") from None
            if not chunk:
                break
            data += chunk
            if len(data) > MAX_ANSWER:
                raise OSError(f"{path}: answer longer than {MAX_ANSWER} bytes to {line.split()[0]!r}: not HAProxy's")
            if time.monotonic() > deadline:
                raise OSError(f"{path}: no end of answer within {timeout:g}s")
    return data.decode(errors="replace")


def set_state(path: str, ref: str, state: str) -> None:
    """``set server REF state STATE``; raises Absent or RuntimeError (HAProxy's answer)."""
    answer = command(path, f"set server {ref} state {state}").strip()
    if any(a in answer for a in ABSENT):
        raise Absent(answer)
    if answer:
        raise RuntimeError(answer)


def server_stat(path: str, ref: str) -> dict[str, str]:
    """The ``show stat`` row of server ``BACKEND/SERVER`` (column → value); raises Absent.

    >>> rows = "# pxname,svname,qcur,scur,status\\nb,s1,0,3,UP\\nb,BACKEND,0,3,UP\\n"
    >>> parse_stat(rows, "b/s1")["scur"]
    '3'
    """
    return parse_stat(command(path, "show stat"), ref)


def parse_stat(text: str, ref: str) -> dict[str, str]:
    backend, _, server = ref.partition("/")
    lines = text.splitlines()
    if not lines or not lines[0].startswith("# "):
        raise RuntimeError(f"unexpected answer to show stat: {text[:200]!r}")
    columns = lines[0][2:].split(",")
    for line in lines[1:]:
        row = dict(zip(columns, line.split(",")))
        if row.get("pxname") == backend and row.get("svname") == server:
            return row
    raise Absent(f"No such server: {ref}")


def in_flight(row: dict[str, str]) -> int:
    """Requests the server still holds: its current sessions and its queue."""
    return sum(int(row.get(k) or 0) for k in ("scur", "qcur"))


def drain(path: str, ref: str, timeout: float) -> int:
    try:
        set_state(path, ref, "drain")
    except (FileNotFoundError, ConnectionRefusedError):
        print(f"lbctl: no load balancer answers on {path}: nothing to drain for {ref}")
        return 0
    except Absent:
        print(f"lbctl: {ref} is not in the load balancer's running config: nothing to drain")
        return 0
    deadline = time.monotonic() + timeout
    while True:
        left = in_flight(server_stat(path, ref))
        if left == 0:
            print(f"lbctl: {ref} drained: no request in flight")
            return 0
        if time.monotonic() >= deadline:
            print(f"lbctl: {ref}: {left} requests still in flight after {timeout:.0f}s; going on (the wait is capped: "
                  "k2_drain_timeout)")
            return 0
        time.sleep(POLL_S)


def ready(path: str, ref: str, timeout: float) -> int:
    try:
        set_state(path, ref, "ready")
    except Absent:
        print(f"lbctl: {ref} is not in the load balancer's running config: nothing to put back")
        return 0
    except OSError as exc:
        print(f"lbctl: cannot put {ref} back: no load balancer answers on {path} ({exc})", file=sys.stderr)
        return 1
    deadline = time.monotonic() + timeout
    status = "?"
    while time.monotonic() < deadline:
        status = server_stat(path, ref).get("status", "?")
        if status == "UP":
            print(f"lbctl: {ref} is UP at the load balancer and takes requests again")
            return 0
        time.sleep(POLL_S)
    print(f"lbctl: {ref} is not UP at the load balancer after {timeout:.0f}s (status {status}: its health checks "
          "fail); the rolling change stops here", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lbctl")
    ap.add_argument("--socket", required=True, help="HAProxy's admin socket (stats socket ... level admin)")
    ap.add_argument("action", choices=("drain", "ready", "show"))
    ap.add_argument("server", help="BACKEND/SERVER")
    ap.add_argument("--timeout", type=float, default=300, help="seconds to wait at most")
    args = ap.parse_args(argv)
    if args.server.count("/") != 1:
        ap.error("server must be BACKEND/SERVER")
    if args.action == "drain":
        return drain(args.socket, args.server, args.timeout)
    if args.action == "ready":
        return ready(args.socket, args.server, args.timeout)
    row = server_stat(args.socket, args.server)
    print(f"{args.server}: status {row.get('status')}, {in_flight(row)} in flight")
    return 0


if __name__ == "__main__":
    sys.exit(main())
