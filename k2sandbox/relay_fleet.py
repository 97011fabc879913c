"""The checkpoint relay (:mod:`k2fleet.hostprogs.relay`) on sandbox hosts, for the distribution
bench and its tests: the control machine serves a verified copy on the sandbox bridge,
every host serves what it has verified, and hosts fetch by a plan (a chain, the doubling
tree's rounds, or per-shard trees from :mod:`k2fleet.hostprogs.swarm`), and the bench's fluid model
of a plan for fleets too large to measure (:func:`simulate`: links of one bandwidth, each host's
ingress and egress shared fairly among its transfers).
"""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from k2fleet.hostprogs import relay, swarm
from k2fleet.planning import relay_plan
from k2fleet.planning.host_archive import ARCHIVE, archive_bytes
from k2sandbox import nspawn as sandbox

RELAY = Path(__file__).resolve().parents[1] / "k2fleet" / "hostprogs" / "relay.py"  # on the control machine
HOST_RELAY = f"{ARCHIVE} relay"  # on hosts: the host archive, as the deploy ships it
HOST_DIR = "/srv/k2fleet/relay-bench"
PORT = 29700


def url(address: str) -> str:
    return f"http://{address}:{PORT}"


@dataclass
class RelayFleet:
    """Relay servers on the control machine (``source``, a verified copy) and on ``hosts``."""

    source: Path
    hosts: list[sandbox.SandboxHost]
    control: subprocess.Popen | None = None
    log: list[str] = field(default_factory=list)
    pieces_digest: str | None = None  # the control copy's pinned pieces (relay pieces), as the deploy pins them

    def start(self) -> None:
        subprocess.run([sys.executable, str(RELAY), "mark", str(self.source)], check=True, capture_output=True)
        pinned = subprocess.run([sys.executable, str(RELAY), "pieces", str(self.source)], check=True,
                                capture_output=True, text=True)
        self.pieces_digest = json.loads(pinned.stdout)["pieces_digest"]
        self.control = subprocess.Popen([sys.executable, str(RELAY), "serve", str(self.source), "--bind",
                                         sandbox.BRIDGE_ADDRESS, "--port", str(PORT), "--exit-with-parent"],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        listening = self.control.stdout.readline() if self.control.stdout else ""
        if not listening.startswith('{"port"'):  # e.g. the port is taken by a relay left running
            self.control.kill()
            raise RuntimeError(f"the control relay did not start: {self.control.communicate()[1][-800:]}")
        for h in self.hosts:
            put = subprocess.run(sandbox.ssh_command(h, f"mkdir -p {Path(ARCHIVE).parent} && cat > {ARCHIVE}"),
                                 input=archive_bytes(), capture_output=True)
            assert put.returncode == 0, put.stderr
            self.restart_server(h)

    def restart_server(self, h: sandbox.SandboxHost) -> None:
        """(Re)start ``h``'s relay server on its address (a transient systemd unit)."""
        out = sandbox.ssh(h, "systemctl stop 'k2-relay-bench*' 2>/dev/null; "  # a unit of its own each start:
                             f"mkdir -p {HOST_DIR} && systemd-run --unit k2-relay-bench-$(date +%s%N) --collect --quiet "
                             f"/usr/bin/python3 {HOST_RELAY} serve {HOST_DIR} --bind {h.address} --port {PORT}")
        if out.returncode != 0:
            raise RuntimeError(f"{h.name}: the relay server did not start: {out.stderr[-500:]}")

    def reset(self, hosts: list[sandbox.SandboxHost]) -> None:
        for h in hosts:
            sandbox.ssh(h, f"rm -rf {HOST_DIR} && mkdir -p {HOST_DIR}")

    def fetch_argv(self, h: sandbox.SandboxHost, plan: dict[str, list[str]] | None, sources: list[str],
                   streams: int | None = None, dead_after: float = 10) -> str:
        """Shell line fetching into ``h``'s directory (plan file written first)."""
        line = f"/usr/bin/python3 {HOST_RELAY} fetch {HOST_DIR} --dead-after {dead_after}"  # the relay's own streams
        if streams is not None:
            line += f" --streams {streams}"
        line += "".join(f" --source {shlex.quote(s)}" for s in sources)
        if plan is not None:
            line = f"cat > /tmp/relay-plan.json <<'EOF'\n{json.dumps(plan)}\nEOF\n{line} --plan /tmp/relay-plan.json"
        return line

    def run_fetches(self, lines: dict[str, str], timeout: float = 1800) -> dict[str, dict]:
        """Run each host's fetch line at once (over ssh); host name → its JSON report."""
        by_name = {h.name: h for h in self.hosts}
        procs = {name: subprocess.Popen(sandbox.ssh_command(by_name[name], line), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
                 for name, line in lines.items()}
        reports = {}
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"{name}: relay fetch exited {proc.returncode}: {err[-1500:]}")
            reports[name] = json.loads(out.strip().splitlines()[-1])
        return reports

    # ---------------------------------------------------------------- schedules

    def pipelined(self, hosts: list[sandbox.SandboxHost], fanout_k: int = 1) -> tuple[float, list[dict]]:
        """Every host fetches at once with the deploy's own argv (:func:`relay_plan.relay_fetch_argv`:
        its place in the fleet order, the per-shard plan, the source last, the control copy's
        pinned pieces): seconds until
        all are done, and their reports in fleet order."""
        fleet = [url(h.address) for h in hosts]
        lines = {h.name: shlex.join(relay_plan.relay_fetch_argv(HOST_DIR, fleet, i, fanout_k, [url(sandbox.BRIDGE_ADDRESS)],
                                                            log_file="/var/log/k2fleet/relay-bench.jsonl",
                                                            secret_file=None, pieces_digest=self.pieces_digest))
                 for i, h in enumerate(hosts)}
        t0 = time.monotonic()
        reports = self.run_fetches(lines)
        return time.monotonic() - t0, [reports[h.name] for h in hosts]

    def doubling_tree(self, hosts: list[sandbox.SandboxHost]) -> float:
        """Today's schedule (:func:`k2fleet.control.checkpoint_copy.plan_fanout`): round by round,
        each host copies the whole checkpoint from its parent once the parent is complete."""
        tree = relay_plan.plan_fanout([h.name for h in hosts])
        address = {h.name: url(h.address) for h in hosts}
        by_name = {h.name: h for h in hosts}
        t0 = time.monotonic()
        for members in tree.rounds:
            lines = {}
            for name in members:
                parent = tree.parents[name]
                lines[name] = self.fetch_argv(by_name[name], None, [address[parent] if parent else url(sandbox.BRIDGE_ADDRESS)])
            self.run_fetches(lines)
        return time.monotonic() - t0

    def stop(self) -> None:
        for h in self.hosts:
            sandbox.ssh(h, "systemctl stop 'k2-relay-bench*' 2>/dev/null; true")
        if self.control is not None:
            self.control.kill()
            self.control.wait()


def max_min_rates(flows: list[tuple[object, ...]], capacity: float) -> list[float]:
    """Max-min fair rates of ``flows`` (each the resources it crosses, every resource of
    ``capacity``), by progressive filling — how TCP flows share links, roughly.

    >>> max_min_rates([("a", "x"), ("a", "y"), ("b", "y")], 10.0)
    [5.0, 5.0, 5.0]
    >>> max_min_rates([("a",), ("b",), ("b",)], 12.0)
    [12.0, 6.0, 6.0]
    """
    rates: list[float | None] = [None] * len(flows)
    left = {r: capacity for f in flows for r in f}
    while any(rate is None for rate in rates):
        users: dict[object, list[int]] = {}
        for i, f in enumerate(flows):
            if rates[i] is None:
                for r in f:
                    users.setdefault(r, []).append(i)
        bottleneck = min(users, key=lambda r: left[r] / len(users[r]))
        share = left[bottleneck] / len(users[bottleneck])
        for i in users[bottleneck]:
            rates[i] = share
            for r in flows[i]:
                left[r] -= share
    return [float(r) for r in rates]  # type: ignore[arg-type]


def simulate(n: int, sizes: Sequence[int], bandwidth: float, fanout: int, hop_s: float = 0.0,
             step: float | None = None, pieces: bool = False) -> float:
    """Seconds until every one of ``n`` hosts holds every shard (``sizes`` bytes each) as
    the relay moves them: each host takes shard j in lane j mod k (k = ``fanout``, 1 for a
    chain), in order within a lane, one shard at a time, from its parent in
    :func:`swarm.plan_sources`; a received shard is passed on ``hop_s`` seconds later (the
    tail of its hash, its checks and a peer noticing it); every link, the source's too,
    has ``bandwidth`` bytes/s each way, shared max-min fairly among the transfers crossing
    it (:func:`max_min_rates`). ``pieces``: a shard larger than one piece
    (:func:`relay.piece_size`) is also passed on while it lands, up to its last complete
    piece (the control copy's pinned pieces); a host never gets ahead of its parent's
    prefix. Fluid, time-stepped.

    >>> round(simulate(1, [100] * 10, 100.0, 1), 1)
    10.0
    >>> round(simulate(3, [100] * 10, 100.0, 1), 1)  # S/B + 2 shard-times
    12.0
    >>> round(simulate(3, [4 << 20] * 10, float(4 << 20), 1, pieces=True), 2)  # S/B + 2 piece-times (1 MiB)
    10.5
    """
    k = max(1, fanout)
    hosts = [f"h{i}" for i in range(n)]
    shards = [f"s{j}" for j in range(len(sizes))]
    plan = swarm.plan_sources(hosts, shards, fanout)
    size = dict(zip(shards, sizes))
    piece = {s: relay.piece_size(b) if pieces and b > relay.piece_size(b) else 0 for s, b in size.items()}
    dt = step or max(sum(sizes) / bandwidth / 2000, 1e-3)
    lanes = [(h, [s for j, s in enumerate(shards) if j % k == lane]) for h in hosts for lane in range(k)]
    nxt = [0] * len(lanes)
    have: dict[tuple[str | None, str], float] = {(swarm.SOURCE, s): 0.0 for s in shards}  # (host, shard) → ready time
    got = [0.0] * len(lanes)
    landing: dict[tuple[str, str], int] = {}  # (host, shard) → the lane it is landing in
    t = 0.0

    def prefix(host: str | None, s: str) -> float:
        """Bytes of ``s`` that ``host`` serves at ``t``."""
        if have.get((host, s), math.inf) <= t + 1e-9:
            return float(size[s])
        li = landing.get((host, s))  # type: ignore[arg-type]
        return (got[li] // piece[s]) * piece[s] if li is not None and piece[s] else 0.0

    while any(i < len(shards_) for i, (_, shards_) in zip(nxt, lanes)):
        active = []
        for li, (h, mine) in enumerate(lanes):
            if nxt[li] < len(mine):
                s = mine[nxt[li]]
                parent = plan[h][s][0]
                ahead = prefix(parent, s)
                if ahead > got[li] + 1e-9:
                    active.append((li, h, s, parent, ahead))
        rates = max_min_rates([(("in", h), ("out", p)) for _, h, _, p, _ in active], bandwidth) if active else []
        for (li, h, s, _, ahead), rate in zip(active, rates):
            landing[(h, s)] = li
            got[li] = min(got[li] + rate * dt, ahead)
            if got[li] >= size[s] - 1e-9:
                have[(h, s)] = t + dt + hop_s
                landing.pop((h, s), None)
                got[li] = 0.0
                nxt[li] += 1
        t += dt
        if t > 1e7:
            raise RuntimeError("simulation did not converge")
    return max(have.values())
