#!/usr/bin/env python3
"""k2fleet instance watchdog: one multi-host instance fails as one (stdlib only).

systemd's ``BindsTo=``/``PartOf=`` tie units of one host; an instance that spans hosts (vLLM
``--headless`` nodes or DP ranks, Ray workers, SGLang ``--nnodes``) has no such tie, and the
engines do not close the gap: headless vLLM ranks keep running after their head exits (vLLM
issue 32136), and a head whose rank died often hangs in a collective instead of exiting.
Each host of such an instance runs this watchdog beside its engine unit (``UNIT-watch.service``):

- **member** (a host whose unit is a rank of the instance):
  ``groupwatch member --unit k2-vllm.service --head 10.0.0.1:8000`` connects to the head's
  port (one that listens for the head's whole life) once per ``--interval``. After the head
  was seen, ``--grace`` failed connects in a row mean the head is gone: the member's unit is
  stopped (no rank runs without its head) and started again once the head's port answers,
  so the instance comes back head first. The "stopped by the watchdog" mark lives in
  ``--state`` (the unit's root-only runtime directory), so a restarted watchdog still starts
  the rank it stopped; a unit an operator stopped is never started.
- **head** (the head's host, for engines whose members hold a connection to the head's
  rendezvous port while they run, e.g. torch's TCPStore on vLLM's ``--master-port`` and
  SGLang's ``--dist-init-addr``):
  ``groupwatch head --unit k2-vllm.service --port 29501 --member 10.0.0.2 ...`` reads the
  host's TCP table once per ``--interval``. Once every member held a connection, a member
  without one for ``--grace`` reads means its rank died: the head's unit is stopped, kept
  down for ``--hold`` seconds (longer than the members' grace, so every member's watchdog
  sees the head gone and stops its rank) and started again; members then start when its
  port answers.

Each action is one line on stdout (the journal): ``HOST: UNIT: ...``. The watchdog acts only
on an active unit and never on a unit that is starting or stopping for another reason.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable

SYSTEMCTL = "/usr/bin/systemctl"
ESTABLISHED = "01"
TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


def say(unit: str, message: str) -> None:
    print(f"{socket.gethostname()}: {unit}: {message}", flush=True)


def split_hostport(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` → (host, port).

    >>> split_hostport("10.0.0.1:8000"), split_hostport("[fd00::1]:29501")
    (('10.0.0.1', 8000), ('fd00::1', 29501))
    """
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def reachable(host: str, port: int, timeout: float) -> bool:
    """Whether a TCP connection to ``host:port`` opens (closed at once, nothing sent)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def unit_state(unit: str) -> str:
    """systemd's ActiveState of ``unit`` (``active``, ``activating``, ``inactive``, ``failed``, ...)."""
    out = subprocess.run([SYSTEMCTL, "show", "-p", "ActiveState", "--value", unit], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def systemctl(verb: str, unit: str) -> None:
    subprocess.run([SYSTEMCTL, verb, unit], check=False)


def _address(hex_text: str) -> str:
    """An address of ``/proc/net/tcp{,6}`` (little-endian 32-bit words) as text; IPv4-mapped
    IPv6 addresses as IPv4.

    >>> _address("0100000A"), _address("0000000000000000FFFF00000200000A")
    ('10.0.0.1', '10.0.0.2')
    """
    raw = bytes.fromhex(hex_text)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    addr = ipaddress.ip_address(raw)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        addr = addr.ipv4_mapped
    return str(addr)


def held_peers(port: int, tables: Iterable[str] = TCP_TABLES) -> set[str]:
    """Remote addresses with an ESTABLISHED connection to this host's local ``port``."""
    peers: set[str] = set()
    for table in tables:
        try:
            with open(table, encoding="ascii") as fh:
                lines = fh.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 4 or fields[3] != ESTABLISHED:
                continue
            local, remote = fields[1].split(":"), fields[2].split(":")
            if int(local[1], 16) == port:
                peers.add(_address(remote[0]))
    return peers


class Member:
    """The member side's decisions, one :meth:`step` per probe (I/O passed in, for tests)."""

    def __init__(self, unit: str, grace: int, mark: str | None,
                 state: Callable[[], str], act: Callable[[str], None]) -> None:
        self.unit, self.grace, self.mark = unit, grace, mark
        self.state, self.act = state, act
        self.seen = False  # the head answered since the watchdog started (or since it came back)
        self.misses = 0

    def stopped_by_us(self) -> bool:
        return bool(self.mark) and os.path.exists(self.mark)  # type: ignore[arg-type]

    def _set_mark(self, on: bool) -> None:
        if not self.mark:
            return
        if on:
            fd = os.open(self.mark, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            os.close(fd)
        elif os.path.exists(self.mark):
            os.unlink(self.mark)

    def step(self, head_up: bool, head: str) -> str | None:
        """One probe's outcome; returns what was done (None: nothing)."""
        if head_up:
            self.seen, self.misses = True, 0
            if self.stopped_by_us():
                self._set_mark(False)
                self.act("start")
                return f"head {head} is back: started"
            return None
        self.misses += 1
        if not self.seen or self.misses < self.grace:
            return None
        self.seen = False
        if self.state() not in ("active", "activating"):
            return None
        self._set_mark(True)
        self.act("stop")
        return f"head {head} gone ({self.misses} failed connects): stopped; starting it when the head is back"


class Head:
    """The head side's decisions, one :meth:`step` per read of the TCP table."""

    def __init__(self, unit: str, members: list[str], grace: int,
                 state: Callable[[], str], act: Callable[[str], None], hold: Callable[[], None]) -> None:
        self.unit, self.members, self.grace = unit, members, grace
        self.state, self.act, self.hold = state, act, hold
        self.armed = False  # every member held a connection during this invocation of the unit
        self.misses = {m: 0 for m in members}

    def step(self, peers: set[str]) -> str | None:
        if self.state() != "active":
            self.armed = False
            self.misses = dict.fromkeys(self.members, 0)
            return None
        if not self.armed:
            self.armed = all(m in peers for m in self.members)
            return None
        for m in self.members:
            self.misses[m] = 0 if m in peers else self.misses[m] + 1
        lost = [m for m in self.members if self.misses[m] >= self.grace]
        if not lost:
            return None
        self.armed = False
        self.misses = dict.fromkeys(self.members, 0)
        self.act("stop")
        self.hold()
        self.act("start")
        return f"rank host(s) {', '.join(lost)} left the instance: stopped the head and started it again"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="groupwatch")
    sub = ap.add_subparsers(dest="side", required=True)
    m = sub.add_parser("member", help="stop this rank when its head is gone; start it when the head is back")
    m.add_argument("--head", type=split_hostport, required=True, help="HOST:PORT the head listens on for its whole life")
    m.add_argument("--state", default=None, help="root-only directory for the 'stopped by the watchdog' mark")
    h = sub.add_parser("head", help="restart the head (stop, hold, start) when a rank host's connection is gone")
    h.add_argument("--port", type=int, required=True, help="the head's rendezvous port members stay connected to")
    h.add_argument("--member", action="append", required=True, help="a rank host's address (repeat)")
    h.add_argument("--hold", type=float, default=10.0, help="seconds the head stays down before it starts again")
    for p in (m, h):
        p.add_argument("--unit", required=True)
        p.add_argument("--interval", type=float, default=1.0)
        p.add_argument("--grace", type=int, default=3)
    args = ap.parse_args(argv)
    unit = args.unit

    def act(verb: str) -> None:
        systemctl(verb, unit)

    if args.side == "member":
        host, port = args.head
        head = f"{host}:{port}"
        mark = os.path.join(args.state, "stopped") if args.state else None
        watch = Member(unit, args.grace, mark, lambda: unit_state(unit), act)
        say(unit, f"watching head {head} every {args.interval:g} s (grace {args.grace})")
        while True:
            done = watch.step(reachable(host, port, max(args.interval, 1.0)), head)
            if done:
                say(unit, done)
            time.sleep(args.interval)
    members = [str(ipaddress.ip_address(a)) for a in args.member]
    watch_head = Head(unit, members, args.grace, lambda: unit_state(unit), act, lambda: time.sleep(args.hold))
    say(unit, f"watching rank hosts {', '.join(members)} on port {args.port} every {args.interval:g} s "
              f"(grace {args.grace}, hold {args.hold:g} s)")
    while True:
        done = watch_head.step(held_peers(args.port))
        if done:
            say(unit, done)
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
