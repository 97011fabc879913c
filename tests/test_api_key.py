"""``k2_api_key_file``: the endpoints' API key goes from a root-only file on the control
machine to root-only files on hosts (the unit's ``EnvironmentFile=``, the health gate's
``--api-key-file``) and nowhere else: not argv, not the plan (text or JSON), not a unit.
The vLLM TEST DOUBLE enforces it as vLLM does (``VLLM_API_KEY``, 401 on /v1, /health
open); the health gate sends it; on the sandbox an endpoint answers 401 without the key
and a completion with it."""

from __future__ import annotations

import json
import os
import secrets
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from k2fleet.cli import format_plan, load_plan, plan_document
from k2fleet.control.artifacts import read_control_artifacts
from k2fleet.hostprogs import health
from k2fleet.planning.desired import desired_state
from k2fleet.planning.units import api_key_paths, unit_file
from tests.test_doubles import LOCAL, Procs, base_env, free_port, model, procs, vllm, wait_status  # noqa: F401 (fixtures)


def key_file(directory: Path, key: str, mode: int = 0o600) -> str:
    path = directory / "api-key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, (key + "\n").encode())
    os.close(fd)
    os.chmod(path, mode)
    return str(path)


@pytest.mark.parametrize("inventory", ["inventories/h200.py", "inventories/mi300x.py", "inventories/h200-dp-ep.py"])
def test_the_key_is_in_no_argv_plan_or_unit_only_in_two_private_files(tmp_path: Path, inventory: str) -> None:
    key = "k2-" + secrets.token_hex(20)
    path = key_file(tmp_path, key)
    dep, plan = load_plan(inventory, [f"k2_api_key_file={path}"])
    shown = format_plan(plan, dep.s.api_key_file, dep.api_model_name) + json.dumps(plan_document(dep, plan))
    assert key not in shown and key[3:15] not in shown
    assert f'-H "Authorization: Bearer $(cat {path})"' in shown  # the printed curl line reads the file
    key_path, env_path = api_key_paths(dep)
    desired = desired_state(dep, plan, read_control_artifacts(dep, plan))
    served = 0
    for hp in plan.hosts.values():
        d = desired[hp.name]
        for svc in hp.services:
            assert key not in " ".join(svc.argv) and key not in json.dumps(svc.env)
            unit = unit_file(dep, svc)
            assert key not in unit
            assert (f"EnvironmentFile={env_path}" in unit) == (svc.health is not None)
            if dep.runtime == "container" and svc.health:
                assert svc.argv[svc.argv.index("VLLM_API_KEY") - 1] == "-e"  # the name only
        files = {p: spec for role in d.files.values() for p, spec in role.items()}
        files |= {p: spec for role in d.service_files.values() for p, spec in role.items()}
        holding = {p for p, spec in files.items() if spec.content and key.encode() in spec.content}
        if any(svc.health for svc in hp.services):
            served += 1
            assert holding == {key_path, env_path}
            assert files[key_path].content == (key + "\n").encode()
            assert files[env_path].content == f'VLLM_API_KEY="{key}"\n'.encode()
            assert {files[p].mode for p in holding} == {"600"}
            assert d.health_argv[d.health_argv.index("--api-key-file") + 1] == key_path
            assert "--api-key-file" in d.checks["healthy"] and key not in json.dumps(d.checks)
            for p in holding:
                assert d.to_json()["files"][p] == {"mode": "600", "sha256": "(secret)", "bytes": None,
                                                  "origin": "api-key"}
        else:
            assert not holding  # headless ranks never get the key
    assert served >= 1


def test_without_the_key_nothing_changes(tmp_path: Path) -> None:
    dep, plan = load_plan("inventories/h200.py")
    d = next(iter(desired_state(dep, plan, read_control_artifacts(dep, plan)).values()))
    assert d.files["api_key"] == {} and "--api-key-file" not in d.health_argv
    assert "api-key" not in unit_file(dep, plan.hosts[d.name].services[0])


def test_the_vllm_double_and_the_health_gate_use_the_key(procs: Procs, model: str, tmp_path: Path) -> None:  # noqa: F811
    key = secrets.token_hex(16)
    port = free_port()
    procs.start(vllm(model, "--host", LOCAL, "--port", str(port), "--served-model-name", "kimi-k2", "-tp", "8"),
                env=base_env(VLLM_API_KEY=key))
    url = f"http://{LOCAL}:{port}"
    wait_status(f"{url}/health", 200)  # open, as in vLLM
    body = json.dumps({"model": "kimi-k2", "messages": [{"role": "user", "content": "hi"}]}).encode()
    for sent in (None, "wrong-" + key, key):
        status, _ = health.request(f"{url}/v1/chat/completions", body, key=sent)
        assert status == (200 if sent == key else 401), sent
    assert health.request(f"{url}/v1/models")[0] == 401
    good = key_file(tmp_path, key)
    argv = ["--base", url, "--model", "kimi-k2", "--unit", "k2-vllm.service", "--timeout", "3"]
    assert health.main([*argv, "--api-key-file", good]) == 0
    (tmp_path / "wrong").mkdir()
    assert health.main([*argv, "--timeout", "2", "--api-key-file", key_file(tmp_path / "wrong", "x" + key)]) == 1
    assert health.main([*argv, "--timeout", "2"]) == 1  # no key: 401 until the timeout


# --------------------------------------------------------------------------- sandbox

SANDBOX_HOSTS = 1  # read by the sandbox_fleet fixture (tests/conftest.py)


def _chat(url: str, key: str | None, model: str = "k2fleet-test/Kimi-K2-Thinking-synthetic") -> tuple[int, dict]:
    body = json.dumps({"model": model,
                       "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}


@pytest.mark.sandbox
def test_sandbox_endpoint_needs_the_key_and_the_gate_passes_with_it(fleet, tmp_path: Path) -> None:
    key = secrets.token_hex(24)
    path = key_file(tmp_path, key)
    result = fleet.deploy({"k2_api_key_file": path})
    assert result.returncode == 0, result.tail()  # the deploy's health gate passed with the key
    assert key not in result.log
    host = fleet.hosts[0]
    url = f"http://{host['address']}:8000/v1/chat/completions"
    assert _chat(url, None)[0] == 401
    assert _chat(url, "not-" + key)[0] == 401
    status, answer = _chat(url, key)
    assert status == 200 and answer["choices"][0]["message"]
    from k2sandbox.harness import ssh

    modes = ssh(host, "stat -c '%a %U %n' /etc/k2fleet/api-key /etc/k2fleet/env/api-key.env; "
                      "tr '\\0' ' ' < /proc/$(systemctl show -p MainPID --value k2-vllm.service)/cmdline").stdout
    assert "600 root /etc/k2fleet/api-key\n600 root /etc/k2fleet/env/api-key.env\n" in modes
    assert key not in modes  # not in the engine's argv
    fleet.forget()  # the next module's deploy starts without the key
