"""Ordered restarts of multi-node instances, on a rehearsed fleet (real systemd, real
pyinfra, engine test doubles that rendezvous over the sandbox network).

Each test rehearses one multi-node seed inventory with ``--keep`` under this module's sandbox lock
(the rehearse process shares it through ``K2FLEET_SANDBOX_LOCK_FD``), then changes one
input and deploys again with the command the rehearsal printed:

- a changed flag restarts exactly the instance it touches, head before members (the
  hosts share one kernel, so systemd's monotonic start stamps compare across hosts),
  every other unit keeps its invocation — the firewall's oneshot too, which is not even
  reloaded (its ExecReload never ran); the deploy after that has 0 changes;
- SGLang PD behind the API front (``k2_api_key_file``): the key is checked there, kept out of
  every argv, and no other local user reaches the router behind it;
- a killed vLLM DP rank is seen by the head (vLLM's API server exits on engine death),
  systemd restarts the head, the ranks' watchdog restarts the ranks after it, and the
  instance forms again with its full DP world.
"""

from __future__ import annotations

import ast
import json
import os
import re
import secrets
import shlex
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest

from k2sandbox import nspawn as sandbox
from k2sandbox.pyinfra_cli import run_pyinfra
from k2sandbox.harness import ROOT, http_json, ssh, tool
from tests.test_rehearse import check_serving

pytestmark = pytest.mark.sandbox
REHEARSAL_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def lock() -> Iterator:
    if os.geteuid() != 0:
        pytest.skip("the sandbox fleet needs root")
    handle = sandbox.hold_sandbox_lock()
    try:
        yield handle
    finally:
        sandbox.down()
        handle.close()


class Kept:
    """A rehearsal left up with ``--keep``: its hosts and its deploy command."""

    def __init__(self, lock, inventory: str, endpoints: int, *data: str, key: str | None = None) -> None:
        """Rehearsed as written (plus ``--data`` ``data``), then called by the test
        (:func:`tests.test_rehearse.check_serving`, with the API ``key`` when the fleet has one):
        these are the only rehearsals of these seed inventories in the suite."""
        proc = subprocess.run([tool("k2fleet"), "rehearse", inventory, "--keep", *(w for d in data for w in ("--data", d))],
                              cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              timeout=REHEARSAL_TIMEOUT_S, env={**os.environ, **sandbox.lock_env(lock)},
                              pass_fds=(lock.fileno(),))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        check_serving(proc, inventory, endpoints, key)
        self.output, self.stderr = proc.stdout, proc.stderr
        lines = proc.stdout.splitlines()
        words = shlex.split(lines[lines.index(next(x for x in lines if "deploy again with:" in x)) + 1])
        assert words[:2] == ["cd", str(ROOT)] and words[2] == "&&", words
        assert words[3].startswith("K2FLEET_STATE_DIR="), words
        self.env = dict([words[3].split("=", 1)])
        self.argv = words[4:]
        self.inventory = Path(self.argv[-2])
        mapping = {line.split()[0]: line.split()[2] for line in lines if line.startswith("  ") and f" -> {sandbox.PREFIX}-" in line}
        by_name = {h.name: asdict(h) for h in sandbox.load_hosts()}
        self.hosts = {name: by_name[sb] for name, sb in mapping.items()}

    def deploy(self, *data: str):
        argv = self.argv[:-2] + [a for item in data for a in ("--data", item)] + self.argv[-2:]
        return run_pyinfra(argv, self.env, 900)

    def unit(self, host: str, unit: str) -> dict[str, str]:
        out = ssh(self.hosts[host], f"systemctl show -p InvocationID -p ActiveEnterTimestampMonotonic "
                                    f"-p NRestarts -p ActiveState -p MainPID -p ExecReload {unit}").stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def units(self) -> dict[tuple[str, str], dict[str, str]]:
        found = {}
        for host in self.hosts:
            names = ssh(self.hosts[host], "systemctl list-units --plain --no-legend 'k2-*.service' | awk '{print $1}'"
                        ).stdout.split()
            for unit in names:
                # the mesh sshd is stopped while a TRT-LLM node runs; the instance watchdogs
                # (tests/test_instance_watch_sandbox.py) are no serving units
                if unit != "k2-mesh-sshd.service" and not unit.endswith("-watch.service"):
                    found[(host, unit)] = self.unit(host, unit)
        return found


FIREWALL = "k2-firewall.service"


def serving(units: dict) -> set[tuple[str, str]]:
    """The serving units among ``units`` (every k2 unit but the firewall's oneshot), which must
    be there: the firewall's units are compared too (not vacuously)."""
    assert any(unit == FIREWALL for _, unit in units), sorted(units)
    return {key for key in units if key[1] != FIREWALL}


def reloaded(before: dict, after: dict) -> list[tuple[str, str]]:
    """(host, unit) whose ExecReload ran between the two looks (its start_time changed): the
    firewall's ``nft -f`` reload (tests/test_unit_restarts_offline.py: a flag change does not)."""
    return sorted(key for key in after if before.get(key, {}).get("ExecReload") != after[key].get("ExecReload"))


def get(url: str) -> tuple[int, object]:
    """(status, body) of a GET; (0, reason) while nothing listens."""
    try:
        return http_json(url, timeout=5)
    except OSError as exc:
        return 0, str(exc)


def restarted(before: dict, after: dict) -> list[tuple[str, str]]:
    """(host, unit) whose invocation changed, in the order they (re)started."""
    changed = [key for key in after if before.get(key, {}).get("InvocationID") != after[key]["InvocationID"]]
    return sorted(changed, key=lambda key: int(after[key]["ActiveEnterTimestampMonotonic"]))


def edit_group_engine_args(inventory: Path, group: str, key: str, value) -> None:
    """Change one engine flag in one group's inline data of a generated inventory."""
    ns: dict = {}
    exec(inventory.read_text(), ns)  # noqa: S102 - the rehearsal's own generated text
    hosts, data = ns[group]
    data["k2_engine_args"] = {**data["k2_engine_args"], key: value}
    lines = [line for line in inventory.read_text().splitlines() if not line.startswith(f"{group} = ")]
    lines.append(f"{group} = ({hosts!r}, {data!r})")
    inventory.write_text("\n".join(lines) + "\n")
    ast.parse(inventory.read_text())


def test_dp_ep_flag_change_restarts_head_then_ranks_and_a_killed_rank_restarts_the_instance(lock) -> None:
    kept = Kept(lock, "inventories/h200-dp-ep.py", 1)
    assert '"model": "kimi-k2"' in kept.output  # k2_served_model_name, what clients send
    before = kept.units()
    assert serving(before) == {("h200-0", "k2-vllm.service"), ("h200-1", "k2-vllm.service")}

    changed = kept.deploy("k2_gpu_memory_utilization=0.8")
    assert changed.returncode == 0, changed.log[-3000:]
    after = kept.units()
    assert restarted(before, after) == [("h200-0", "k2-vllm.service"), ("h200-1", "k2-vllm.service")]
    assert reloaded(before, after) == [], (before, after)
    again = kept.deploy("k2_gpu_memory_utilization=0.8")
    assert again.returncode == 0 and again.changed == 0, again.changed_operations

    # Kill the headless ranks' engine: the head sees it and exits; systemd restarts both.
    head, member = kept.hosts["h200-0"], kept.hosts["h200-1"]
    deaths = "journalctl -u k2-vllm.service --no-pager -o cat | grep -c 'died: engine core dead'"
    deaths_before = int(ssh(head, deaths, check=False).stdout.strip() or 0)
    ssh(member, f"kill -9 {after[('h200-1', 'k2-vllm.service')]['MainPID']}")
    deadline = time.monotonic() + 90
    now: dict = {}
    while time.monotonic() < deadline:
        status, models = get(f"http://{head['address']}:8000/v1/models")
        # the head restarts on its own (systemd: NRestarts); the ranks' watchdog stops the ranks while
        # the head is down and starts them after it (a new invocation); the units are looked at (over
        # ssh) once the head answers again
        if status == 200:
            now = kept.units()
            if int(now[("h200-0", "k2-vllm.service")]["NRestarts"]) > int(after[("h200-0", "k2-vllm.service")]["NRestarts"]) \
                    and all(now[k]["InvocationID"] != after[k]["InvocationID"] for k in serving(now)) \
                    and now[("h200-0", "k2-vllm.service")]["ActiveState"] == "active" \
                    and get(f"http://{head['address']}:8000/health")[0] == 200:
                break
        time.sleep(0.5)
    else:
        pytest.fail(f"instance did not restart and form again: {now}")
    meta = models["data"][0].get("metadata", models["data"][0])
    assert meta.get("data_parallel_size") == 16, models
    assert int(ssh(head, deaths, check=False).stdout.strip() or 0) > deaths_before  # the head saw it
    healthy = kept.deploy("k2_gpu_memory_utilization=0.8")
    assert healthy.returncode == 0 and healthy.changed == 0, healthy.changed_operations


def test_sglang_pd_behind_the_api_front_then_a_decode_flag_change_restarts_only_the_decode_instance(
        lock, tmp_path: Path) -> None:
    """``inventories/h200-sglang-pd.py`` with ``k2_api_key_file``: the PD router's host runs
    k2-api-front.service (HAProxy) on k2_router_port, the router on 127.0.0.1:k2_api_backend_port;
    the rehearsal's gates and probes pass with the key; from the control machine the endpoint
    answers 401 without the key or with a wrong one, a completion with it, /health without it;
    the key is in no argv and in two 0600 files; another local user binds none of k2fleet's
    ports and cannot reach the router behind the front. Then a decode flag change restarts
    exactly the decode instance, in order, and the deploy after it has 0 changes."""
    from tests.test_api_key import _chat, key_file

    key = secrets.token_hex(24)
    path = key_file(tmp_path, key)
    kept = Kept(lock, "inventories/h200-sglang-pd.py", 3, f"k2_api_key_file={path}", key=key)
    assert key not in kept.output + kept.stderr
    main = re.search(r"^endpoint: (http://\S+/v1)$", kept.output, re.M)
    sent = re.search(r"^try: curl .* -d '(\{.*\})'$", kept.output, re.M)
    assert main and sent, kept.output
    model = json.loads(sent.group(1))["model"]
    url = f"{main.group(1)}/chat/completions"
    assert _chat(url, None, model)[0] == 401
    assert _chat(url, "not-" + key, model)[0] == 401
    status, answer = _chat(url, key, model)
    assert status == 200 and answer["choices"][0]["message"], answer
    base = main.group(1).removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/health", timeout=30) as resp:
        assert resp.status == 200
    address = base.removeprefix("http://").rsplit(":", 1)[0]
    router = next(h for h in sandbox.load_hosts() if h.address == address)
    seen = sandbox.ssh(router, "stat -c '%a %U %n' /etc/k2fleet/api-key /etc/k2fleet/api-front.keys; "
                               "systemctl is-active k2-api-front.service; "
                               "for u in k2-api-front k2-sglang-router; do "
                               "tr '\\0' ' ' < /proc/$(systemctl show -p MainPID --value $u.service)/cmdline; echo; "
                               "done; systemctl show -p ExecStart --value k2-sglang-router.service; ss -ltnH",
                       timeout=60).stdout
    assert "600 root /etc/k2fleet/api-key\n600 root /etc/k2fleet/api-front.keys\nactive\n" in seen, seen
    assert key not in seen  # not in HAProxy's or the router's argv
    assert "/usr/sbin/haproxy -Ws -f /etc/k2fleet/api-front.cfg" in seen
    # the router renames its process (sglang::router): its address is read from its unit's ExecStart
    assert "--host 127.0.0.1 --port 8001" in seen and "127.0.0.1:8001" in seen, seen
    # another local user (uid 65534) on the router's host: binds none of k2fleet's ports,
    # cannot reach the router behind the front, still reaches the front (which wants the key)
    probe = ("import errno, socket\n"
             "def go(what, fn):\n"
             "    try:\n        fn(); print(what, 'ok')\n"
             "    except OSError as e:\n        print(what, errno.errorcode[e.errno])\n"
             "for port in (8000, 8001, 29700):\n"
             "    go(f'bind {port}', lambda: socket.socket().bind(('127.0.0.1', port)))\n"
             "go('backend', lambda: socket.create_connection(('127.0.0.1', 8001), 5))\n"
             f"go('front', lambda: socket.create_connection(({address!r}, 8000), 5))\n")
    seen = sandbox.ssh(router, "cat /proc/sys/net/ipv4/ip_unprivileged_port_start /etc/sysctl.d/60-k2fleet-privileged-ports.conf; "
                               f"setpriv --reuid=65534 --regid=65534 --clear-groups python3 -c {shlex.quote(probe)}",
                       timeout=60).stdout
    assert seen.startswith("29701\n") and "net.ipv4.ip_unprivileged_port_start = 29701\n" in seen, seen
    for line in ("bind 8000 EACCES", "bind 8001 EACCES", "bind 29700 EACCES", "backend ECONNREFUSED", "front ok"):
        assert line in seen.splitlines(), seen

    before = kept.units()
    edit_group_engine_args(kept.inventory, "decode", "max-running-requests", 4096)
    changed = kept.deploy()
    assert changed.returncode == 0, changed.log[-3000:]
    after = kept.units()
    serving(before)
    assert restarted(before, after) == [("decode-0", "k2-sglang-decode.service"),
                                        ("decode-1", "k2-sglang-decode.service")], (before, after)
    assert reloaded(before, after) == [], (before, after)  # the decode group's line moved: the rules did not
    again = kept.deploy()
    assert again.returncode == 0 and again.changed == 0, again.changed_operations


def test_sglang_tp16_flag_change_restarts_node0_then_node1(lock) -> None:
    kept = Kept(lock, "inventories/h200-sglang-tp16.py", 1)
    before = kept.units()
    assert len(serving(before)) == 2
    changed = kept.deploy("k2_gpu_memory_utilization=0.8")
    assert changed.returncode == 0, changed.log[-3000:]
    after = kept.units()
    order = restarted(before, after)
    assert [host for host, _ in order] == list(kept.hosts) and FIREWALL not in {u for _, u in order}, (before, after)
    assert reloaded(before, after) == [], (before, after)
    again = kept.deploy("k2_gpu_memory_utilization=0.8")
    assert again.returncode == 0 and again.changed == 0, again.changed_operations


def test_h800_pp_flag_change_restarts_only_the_api_server_and_a_ray_worker_that_never_joins_is_named(lock) -> None:
    kept = Kept(lock, "inventories/h800-pp.py", 1)
    # a real Ray cluster with Ray's token authentication on (#21): a client on a fleet host
    # without the deployment's token is refused by the head's GCS, with it joins
    head, worker = kept.hosts["h800-0"], kept.hosts["h800-1"]
    probe = (f"/opt/k2fleet/venv/vllm-0.33.0/bin/python -c \"import ray; ray.init(address='{head['address']}:6379'); "
             "print('nodes', len(ray.nodes()))\"")
    # refused at its first try ("Unauthenticated ... InvalidAuthToken"); Ray's connect loop retries
    # once a second for 20 s unless RAY_gcs_server_port_wait_time_s bounds it (ray/_private/node.py)
    without = ssh(worker, f"RAY_AUTH_MODE=disabled RAY_gcs_server_port_wait_time_s=2 timeout 60 {probe}", check=False)
    assert without.returncode != 0 and "nodes" not in without.stdout, without.stdout + without.stderr
    assert "InvalidAuthToken" in without.stdout + without.stderr, without.stdout + without.stderr
    token = "RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=/etc/k2fleet/ray/auth_token"
    joined = ssh(worker, f"{token} timeout 60 {probe}", check=False)
    assert joined.returncode == 0 and "nodes 2" in joined.stdout, joined.stdout + joined.stderr
    assert ssh(worker, "stat -c %a /etc/k2fleet/ray/auth_token").stdout.strip() == "600"
    before = kept.units()
    assert serving(before) == {("h800-0", "k2-ray.service"), ("h800-0", "k2-vllm.service"), ("h800-1", "k2-ray.service")}
    changed = kept.deploy("k2_max_model_len=1024")
    assert changed.returncode == 0, changed.log[-3000:]
    after = kept.units()
    assert restarted(before, after) == [("h800-0", "k2-vllm.service")], (before, after)
    assert reloaded(before, after) == [], (before, after)
    again = kept.deploy("k2_max_model_len=1024")
    assert again.returncode == 0 and again.changed == 0, again.changed_operations
    # a Ray worker that never joins (blocked by a firewall, or hung): its k2-ray unit runs but
    # starts no Ray node; the next change's restart of the head's k2-vllm waits for it in its
    # gate and fails the deploy naming the node, within k2_health_timeout
    never = ("mkdir -p /etc/systemd/system/k2-ray.service.d && printf '%s' "
             f"{shlex.quote(NEVER_JOINS)} > /etc/systemd/system/k2-ray.service.d/never-joins.conf && "
             "systemctl daemon-reload && systemctl restart k2-ray.service")
    assert ssh(worker, never, check=False).returncode == 0
    # The start is not tried a second time (it failed after its gate waited: the deploy fails
    # after one gate timeout, not two; tests/test_start_or_explain.py)
    failed = kept.deploy("k2_max_model_len=2048", "k2_health_timeout=12")  # > QUICK_FAILURE_S: no second try
    assert failed.returncode != 0, failed.log[-3000:]
    never_joined = f"k2-vllm.service: Ray node h800-1 ({worker['address']}) has not joined within 12s"
    assert failed.log.count(never_joined) == 1, failed.log[-3000:]


# Makes the worker's k2-ray unit run but never join the cluster: a systemd drop-in that
# starts no Ray node (ExecStart= clears the unit's own).
NEVER_JOINS = "[Service]\nExecStart=\nExecStart=/bin/sleep infinity\n"


def test_trtllm_mpi_containers_config_change_restarts_nodes_then_the_mpirun_launcher(lock) -> None:
    kept = Kept(lock, "inventories/h200-trtllm-mpi.py", 1)
    # as written: the head docker-execs the real OpenMPI mpirun into its container, which starts
    # orted in the other host's container over SSH on the mesh port; the gate sees TP16 = world 16
    assert f"ok   h200-0 k2-trtllm: http://{sandbox.host_address(1)}:8000/v1" in kept.output
    before = kept.units()
    assert serving(before) == {("h200-0", "k2-trtllm-node.service"), ("h200-1", "k2-trtllm-node.service"),
                               ("h200-0", "k2-trtllm.service")}
    changed = kept.deploy("k2_max_model_len=4096")  # the extra LLM API options YAML on both hosts
    assert changed.returncode == 0, changed.log[-3000:]
    after = kept.units()
    order = restarted(before, after)
    assert set(order[:2]) == {("h200-0", "k2-trtllm-node.service"), ("h200-1", "k2-trtllm-node.service")}, order
    assert order[2:] == [("h200-0", "k2-trtllm.service")], order
    assert reloaded(before, after) == [], (before, after)
    again = kept.deploy("k2_max_model_len=4096")
    assert again.returncode == 0 and again.changed == 0, again.changed_operations
