"""Local users (issue #33 item 4), on the real kernel: in a network namespace of its own
(``unshare --net``: the machine's own firewall and sysctls are not touched), k2fleet's rendered
sysctl value and nftables table are applied, and a process running as uid 65534 tries what a
hostile local user would: bind k2fleet's ports (8000, 8001, 29700) before its units do, and
connect to the engine behind the API front (which takes no key). The same probes without
k2fleet's settings show the test can fail: there, both succeed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k2fleet.cli import load_plan
from k2fleet.planning import api_front, privileged_ports
from k2fleet.planning.firewall import host_firewall
from tests.test_api_key import key_file

NOBODY = 65534

PROBE = r'''
import encodings.idna, errno, json, os, socket, subprocess, sys  # idna: nobody cannot read the interpreter's lib
cfg = json.loads(sys.argv[1])
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
out = {}

def as_nobody(fn):
    """fn() in a child running as uid 65534: "ok" or the errno's name."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setgroups([]); os.setgid(65534); os.setuid(65534)
            fn()
            res = "ok"
        except OSError as exc:
            res = errno.errorcode.get(exc.errno, str(exc.errno))
        except Exception as exc:  # noqa: BLE001 (reported, not raised in a forked child)
            res = repr(exc)
        os.write(w, res.encode()); os._exit(0)
    os.close(w)
    res = os.read(r, 100).decode(); os.close(r); os.waitpid(pid, 0)
    return res

def bind(family, host, port):
    def fn():
        s = socket.socket(family); s.bind((host, port)); s.listen(); s.close()
    return fn

def connect(port):
    def fn():
        s = socket.create_connection(("127.0.0.1", port), timeout=3); s.close()
    return fn

if cfg["apply"]:
    check = subprocess.run(cfg["check"]).returncode
    out["check_before"] = check
    subprocess.run(["/bin/sh", "-c", cfg["apply_cmd"]], check=True)
    out["check_after"] = subprocess.run(cfg["check"]).returncode
    subprocess.run(["nft", "-f", cfg["rules"]], check=True)
for port in cfg["ports"]:
    out[f"bind4 {port}"] = as_nobody(bind(socket.AF_INET, "127.0.0.1", port))
    out[f"bind6 {port}"] = as_nobody(bind(socket.AF_INET6, "::1", port))
out["bind4 free"] = as_nobody(bind(socket.AF_INET, "127.0.0.1", cfg["free"]))
# root's listeners: the engine behind the front and the front itself
listeners = {}
for port in (cfg["backend"], cfg["api"]):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port)); s.listen(16); listeners[port] = s
out["nobody to backend"] = as_nobody(connect(cfg["backend"]))
out["nobody to api"] = as_nobody(connect(cfg["api"]))
try:
    connect(cfg["backend"])(); out["root to backend"] = "ok"
except OSError as exc:
    out["root to backend"] = errno.errorcode.get(exc.errno, str(exc.errno))
print(json.dumps(out))
'''


def _probe(tmp_path: Path, apply: bool) -> dict:
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("nft"):
        pytest.skip("needs root, unshare and nft")
    dep, plan = load_plan("inventories/b200-trtllm.py", [f"k2_api_key_file={key_file(tmp_path, 'sk-local')}"])
    hp = next(h for h in plan.hosts.values() if api_front.has_front(h))
    fw = host_firewall(dep, hp)
    assert fw is not None
    rules = tmp_path / "firewall.nft"
    rules.write_text(fw.rules())
    value = privileged_ports.port_start(dep, plan)
    cfg = {"apply": apply, "rules": str(rules), "check": privileged_ports.check_argv(value),
           "apply_cmd": privileged_ports.apply_argv(value),
           "ports": [dep.s.port, dep.s.api_backend_port, dep.s.relay_port], "free": value + 1000,
           "backend": dep.s.api_backend_port, "api": dep.s.port}
    run = subprocess.run(["unshare", "--net", sys.executable, "-c", PROBE, json.dumps(cfg)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_exploit_without_k2fleets_settings_a_local_user_squats_and_reaches_the_engine(tmp_path: Path) -> None:
    got = _probe(tmp_path, apply=False)
    assert got["bind4 8000"] == got["bind4 8001"] == got["bind4 29700"] == "ok"
    assert got["nobody to backend"] == "ok"


def test_no_local_user_binds_a_served_port_or_reaches_the_engine(tmp_path: Path) -> None:
    got = _probe(tmp_path, apply=True)
    assert got["check_before"] != 0 and got["check_after"] == 0  # the fact's check: applied, then settled
    for port in (8000, 8001, 29700):
        assert got[f"bind4 {port}"] == "EACCES" and got[f"bind6 {port}"] == "EACCES", got  # IPv6 too
    assert got["bind4 free"] == "ok"  # a port above the value stays an ordinary user's
    assert got["nobody to backend"] == "ECONNREFUSED"  # reset by the table's output chain
    assert got["nobody to api"] == "ok" and got["root to backend"] == "ok"  # the front stays reachable; root passes


def test_the_value_covers_every_named_port_below_the_ephemeral_range() -> None:
    for inventory in ("inventories/h200.py", "inventories/b200-trtllm.py", "inventories/h200-sglang-pd.py"):
        dep, plan = load_plan(inventory)
        value = privileged_ports.port_start(dep, plan)
        assert value <= privileged_ports.CEILING
        for first, last, what in privileged_ports.served_ports(dep, plan):
            assert last < value or last >= privileged_ports.CEILING, what
        assert dep.s.relay_port < value and dep.s.port < value


# --------------------------------------------------------------------------- the control state directory


def _plant(tmp_path: Path, monkeypatch, uid: int, mode: int = 0o755) -> tuple[Path, object, object]:
    from k2fleet.control.artifacts import state_dir

    base = tmp_path / "state"
    base.mkdir(mode=0o700)
    monkeypatch.setenv("K2FLEET_STATE_DIR", str(base))
    dep, plan = load_plan("inventories/h200.py")
    planted = state_dir(dep)
    planted.mkdir(mode=mode)
    (planted / "relay.secret").write_text("planted-relay-secret\n")
    (planted / "ray.token").write_text("planted-ray-token\n")
    os.chown(planted, uid, uid)
    for f in planted.iterdir():
        os.chown(f, uid, uid)
    return planted, dep, plan


def test_exploit_another_users_state_dir_is_refused_not_read(tmp_path: Path, monkeypatch) -> None:
    """Another local user made ``$K2FLEET_STATE_DIR/<id>`` first and planted a relay secret
    and a Ray token: nothing is read from it (``plan``) or made in it (the deploy)."""
    from k2fleet.control import ControlError
    from k2fleet.control.artifacts import prepare_control_artifacts, read_control_artifacts

    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory of uid 65534")
    planted, dep, plan = _plant(tmp_path, monkeypatch, NOBODY)
    for call in (read_control_artifacts, prepare_control_artifacts):
        with pytest.raises(ControlError) as err:
            call(dep, plan)
        line = str(err.value)
        assert "\n" not in line and str(planted) in line and f"uid {NOBODY}" in line and "chmod 700" in line


def test_a_state_dir_others_may_write_is_refused(tmp_path: Path, monkeypatch) -> None:
    from k2fleet.control import ControlError
    from k2fleet.control.artifacts import read_control_artifacts

    planted, dep, plan = _plant(tmp_path, monkeypatch, os.geteuid(), 0o777)
    os.chmod(planted, 0o777)
    with pytest.raises(ControlError, match="mode 777"):
        read_control_artifacts(dep, plan)
    os.chmod(planted, 0o700)
    assert read_control_artifacts(dep, plan).relay_secret == b"planted-relay-secret\n"  # its own: read


# --------------------------------------------------------------------------- the role (@fake hosts)


def test_the_role_raises_the_value_only_where_the_check_fails(tmp_path: Path) -> None:
    """tests/test_roles_offline.py's harness: a host whose kernel value is below the plan's gets
    the drop-in and the write; its settled peer gets nothing (the settled case: that module's
    every-role test)."""
    import dataclasses

    from tests.test_roles_offline import H200, planned, run_roles, settled_fleet

    dep, plan, desired = planned(str(H200))
    value = desired["h200-1"].port_start
    assert value == privileged_ports.port_start(dep, plan) > dep.s.relay_port
    assert desired["h200-1"].files[privileged_ports.GROUP][privileged_ports.SYSCTL_PATH].content == \
        privileged_ports.sysctl_file(value).encode()
    facts = settled_fleet(dep, desired)
    facts["h200-1"] = dataclasses.replace(facts["h200-1"], checks={**facts["h200-1"].checks, privileged_ports.CHECK: 1},
                                          files={**facts["h200-1"].files, privileged_ports.SYSCTL_PATH: None})
    out = run_roles(dep, plan, desired, facts, tmp_path, [])
    raised = out.op("h200-1", "make ports below")
    assert raised.changed and raised.commands == [privileged_ports.apply_argv(value)]
    assert f"<upload> {privileged_ports.SYSCTL_PATH}" in out.op("h200-1", "sysctl drop-in").commands
    assert not [c for c in out.commands("h200-0") if "ip_unprivileged_port_start" in c]


def test_the_node_exporter_gets_the_capability_to_bind_its_port() -> None:
    from tests.test_roles_offline import planned

    dep, plan, desired = planned("inventories/h200.py", ("k2_metrics=true", "k2_node_exporter=true"))
    for d in desired.values():
        dropin = d.files[privileged_ports.GROUP][privileged_ports.NODE_EXPORTER_DROPIN]
        assert b"AmbientCapabilities=CAP_NET_BIND_SERVICE\n" in dropin.content and dropin.mode == "644"
    dep, plan, desired = planned("inventories/h200.py")
    assert all(privileged_ports.NODE_EXPORTER_DROPIN not in d.files[privileged_ports.GROUP] for d in desired.values())


def test_a_host_k2fleet_serves_nothing_on_keeps_its_sysctl() -> None:
    """The Slurm login host belongs to its site (slurmctld binds 6817 as user slurm): no drop-in."""
    from tests.test_roles_offline import artifacts
    from k2fleet.planning.desired import desired_state

    dep, plan = load_plan("inventories/gb200-trtllm-disagg.py")
    desired = desired_state(dep, plan, artifacts(dep, plan))
    for d in desired.values():
        assert privileged_ports.GROUP not in d.files and privileged_ports.CHECK not in d.checks


@pytest.mark.parametrize("sudo", [False, True], ids=["root-login", "sudo-login"])
def test_the_control_copys_tunnel_is_a_port_the_login_may_bind(tmp_path: Path, monkeypatch, sudo: bool) -> None:
    """sshd binds the reverse tunnel (``ssh -R 127.0.0.1:PORT:...``) as the login's user: a
    root login keeps the privileged k2_relay_port; a ``_sudo`` login, which may not bind a
    port below the value any more, gets the first unprivileged one (and the fetch is told so)."""
    import dataclasses

    from k2fleet.deploy import pipeline
    from k2fleet.planning.deployment import CHECKPOINT_CHECK
    from tests.test_roles_offline import H200, ControlCalls, checkpoint, fanout, planned, run_roles, settled_fleet

    calls = ControlCalls()
    for module, name in ((fanout, "prepare_control_copy"), (fanout, "relay_to_host"), (checkpoint, "send_token")):
        monkeypatch.setattr(module, name, lambda *a, _n=name, **k: calls.record(_n, k))
    become = ["sudo", "-n", "-H", "--"] if sudo else []
    monkeypatch.setattr(pipeline, "side_channel", lambda data, name: (f"ops@{name}", ["ssh"], become))
    dep, plan, desired = planned(str(H200))
    facts = settled_fleet(dep, desired)
    facts["h200-1"] = dataclasses.replace(facts["h200-1"], checks={**facts["h200-1"].checks, CHECKPOINT_CHECK: 1})
    run_roles(dep, plan, desired, facts, tmp_path, calls)
    call = calls.kwargs[calls.index("relay_to_host")]
    want = desired["h200-1"].port_start if sudo else dep.s.relay_port
    assert want == (29701 if sudo else 29700)
    assert call["tunnel_port"] == want and call["fetch_argv"][-2] == f"http://127.0.0.1:{want}"
    assert call["fetch_argv"][:len(become)] == become
