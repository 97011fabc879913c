"""Benchmark checkpoint distribution at the link limit (root; not a pytest test).

On 3 and 5 sandbox hosts whose links are shaped (``k2fleet sandbox shape RATE``: htb on
each host's veth, both directions, ACKs ahead of bulk) and a ~1 GB synthetic checkpoint
(62 shards of 16 MiB, Kimi-K2-Thinking's layout) served by the control machine's
verified copy on the sandbox bridge, measured in one run:

* **pipelined**: every host fetches at once with :mod:`k2fleet.hostprogs.relay`, with the argv
  the deploy runs (:func:`k2fleet.planning.relay_plan.relay_fetch_argv`, the plan
  :func:`k2fleet.hostprogs.swarm.fanout_for` picks: a chain for these sizes, and the control
  copy's pinned pieces, ``relay pieces``), each shard from its parent piece by piece as the
  parent verifies each piece (1 MiB pieces of a 16 MiB shard); on 5 hosts also in 2 trees (the
  plan of larger fleets), to check the simulation of trees against a measurement;
* **doubling tree**: the old schedule (:mod:`k2fleet.control.checkpoint_copy`): round by round,
  a host copies the whole checkpoint from its parent once the parent holds all of it (the
  same relay transport, so only the schedule differs);
* **from the Hub** (``hub_to_fleet_vs_link_limit``): the Hub test double
  (:mod:`k2sandbox.hub_double`) on the sandbox bridge, behind the fetcher host's shaped link;
  the fetcher downloads with the deploy's argv (``download.py --publish``: each file
  verified, then served by its relay) while two receivers fetch through the relay chain
  from it at the same moment. Fleet-ready time ÷ (S / min(hub link, fleet link)); both
  links are the shaped rate here;
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
time. Larger fleets are simulated (:func:`k2sandbox.relay_fleet.simulate`) from the
5-host chain's measured per-shard time on a busy link, extra per-hop delay and start-up,
for chains and k trees, shards passed on piece by piece as measured; the figure for each
size is the deploy's plan.

    python bench/distribution_bench.py [--rate 200mbit] [--shard-mib 16] [--shards 62] [--only stream|fleet]
    python bench/distribution_bench.py --short   # the suite's run: 8 shards of 2 MiB, 100mbit, one round, 5 hosts, the plan simulated

Ends with ``ratios: distribution_vs_link_limit=X tree_vs_link_limit=X hub_to_fleet_vs_link_limit=X stream_vs_raw_tcp=X
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
from k2sandbox.relay_fleet import HOST_DIR, RelayFleet, simulate, url  # noqa: E402
from k2fleet.planning import relay_plan  # noqa: E402
from verify_bench import prefault  # noqa: E402  (bench/ is on sys.path as this script's directory)

RATES = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8}
REPO, REVISION = "k2fleet-bench/Kimi-K2-Thinking", "b" * 40
HUB_HOSTS = 3  # the fetcher and two receivers
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


def stream_phase(fleet: RelayFleet, hosts: list[sandbox.SandboxHost], size: int, results: dict[str, float],
                 rounds: int = ROUNDS) -> None:
    """One host-to-host copy vs raw TCP between the same hosts, unshaped, ``rounds`` times
    over, the best of each: the relay's transport alone (``stream_vs_raw_tcp``), and a
    relay fetch with every file hashed, checked and in place, with 1 and 4 range streams
    per file (``copy_with_verify_vs_raw_tcp``: the better stream count)."""
    fleet.reset(hosts[:2])
    fleet.run_fetches({hosts[0].name: fleet.fetch_argv(hosts[0], None, [url(sandbox.BRIDGE_ADDRESS)])})
    copies: dict[int, list[dict]] = {1: [], 4: []}
    raws, transports = [], []
    for _ in range(rounds):
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


HUB_SITE = "/opt/k2fleet/bench-hubclient"  # on the fetcher host: the control machine's huggingface_hub and its deps


def hub_client_tar() -> bytes:
    """huggingface_hub and every package it requires, from this interpreter's site-packages, as
    a tar (the sandbox hosts run the same Debian and Python: what the deploy's offline
    wheelhouse would install there, without building one)."""
    import io
    import re
    import tarfile
    from importlib.metadata import PackageNotFoundError, distribution

    files: set[Path] = set()
    seen: set[str] = set()
    todo = ["huggingface_hub"]
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue  # an optional dependency for another Python
        base = Path(str(dist.locate_file("")))
        files |= {base / f for f in dist.files or [] if not str(f).startswith("..")}
        todo += [re.split(r"[ ;<>=!~\[(]", r)[0] for r in dist.requires or [] if "extra ==" not in r]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for f in sorted(files):
            if f.is_file() and "__pycache__" not in f.parts:
                tar.add(f, arcname=str(f.relative_to(base)))
    return buf.getvalue()


def hub_phase(fleet: RelayFleet, hosts: list[sandbox.SandboxHost], src: Path, repo: str, revision: str) -> tuple[float, dict]:
    """The Hub to the fleet, pipelined, as the deploy runs it with a fetcher host: the Hub
    test double on the sandbox bridge (behind the fetcher's shaped link), ``hosts[0]``
    downloads with the deploy's argv (:func:`k2fleet.deploy.roles.checkpoint.download_argv`:
    ``--publish``, the receivers' order) into the directory its relay serves, while the
    others fetch through the relay chain from it at the same moment (the deploy's one
    operation). Seconds until every host holds the verified checkpoint, and the
    receivers' reports."""
    from k2sandbox.hub_double import HubDouble
    from k2fleet.deploy.roles.checkpoint import FETCHER_WORKERS

    fetcher = hosts[0]
    untar = sandbox.ssh_command(fetcher, f"rm -rf {HUB_SITE} && mkdir -p {HUB_SITE} && tar -xzf - -C {HUB_SITE}")
    import subprocess

    put = subprocess.run(untar, input=hub_client_tar(), capture_output=True)
    assert put.returncode == 0, put.stderr
    with HubDouble(host=sandbox.BRIDGE_ADDRESS) as hub:
        hub.add_commit(repo, src, sha=revision)
        download = (f"PYTHONPATH={HUB_SITE} HF_ENDPOINT={hub.url} HF_HUB_DISABLE_TELEMETRY=1 HF_HUB_DISABLE_PROGRESS_BARS=1 "
                    f"/usr/bin/python3 {ARCHIVE} download {shlex.quote(repo)} --revision {revision} --dir {HOST_DIR} "
                    f"--publish --max-workers {FETCHER_WORKERS} >/dev/null && echo '{{}}'")
        relays = [url(h.address) for h in hosts]
        lines = {fetcher.name: download}
        for i, h in enumerate(hosts[1:], start=1):
            lines[h.name] = shlex.join(relay_plan.relay_fetch_argv(HOST_DIR, relays, i, swarm.fanout_for(len(hosts)), [],
                                                                   log_file="/var/log/k2fleet/relay-bench.jsonl",
                                                                   pin=(repo, revision), secret_file=None))
        t0 = time.monotonic()
        reports = fleet.run_fetches(lines)
        seconds = time.monotonic() - t0
        served = sum(hub.bytes_served.values())
    size = sum(e["size"] for e in json.loads((src / ".k2fleet/manifest.json").read_text())["files"].values())
    assert served == size, (served, size)  # the Hub sent each byte once, to the fetcher only
    for h in hosts:
        check = sandbox.ssh(h, f"/usr/bin/python3 {ARCHIVE} verify {HOST_DIR} --marker-only")
        assert check.returncode == 0, (h.name, check.stdout, check.stderr)
    return seconds, reports


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
    p.add_argument("--short", action="store_true",
                   help="the test suite's run: 8 shards of 2 MiB on 100mbit links, one round of unshaped copies, "
                        "the 5-host fleet only, and only the deploy's own plan simulated")
    args = p.parse_args()
    if args.short:  # shards of 2 pieces: passed on piece by piece, as the full run's are
        args.shards, args.shard_mib, args.rate = 8, 2, "100mbit"
    # one directory per shape (ensure_synthetic_checkpoint keys it): a --short run never moves a full run's
    src = ensure_synthetic_checkpoint(args.workdir / "source", REPO, REVISION,
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
        pinned_pieces = fleet.pieces_digest is not None
        if args.only != "fleet":
            stream_phase(fleet, hosts, size, results, rounds=1 if args.short else ROUNDS)
        if args.only != "stream":
            sandbox.shape(args.rate)
            for n in ((5,) if args.short else (3, 5)):
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
            fleet.reset(hosts[:HUB_HOSTS])
            t_hub, _ = hub_phase(fleet, hosts[:HUB_HOSTS], src, REPO, REVISION)
            results["hub_to_fleet"] = t_hub / limit  # the Hub's link (the fetcher's) and the fleet's: both B
            print(f"{HUB_HOSTS} hosts from the Hub double behind the fetcher's shaped link, pipelined: {t_hub:.1f}s "
                  f"= {t_hub / limit:.3f} × S/min(hub link, fleet link)")
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
    # time steps per S/B: the short run's 10x coarser (measured on the short run's shards: 64 hosts in
    # 2 trees 2.823 -> 2.875 x S/B, 11 s -> 1 s of one core; 256 hosts 3.259 -> 3.387, 116 s -> 6 s)
    steps = 300 if args.short else 3000
    for n, fanouts in ((5, (1, 2)), (16, (1, 2, 4)), (64, (1, 2, 4)), (256, (2,))):
        for k in (k for k in fanouts if k == swarm.fanout_for(n) or not args.short):
            t = simulate(n, sizes, rate, k, hop_s=hop_s, step=limit / (steps if n <= 64 else steps // 2),
                         pieces=pinned_pieces) + startup
            print(f"simulated {n} hosts, {'chain' if k == 1 else f'{k} trees'}: {t:.1f}s = {t / limit:.3f} × S/B"
                  + (" (the deploy's plan)" if k == swarm.fanout_for(n) else ""))
            if k == swarm.fanout_for(n):
                results[f"simulated_{n}"] = t / limit
    print(", ".join(f"{name} {value:.3f}" for name, value in results.items()
                    if name in ("pipelined_3", "tree_3", "trees_5", "simulated_16", "simulated_256")) + " (× S/B)")
    if args.only:
        return 0
    print(f"ratios: distribution_vs_link_limit={results['pipelined_5']:.3f} tree_vs_link_limit={results['tree_5']:.3f} "
          f"hub_to_fleet_vs_link_limit={results['hub_to_fleet']:.3f} "
          f"stream_vs_raw_tcp={results['stream_vs_raw_tcp']:.3f} "
          f"copy_with_verify_vs_raw_tcp={results['copy_with_verify_vs_raw_tcp']:.3f} "
          f"simulated_64_vs_link_limit={results['simulated_64']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
