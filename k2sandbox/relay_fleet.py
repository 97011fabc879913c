"""The checkpoint relay (:mod:`k2fleet.hostprogs.relay`) on sandbox hosts, for the distribution
bench and its tests: the control machine serves a verified copy on the sandbox bridge,
every host serves what it has verified, and hosts fetch by a plan (a chain, the doubling
tree's rounds, or per-shard trees from :mod:`k2fleet.hostprogs.swarm`).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

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

    def start(self) -> None:
        subprocess.run([sys.executable, str(RELAY), "mark", str(self.source)], check=True, capture_output=True)
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
        its place in the fleet order, the per-shard plan, the source last): seconds until
        all are done, and their reports in fleet order."""
        fleet = [url(h.address) for h in hosts]
        lines = {h.name: shlex.join(relay_plan.relay_fetch_argv(HOST_DIR, fleet, i, fanout_k, [url(sandbox.BRIDGE_ADDRESS)],
                                                            log_file="/var/log/k2fleet/relay-bench.jsonl",
                                                            secret_file=None))
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
