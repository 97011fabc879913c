"""Rolling changes (issue #24 item 2), offline: the restart and reboot steps as data
(``k2fleet/planning/host_actions.py``), the operations they become on pyinfra's ``@fake``
hosts in their fleet-wide order (the real roles, :mod:`tests.test_roles_offline`'s machinery),
the load balancer's plan (``k2fleet/planning/load_balancer.py``); and on loopback, the real
HAProxy with k2fleet's config before two stdlib replicas, driven by the host program
``lbctl`` through its admin socket: a replica drained, stopped and started again while a
client loop through HAProxy sees no failed request.
"""

from __future__ import annotations

import dataclasses
import http.client
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from k2fleet.cli import load_plan
from k2fleet.hostprogs import lbctl
from k2fleet.inventory.spec import SpecError
from k2fleet.planning import api_front, load_balancer
from k2fleet.planning.firewall import ANYONE, host_firewall
from k2fleet.planning.host_actions import reboot_steps, restart_steps
from k2fleet.planning.load_balancer import Server
from k2fleet.planning.units import unit_file
from tests.test_doubles import LOCAL, free_port, wait_for
from tests.test_roles_offline import H200, ControlCalls, digests, planned, run_roles, settled_fleet

FLAG = 'k2_engine_args={"max-num-seqs": 64}'
LB = ("k2_load_balancer=h200-0",)


def _steps(data: tuple[str, ...] = (), lb_running: bool = True):
    dep0, _, before = planned(str(H200), data)
    _, _, after = planned(str(H200), (*data, FLAG))
    facts = settled_fleet(dep0, before)
    if not lb_running:
        units = facts["h200-0"].units
        facts["h200-0"] = dataclasses.replace(facts["h200-0"], units={
            u: (s if u != load_balancer.UNIT else {**s, "ActiveState": "inactive"}) for u, s in units.items()})
    return after, facts, restart_steps(after, facts)


# --- the steps as data ----------------------------------------------------------------------------
def test_a_flag_change_on_two_replicas_is_two_steps_in_instance_order() -> None:
    _, _, steps = _steps()
    assert [(s.instance, s.units, s.server, s.gate) for s in steps] == [
        ("serve-0", {"h200-0": ((0, "k2-vllm"),)}, None, ("h200-0",)),
        ("serve-1", {"h200-1": ((0, "k2-vllm"),)}, None, ("h200-1",)),
    ]


def test_all_at_once_is_one_step_with_every_restart() -> None:
    _, _, steps = _steps(("k2_rollout=all-at-once",))
    assert [(s.instance, s.units) for s in steps] == [
        (None, {"h200-0": ((0, "k2-vllm"),), "h200-1": ((0, "k2-vllm"),)})]


def test_behind_a_running_load_balancer_each_step_drains_its_replica() -> None:
    desired, _, steps = _steps(LB)
    assert [(s.instance, s.server) for s in steps] == [("serve-0", "h200-0"), ("serve-1", "h200-1")]
    lb = desired["h200-1"].rollout.balancer
    assert lb is not None and lb.host == "h200-0"
    assert lb.argv("drain", "h200-1")[2:] == ["lbctl", "--socket", load_balancer.SOCKET, "drain",
                                              "k2-replicas/h200-1", "--timeout", "300"]
    # the load balancer is not a replica: it never restarts in a step (its config only reloads)
    assert all(name != load_balancer.LB for s in steps for slots in s.units.values() for _, name in slots)


def test_a_load_balancer_that_is_not_running_yet_drains_nothing() -> None:
    _, _, steps = _steps(LB, lb_running=False)
    assert [(s.instance, s.server) for s in steps] == [("serve-0", None), ("serve-1", None)]


def test_instances_that_do_not_change_get_no_step() -> None:
    dep, _, after = planned(str(H200), (FLAG,))
    facts = settled_fleet(dep, after)  # both hold the new plan already
    assert restart_steps(after, facts) == []
    dep0, _, before = planned(str(H200))
    facts["h200-1"] = settled_fleet(dep0, before)["h200-1"]  # only h200-1 still runs the old flag
    assert [s.instance for s in restart_steps(after, facts)] == ["serve-1"]


def test_units_that_were_not_running_just_start() -> None:
    dep0, _, before = planned(str(H200))
    _, _, after = planned(str(H200), (FLAG,))
    facts = settled_fleet(dep0, before)
    facts = {h: dataclasses.replace(f, units={u: {**s, "ActiveState": "inactive"} for u, s in f.units.items()})
             for h, f in facts.items()}
    assert restart_steps(after, facts) == []  # a first start: nothing is serving, nothing to keep serving


def test_rolling_reboots_go_instance_by_instance_the_load_balancers_host_last() -> None:
    data = (*LB, "k2_reboot=rolling")
    dep0, _, desired = planned(str(H200), data)
    facts = settled_fleet(dep0, desired)
    steps = reboot_steps(desired, facts, {"h200-0": "driver", "h200-1": "driver"})
    assert [(s.instance, s.reboot, s.server, s.gate) for s in steps] == [
        ("serve-1", ("h200-1",), "h200-1", ("h200-1",)), ("serve-0", ("h200-0",), "h200-0", ("h200-0",))]
    assert all(s.units == {} for s in steps)  # one-host instances: their units came back at boot
    _, _, desired = planned(str(H200), (*LB, "k2_reboot=rolling", "k2_rollout=all-at-once"))
    assert reboot_steps(desired, facts, {"h200-0": "driver"}) == []  # the bootstrap reboots as before
    _, _, desired = planned(str(H200), LB)  # k2_reboot: if-needed
    assert reboot_steps(desired, facts, {"h200-0": "driver"}) == []


# --- the operations, in their fleet-wide order --------------------------------------------------------
def test_the_roles_restart_one_replica_after_the_others_health_gate(tmp_path: Path) -> None:
    dep0, _, before = planned(str(H200), LB)
    dep, plan, desired = planned(str(H200), (*LB, FLAG))
    out = run_roles(dep, plan, desired, settled_fleet(dep0, before), tmp_path, ControlCalls())
    ran = [(host, name) for host, name in out.timeline if name.startswith("rolling") and out.ops[host][name].changed]
    assert ran == [
        ("h200-0", "rolling 1/2 (serve-0): drain h200-0 at the load balancer (its requests in flight finish)"),
        ("h200-0", "rolling 1/2 (serve-0): stop k2-vllm (stage 0)"),
        ("h200-0", "rolling 1/2 (serve-0): start k2-vllm (stage 0)"),
        ("h200-0", "rolling 1/2 (serve-0): health gate of serve-0: /health 200 and a real chat completion"),
        ("h200-0", "rolling 1/2 (serve-0): put h200-0 back at the load balancer (UP in its health checks)"),
        ("h200-0", "rolling 2/2 (serve-1): drain h200-1 at the load balancer (its requests in flight finish)"),
        ("h200-1", "rolling 2/2 (serve-1): stop k2-vllm (stage 0)"),
        ("h200-1", "rolling 2/2 (serve-1): start k2-vllm (stage 0)"),
        ("h200-1", "rolling 2/2 (serve-1): health gate of serve-1: /health 200 and a real chat completion"),
        ("h200-0", "rolling 2/2 (serve-1): put h200-1 back at the load balancer (UP in its health checks)"),
    ]
    drain = out.op("h200-0", "rolling 2/2 (serve-1): drain").commands
    assert len(drain) == 1 and "lbctl --socket /run/k2fleet-lb/admin.sock drain k2-replicas/h200-1" in drain[0]
    for host in desired:  # the load balancer is neither stopped nor reloaded: its config did not change
        assert not [c for c in out.commands(host) if "k2-lb" in c], out.commands(host)


def test_a_new_replica_reloads_the_load_balancer_and_restarts_no_engine(tmp_path: Path) -> None:
    """Adding a backend (here: the LB's config changes because the second replica's port
    appears in it) reloads HAProxy (streams in flight go on), it does not restart it."""
    dep0, plan0, before = planned(str(H200), LB)
    cfg = load_balancer.config_path(dep0)
    old = before["h200-0"].service_files[load_balancer.LB][cfg]
    facts = settled_fleet(dep0, before)
    stale = dataclasses.replace(old, content=old.content.replace(b"    server h200-1 192.0.2.11:8000\n", b""))
    facts["h200-0"] = dataclasses.replace(facts["h200-0"], files={**facts["h200-0"].files, cfg: stale.sha256})
    out = run_roles(dep0, plan0, before, facts, tmp_path, ControlCalls())
    lb_cmds = [c.split(" || ")[0] for c in out.commands("h200-0") if "k2-lb" in c or c.startswith("<upload> /etc/k2fleet/lb")]
    assert lb_cmds == ["<upload> /etc/k2fleet/lb.cfg", "systemctl reload k2-lb.service"], lb_cmds
    assert not [c for h in before for c in out.commands(h) if c.startswith("systemctl") and "k2-vllm" in c]


def h200_copy(directory: Path, third_host: bool) -> Path:
    """``directory/h200.py``: inventories/h200.py with its group data, and a third host
    (h200-2, 192.0.2.12) when ``third_host``; written over on each call."""
    (directory / "group_data").mkdir(exist_ok=True)
    for name in ("all.py", "h200.py"):
        shutil.copy(H200.parent / "group_data" / name, directory / "group_data" / name)
    second = '    ("h200-1", {"ssh_hostname": "192.0.2.11"}),\n'
    assert second in H200.read_text()
    text = H200.read_text().replace(second, second + '    ("h200-2", {"ssh_hostname": "192.0.2.12"}),\n') \
        if third_host else H200.read_text()
    (directory / "h200.py").write_text(text)
    return directory / "h200.py"


def test_a_host_added_to_the_fleet_changes_only_the_load_balancers_config_and_the_allow_lists(tmp_path: Path) -> None:
    """h200.py with a third host: on the hosts that stay, the load balancer's config (reloaded)
    and the firewall rules (their allow lists) are the only files that change — its unit file
    names no replica, so k2-lb is not restarted — and no engine unit restarts."""
    three = h200_copy(tmp_path, third_host=True)
    dep0, plan0, before = planned(str(H200), LB)
    dep1, plan1, after = planned(str(three), LB)
    assert set(after) == {"h200-0", "h200-1", "h200-2"}
    changed = {}
    for host in before:
        old, new = digests(before[host]), digests(after[host])
        changed[host] = sorted(p for p in set(old) | set(new) if old.get(p) != new.get(p))
    assert changed == {"h200-0": ["/etc/k2fleet/firewall.nft", load_balancer.config_path(dep1)],
                       "h200-1": ["/etc/k2fleet/firewall.nft"]}, changed
    facts = settled_fleet(dep0, before)
    facts["h200-2"] = settled_fleet(dep1, after)["h200-2"]
    assert restart_steps(after, facts) == []  # the reload is not a restart


def test_the_deployment_keeps_its_identity_when_a_host_is_added(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control machine's state directory (relay secret, Ray token, mesh keys) is the
    inventory file's: a host added to it, a new revision or engine version keep it, so the
    hosts that stay are not handed new secrets; another inventory file, even with the same
    hosts, is another deployment; the same file named by another path is the same one."""
    from k2fleet.control.artifacts import dep_id

    inventory = h200_copy(tmp_path, third_host=False)
    before, _ = load_plan(str(inventory), list(LB))
    h200_copy(tmp_path, third_host=True)  # the same file, edited as an operator adds a host
    monkeypatch.setattr(sys.modules["pyinfra_cli.util"], "PYTHON_CODES", {})  # pyinfra keeps a file's code by name
    after, _ = load_plan(str(inventory), list(LB))
    assert len(before.fleet.hosts) == 2 and len(after.fleet.hosts) == 3 and dep_id(after) == dep_id(before)
    upgraded, _ = load_plan(str(inventory), [*LB, "k2_revision=" + "f" * 40])
    assert upgraded.s.revision == "f" * 40 and dep_id(upgraded) == dep_id(before)
    monkeypatch.chdir(tmp_path)
    assert dep_id(load_plan("h200.py", list(LB))[0]) == dep_id(before)  # relative, from another directory
    (tmp_path / "other").mkdir()
    other = h200_copy(tmp_path / "other", third_host=True)
    assert dep_id(load_plan(str(other), list(LB))[0]) != dep_id(after)


# --- the load balancer's plan -------------------------------------------------------------------------
def test_the_load_balancer_plan(tmp_path: Path) -> None:
    dep, plan = load_plan(str(H200), list(LB))
    lb = next(s for s in plan.hosts["h200-0"].services if s.name == load_balancer.LB)
    assert lb.ports == {"k2_load_balancer_port": 8080} and lb.stage == 1
    assert plan.endpoint() == ("192.0.2.10", 8080)
    cfg = lb.files[load_balancer.config_path(dep)]
    assert "    bind 0.0.0.0:8080\n" in cfg and "option httpchk GET /health" in cfg
    assert "server h200-0 192.0.2.10:8000" in cfg and "server h200-1 192.0.2.11:8000" in cfg
    assert f"stats socket {load_balancer.SOCKET} mode 600 level admin" in cfg
    unit = unit_file(dep, lb)
    assert "RuntimeDirectory=k2fleet-lb\nRuntimeDirectoryMode=0700" in unit and "ExecReload=" in unit
    fw = host_firewall(dep, plan.hosts["h200-0"])
    assert fw is not None and any(o.ports == "8080" and o.who == ANYONE for o in fw.openings)
    _, fleet = load_plan(str(H200), [*LB, "k2_bind_address=fleet"])
    lb = next(s for s in fleet.hosts["h200-0"].services if s.name == load_balancer.LB)
    assert "    bind 192.0.2.10:8080\n" in lb.files[load_balancer.config_path(dep)]


def test_behind_the_api_front_the_backends_are_the_fronts(tmp_path: Path) -> None:
    """SGLang with an API key: each replica's endpoint is its front on k2_port (the key is
    checked there; the LB forwards Authorization as it came); no key in the LB's config."""
    from tests.test_api_key import key_file

    key = "sk-rollout-test-key-0123456789"
    path = key_file(tmp_path, key)
    dep, plan = load_plan(str(H200), [*LB, "k2_engine=sglang", f"k2_api_key_file={path}"])
    lb = next(s for s in plan.hosts["h200-0"].services if s.name == load_balancer.LB)
    cfg = lb.files[load_balancer.config_path(dep)]
    assert "server h200-1 192.0.2.11:8000" in cfg and key not in cfg
    fronts = [s for h in plan.hosts.values() for s in h.services if s.name == api_front.FRONT]
    assert len(fronts) == 2 and all(s.ports == {"k2_port": 8000} for s in fronts)


@pytest.mark.parametrize("data,words", [
    (("k2_load_balancer=h200-9",), "not a host of this inventory"),
    (("k2_load_balancer=h200-0", "k2_load_balancer_port=8000"), "also used by"),
])
def test_bad_load_balancer_keys_are_refused(data: tuple[str, ...], words: str) -> None:
    with pytest.raises(SpecError, match=words):
        load_plan(str(H200), list(data))


def test_a_load_balancer_with_pd_roles_is_refused() -> None:
    with pytest.raises(SpecError, match="PD router already balances") as exc:
        load_plan("inventories/h200-sglang-pd.py", ["k2_load_balancer=router-0"])
    assert exc.value.key == "k2_load_balancer"


# --- on loopback: the real HAProxy, two replicas, lbctl -----------------------------------------------
HAPROXY = shutil.which("haproxy") or api_front.HAPROXY


class Replica(http.server.ThreadingHTTPServer):
    """A tiny replica: /health 200, chat completions that take ``delay`` seconds (requests in
    flight while it is drained), answering with its name."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, name: str, port: int, delay: float = 0.05) -> None:
        super().__init__((LOCAL, port), _ReplicaHandler)
        self.name, self.delay, self.served = name, delay, 0
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _ReplicaHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Replica

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send(200 if self.path == "/health" else 404, b"")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        time.sleep(self.server.delay)
        self.server.served += 1
        self._send(200, json.dumps({"choices": [{"message": {"content": self.server.name}}]}).encode())


class ClientLoop:
    """Chat completions through the load balancer, one after another on fresh connections,
    from two threads, counting answers per replica and every failure."""

    def __init__(self, port: int) -> None:
        self.port, self.stop, self.failures, self.answers = port, threading.Event(), [], {}
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(2)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        body = json.dumps({"model": "kimi", "messages": [{"role": "user", "content": "hi"}]}).encode()
        while not self.stop.is_set():
            try:
                conn = http.client.HTTPConnection(LOCAL, self.port, timeout=10)
                conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json",
                                                                    "Authorization": "Bearer sk-client"})
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                if resp.status != 200:
                    self.failures.append(f"{resp.status} {data[:80]!r}")
                    continue
                who = json.loads(data)["choices"][0]["message"]["content"]
                self.answers[who] = self.answers.get(who, 0) + 1
            except (OSError, ValueError, http.client.HTTPException) as exc:
                self.failures.append(repr(exc))

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(15)


def _wait_up(sock: str, ref: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if lbctl.server_stat(sock, ref).get("status") == "UP":
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{ref} not UP")


@pytest.fixture
def balancer(tmp_path: Path):
    """The real HAProxy with k2fleet's config on 127.0.0.1 before two replicas; yields
    (port, admin socket, replicas by name, their ports)."""
    if not os.path.exists(HAPROXY):
        pytest.fail(f"{HAPROXY} is missing: install Debian's haproxy (dev.sh does)")
    ports = {"r0": free_port(), "r1": free_port()}
    replicas = {name: Replica(name, port) for name, port in ports.items()}
    port, sock = free_port(), str(tmp_path / "admin.sock")
    cfg = tmp_path / "lb.cfg"
    cfg.write_text(load_balancer.config(LOCAL, port, [Server(n, LOCAL, p) for n, p in ports.items()], "/health", sock))
    log = open(tmp_path / "haproxy.log", "w+")
    proc = subprocess.Popen([HAPROXY, "-Ws", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT)
    try:
        for name in ports:
            _wait_up(sock, load_balancer.server_ref(name))
        yield port, sock, replicas, ports
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for r in replicas.values():
            r.stop()
        log.close()


def test_haproxy_accepts_the_load_balancer_config(tmp_path: Path) -> None:
    cfg = tmp_path / "lb.cfg"
    cfg.write_text(load_balancer.config("0.0.0.0", 8080, [Server("h200-0", "192.0.2.10", 8000),
                                                          Server("h200-1", "192.0.2.11", 8000)], "/health",
                                        str(tmp_path / "admin.sock")))
    check = subprocess.run([HAPROXY, "-c", "-f", str(cfg)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_drained_replica_restarts_while_clients_see_no_failure(balancer, capsys) -> None:
    port, sock, replicas, ports = balancer
    loop = ClientLoop(port)
    try:
        time.sleep(1)
        assert set(loop.answers) == {"r0", "r1"}, loop.answers  # both replicas serve
        for name in ("r0", "r1"):  # the rolling change: one replica after the other
            ref = load_balancer.server_ref(name)
            replicas[name].delay = 0.5  # requests in flight while it drains
            time.sleep(0.3)
            assert lbctl.main(["--socket", sock, "drain", ref, "--timeout", "20"]) == 0
            assert "drained: no request in flight" in capsys.readouterr().out
            row = lbctl.server_stat(sock, ref)
            assert row["status"] == "DRAIN" and lbctl.in_flight(row) == 0
            replicas[name].stop()  # the replica's units stop ...
            stopped, served = time.monotonic(), replicas[name].served
            # ... its health checks fail (fall 2: one within inter 2s, the next at fastinter 0.5s): HAProxy
            # marks it down within 2.5 s (4 s with inter alone)
            wait_for(lambda: lbctl.server_stat(sock, ref).get("status", "").startswith("DOWN"), 10, f"{ref} DOWN")
            assert time.monotonic() - stopped < 3.2
            replicas[name] = Replica(name, ports[name])  # ... and start again (its health gate passed)
            assert lbctl.main(["--socket", sock, "ready", ref, "--timeout", "30"]) == 0  # waits until UP
            assert lbctl.server_stat(sock, ref)["status"] == "UP"
            before = replicas[name].served
            deadline = time.monotonic() + 10
            while replicas[name].served == before and time.monotonic() < deadline:
                time.sleep(0.05)
            assert replicas[name].served > before, f"{name} takes requests again"
            assert served > 0
    finally:
        loop.finish()
    assert loop.failures == [], loop.failures[:5]
    assert sum(loop.answers.values()) > 20, loop.answers


def test_a_reload_with_a_new_replica_refuses_no_connection(balancer, tmp_path: Path) -> None:
    """A host added to the fleet: its config (one more server) is reloaded into the running
    HAProxy (``systemctl reload k2-lb``: SIGUSR2 to the master) while clients loop: no
    connection is refused across five reloads (Debian's HAProxy 2.6 here: the new worker binds
    beside the old one before the old one stops accepting), and the new replica gets requests.
    A restart instead of a reload is what refused connections on the sandbox (the unit-file
    test above keeps the deploy from restarting it)."""
    port, sock, replicas, ports = balancer
    ports["r2"] = free_port()
    replicas["r2"] = Replica("r2", ports["r2"])
    cfg = tmp_path / "lb.cfg"
    master = int(subprocess.run(["pgrep", "-o", "-f", f"{HAPROXY} -Ws -f {cfg}"], capture_output=True,
                                text=True).stdout.split()[0])
    loop = ClientLoop(port)
    try:
        time.sleep(0.5)
        for reload in range(5):  # every reload is a chance to refuse; one new server, then the same config
            if reload == 0:
                cfg.write_text(load_balancer.config(LOCAL, port, [Server(n, LOCAL, p) for n, p in ports.items()],
                                                    "/health", sock))
            os.kill(master, signal.SIGUSR2)
            time.sleep(1)
        _wait_up(sock, load_balancer.server_ref("r2"))
        served = replicas["r2"].served
        time.sleep(1)
        assert replicas["r2"].served > served
    finally:
        loop.finish()
    assert loop.failures == [], loop.failures[:5]
    assert sum(loop.answers.values()) > 20, loop.answers


def test_lbctl_on_a_server_or_socket_that_is_not_there(balancer, tmp_path: Path, capsys) -> None:
    _, sock, _, _ = balancer
    assert lbctl.main(["--socket", sock, "drain", "k2-replicas/nobody", "--timeout", "1"]) == 0
    assert "not in the load balancer's running config" in capsys.readouterr().out
    assert lbctl.main(["--socket", sock, "ready", "k2-replicas/nobody", "--timeout", "1"]) == 0
    gone = str(tmp_path / "no.sock")
    assert lbctl.main(["--socket", gone, "drain", "k2-replicas/r0", "--timeout", "1"]) == 0
    assert lbctl.main(["--socket", gone, "ready", "k2-replicas/r0", "--timeout", "1"]) == 1


def test_drain_is_capped_and_ready_fails_on_a_replica_that_stays_down(balancer, capsys) -> None:
    port, sock, replicas, _ = balancer
    replicas["r0"].delay = 5
    ref = load_balancer.server_ref("r0")
    loop = ClientLoop(port)
    try:
        deadline = time.monotonic() + 5
        while lbctl.in_flight(lbctl.server_stat(sock, ref)) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        started = time.monotonic()
        assert lbctl.main(["--socket", sock, "drain", ref, "--timeout", "1"]) == 0
        assert time.monotonic() - started < 3
        assert "still in flight after 1s; going on" in capsys.readouterr().out
    finally:
        loop.finish()
    replicas["r0"].stop()
    wait_for(lambda: lbctl.server_stat(sock, ref).get("status", "").startswith("DOWN"), 10, f"{ref} DOWN")
    assert lbctl.main(["--socket", sock, "ready", ref, "--timeout", "2"]) == 1
    assert "is not UP at the load balancer" in capsys.readouterr().err


def test_lbctl_caps_what_it_reads_from_the_admin_socket(tmp_path: Path) -> None:
    """A socket that answers without end (not HAProxy, or a hostile one) is read up to
    lbctl.MAX_ANSWER bytes, then refused — not held in memory until it stops."""
    import socket as sk
    import threading

    path = str(tmp_path / "admin.sock")
    server = sk.socket(sk.AF_UNIX, sk.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def flood() -> None:
        conn, _ = server.accept()
        try:
            while True:
                conn.sendall(b"x" * 65536)
        except OSError:
            pass
        finally:
            conn.close()

    threading.Thread(target=flood, daemon=True).start()
    with pytest.raises(OSError, match="answer longer than"):
        lbctl.command(path, "show stat", timeout=10)
    server.close()


def test_lbctl_gives_up_on_an_answer_that_never_ends_within_its_timeout(tmp_path: Path) -> None:
    """A socket that drips a byte now and then (each read succeeds, the answer never ends)
    is given up at the command's timeout in all, not held per read."""
    import socket as sk
    import threading

    path = str(tmp_path / "admin.sock")
    server = sk.socket(sk.AF_UNIX, sk.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    stop = threading.Event()

    def drip() -> None:
        conn, _ = server.accept()
        with conn:
            while not stop.wait(0.2):
                try:
                    conn.sendall(b"x")
                except OSError:
                    return

    threading.Thread(target=drip, daemon=True).start()
    started = time.monotonic()
    with pytest.raises(OSError, match="no end of answer within 1s"):
        lbctl.command(path, "show stat", timeout=1)
    assert time.monotonic() - started < 2
    stop.set()
    server.close()
