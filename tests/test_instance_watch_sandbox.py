"""A multi-host instance fails as one, on a rehearsed fleet (real systemd, real pyinfra, the
vLLM engine TEST DOUBLE's ``--nnodes`` rendezvous over the sandbox network): the seed
``inventories/h200-k2-0905.py`` (TP8 × PP2 over two hosts, ``--headless`` node 1).

- The head's engine process is killed: the rank's watchdog stops the rank while the head is
  down (the rank is inactive before the head starts again), then starts it after the head:
  the instance answers a completion again.
- The rank's engine process is killed: the head's watchdog sees the rank host's connection
  to ``--master-port`` gone and stops and starts the head although its process was alive;
  the rank starts after it; the instance answers again.

The hosts share one kernel, so systemd's monotonic timestamps compare across hosts.
"""

from __future__ import annotations

import time

import pytest

from k2sandbox.harness import http_json, ssh
from tests.test_rehearse_restart import Kept, lock  # noqa: F401 - the sandbox lock fixture

pytestmark = pytest.mark.sandbox
ENGINE, WATCH = "k2-vllm.service", "k2-vllm-watch.service"


def show(host: dict, unit: str) -> dict[str, str]:
    props = "-p InvocationID -p ActiveState -p MainPID -p ActiveEnterTimestampMonotonic -p InactiveEnterTimestampMonotonic"
    out = ssh(host, f"systemctl show {props} {unit}").stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def now_monotonic(host: dict) -> int:
    """The shared kernel's CLOCK_MONOTONIC in µs, as systemd stamps units."""
    return int(float(ssh(host, "cat /proc/uptime").stdout.split()[0]) * 1e6)


def serves(url: str, model: str) -> bool:
    try:
        status, body = http_json(f"{url}/v1/chat/completions", {"model": model, "max_tokens": 4,
                                                                 "messages": [{"role": "user", "content": "hi"}]}, 10)
    except OSError:
        return False
    return status == 200 and bool(body.get("choices"))


def engines(host: dict) -> int:
    """How many engine (double) processes the host runs, by ps."""
    return len([l for l in ssh(host, "ps -eo args", check=False).stdout.splitlines() if " serve " in l and "vllm" in l])


def journal(host: dict, unit: str) -> str:
    return ssh(host, f"journalctl -u {unit} --no-pager -o cat", check=False).stdout


def wait_formed(kept: Kept, url: str, model: str, head_before: dict, rank_before: dict, timeout: float = 120):
    deadline = time.monotonic() + timeout
    head, rank = kept.hosts["h200-0"], kept.hosts["h200-1"]
    while time.monotonic() < deadline:
        h, r = show(head, ENGINE), show(rank, ENGINE)
        if (h["InvocationID"] != head_before["InvocationID"] and r["InvocationID"] != rank_before["InvocationID"]
                and h["ActiveState"] == r["ActiveState"] == "active" and serves(url, model)):
            return h, r
        time.sleep(1)
    pytest.fail(f"the instance did not restart and serve again: head {show(head, ENGINE)}, rank {show(rank, ENGINE)}\n"
                f"{journal(rank, WATCH)[-1500:]}\n{journal(head, WATCH)[-1500:]}")


def test_a_dead_head_or_rank_restarts_the_whole_instance_head_first(lock) -> None:  # noqa: F811
    kept = Kept(lock, "inventories/h200-k2-0905.py", 1)
    head, rank = kept.hosts["h200-0"], kept.hosts["h200-1"]
    url = f"http://{head['address']}:8000"
    status, models = http_json(f"{url}/v1/models")
    assert status == 200, models
    model = models["data"][0]["id"]
    assert serves(url, model)
    assert show(rank, WATCH)["ActiveState"] == "active" and show(head, WATCH)["ActiveState"] == "active"
    assert engines(head) == 1 and engines(rank) == 1

    # 1. the head's engine dies: the rank stops while the head is down, starts after it
    h0, r0 = show(head, ENGINE), show(rank, ENGINE)
    killed_at = now_monotonic(head)
    ssh(head, f"kill -9 {h0['MainPID']}")
    h1, r1 = wait_formed(kept, url, model, h0, r0)
    stopped = int(r1["InactiveEnterTimestampMonotonic"])
    assert killed_at < stopped < int(h1["ActiveEnterTimestampMonotonic"]), (killed_at, r1, h1)  # no rank without a head
    assert int(h1["ActiveEnterTimestampMonotonic"]) <= int(r1["ActiveEnterTimestampMonotonic"]), (h1, r1)
    assert "gone" in journal(rank, WATCH) and "is back: started" in journal(rank, WATCH)
    assert engines(head) == 1 and engines(rank) == 1

    # 2. the rank's engine dies: the head (alive) is stopped and started, then the rank
    killed_at = now_monotonic(rank)
    ssh(rank, f"kill -9 {r1['MainPID']}")
    h2, r2 = wait_formed(kept, url, model, h1, r1)
    assert killed_at < int(h2["InactiveEnterTimestampMonotonic"]) < int(h2["ActiveEnterTimestampMonotonic"])
    assert int(h2["ActiveEnterTimestampMonotonic"]) <= int(r2["ActiveEnterTimestampMonotonic"]), (h2, r2)
    assert "left the instance" in journal(head, WATCH)
    assert engines(head) == 1 and engines(rank) == 1

    # the fleet is as the deploy wants it: a re-run changes nothing
    again = kept.deploy()
    assert again.returncode == 0 and again.changed == 0, again.changed_operations
