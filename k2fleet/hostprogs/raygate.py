#!/usr/bin/env python3
"""k2fleet Ray gate, run ON the Ray head before the engine that drives the cluster starts
(``ExecStartPre`` of its unit): wait until the real Ray cluster reports every planned
node alive with its planned GPUs, or fail naming the node that never joined.

    k2fleet-host.pyz raygate --address 10.0.0.1:6379 --unit k2-vllm.service --timeout 600 \\
        --node h800-0=10.0.0.1:8 --node h800-1=10.0.0.2:8

Run it with the engine venv's python (``k2_venv/bin/python3``): ``ray`` is imported from there (the only import
outside the standard library). The cluster is asked through Ray's own API (``ray.init(address=...)`` +
``ray.nodes()``), polled twice a second — the gate never sleeps a fixed time. Exit 0 and one line when the
cluster is complete; exit 1 with ``HOST: UNIT: Ray node NAME (ADDRESS) ...`` naming each missing node otherwise.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import time


def planned_node(text: str) -> tuple[str, str, int]:
    """``NAME=ADDRESS:GPUS`` → (name, address, GPUs).

    >>> planned_node("h800-1=10.0.0.2:8")
    ('h800-1', '10.0.0.2', 8)
    """
    name, _, rest = text.partition("=")
    address, _, gpus = rest.rpartition(":")
    if not name or not address or not gpus.isdigit():
        raise argparse.ArgumentTypeError(f"expected NAME=ADDRESS:GPUS, got {text!r}")
    return name, address, int(gpus)


def missing_nodes(planned: list[tuple[str, str, int]], nodes: list[dict]) -> list[str]:
    """What differs between the planned nodes and ``ray.nodes()``: one phrase per node.

    >>> alive = [{"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"GPU": 8.0}}]
    >>> missing_nodes([("a", "10.0.0.1", 8), ("b", "10.0.0.2", 8)], alive)
    ['Ray node b (10.0.0.2) has not joined']
    >>> missing_nodes([("a", "10.0.0.1", 8)], [dict(alive[0], Resources={"GPU": 4.0})])
    ['Ray node a (10.0.0.1) joined with 4 GPUs, planned 8']
    """
    alive = {n.get("NodeManagerAddress"): n for n in nodes if n.get("Alive")}
    problems = []
    for name, address, gpus in planned:
        node = alive.get(address)
        if node is None:
            problems.append(f"Ray node {name} ({address}) has not joined")
            continue
        have = int((node.get("Resources") or {}).get("GPU", 0))
        if have != gpus:
            problems.append(f"Ray node {name} ({address}) joined with {have} GPUs, planned {gpus}")
    return problems


def wait_for_cluster(address: str, planned: list[tuple[str, str, int]], timeout: float) -> list[str]:
    """Poll the cluster until every planned node is alive with its GPUs; [] or the problems."""
    import ray  # the engine venv's real Ray

    deadline = time.monotonic() + timeout
    problems = [f"the Ray head at {address} never answered"]
    connected = False
    while time.monotonic() < deadline:
        try:
            if not connected:
                ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
                connected = True
            problems = missing_nodes(planned, ray.nodes())
        except Exception as exc:  # noqa: BLE001 - the head not up yet; keep polling until the deadline
            problems = [f"the Ray head at {address} did not answer: {exc}"]
        if not problems:
            break
        time.sleep(0.5)
    if connected:
        ray.shutdown()
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="raygate")
    ap.add_argument("--address", required=True, help="HEAD:PORT of the Ray cluster's GCS")
    ap.add_argument("--unit", required=True, help="the unit this gate guards (named in failures)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--node", type=planned_node, action="append", required=True, help="NAME=ADDRESS:GPUS, planned")
    args = ap.parse_args(argv)
    problems = wait_for_cluster(args.address, args.node, args.timeout)
    me = socket.gethostname()
    if problems:
        for problem in problems:
            print(f"{me}: {args.unit}: {problem} within {args.timeout:.0f}s (Ray cluster {args.address})",
                  file=sys.stderr, flush=True)
        return 1
    names = ", ".join(f"{name} ({gpus} GPUs)" for name, _, gpus in args.node)
    print(f"{me}: {args.unit}: Ray cluster {args.address} complete: {names}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
