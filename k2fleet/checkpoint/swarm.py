"""Pipelined distribution plans (pure): who passes which shard to whom.

The doubling tree (:mod:`k2fleet.checkpoint.fanout`) moves whole checkpoints in rounds:
1 + ⌈log2 N⌉ transfer times. Here every shard moves on its own as soon as a host has
verified it (:mod:`k2fleet.host.relay`), so hosts work at once:

- ``fanout=1``: a chain source → h1 → h2 → … (each link carries the checkpoint once; the
  last host finishes N-1 shard-times after the first);
- ``fanout=k ≥ 2``: per shard a k-ary tree over the hosts in an order rotated by the
  shard's index (SplitStream's idea): shard j's tree has depth ⌈log_k N⌉ and its interior
  hosts are a different ~N/k hosts for each j, so every host forwards about one
  checkpoint's worth in all while the last host finishes only a few shard-times after S/B.

Each host gets, per shard, its parent first and then fallbacks (the parent's ancestors,
then the source), so a dead host is routed around. :func:`simulate` is a fluid model of a
plan on links of one bandwidth (each host's ingress and egress shared fairly among its
transfers) for fleets too large to measure.

>>> plan = plan_sources(["a", "b", "c", "d"], ["s0", "s1", "s2"], fanout=1)
>>> plan["c"]["s0"]
['b', 'a', None]
>>> sorted({p["s1"][0] for p in plan_sources(["a", "b", "c"], ["s0", "s1"], fanout=2).values()}, key=str)
[None, 'c']
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SOURCE = None  # a parent that is the source (the control machine's verified copy)


def shard_order(hosts: Sequence[str], shard_index: int, fanout: int) -> list[str]:
    """The host order of one shard's tree: a chain keeps the fleet order; a k-ary tree
    rotates it so that consecutive shards take their interior hosts (the first ~n/k of
    the order) from different stripes of the fleet, SplitStream-like: each host forwards
    k copies of about 1/k of the shards, and no host forwards two shards in a row."""
    if fanout <= 1 or not hosts:
        return list(hosts)
    stripe = -(-len(hosts) // fanout)  # interior hosts of one tree: about n/k; stripes take turns
    r = (shard_index % fanout) * stripe + (shard_index // fanout) % stripe
    r %= len(hosts)
    return list(hosts[r:]) + list(hosts[:r])


CHAIN_MAX_HOSTS = 16  # up to here a chain's N-1 extra shard-times stay small against S/B


def fanout_for(hosts: int) -> int:
    """The plan the deploy uses for a fleet of ``hosts`` that load weights: a chain up
    to :data:`CHAIN_MAX_HOSTS` (every host forwards each shard once, finishing N-1
    shard-times after the first), per-shard binary trees beyond (depth ⌈log2 N⌉, each
    host forwarding about one checkpoint in all). ``bench/distribution_bench.py``
    simulates both from measured shard times.

    >>> fanout_for(3), fanout_for(16), fanout_for(64)
    (1, 1, 2)
    """
    return 1 if hosts <= CHAIN_MAX_HOSTS else 2


def parent_position(position: int, fanout: int) -> int | None:
    """Parent position in a k-ary heap (None: the root, fed by the source)."""
    if position == 0:
        return None
    return position - 1 if fanout <= 1 else (position - 1) // fanout


def plan_sources(hosts: Sequence[str], shards: Sequence[str], fanout: int = 1) -> dict[str, dict[str, list[str | None]]]:
    """host → shard → sources to try in order: parent, its ancestors, then the source (None)."""
    plan: dict[str, dict[str, list[str | None]]] = {h: {} for h in hosts}
    for j, shard in enumerate(shards):
        order = shard_order(hosts, j, fanout)
        for pos, host in enumerate(order):
            chain: list[str | None] = []
            p = parent_position(pos, fanout)
            while p is not None:
                chain.append(order[p])
                p = parent_position(p, fanout)
            plan[host][shard] = [*chain, SOURCE]
    return plan


def depth(n: int, fanout: int) -> int:
    """Hops from the source to the deepest host of one shard's tree.

    >>> depth(64, 1), depth(64, 4), depth(256, 4)
    (64, 4, 5)
    """
    if n <= 0:
        return 0
    if fanout <= 1:
        return n
    d, reach, level = 0, 0, 1
    while reach < n:
        reach += level
        level *= fanout
        d += 1
    return d


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


def simulate(n: int, sizes: Sequence[int], bandwidth: float, fanout: int, verify_rate: float = math.inf,
             step: float | None = None, inflight_max: int = 2, source_uploads: int = 1) -> float:
    """Seconds until every one of ``n`` hosts holds every shard (``sizes`` bytes each),
    when every link (the source's too) has ``bandwidth`` bytes/s in each direction,
    shared fairly among a host's concurrent transfers, and a shard is passed on only
    after ``bytes / verify_rate`` seconds of hashing on the receiver. A host takes its
    shards in plan order, at most ``inflight_max`` at once; a sender serves the earliest
    shards first, at most ``fanout`` at once (the source ``source_uploads``: shards leave
    it one after the other at full rate); concurrent transfers share links max-min fairly
    (:func:`max_min_rates`). Fluid, time-stepped.

    >>> round(simulate(1, [100] * 10, 100.0, 1), 1)
    10.0
    """
    hosts = [f"h{i}" for i in range(n)]
    shards = [f"s{j}" for j in range(len(sizes))]
    plan = plan_sources(hosts, shards, fanout)
    size = dict(zip(shards, sizes))
    total = sum(sizes)
    dt = step or max(total / bandwidth / 2000, 1e-3)
    have: dict[tuple[str | None, str], float] = {(SOURCE, s): 0.0 for s in shards}  # (host, shard) → ready time
    got = {(h, s): 0.0 for h in hosts for s in shards}
    done_at: dict[tuple[str, str], float] = {}
    t = 0.0
    while len(have) < len(shards) * (n + 1):
        wanted = []  # (shard index, receiver, shard, parent): what each receiver would take now
        for h in hosts:
            inflight = 0
            for j, s in enumerate(shards):
                if (h, s) in have or (h, s) in done_at:
                    continue
                parent = plan[h][s][0]
                if (parent, s) in have and have[(parent, s)] <= t:
                    if parent is SOURCE:  # the source's bytes are the critical path: nothing beside them
                        wanted = [w for w in wanted if w[1] != h]
                        wanted.append((j, h, s, parent))
                        break
                    wanted.append((j, h, s, parent))
                    inflight += 1
                    if inflight == inflight_max:
                        break
        active = []  # (receiver, shard, parent): each sender serves its earliest shards first, a few at once
        serving: dict[str | None, int] = {}
        for j, h, s, parent in sorted(wanted, key=lambda w: (w[0], w[1])):
            cap = source_uploads if parent is SOURCE else max(1, fanout)
            if serving.get(parent, 0) < cap:
                serving[parent] = serving.get(parent, 0) + 1
                active.append((h, s, parent))
        rates = max_min_rates([(("in", h), ("out", p)) for h, _, p in active], bandwidth)
        for (h, s, p), rate in zip(active, rates):
            got[(h, s)] += rate * dt
            if got[(h, s)] >= size[s]:
                done_at[(h, s)] = t + dt
        t += dt
        for (h, s), when in list(done_at.items()):
            have[(h, s)] = when + size[s] / verify_rate
            del done_at[(h, s)]
        if t > 1e7:
            raise RuntimeError("simulation did not converge")
    return max(have.values())
