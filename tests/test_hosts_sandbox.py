"""Issue #36 item 2 on the sandbox: hosts that come and go on a serving fleet. vLLM replicas
(``inventories/sandbox.py``'s fleet data, engine TEST DOUBLES) behind k2fleet's HAProxy load
balancer on the first host, k2fleet's firewall on every host, a client loop through the
load balancer during each change, every request counted. One booted fleet of 3 hosts, the
inventory a file of this test's listing 2 or 3 of them, in sequence:

1. **add** ``k2sb-3``: only it gets the engine; the others' engines keep running (same
   MainPID), the load balancer reloads (same MainPID) with the new server and sends it
   requests, and the others' firewall tables allow the new address — 0 failed requests;
2. **replace** ``k2sb-2`` under the same name: its machine dies (its container's init
   killed), a new bare one boots with the same name and address (a new disk and host key),
   and the deploy makes it serve again; the other engines keep running — 0 failed requests
   during the deploy;
3. **drain and remove** ``k2sb-3``: ``k2fleet down INVENTORY --host k2sb-3`` drains it at the
   load balancer and removes k2fleet's units there, then the inventory without it is
   deployed: the load balancer and the firewall tables forget it, nothing else restarts —
   0 failed requests; a re-run changes nothing.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from k2fleet.planning import host_archive, load_balancer
from k2sandbox import nspawn as sandbox
from k2sandbox.harness import ROOT, SandboxFleet, main_pid, ssh, tool
from tests.test_doubles import wait_for
from tests.test_rolling_sandbox import ClientLoop

pytestmark = pytest.mark.sandbox
SANDBOX_HOSTS = 3
SANDBOX_DOCKER = False
LB_PORT = 8080
UNIT = "k2-vllm.service"
LB_UNIT = "k2-lb.service"
# what a change of the fleet's membership may change on a host that stays: its firewall table
# (the allow lists), the load balancer's config (reloaded) and systemd's view of it, the
# checkpoint relays that feed a new host (peers that must know), the health gate (a check)
MEMBERSHIP_OPERATIONS = ("k2fleet: firewall |", "load balancer", "k2-lb", "reload systemd units",
                         "k2fleet: checkpoint |", "k2fleet: health gate |")


def inventory(directory: Path, names: list[str]) -> str:
    """``directory/sandbox.py``: a copy of ``inventories/sandbox.py`` (its group data too) listing
    only ``names`` — rewritten in place from one step to the next, as an operator edits the
    inventory (its path is the deployment's identity on the control machine)."""
    (directory / "group_data").mkdir(exist_ok=True)
    for name in ("all.py", "sandbox.py"):
        shutil.copy(ROOT / "inventories/group_data" / name, directory / "group_data" / name)
    (directory / "sandbox.py").write_text(
        "from k2sandbox.nspawn import sandbox_inventory_hosts\n\n"
        f"sandbox_hosts = [h for h in sandbox_inventory_hosts() if h[0] in {names!r}]\n")
    return str(directory / "sandbox.py")


def pids(hosts: list[dict], unit: str = UNIT) -> dict[str, int]:
    return {h["name"]: main_pid(h, unit) for h in hosts}


def served_requests(host: dict) -> float:
    """The engine double's own request counter (vLLM's ``vllm:request_success_total``)."""
    with urllib.request.urlopen(f"http://{host['address']}:8000/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:request_success_total"))


def with_loop(base: str, model: str, action):
    """``action()`` with the client loop running through the load balancer; (its result, loop)."""
    loop = ClientLoop(base, model)
    loop.start()
    loop.answered()
    try:
        result = action()
    finally:
        try:
            loop.answered()  # it serves after the change too
        finally:
            loop.stop.set()
            loop.join(60)
    return result, loop


def lb_status(lb_host: dict, server: str) -> str:
    """HAProxy's status of ``server`` on the load balancer host, as lbctl reads it from the admin socket."""
    program = (f"import sys; sys.path.insert(0, {host_archive.ARCHIVE!r}); from k2fleet.hostprogs import lbctl; "
               f"print(lbctl.server_stat({load_balancer.SOCKET!r}, {load_balancer.server_ref(server)!r})['status'])")
    return ssh(lb_host, f"python3 -c {shlex.quote(program)}", check=False).stdout.strip()


def changed_elsewhere(result, stayed: list[str]) -> dict[str, list[str]]:
    """Operations that changed one of the hosts that ``stayed`` beyond what membership changes."""
    return {op: hosts for op, hosts in result.changed_operations.items()
            if set(hosts) & set(stayed) and not any(word in op for word in MEMBERSHIP_OPERATIONS)}


def test_a_host_is_added_replaced_drained_and_removed_while_the_others_serve(
        sandbox_fleet: SandboxFleet, tmp_path: Path) -> None:
    fleet = sandbox_fleet
    one, two, three = fleet.hosts
    data = {"k2_load_balancer": one["name"]}
    inv = inventory(tmp_path, [one["name"], two["name"]])
    first = fleet.deploy(data, inventory=inv)
    assert first.returncode == 0, first.tail()
    base = f"http://{one['address']}:{LB_PORT}/v1"
    with urllib.request.urlopen(f"{base}/models", timeout=30) as answer:
        model = json.load(answer)["data"][0]["id"]
    figures = {}

    # 1. add k2sb-3
    engines, balancer = pids([one, two]), main_pid(one, LB_UNIT)
    inventory(tmp_path, [one["name"], two["name"], three["name"]])
    added, loop = with_loop(base, model, lambda: fleet.deploy(data, inventory=inv))
    assert added.returncode == 0, added.tail()
    figures["add"] = (loop.ok, loop.failed)
    assert loop.ok >= 5 and loop.failed == 0, (loop.ok, loop.failed, loop.errors[:5])
    assert pids([one, two]) == engines and main_pid(one, LB_UNIT) == balancer  # reloaded, not restarted
    assert main_pid(three, UNIT) > 0
    assert changed_elsewhere(added, [one["name"], two["name"]]) == {}, added.changed_operations
    assert f"{three['address']}:8000" in ssh(one, "cat /etc/k2fleet/lb.cfg").stdout
    for h in (one, two):
        assert three["address"] in ssh(h, "nft list ruleset").stdout, h["name"]
    before = served_requests(three)
    _, loop = with_loop(base, model, lambda: wait_for(lambda: served_requests(three) > before, 30, "requests to the added host"))
    assert served_requests(three) > before and loop.failed == 0  # the load balancer sends it requests

    # 2. replace k2sb-2 under the same name: a new bare machine
    engines = pids([one, three])
    ssh(two, "touch /root/old-machine")
    sandbox.replace_host(2)
    # the load balancer's health checks see it down (asked on its admin socket, with the host archive's lbctl)
    wait_for(lambda: lb_status(one, two["name"]).startswith("DOWN"), 30, "the replaced host DOWN at the load balancer")
    assert lb_status(one, two["name"]).startswith("DOWN")
    replaced, loop = with_loop(base, model, lambda: fleet.deploy(data, inventory=inv))
    assert replaced.returncode == 0, replaced.tail()
    figures["replace"] = (loop.ok, loop.failed)
    assert loop.ok >= 5 and loop.failed == 0, (loop.ok, loop.failed, loop.errors[:5])
    assert pids([one, three]) == engines
    assert main_pid(two, UNIT) > 0 and ssh(two, "test -e /root/old-machine; echo $?").stdout.strip() == "1"
    before = served_requests(two)
    _, loop = with_loop(base, model, lambda: wait_for(lambda: served_requests(two) > before, 30, "requests to the replaced host"))
    assert served_requests(two) > before and loop.failed == 0

    # 3. drain and remove k2sb-3
    engines = pids([one, two])

    def remove() -> tuple[subprocess.CompletedProcess, object]:
        down = subprocess.run([tool("k2fleet"), "down", inv, "--host", three["name"], "--data",
                               f"k2_load_balancer={one['name']}"], cwd=ROOT, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=600, env={**os.environ, **fleet.env})
        inventory(tmp_path, [one["name"], two["name"]])
        return down, fleet.deploy(data, inventory=inv)

    (down, removed), loop = with_loop(base, model, remove)
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"{one['name']}: load balancer: " in down.stdout and f"{three['name']}: down: " in down.stdout, down.stdout
    assert removed.returncode == 0, removed.tail()
    figures["remove"] = (loop.ok, loop.failed)
    assert loop.ok >= 5 and loop.failed == 0, (loop.ok, loop.failed, loop.errors[:5])
    assert pids([one, two]) == engines
    assert changed_elsewhere(removed, [one["name"], two["name"]]) == {}, removed.changed_operations
    assert ssh(three, "systemctl list-unit-files --plain --no-legend 'k2-*'", check=False).stdout.strip() == ""
    assert ssh(three, "systemctl list-units --state=active,activating,failed --plain --no-legend 'k2-*'",
               check=False).stdout.strip() == ""
    assert f"{three['address']}:8000" not in ssh(one, "cat /etc/k2fleet/lb.cfg").stdout
    for h in (one, two):
        assert three["address"] not in ssh(h, "nft list ruleset").stdout, h["name"]
    again = fleet.deploy(data, inventory=inv)
    assert again.returncode == 0 and again.changed == 0, again.changed_operations or again.tail()
    print("hosts come and go behind the load balancer: " + "; ".join(
        f"{step} {ok} ok / {failed} failed" for step, (ok, failed) in figures.items()))
