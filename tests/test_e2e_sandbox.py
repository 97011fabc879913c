"""End to end on the sandbox fleet: the real pyinfra CLI, ``pyinfra -y --json [--data ...]
inventories/sandbox.py deploys/kimi.py`` (and ``inventories/sandbox-trtllm-mpi.py``),
against 3 real hosts (systemd, sshd, own addresses, no route out), engines being
k2fleet's test doubles (no GPUs here).

Each test gets the fleet state it needs from the ``fleet`` fixture (tests/conftest.py)
— bare, or deployed with given ``--data`` — never from an earlier test.
"""

from __future__ import annotations

import json

import pytest

from k2sandbox.checkpoint_cache import SANDBOX_MODEL
from k2sandbox.harness import TRTLLM_INVENTORY, SandboxFleet, http_json, main_pid, ssh

pytestmark = pytest.mark.sandbox

MAX_SEQS_64 = {"k2_engine_args": {"max-num-seqs": 64}}
DEEPSEEK_OVERLAY = {"k2_model_type_override": "deepseek_v3"}
MANAGED = "/etc/k2fleet /opt/k2fleet /srv/k2fleet /etc/systemd/system"


@pytest.fixture
def vllm_fleet(fleet: SandboxFleet) -> SandboxFleet:
    """The fleet serving inventories/sandbox.py as it is (no --data)."""
    fleet.ensure_deployed()
    return fleet


@pytest.fixture
def trtllm_fleet(fleet: SandboxFleet) -> SandboxFleet:
    """The fleet serving inventories/sandbox-trtllm-mpi.py (hosts 1-2)."""
    fleet.ensure_deployed(inventory=TRTLLM_INVENTORY)
    return fleet


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


def _managed_state(host: dict) -> str:
    """Every file k2fleet manages on ``host``, with size and mtime (empty on a bare host)."""
    return ssh(host, f"find {MANAGED} -xdev -printf '%p %s %T@\\n' 2>/dev/null | sort").stdout


def test_preflight_refuses_a_host_before_any_change(fleet: SandboxFleet) -> None:
    before = {h["name"]: _managed_state(h) for h in fleet.hosts}
    result = fleet.deploy({"k2_nic": "eth9"})
    assert result.returncode != 0
    assert "preflight failed" in result.output and "k2_nic eth9 does not exist" in result.output, result.tail()
    assert not result.ran_operations and "Starting operation" not in result.output  # stopped while planning
    for host in fleet.hosts:
        assert _managed_state(host) == before[host["name"]], host["name"]


def test_vllm_deploy_to_a_healthy_fleet(fleet: SandboxFleet) -> None:
    fleet.ensure_bare()
    result = fleet.deploy()
    assert result.returncode == 0, result.tail()
    assert result.changed > 0
    for host in fleet.hosts:
        status, _ = http_json(f"http://{host['address']}:8000/health")
        assert status == 200, host["name"]
        choice = chat(host["address"])
        assert choice["message"]["content"].strip()
        assert choice["message"]["reasoning_content"].strip()  # kimi_k2 reasoning parser is on
        assert chat(host["address"], tools=True)["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        verified = ssh(host, "test -f /srv/k2fleet/models/*/*/.k2fleet/verified.json && echo yes").stdout.strip()
        assert verified == "yes"


def test_second_run_changes_nothing(vllm_fleet: SandboxFleet) -> None:
    result = vllm_fleet.deploy()
    assert result.returncode == 0, result.tail()
    assert result.changed == 0, result.changed_operations


def test_changing_one_engine_flag_restarts_only_the_engine_units(vllm_fleet: SandboxFleet) -> None:
    fleet = vllm_fleet
    before = {h["name"]: (main_pid(h, "k2-vllm.service"), main_pid(h, "k2-mesh-sshd.service")) for h in fleet.hosts}
    result = fleet.deploy(MAX_SEQS_64)
    assert result.returncode == 0, result.tail()
    for host in fleet.hosts:
        engine, mesh = main_pid(host, "k2-vllm.service"), main_pid(host, "k2-mesh-sshd.service")
        assert engine != before[host["name"]][0], f"{host['name']}: k2-vllm was not restarted"
        assert mesh == before[host["name"]][1], f"{host['name']}: the mesh sshd was restarted"
        assert "--max-num-seqs 64" in ssh(host, "cat /etc/systemd/system/k2-vllm.service").stdout
        assert chat(host["address"])["message"]["content"]
    again = fleet.deploy(MAX_SEQS_64)
    assert again.returncode == 0 and again.changed == 0, again.changed_operations or again.tail()


def test_dry_run_touches_nothing(vllm_fleet: SandboxFleet) -> None:
    fleet = vllm_fleet
    units = {h["name"]: ssh(h, "sha256sum /etc/systemd/system/k2-vllm.service").stdout for h in fleet.hosts}
    pids = {h["name"]: main_pid(h, "k2-vllm.service") for h in fleet.hosts}
    result = fleet.deploy({"k2_engine_args": {"max-num-seqs": 8}}, extra=("--dry",))
    assert result.returncode == 0, result.tail()
    assert result.payload is not None and result.payload["results"] is None  # planned, not run
    for host in fleet.hosts:
        assert ssh(host, "sha256sum /etc/systemd/system/k2-vllm.service").stdout == units[host["name"]]
        assert main_pid(host, "k2-vllm.service") == pids[host["name"]]


def test_model_type_fallback_serves_an_overlay_and_leaves_verified_files_alone(fleet: SandboxFleet) -> None:
    result = fleet.deploy(DEEPSEEK_OVERLAY)
    assert result.returncode == 0, result.tail()
    for host in fleet.hosts:
        status, models = http_json(f"http://{host['address']}:8000/v1/models")
        assert status == 200 and "deepseek_v3" in json.dumps(models), models
        base = ssh(host, "ls -d /srv/k2fleet/models/*/*[0-9a-f] | head -1").stdout.strip()
        assert '"model_type": "kimi_k2"' in ssh(host, f"cat {base}/config.json").stdout  # verified file untouched
        assert ssh(host, f"python3 /opt/k2fleet/lib/k2fleet-host.pyz verify --full {base}", check=False).returncode == 0
        manifest = json.loads(ssh(host, f"cat {base}/.k2fleet/manifest.json").stdout)
        assert manifest["overlay"]["model_type"] == "deepseek_v3"  # recorded in the manifest
    again = fleet.deploy(DEEPSEEK_OVERLAY)
    assert again.returncode == 0 and again.changed == 0, again.changed_operations or again.tail()


def test_trtllm_two_node_mpirun_over_the_mesh(vllm_fleet: SandboxFleet) -> None:
    fleet = vllm_fleet  # serving vLLM first: switching engines must remove its units
    result = fleet.deploy(inventory=TRTLLM_INVENTORY)
    assert result.returncode == 0, result.tail()
    head, worker = fleet.hosts[0], fleet.hosts[1]
    choice = chat(head["address"])
    assert choice["message"]["content"].strip()
    # the rank processes really run on both hosts, launched by mpirun over port 2233
    assert int(ssh(worker, "pgrep -fc 'trtllm-serve serve' || true").stdout.strip() or 0) >= 8
    assert "k2-vllm" not in ssh(head, "ls /etc/systemd/system").stdout  # stale units removed
    again = fleet.deploy(inventory=TRTLLM_INVENTORY)
    assert again.returncode == 0 and again.changed == 0, again.changed_operations or again.tail()


MPI = "mpirun --allow-run-as-root -np 2 -H {a}:1,{b}:1 -mca plm_rsh_agent ssh -mca plm_rsh_args '{rsh}' hostname"
GOOD = "-p 2233 -F /etc/k2fleet/mesh/ssh_config"


def test_mpirun_mesh_works_only_with_the_right_port_key_and_known_hosts(trtllm_fleet: SandboxFleet) -> None:
    head, worker = trtllm_fleet.hosts[0], trtllm_fleet.hosts[1]
    # stdout: what the ranks printed; stderr: mpirun's own messages (OpenMPI's rsh launcher may
    # warn "setpgid(...) failed in parent ... Permission denied" when the child won the race: harmless)
    run = lambda rsh: ssh(head, MPI.format(a=head["address"], b=worker["address"], rsh=rsh), check=False)
    explicit = ("-p 2233 -i /etc/k2fleet/mesh/id_ed25519 -o IdentitiesOnly=yes -o UserKnownHostsFile=/etc/k2fleet/mesh/known_hosts "
                "-o StrictHostKeyChecking=yes -o BatchMode=yes")
    for rsh in (GOOD, explicit):
        ok = run(rsh)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert sorted(ok.stdout.split()) == sorted([head["name"], worker["name"]]), ok.stdout + ok.stderr
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
        assert result.returncode != 0, f"mpirun succeeded with {what}: {result.stdout}{result.stderr}"
    # only the head holds a mesh key, and nobody logs into the head's mesh sshd (DenyUsers *)
    assert ssh(worker, "test -e /etc/k2fleet/mesh/id_ed25519 && echo yes || echo no").stdout.strip() == "no"
    ssh(worker, "test -f /tmp/worker_key || ssh-keygen -q -t ed25519 -N '' -f /tmp/worker_key")
    into_head = ssh(worker, f"ssh -p 2233 -i /tmp/worker_key -o BatchMode=yes -o StrictHostKeyChecking=no "
                            f"-o UserKnownHostsFile=/dev/null root@{head['address']} true", check=False)
    assert into_head.returncode != 0, into_head.stdout + into_head.stderr
