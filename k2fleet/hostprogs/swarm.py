"""Pipelined distribution plans (pure): who passes which shard to whom.

The doubling tree (:mod:`k2fleet.control.checkpoint_copy`) moves whole checkpoints in rounds:
1 + ⌈log2 N⌉ transfer times. Here every shard moves on its own as soon as a host has
verified it (:mod:`k2fleet.hostprogs.relay`), so hosts work at once:

- ``fanout=1``: a chain source → h1 → h2 → … (each link carries the checkpoint once; the
  last host finishes N-1 shard-times after the first);
- ``fanout=k ≥ 2``: k fixed k-ary trees with disjoint interiors (SplitStream's idea),
  shard j down tree j mod k: each tree has depth ⌈log_k N⌉, every host forwards the
  shards of one tree (about one checkpoint's worth in all) and receives each tree's
  shards from one parent, so the last host finishes k·depth shard-times after S/B
  rather than the chain's N.

Each host gets, per shard, its parent first and then fallbacks (the parent's ancestors,
then the source), so a dead host is routed around. (A fluid model of a plan, for fleets too
large to measure, is the distribution bench's: :func:`k2sandbox.relay_fleet.simulate`.)

>>> plan = plan_sources(["a", "b", "c", "d"], ["s0", "s1", "s2"], fanout=1)
>>> plan["c"]["s0"]
['b', 'a', None]
>>> sorted({p["s1"][0] for p in plan_sources(["a", "b", "c"], ["s0", "s1"], fanout=2).values()}, key=str)
[None, 'b']
"""

from __future__ import annotations

from collections.abc import Sequence

SOURCE = None  # a parent that is the source (the control machine's verified copy)


def shard_order(hosts: Sequence[str], shard_index: int, fanout: int) -> list[str]:
    """The host order of one shard's tree: a chain keeps the fleet order; with k-ary trees shard j goes down
    tree j mod k, the fleet order rotated by (j mod k)·⌈(n-1)/k⌉. A k-ary heap's interior hosts are its first
    ⌈(n-1)/k⌉ positions, so the k trees have disjoint interiors (SplitStream) when k of them fit in n
    (:func:`disjoint`): every host forwards the shards of one tree only, k copies of about 1/k of the
    checkpoint, and receives each tree's shards from one fixed parent.

    >>> shard_order(list("abcd"), 1, 2), shard_order(list("abcd"), 2, 2)
    (['c', 'd', 'a', 'b'], ['a', 'b', 'c', 'd'])
    >>> shard_order(list("abcde"), 1, 2)
    ['c', 'd', 'e', 'a', 'b']
    """
    if fanout <= 1 or not hosts:
        return list(hosts)
    r = (shard_index % fanout) * interior(len(hosts), fanout) % len(hosts)
    return list(hosts[r:]) + list(hosts[:r])


def interior(hosts: int, fanout: int) -> int:
    """Hosts with children in a ``fanout``-ary heap of ``hosts``: ⌈(n-1)/k⌉."""
    return -(-(hosts - 1) // max(1, fanout)) if hosts > 1 else 0


def disjoint(hosts: int, fanout: int) -> bool:
    """Whether ``fanout`` trees over ``hosts`` can have disjoint interiors (each host
    forwarding for one tree only): k·⌈(n-1)/k⌉ ≤ n.

    >>> disjoint(5, 2), disjoint(5, 3), disjoint(16, 3)
    (True, False, True)
    """
    return fanout <= 1 or fanout * interior(hosts, fanout) <= hosts


FANOUTS = (1, 2, 3, 4)


def hop_cost(hosts: int, fanout: int) -> int:
    """Shard-times the last host of a plan finishes after S/B, roughly: each of the
    :func:`depth` hops from the source waits for one whole shard (verified before it is
    passed on), and a shard moves at 1/k of a link when k trees share each host's links.

    >>> hop_cost(5, 1), hop_cost(5, 2), hop_cost(64, 1), hop_cost(64, 2)
    (5, 6, 64, 14)
    """
    return max(1, fanout) * depth(hosts, fanout)


def fanout_for(hosts: int) -> int:
    """The plan the deploy uses for a fleet of ``hosts`` that load weights: the k (1: a
    chain) of least :func:`hop_cost`, a chain on ties. ``bench/distribution_bench.py``
    measures a chain and simulates the rest from measured shard times.

    >>> fanout_for(3), fanout_for(8), fanout_for(9), fanout_for(64), fanout_for(256)
    (1, 1, 2, 2, 2)
    """
    return min((k for k in FANOUTS if disjoint(hosts, k)), key=lambda k: (hop_cost(hosts, k), k))


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
