"""Fleet reachability, run ON the hosts before the engines start: can every host open the
ports its peers will listen on? (A blocked rendezvous port otherwise shows up as an engine
that hangs after the model has loaded.)

    k2fleet-host.pyz reach listen --bind 10.0.0.1 --ports 29501,13345 --seconds 120
    k2fleet-host.pyz reach probe --host h200-1 --targets 10.0.0.1:29501,10.0.0.1:13345 --timeout 30

``listen`` (started in the background, as a transient unit) holds each port on the host's fleet address that
nothing listens on yet, accepts and closes connections, and exits after ``--seconds`` (a port already in use is
left to its owner: a running engine answers for it). ``probe`` connects to every target until it answers,
``--timeout`` passes (a refused port is tried again: the peers' listeners may start a moment later) or its
attempts time out :data:`TIMEOUTS_IN_A_ROW` times in a row (its packets are dropped), and prints one line per
target it could not reach, naming the host, the target, why, and the fix; exit 1 if any. Standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import selectors
import socket
import sys
import time

MAX_PORTS = 64  # ports one listener holds at most
MAX_TARGETS = 1024  # targets one probe tries at most
MAX_SECONDS = 600.0  # the longest a listener stays or a probe waits
ATTEMPT_S = 2.0  # one connection attempt
RETRY_S = 0.5
# Timed-out attempts in a row after which a target is named: its SYNs are dropped (a firewall's
# drop rule, a security group), which waiting does not change. Every listener is up before any
# probe starts (pyinfra runs each operation on every host first), and a port not listened on yet
# is refused, not dropped: refusals are retried until the timeout. Each attempt (ATTEMPT_S)
# already includes the kernel's own SYN retransmission.
TIMEOUTS_IN_A_ROW = 3


def _ports(text: str) -> list[int]:
    ports = [int(p) for p in text.split(",") if p]
    if not ports or len(ports) > MAX_PORTS or not all(1 <= p <= 65535 for p in ports):
        raise ValueError(f"--ports: 1 to {MAX_PORTS} ports in 1..65535")
    return ports


def _targets(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"--targets: {item!r} is not ADDRESS:PORT")
        out.append((host.strip("[]"), int(port)))
    if not out or len(out) > MAX_TARGETS:
        raise ValueError(f"--targets: 1 to {MAX_TARGETS} targets")
    return out


def listen(bind: str, ports: list[int], seconds: float) -> int:
    """Hold the free ones of ``ports`` on ``bind`` for ``seconds``; 1 if ``bind`` is not an
    address of this host (then no peer can reach it there either)."""
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    sel = selectors.DefaultSelector()
    held = []
    for port in ports:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bind, port))
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                print(f"reach: {bind}:{port} is in use already (its owner answers for it)", flush=True)
                continue
            print(f"reach: cannot listen on {bind}:{port}: {exc.strerror} (is {bind} this host's fleet address?)")
            return 1
        sock.listen(64)
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ)
        held.append(sock)
    deadline = time.monotonic() + min(seconds, MAX_SECONDS)
    while held and (left := deadline - time.monotonic()) > 0:
        for key, _ in sel.select(timeout=left):
            with contextlib.suppress(OSError):
                key.fileobj.accept()[0].close()  # type: ignore[union-attr]
    for sock in held:
        sock.close()
    return 0


def probe(host: str, targets: list[tuple[str, int]], timeout: float) -> int:
    """Connect to every target until it answers, ``timeout`` passes or it timed out
    :data:`TIMEOUTS_IN_A_ROW` times in a row; one line per target not reached."""
    deadline = time.monotonic() + min(timeout, MAX_SECONDS)
    pending = {t: "no attempt" for t in targets}
    timeouts = dict.fromkeys(targets, 0)  # timed-out attempts in a row, per target
    while any(timeouts[t] < TIMEOUTS_IN_A_ROW for t in pending):
        for target in [t for t in pending if timeouts[t] < TIMEOUTS_IN_A_ROW]:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                with socket.create_connection(target, timeout=min(ATTEMPT_S, max(0.1, left))):
                    del pending[target]
            except TimeoutError:
                pending[target], timeouts[target] = "timed out", timeouts[target] + 1
            except OSError as exc:
                pending[target], timeouts[target] = exc.strerror or type(exc).__name__, 0
        if time.monotonic() >= deadline or not any(timeouts[t] < TIMEOUTS_IN_A_ROW for t in pending):
            break
        time.sleep(RETRY_S)
    for (address, port), why in sorted(pending.items()):
        when = (f"{TIMEOUTS_IN_A_ROW} times in a row" if timeouts[(address, port)] >= TIMEOUTS_IN_A_ROW
                else f"within {timeout:.0f}s")
        print(f"reach: {host} cannot open {address}:{port} ({why}) {when}: the engines rendezvous "
              "there; let the fleet's hosts reach each other on this port (host firewalls, security groups, "
              "routes), or set k2_address to the host's address on the fleet network")
    return 1 if pending else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="k2fleet-host.pyz reach", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_listen = sub.add_parser("listen")
    p_listen.add_argument("--bind", required=True)
    p_listen.add_argument("--ports", required=True)
    p_listen.add_argument("--seconds", type=float, default=120.0)
    p_probe = sub.add_parser("probe")
    p_probe.add_argument("--host", required=True)
    p_probe.add_argument("--targets", required=True)
    p_probe.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args(argv)
    try:
        if args.command == "listen":
            return listen(args.bind, _ports(args.ports), args.seconds)
        return probe(args.host, _targets(args.targets), args.timeout)
    except ValueError as exc:
        print(f"reach: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
