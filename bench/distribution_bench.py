"""Benchmark checkpoint distribution at the link limit (root; not a pytest test).

On 3 and 5 sandbox hosts whose links are shaped (``k2fleet sandbox shape RATE``: tc tbf
on each host's veth, both directions) and a ~1 GB synthetic checkpoint (62 shards of
16 MiB, Kimi-K2-Thinking's layout) served by the control machine's verified copy on the
sandbox bridge, measured in one run:

* **pipelined**: every host fetches at once with :mod:`k2fleet.host.relay`, with the argv
  the deploy runs (:func:`k2fleet.checkpoint.fanout.relay_fetch_argv`, the plan
  :func:`k2fleet.checkpoint.swarm.fanout_for` picks: a chain for these sizes), each shard
  from its parent as soon as the parent verified it;
* **doubling tree**: today's schedule (:mod:`k2fleet.checkpoint.fanout`): round by round,
  a host copies the whole checkpoint from its parent once the parent holds all of it (the
  same relay transport, so only the schedule differs);
* **one stream vs raw TCP** (links unshaped): one host-to-host relay fetch of the
  checkpoint vs the same bytes over one plain TCP connection between the same two hosts:
  ``stream_vs_raw_tcp`` compares the relay's time receiving bytes (its parallel range
  streams), ``copy_with_verify_vs_raw_tcp`` its whole copy, sha256 of every file included
  (hashing is not overlapped with the next file's transfer).

The link limit is S/B (checkpoint bytes ÷ the shaped rate): one host's transfer time.
Larger fleets are simulated (:func:`k2fleet.checkpoint.swarm.simulate`, links of the
shaped rate, hashing at the rate measured on a host) for chains and per-shard k-ary
trees; each size reports the best plan.

    python bench/distribution_bench.py [--rate 200mbit] [--shard-mib 16] [--shards 62]

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

from k2fleet import sandbox  # noqa: E402
from k2fleet.checkpoint import swarm  # noqa: E402
from k2fleet.synthetic import ensure_synthetic_checkpoint  # noqa: E402
from k2fleet.testing.relay_fleet import HOST_DIR, RelayFleet, url  # noqa: E402

RATES = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8}
RAW_TCP_PORT = 29711


def rate_bytes(rate: str) -> float:
    for unit, factor in RATES.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * factor
    raise ValueError(rate)


def raw_tcp_seconds(sender: sandbox.SandboxHost, receiver: sandbox.SandboxHost, nbytes: int) -> float:
    """Seconds for ``nbytes`` over one plain TCP connection sender → receiver (the
    sender reads the checkpoint's files; the receiver discards)."""
    sink = ("import socket,time;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
            f"s.bind(('{receiver.address}',{RAW_TCP_PORT}));s.listen(1);c,_=s.accept();n=0;t=time.monotonic()\n"
            "while True:\n b=c.recv(1<<20)\n if not b: break\n n+=len(b)\n"
            "print(n, time.monotonic()-t)")
    source = ("import socket,os,sys;c=socket.create_connection(('%s',%d))\n"
              "for d,_,fs in os.walk('%s'):\n"
              " for f in sorted(fs):\n"
              "  p=os.path.join(d,f)\n"
              "  if '/.k2fleet' in p: continue\n"
              "  with open(p,'rb') as h:\n"
              "   while True:\n    b=h.read(1<<20)\n    if not b: break\n    c.sendall(b)\n"
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="200mbit")
    p.add_argument("--shard-mib", type=int, default=16)
    p.add_argument("--shards", type=int, default=62)
    p.add_argument("--workdir", type=Path, default=Path("/var/tmp/k2fleet-distribution-bench"))
    args = p.parse_args()
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
        # one stream vs raw TCP, unshaped: h1 gets the checkpoint from the source, h2 from h1
        fleet.reset(hosts[:2])
        fleet.run_fetches({hosts[0].name: fleet.fetch_argv(hosts[0], None, [url(sandbox.BRIDGE_ADDRESS)])})
        report = fleet.run_fetches({hosts[1].name: fleet.fetch_argv(hosts[1], None, [url(hosts[0].address)])})
        copy = report[hosts[1].name]
        relay_s, wire_s = copy["seconds"], copy["transfer_seconds"]  # the relay's own clocks: no ssh start-up
        raw_s = raw_tcp_seconds(hosts[0], hosts[1], size)
        results["stream_vs_raw_tcp"] = raw_s / wire_s
        results["copy_with_verify_vs_raw_tcp"] = raw_s / relay_s
        print(f"one host-to-host copy, unshaped: relay transfer {wire_s:.2f}s ({size / wire_s / 1e6:.0f} MB/s) "
              f"+ sha256 {copy['verify_seconds']:.2f}s = {relay_s:.2f}s ({size / relay_s / 1e6:.0f} MB/s end to end); "
              f"raw TCP {raw_s:.2f}s ({size / raw_s / 1e6:.0f} MB/s)")
        sandbox.shape(args.rate)
        for n in (3, 5):
            fleet.reset(hosts[:n])
            t_pipe = fleet.pipelined(hosts[:n], swarm.fanout_for(n))
            fleet.reset(hosts[:n])
            t_tree = fleet.doubling_tree(hosts[:n])
            results[f"pipelined_{n}"], results[f"tree_{n}"] = t_pipe / limit, t_tree / limit
            print(f"{n} hosts: pipelined chain {t_pipe:.1f}s = {t_pipe / limit:.3f} × S/B; "
                  f"doubling tree {t_tree:.1f}s = {t_tree / limit:.3f} × S/B")
        hash_rate = float(sandbox.ssh(hosts[0], "python3 -c \"import hashlib,time;b=bytes(64<<20);t=time.monotonic();"
                                                "hashlib.sha256(b).digest();print(len(b)/(time.monotonic()-t))\"").stdout)
        fleet.stop()
    finally:
        sandbox.shape("off")
        sandbox.down()
        lock.close()
    sizes = [manifest["files"][f]["size"] for f in files]
    for n in (16, 64, 256):
        best = None
        for k in (1, 2, 4):
            t = swarm.simulate(n, sizes, bandwidth, k, verify_rate=hash_rate, step=limit / 400)
            print(f"simulated {n} hosts, {'chain' if k == 1 else f'{k}-ary per-shard trees'}: {t / limit:.3f} × S/B")
            best = min(best or t, t)
        results[f"simulated_{n}"] = best / limit
    print(f"(host sha256 rate {hash_rate / 1e6:.0f} MB/s; 3-host runs: pipelined {results['pipelined_3']:.3f}, "
          f"tree {results['tree_3']:.3f})")
    print(f"ratios: distribution_vs_link_limit={results['pipelined_5']:.3f} tree_vs_link_limit={results['tree_5']:.3f} "
          f"stream_vs_raw_tcp={results['stream_vs_raw_tcp']:.3f} "
          f"copy_with_verify_vs_raw_tcp={results['copy_with_verify_vs_raw_tcp']:.3f} "
          f"simulated_64_vs_link_limit={results['simulated_64']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
