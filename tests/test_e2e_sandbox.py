"""End to end on the sandbox fleet: `pyinfra inventories/sandbox.py deploys/kimi.py`
against 3 real hosts (systemd, sshd, own addresses, no route out), engines being
k2fleet's test doubles (no GPUs here)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from k2fleet import sandbox
from k2fleet.synthetic import SANDBOX_MODEL, ensure_sandbox_checkpoint
from tests.sandbox_harness import deploy, hold_sandbox_lock, http_json, main_pid, ssh

pytestmark = pytest.mark.sandbox

TRT = {"K2FLEET_SANDBOX_SCENARIO": "trtllm-mpi"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, request):
    import os

    if os.geteuid() != 0:
        pytest.skip("the sandbox fleet needs root")
    lock = hold_sandbox_lock()
    state = tmp_path_factory.mktemp("k2state")
    mp = pytest.MonkeyPatch()
    mp.setenv("K2FLEET_STATE_DIR", str(state))
    ensure_sandbox_checkpoint()
    sandbox.down()  # start from fresh hosts: the deploy must work on bare ones
    hosts = sandbox.up(3)
    yield [dataclasses.asdict(h) for h in hosts]
    sandbox.down()
    mp.undo()
    lock.close()


def chat(address: str, port: int = 8000, tools: bool = False) -> dict:
    status, models = http_json(f"http://{address}:{port}/v1/models")
    assert status == 200, models
    name = models["data"][0]["id"]
    assert name == SANDBOX_MODEL or name.startswith("/srv/k2fleet/models/")  # trtllm-serve names it by path
    body = {"model": name, "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 32}
    if tools:
        body["tools"] = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]
    status, answer = http_json(f"http://{address}:{port}/v1/chat/completions", body)
    assert status == 200, answer
    return answer["choices"][0]


def test_preflight_refuses_a_host_before_any_change(fleet) -> None:
    result = deploy({"K2FLEET_SANDBOX_NIC": "eth9"})
    assert result.returncode != 0
    assert "preflight failed" in result.output and "k2_nic eth9 does not exist" in result.output
    assert "Starting operation" not in result.output  # stopped while planning: nothing ran
    for host in fleet:
        assert ssh(host, "ls /etc/k2fleet /opt/k2fleet 2>/dev/null | wc -l").stdout.strip() == "0"


def test_vllm_deploy_to_a_healthy_fleet(fleet) -> None:
    result = deploy()
    assert result.returncode == 0, result.output[-4000:]
    assert result.changed > 0
    for host in fleet:
        status, _ = http_json(f"http://{host['address']}:8000/health")
        assert status == 200, host["name"]
        choice = chat(host["address"])
        assert choice["message"]["content"].strip()
        assert choice["message"]["reasoning_content"].strip()  # kimi_k2 reasoning parser is on
        assert chat(host["address"], tools=True)["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        verified = ssh(host, "test -f /srv/k2fleet/models/*/*/.k2fleet/verified.json && echo yes").stdout.strip()
        assert verified == "yes"


def test_second_run_changes_nothing(fleet) -> None:
    result = deploy()
    assert result.returncode == 0, result.output[-4000:]
    assert result.changed == 0, result.output[-4000:]


def test_changing_one_engine_flag_restarts_only_the_engine_units(fleet) -> None:
    before = {h["name"]: (main_pid(h, "k2-vllm.service"), main_pid(h, "k2-mesh-sshd.service")) for h in fleet}
    result = deploy({"K2FLEET_SANDBOX_ENGINE_ARGS": '{"max-num-seqs": 64}'})
    assert result.returncode == 0, result.output[-4000:]
    for host in fleet:
        engine, mesh = main_pid(host, "k2-vllm.service"), main_pid(host, "k2-mesh-sshd.service")
        assert engine != before[host["name"]][0], f"{host['name']}: k2-vllm was not restarted"
        assert mesh == before[host["name"]][1], f"{host['name']}: the mesh sshd was restarted"
        assert "--max-num-seqs 64" in ssh(host, "cat /etc/systemd/system/k2-vllm.service").stdout
        assert chat(host["address"])["message"]["content"]
    again = deploy({"K2FLEET_SANDBOX_ENGINE_ARGS": '{"max-num-seqs": 64}'})
    assert again.returncode == 0 and again.changed == 0, again.output[-3000:]


def test_dry_run_touches_nothing(fleet) -> None:
    units = {h["name"]: ssh(h, "sha256sum /etc/systemd/system/k2-vllm.service").stdout for h in fleet}
    pids = {h["name"]: main_pid(h, "k2-vllm.service") for h in fleet}
    result = deploy({"K2FLEET_SANDBOX_ENGINE_ARGS": '{"max-num-seqs": 8}'}, "--dry")
    assert result.returncode == 0, result.output[-4000:]
    for host in fleet:
        assert ssh(host, "sha256sum /etc/systemd/system/k2-vllm.service").stdout == units[host["name"]]
        assert main_pid(host, "k2-vllm.service") == pids[host["name"]]


def test_model_type_fallback_serves_an_overlay_and_leaves_verified_files_alone(fleet) -> None:
    env = {"K2FLEET_SANDBOX_MODEL_TYPE": "deepseek_v3"}
    result = deploy(env)
    assert result.returncode == 0, result.output[-4000:]
    for host in fleet:
        status, models = http_json(f"http://{host['address']}:8000/v1/models")
        assert status == 200 and "deepseek_v3" in json.dumps(models), models
        base = ssh(host, "ls -d /srv/k2fleet/models/*/*[0-9a-f] | head -1").stdout.strip()
        assert '"model_type": "kimi_k2"' in ssh(host, f"cat {base}/config.json").stdout  # verified file untouched
        assert ssh(host, f"python3 /opt/k2fleet/lib/verify.py --full {base}", check=False).returncode == 0
        manifest = json.loads(ssh(host, f"cat {base}/.k2fleet/manifest.json").stdout)
        assert manifest["overlay"]["model_type"] == "deepseek_v3"  # recorded in the manifest
    again = deploy(env)
    assert again.returncode == 0 and again.changed == 0, again.output[-3000:]


def test_trtllm_two_node_mpirun_over_the_mesh(fleet) -> None:
    result = deploy(TRT)
    assert result.returncode == 0, result.output[-4000:]
    head, worker = fleet[0], fleet[1]
    choice = chat(head["address"])
    assert choice["message"]["content"].strip()
    # the rank processes really run on both hosts, launched by mpirun over port 2233
    assert int(ssh(worker, "pgrep -fc 'trtllm-serve serve' || true").stdout.strip() or 0) >= 8
    assert "k2-vllm" not in ssh(head, "ls /etc/systemd/system").stdout  # stale units removed
    again = deploy(TRT)
    assert again.returncode == 0 and again.changed == 0, again.output[-3000:]


MPI = "mpirun --allow-run-as-root -np 2 -H {a}:1,{b}:1 -mca plm_rsh_agent ssh -mca plm_rsh_args '{rsh}' hostname"
GOOD = "-p 2233 -F /etc/k2fleet/mesh/ssh_config"


def test_mpirun_mesh_works_only_with_the_right_port_key_and_known_hosts(fleet) -> None:
    head, worker = fleet[0], fleet[1]
    run = lambda rsh: ssh(head, MPI.format(a=head["address"], b=worker["address"], rsh=rsh) + " 2>&1", check=False)
    explicit = ("-p 2233 -i /etc/k2fleet/mesh/id_ed25519 -o IdentitiesOnly=yes -o UserKnownHostsFile=/etc/k2fleet/mesh/known_hosts "
                "-o StrictHostKeyChecking=yes -o BatchMode=yes")
    for rsh in (GOOD, explicit):
        ok = run(rsh)
        assert ok.returncode == 0, ok.stdout
        assert sorted(ok.stdout.split()) == sorted([head["name"], worker["name"]])
    ssh(head, "test -f /tmp/other_key || ssh-keygen -q -t ed25519 -N '' -f /tmp/other_key")
    ssh(head, ": > /tmp/empty_known_hosts")
    bad = {
        "wrong port": "-p 22 -F /etc/k2fleet/mesh/ssh_config",
        "wrong key": "-p 2233 -i /tmp/other_key -o IdentitiesOnly=yes -o UserKnownHostsFile=/etc/k2fleet/mesh/known_hosts "
                     "-o StrictHostKeyChecking=yes -o BatchMode=yes",
        "empty known_hosts": "-p 2233 -F /etc/k2fleet/mesh/ssh_config -o UserKnownHostsFile=/tmp/empty_known_hosts",
    }
    for what, rsh in bad.items():
        result = run(rsh)
        assert result.returncode != 0, f"mpirun succeeded with {what}: {result.stdout}"
