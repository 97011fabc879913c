"""``k2fleet status``, offline: the pure :func:`~k2fleet.planning.host_status.host_status` over
constructed HostState facts (a settled host, then one change at a time, each named), the
CLI's table and ``--json`` with the fact gathering replaced at its seam
(:func:`k2fleet.deploy.status.gather_facts`), its exit codes, and a bad inventory refused
in one line (exit 2) before any connection. Also: what status names, the deploy repairs
(``host_actions`` holds it: a disabled unit and a lost hold make a host unsettled, and the
roles enable / hold again)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from k2fleet import cli
from k2fleet.control import artifacts as control_artifacts
from k2fleet.control import checkpoint_copy
from k2fleet.deploy import status as gathering
from k2fleet.planning.deployment import CHECKPOINT_CHECK
from k2fleet.planning.desired import HEALTH_CHECK, FileSpec, HostDesired
from k2fleet.planning.host_actions import host_actions
from k2fleet.planning.host_bootstrap import GPU_GATE_CHECK
from k2fleet.planning.host_fact import HostReport
from k2fleet.planning.host_status import host_status
from tests.test_roles_offline import (H200, artifacts, control_calls, planned, run_roles,  # noqa: F401 (fixture)
                                      settled, settled_fleet)

UNIT = "k2-vllm.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT}"


@pytest.fixture(scope="module")
def fleet() -> tuple[Any, Any, dict[str, HostDesired]]:
    return planned(str(H200))


def _one(fleet: Any) -> tuple[Any, HostDesired, HostReport]:
    dep, _, desired = fleet
    d = desired["h200-0"]
    return dep, d, settled(dep, d)


def _status(dep: Any, d: HostDesired, fact: HostReport):
    return host_status(d, fact, {"engine": dep.engine}, tuple(ws.check for ws in dep.weight_sets))


def _lines(status: Any) -> list[str]:
    return [item.line() for item in status.drift]


def _held_package(d: HostDesired) -> str:
    assert d.bootstrap is not None
    return next(p.name for p in d.bootstrap.packages if p.hold and p.version)


# --------------------------------------------------------------------------- host_status (pure)


def test_a_settled_host_has_no_drift(fleet: Any) -> None:
    dep, d, fact = _one(fleet)
    status = _status(dep, d, fact)
    assert status.ok and status.drift == ()
    assert host_actions(d, fact).settled
    assert status.units[UNIT] == "active/enabled"
    assert status.checkpoint == {CHECKPOINT_CHECK: "verified"}
    assert status.checks[HEALTH_CHECK] == "ok"
    assert status.engine["running_version"] is None  # the fact does not report it: unknown
    assert status.driver["driver"] == "570.86.15" and status.driver["gate"] == "ok"


def test_a_changed_unit_file_is_named(fleet: Any) -> None:
    dep, d, fact = _one(fleet)
    edited = dataclasses.replace(fact, files={**fact.files, UNIT_PATH: "f" * 64})
    (line,) = _lines(_status(dep, d, edited))
    assert line.startswith(f"file {UNIT_PATH}: content differs (sha256 ffffffffffff…, planned ")
    gone = dataclasses.replace(fact, files={**fact.files, UNIT_PATH: None})
    assert _lines(_status(dep, d, gone)) == [f"file {UNIT_PATH}: missing"]


def test_an_inactive_or_disabled_unit_is_named(fleet: Any) -> None:
    dep, d, fact = _one(fleet)
    failed = dataclasses.replace(fact, units={**fact.units, UNIT: {**fact.units[UNIT], "ActiveState": "failed"}})
    assert _lines(_status(dep, d, failed)) == [f"unit {UNIT}: failed/enabled (planned active)"]
    disabled = dataclasses.replace(fact, units={**fact.units, UNIT: {**fact.units[UNIT], "UnitFileState": "disabled"}})
    assert _lines(_status(dep, d, disabled)) == [f"unit {UNIT}: active/disabled (planned enabled)"]
    assert host_actions(d, disabled).enable == (UNIT,) and not host_actions(d, disabled).settled


def test_a_held_package_upgraded_or_unheld_is_named(fleet: Any) -> None:
    dep, d, fact = _one(fleet)
    name = _held_package(d)
    unheld = dataclasses.replace(fact, boot=dataclasses.replace(fact.boot, holds=tuple(h for h in fact.boot.holds
                                                                                          if h != name)))
    have = fact.boot.package_versions[name]
    assert _lines(_status(dep, d, unheld)) == [f"hold {name}: not held (installed {have})"]
    assert host_actions(d, unheld).holds == (name,) and not host_actions(d, unheld).settled
    # apt-mark unhold + an upgrade: another version, and not held
    upgraded = dataclasses.replace(unheld, boot=dataclasses.replace(
        unheld.boot, package_versions={**fact.boot.package_versions, name: "999.1.2-1"}))
    lines = _lines(_status(dep, d, upgraded))
    assert f"hold {name}: not held (installed 999.1.2-1)" in lines
    assert any(line.startswith(f"package {name}: installed 999.1.2-1, planned ") for line in lines), lines


def test_failing_checks_are_named_by_kind(fleet: Any) -> None:
    dep, d, fact = _one(fleet)
    bad = dataclasses.replace(fact, checks={**fact.checks, CHECKPOINT_CHECK: 1, HEALTH_CHECK: 1, GPU_GATE_CHECK: None})
    assert sorted(_lines(_status(dep, d, bad))) == sorted([
        f"checkpoint {CHECKPOINT_CHECK}: marker not verified (failing (exit 1))",
        f"health {HEALTH_CHECK}: failing (exit 1)",
        f"gpu-gate {GPU_GATE_CHECK}: did not finish"])
    assert _status(dep, d, bad).checkpoint == {CHECKPOINT_CHECK: "not verified"}


def test_a_secret_file_is_named_without_its_digest(fleet: Any) -> None:
    dep, d, fact = _one(fleet)
    path = "/etc/k2fleet/api-key"
    secret = dataclasses.replace(d, files={**d.files, "api_key": {path: FileSpec(b"KEY\n", "600", "api-key", secret=True)}})
    lines = _lines(_status(dep, secret, dataclasses.replace(fact, files={**fact.files, path: "a" * 64})))
    assert lines == [f"file {path}: content differs (secret)"]


# --------------------------------------------------------------------------- the deploy repairs what status names


def test_the_deploy_enables_a_disabled_unit_and_holds_again(fleet: Any, tmp_path: Path,
                                                           control_calls: list[str]) -> None:  # noqa: F811
    dep, plan, desired = fleet
    facts = settled_fleet(dep, desired)
    name = _held_package(desired["h200-0"])
    f = facts["h200-0"]
    facts["h200-0"] = dataclasses.replace(
        f, units={**f.units, UNIT: {**f.units[UNIT], "UnitFileState": "disabled"}},
        boot=dataclasses.replace(f.boot, holds=tuple(h for h in f.boot.holds if h != name)))
    out = run_roles(dep, plan, desired, facts, tmp_path, control_calls)
    commands = out.commands("h200-0")
    assert any(f"systemctl enable --now {UNIT}" in c for c in commands), commands
    assert any("apt-mark hold" in c and name in c for c in commands), commands
    assert not any(f"enable --now {UNIT}" in c for c in out.commands("h200-1"))


# --------------------------------------------------------------------------- the command


@pytest.fixture
def seam(monkeypatch: pytest.MonkeyPatch, fleet: Any) -> dict[str, Any]:
    """The fact gathering replaced: ``seam["facts"]`` is what it returns, ``seam["calls"]`` its calls."""
    dep, plan, desired = fleet
    got: dict[str, Any] = {"facts": settled_fleet(dep, desired), "calls": []}

    def gather(inventory: str, data: Any, queries: dict[str, Any]) -> dict[str, Any]:
        got["calls"].append((inventory, list(data), sorted(queries)))
        return got["facts"]

    monkeypatch.setattr(gathering, "gather_facts", gather)
    monkeypatch.setattr(control_artifacts, "read_control_artifacts", lambda dep, plan: artifacts(dep, plan))
    # the fixture's desired state holds no manifest pin: so does the command's (whatever this machine's cache holds)
    monkeypatch.setattr(checkpoint_copy, "manifest_pins", lambda dep, fetch: {})
    return got


def test_status_of_a_healthy_fleet_exits_0(seam: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", str(H200)]) == 0
    out = capsys.readouterr().out
    assert seam["calls"] == [(str(H200), [], ["h200-0", "h200-1"])]
    table = out.splitlines()[1:4]
    assert table[0].split() == ["HOST", "STATE", "UNITS", "CHECKPOINT", "HEALTH", "DRIFT"]
    assert table[1].split() == ["h200-0", "ok", "4/4", "active", "verified", "ok", "0"]
    assert f"  units: {UNIT} active/enabled" in out
    assert "running unknown" in out and "drift: none" in out
    assert out.rstrip().endswith("status: 2 hosts, all settled and healthy")


def test_status_names_each_drift_and_exits_1(seam: dict[str, Any], fleet: Any,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    dep, _, desired = fleet
    name = _held_package(desired["h200-1"])
    f = seam["facts"]["h200-1"]
    seam["facts"]["h200-1"] = dataclasses.replace(
        f, files={**f.files, UNIT_PATH: "0" * 64}, checks={**f.checks, CHECKPOINT_CHECK: 1},
        boot=dataclasses.replace(f.boot, holds=tuple(h for h in f.boot.holds if h != name)))
    assert cli.main(["status", str(H200)]) == 1
    out = capsys.readouterr().out
    assert f"  drift: file {UNIT_PATH}: content differs" in out
    assert f"  drift: hold {name}: not held" in out
    assert f"  drift: checkpoint {CHECKPOINT_CHECK}: marker not verified" in out
    assert "status: 2 hosts, 1 with drift or ill health: h200-1" in out
    assert cli.main(["status", str(H200), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["hosts"]["h200-0"]["ok"] is True
    kinds = {(d["kind"], d["subject"]) for d in doc["hosts"]["h200-1"]["drift"]}
    assert kinds == {("file", UNIT_PATH), ("hold", name), ("checkpoint", CHECKPOINT_CHECK)}


def test_status_json_of_a_healthy_fleet(seam: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", str(H200), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True and doc["engine"] == "vllm" and doc["completion"] is None
    host = doc["hosts"]["h200-0"]
    assert host["units"][UNIT] == "active/enabled" and host["drift"] == [] and host["error"] is None
    assert host["checkpoint"] == {CHECKPOINT_CHECK: "verified"} and host["engine"]["running_version"] is None


def test_an_unreached_host_is_named_and_exits_1(seam: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    seam["facts"]["h200-1"] = "ConnectError: could not connect to 192.0.2.11"
    assert cli.main(["status", str(H200)]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[3].split() == ["h200-1", "unreachable", "-", "-", "-", "1"]
    assert "drift: host h200-1: not reached: ConnectError: could not connect to 192.0.2.11" in out


def test_completion_through_the_endpoint(seam: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from k2fleet.control import endpoint

    asked: list[tuple] = []
    monkeypatch.setattr(endpoint.health, "chat", lambda base, model, key=None, tls=None: asked.append((base, model, key))
                        or "yes")
    assert cli.main(["status", str(H200), "--completion"]) == 0
    assert asked == [("http://192.0.2.10:8000", "moonshotai/Kimi-K2-Thinking", None)]
    assert "endpoint http://192.0.2.10:8000/v1: ok: completion: 'yes'" in capsys.readouterr().out

    def refused(*a: Any, **k: Any) -> str:
        raise OSError("connection refused")

    monkeypatch.setattr(endpoint.health, "chat", refused)
    assert cli.main(["status", str(H200), "--completion", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["hosts"]["h200-0"]["ok"] and doc["completion"] == {
        "ok": False, "detail": "chat completion failed: connection refused"}


def test_a_bad_inventory_is_refused_before_any_connection(seam: dict[str, Any], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        cli.main(["status", str(H200), "--data", "k2_port=99999"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "k2_port" in err
    assert seam["calls"] == []


def test_gather_facts_through_pyinfra_on_loopback(tmp_path: Path) -> None:
    """The real seam, through pyinfra's API: ``@local`` (this machine, the probe only reads)
    answers a HostReport; a host whose probe gives nothing is named, not raised. In a
    subprocess: the gathering patches the socket module for gevent, as pyinfra's CLI does."""
    import subprocess
    import sys

    inventory = tmp_path / "local.py"
    inventory.write_text('hosts = ["@local", "@fake/silent"]\n')
    code = ("import json, sys\nfrom k2fleet.deploy.status import gather_facts\n"
            f"out = gather_facts({str(inventory)!r}, [], {{'@local': {{'disk_path': '/', 'files': ['/etc/hostname']}},"
            " '@fake/silent': {'disk_path': '/'}})\n"
            "print(json.dumps({k: v if isinstance(v, str) else sorted(v.files) for k, v in out.items()}))\n")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root,
                         env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == {"@local": ["/etc/hostname"],
                                                        "@fake/silent": "the HostState probe gave no report"}
