"""Benchmark checkpoint distribution at the link limit (root; not a pytest test).

On 3 and 5 sandbox hosts whose links are shaped (``k2fleet sandbox shape RATE``: htb on
each host's veth, both directions, ACKs ahead of bulk) and a ~1 GB synthetic checkpoint
(62 shards of 16 MiB, Kimi-K2-Thinking's layout) served by the control machine's
verified copy on the sandbox bridge, measured in one run:

* **pipelined**: every host fetches at once with :mod:`k2fleet.hostprogs.relay`, with the argv
  the deploy runs (:func:`k2fleet.control.checkpoint_copy.relay_fetch_argv`, the plan
  :func:`k2fleet.hostprogs.swarm.fanout_for` picks: a chain for these sizes), each shard
  from its parent as soon as the parent verified it; on 5 hosts also in 2 trees (the
  plan of larger fleets), to check the simulation of trees against a measurement;
* **doubling tree**: the old schedule (:mod:`k2fleet.control.checkpoint_copy`): round by round,
  a host copies the whole checkpoint from its parent once the parent holds all of it (the
  same relay transport, so only the schedule differs);
* **one transfer vs raw TCP** (links unshaped, best of three each): the relay's own
  transport moving the checkpoint between two hosts into files (one kept-alive connection,
  ``sendfile`` out, ``splice`` in; nothing hashed) vs the same bytes over one plain TCP
  connection (``sendfile`` out, the receiver ``recv_into`` one buffer and discarding):
  ``stream_vs_raw_tcp``; and a whole relay fetch, every file hashed, checked and in place
  (1 and 4 range streams per file), vs the same raw TCP: ``copy_with_verify_vs_raw_tcp``.
  Before each copy that lands files, free memory is prefaulted as in
  ``bench/verify_bench.py`` (this VM's host takes freed memory back and a copy landing on it
  paid its page faults: the same transport took 0.5 to 2.5 s).

The link limit is S/B (checkpoint bytes ÷ the nominal shaped rate): one host's transfer
time. Larger fleets are simulated (:func:`k2fleet.hostprogs.swarm.simulate`) from the
5-host chain's measured per-shard time on a busy link, extra per-hop delay and start-up,
for chains and k trees; the figure for each size is the deploy's plan.

    python bench/distribution_bench.py [--rate 200mbit] [--shard-mib 16] [--shards 62] [--only stream|fleet]
    python bench/distribution_bench.py --short   # the suite's run: 8 shards of 1 MiB, 100mbit

Ends with ``ratios: distribution_vs_link_limit=X tree_vs_link_limit=X stream_vs_raw_tcp=X
copy_with_verify_vs_raw_tcp=X simulated_64_vs_link_limit=X`` (distribution and tree: the
5-host runs).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k2sandbox import nspawn as sandbox  # noqa: E402
from k2fleet.hostprogs import swarm  # noqa: E402
from k2sandbox.checkpoint_cache import ensure_synthetic_checkpoint  # noqa: E402
from k2fleet.planning.host_archive import ARCHIVE  # noqa: E402
from k2sandbox.relay_fleet import HOST_DIR, RelayFleet, url  # noqa: E402
from verify_bench import prefault  # noqa: E402  (bench/ is on sys.path as this script's directory)

RATES = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8}
RAW_TCP_PORT = 29711
ROUNDS = 3  # of the unshaped copies; the best of each kind counts (this VM's figures wander by ±15%)
# before each unshaped copy that lands files: write, then free, this many times its bytes of
# anonymous memory, so its page cache lands on memory the VM's host backs (bench/verify_bench.py)
PREFAULT_TIMES = 2.5


def rate_bytes(rate: str) -> float:
    for unit, factor in RATES.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * factor
    raise ValueError(rate)


def raw_tcp_seconds(sender: sandbox.SandboxHost, receiver: sandbox.SandboxHost, nbytes: int) -> float:
    """Seconds for ``nbytes`` over one plain TCP connection sender → receiver: the
    sender ``sendfile``s the checkpoint's files, the receiver ``recv_into``s one buffer
    and discards (the cheapest copy both ends can make, so the fairest baseline)."""
    sink = ("import socket,time;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
            f"s.bind(('{receiver.address}',{RAW_TCP_PORT}));s.listen(1);c,_=s.accept();n=0;t=time.monotonic()\n"
            "m=memoryview(bytearray(1<<20))\n"
            "while True:\n k=c.recv_into(m)\n if not k: break\n n+=k\n"
            "print(n, time.monotonic()-t)")
    source = ("import socket,os,sys;c=socket.create_connection(('%s',%d))\n"
              "for d,_,fs in os.walk('%s'):\n"
              " for f in sorted(fs):\n"
              "  p=os.path.join(d,f)\n"
              "  if '/.k2fleet' in p: continue\n"
              "  with open(p,'rb') as h: c.sendfile(h)\n"
              "c.close()" % (receiver.address, RAW_TCP_PORT, HOST_DIR))
    import subprocess

    recv = subprocess.Popen(sandbox.ssh_command(receiver, f"python3 -c {shlex.quote(sink)}"), stdout=subprocess.PIPE,
                            text=True)
    time.sleep(1.0)
    out = sandbox.ssh(sender, f"python3 -c {shlex.quote(source)}", timeout=600)
    assert out.returncode == 0, out.stderr
    got, seconds = recv.communicate(timeout=600)[0].split()
    assert int(got) >= nbytes * 0.99, (got, nbytes)
    return float(seconds)


def relay_transport_seconds(sender: sandbox.SandboxHost, receiver: sandbox.SandboxHost, nbytes: int) -> float:
    """Seconds the relay's own transport takes to move the checkpoint sender → receiver
    into files, nothing hashed: on the receiver, relay.py's :class:`Source` asks the
    sender's relay server for each file in turn on one kept-alive connection (the server
    ``sendfile``s, the receiver ``splice``s into the file), as a fetch does minus its checks."""
    scratch = "/var/tmp/k2-transport"
    code = ("import json,os,sys,time;sys.path.insert(0,%r);from k2fleet.hostprogs import relay\n"
            "src=relay.Source(%r);m=json.loads(src.request('/manifest')[1]);os.makedirs(%r,exist_ok=True)\n"
            "t=time.monotonic()\n"
            "for i,(rel,e) in enumerate(sorted(m['files'].items())):\n"
            " fd=os.open(os.path.join(%r,str(i)),os.O_RDWR|os.O_CREAT|os.O_TRUNC,0o644);os.ftruncate(fd,e['size'])\n"
            " if e['size']: src.get_range(rel,fd,0,e['size']-1)\n"
            " os.close(fd)\n"
            "print(time.monotonic()-t)" % (ARCHIVE, url(sender.address), scratch, scratch))
    sandbox.ssh(receiver, f"rm -rf {scratch} && sync")
    prefault(int(PREFAULT_TIMES * nbytes))
    out = sandbox.ssh(receiver, f"python3 -c {shlex.quote(code)}", timeout=600)
    assert out.returncode == 0, out.stderr
    sandbox.ssh(receiver, f"rm -rf {scratch}")
    return float(out.stdout.split()[-1])


def one_copy(fleet: RelayFleet, hosts: list[sandbox.SandboxHost], streams: int, nbytes: int) -> dict:
    """h2 copies the checkpoint from h1 (unshaped) with ``streams`` range streams; its report."""
    fleet.reset(hosts[1:2])
    sandbox.ssh(hosts[1], "sync")  # no dirty pages of an earlier copy in the way
    prefault(int(PREFAULT_TIMES * nbytes))
    return fleet.run_fetches({hosts[1].name: fleet.fetch_argv(hosts[1], None, [url(hosts[0].address)],
                                                              streams=streams)})[hosts[1].name]


def stream_phase(fleet: RelayFleet, hosts: list[sandbox.SandboxHost], size: int, results: dict[str, float]) -> None:
    """One host-to-host copy vs raw TCP between the same hosts, unshaped, ``ROUNDS`` times
    over, the best of each: the relay's transport alone (``stream_vs_raw_tcp``), and a
    relay fetch with every file hashed, checked and in place, with 1 and 4 range streams
    per file (``copy_with_verify_vs_raw_tcp``: the better stream count)."""
    fleet.reset(hosts[:2])
    fleet.run_fetches({hosts[0].name: fleet.fetch_argv(hosts[0], None, [url(sandbox.BRIDGE_ADDRESS)])})
    copies: dict[int, list[dict]] = {1: [], 4: []}
    raws, transports = [], []
    for _ in range(ROUNDS):
        for streams in copies:
            copies[streams].append(one_copy(fleet, hosts, streams, size))
        transports.append(relay_transport_seconds(hosts[0], hosts[1], size))
        sandbox.ssh(hosts[1], "sync")
        raws.append(raw_tcp_seconds(hosts[0], hosts[1], size))
    raw_s, transport_s = min(raws), min(transports)
    best = {streams: min(reports, key=lambda r: r["seconds"]) for streams, reports in copies.items()}
    print(f"raw TCP, one connection (sendfile out, receiver discarding): {raw_s:.2f}s ({size / raw_s / 1e6:.0f} MB/s)")
    print(f"relay transport, one connection, into files, nothing hashed: {transport_s:.2f}s "
          f"({size / transport_s / 1e6:.0f} MB/s)")
    for streams, copy in best.items():
        print(f"relay fetch, {streams} stream(s) per file, every file hashed, checked and in place: {copy['seconds']:.2f}s "
              f"({size / copy['seconds'] / 1e6:.0f} MB/s; bytes landing {copy['transfer_seconds']:.2f}s of it, "
              "summed over files)")
    results["stream_vs_raw_tcp"] = raw_s / transport_s
    results["copy_with_verify_vs_raw_tcp"] = raw_s / min(copy["seconds"] for copy in best.values())


def hop_times(reports: list[dict]) -> tuple[float, float]:
    """From a chain's reports (fleet order): (the last host's median seconds between
    consecutive shards — one shard-time on a busy link —, the median seconds a shard
    takes from one host's ready to the next host's: that shard-time plus the hop's
    overhead)."""
    def ready(r: dict) -> dict[str, float]:
        return {f: r["started"] + t for f, t in r["ready_at"].items()}

    last = sorted(ready(reports[-1]).values())
    cycles = sorted(b - a for a, b in zip(last, last[1:]))
    hops = sorted(ready(b)[f] - ready(a)[f] for a, b in zip(reports, reports[1:]) for f in ready(a))
    return cycles[len(cycles) // 2], hops[len(hops) // 2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="200mbit")
    p.add_argument("--shard-mib", type=int, default=16)
    p.add_argument("--shards", type=int, default=62)
    p.add_argument("--only", choices=("stream", "fleet"), help="run one phase (for tuning; no ratios line)")
    p.add_argument("--keep", action="store_true", help="leave the sandbox fleet up (for tuning)")
    p.add_argument("--workdir", type=Path, default=Path("/var/tmp/k2fleet-distribution-bench"))
    p.add_argument("--short", action="store_true", help="8 shards of 1 MiB on 100mbit links (the test suite's run)")
    args = p.parse_args()
    if args.short:
        args.shards, args.shard_mib, args.rate = 8, 1, "100mbit"
    src = ensure_synthetic_checkpoint(args.workdir / "source", "k2fleet-bench/Kimi-K2-Thinking", "b" * 40,
                                      num_shards=args.shards, shard_bytes=args.shard_mib << 20)
    manifest = json.loads((src / ".k2fleet/manifest.json").read_text())
    files = sorted(manifest["files"])
    size = sum(e["size"] for e in manifest["files"].values())
    bandwidth = rate_bytes(args.rate)
    limit = size / bandwidth
    print(f"checkpoint: {len(files)} files, {size / 1e9:.2f} GB; links {args.rate} = {bandwidth / 1e6:.1f} MB/s; "
          f"link limit S/B = {limit:.1f}s")
    lock = sandbox.hold_sandbox_lock()
    results: dict[str, float] = {}
    try:
        sandbox.down()
        hosts = sandbox.up(5, docker=False)
        fleet = RelayFleet(src, hosts)
        fleet.start()
        if args.only != "fleet":
            stream_phase(fleet, hosts, size, results)
        if args.only != "stream":
            sandbox.shape(args.rate)
            for n in (3, 5):
                fleet.reset(hosts[:n])
                t_pipe, reports = fleet.pipelined(hosts[:n], swarm.fanout_for(n))
                fleet.reset(hosts[:n])
                t_tree = fleet.doubling_tree(hosts[:n])
                results[f"pipelined_{n}"], results[f"tree_{n}"] = t_pipe / limit, t_tree / limit
                kind = "chain" if swarm.fanout_for(n) == 1 else f"{swarm.fanout_for(n)} trees"
                print(f"{n} hosts: pipelined ({kind}) {t_pipe:.1f}s = {t_pipe / limit:.3f} × S/B; "
                      f"doubling tree {t_tree:.1f}s = {t_tree / limit:.3f} × S/B")
                if n == 5:
                    cycle, hop = hop_times(reports)
                    startup = t_pipe - max(r["seconds"] for r in reports)
            fleet.reset(hosts[:5])
            t_trees, _ = fleet.pipelined(hosts[:5], 2)
            results["trees_5"] = t_trees / limit
            print(f"5 hosts: pipelined (2 trees) {t_trees:.1f}s = {t_trees / limit:.3f} × S/B")
        fleet.stop()
    finally:
        sandbox.shape("off")
        if not args.keep:
            sandbox.down()
        lock.close()
    if args.only == "stream":
        return 0
    sizes = [manifest["files"][f]["size"] for f in files]
    shard = max(sizes)
    rate, hop_s = shard / cycle, max(0.0, hop - cycle)
    print(f"measured on the 5-host chain: a {shard / 2**20:.0f} MiB shard every {cycle:.3f}s on a busy link "
          f"({rate / 1e6:.1f} MB/s), {hop_s:.3f}s more per hop (ready to ready {hop:.3f}s), start-up {startup:.2f}s")
    for n, fanouts in ((5, (1, 2)), (16, (1, 2, 4)), (64, (1, 2, 4)), (256, (2,))):
        for k in fanouts:
            t = swarm.simulate(n, sizes, rate, k, hop_s=hop_s, step=limit / (3000 if n <= 64 else 1500)) + startup
            print(f"simulated {n} hosts, {'chain' if k == 1 else f'{k} trees'}: {t:.1f}s = {t / limit:.3f} × S/B"
                  + (" (the deploy's plan)" if k == swarm.fanout_for(n) else ""))
            if k == swarm.fanout_for(n):
                results[f"simulated_{n}"] = t / limit
    print(f"(3-host runs: pipelined {results['pipelined_3']:.3f}, tree {results['tree_3']:.3f}; "
          f"5 hosts in 2 trees {results['trees_5']:.3f}; simulated 16: {results['simulated_16']:.3f}, "
          f"256: {results['simulated_256']:.3f})")
    if args.only:
        return 0
    print(f"ratios: distribution_vs_link_limit={results['pipelined_5']:.3f} tree_vs_link_limit={results['tree_5']:.3f} "
          f"stream_vs_raw_tcp={results['stream_vs_raw_tcp']:.3f} "
          f"copy_with_verify_vs_raw_tcp={results['copy_with_verify_vs_raw_tcp']:.3f} "
          f"simulated_64_vs_link_limit={results['simulated_64']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
