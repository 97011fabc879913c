"""``k2fleet rehearse INVENTORY``: a user's own inventory on bare sandbox hosts (engine
test doubles, simulated GPUs), through the real CLI.

The rehearse command takes the sandbox lock (``/tmp/k2sb.lock``) itself for as long as
it uses the sandbox, so these tests do not hold it around the command (the lock is not
re-entrant across processes); other modules' fixtures hold it module-wide, so a
rehearsal waits for them. Each rehearsal leaves the sandbox down.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

import pytest

from k2sandbox import nspawn as sandbox
from k2sandbox.rehearse import connection_overlay, failure_summary, generated_inventory, inventory_groups
from k2sandbox.harness import ROOT, tool
from tests.fleet_calls import call_kept_fleet

REHEARSAL_TIMEOUT_S = 600


def rehearse(*args: str, timeout: float = REHEARSAL_TIMEOUT_S) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = subprocess.run([tool("k2fleet"), "rehearse", *args], cwd=ROOT, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout)
    return proc, time.monotonic() - started


def last_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def sandbox_is_down() -> bool:
    with sandbox.hold_sandbox_lock():
        return not sandbox.status() and not sandbox._sandbox_netns()


def check_serving(proc: subprocess.CompletedProcess, inventory: str, endpoints: int, key: str | None = None) -> None:
    """A kept rehearsal (``--keep``): it ended healthy with a settled re-run, and the TEST calls the
    fleet itself (:func:`tests.fleet_calls.call_kept_fleet`, with the fleet's API ``key``) rather
    than taking "healthy" from the command's own last line."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert last_line(proc) == f"rehearsal {inventory}: {endpoints}/{endpoints} endpoints healthy, re-run 0 changes"
    call_kept_fleet(proc.stdout, endpoints, key)


def rehearse_kept(inventory: str, endpoints: int, *args: str, check=None) -> subprocess.CompletedProcess:
    """``k2fleet rehearse INVENTORY --keep``, :func:`check_serving`, then ``check(proc)`` on the kept
    fleet. The sandbox is brought down afterwards (``k2fleet sandbox down``) and must be down."""
    proc, seconds = rehearse(inventory, "--keep", *args)
    print(f"rehearse {inventory}: {seconds:.0f}s")
    try:
        check_serving(proc, inventory, endpoints)
        if check is not None:
            check(proc)
    finally:
        subprocess.run([tool("k2fleet"), "sandbox", "down"], cwd=ROOT, capture_output=True, timeout=300)
    assert sandbox_is_down()
    return proc


# ---------------------------------------------------------------- offline


def test_generated_inventory_keeps_groups_host_and_inline_group_data() -> None:
    groups = inventory_groups(ROOT / "inventories/h200-sglang-pd.py")
    names = [h for value in groups.values() if isinstance(value, tuple) for h, _ in value[0]]
    hosts = [sandbox.SandboxHost(f"k2sb-{i}", f"10.213.0.{10 + i}", "root", "/k", "/kh") for i in range(1, 6)]
    text = generated_inventory("inventories/h200-sglang-pd.py", groups, connection_overlay(names, hosts))
    ns: dict = {}
    exec(text, ns)  # noqa: S102 - our own generated text
    assert ns["prefill"][1]["k2_role"] == "prefill" and ns["decode"][1]["k2_tp"] == 16
    assert ns["router"][0] == [("router-0", {"ssh_hostname": "10.213.0.15", "ssh_user": "root", "ssh_key": "/k",
                                            "ssh_known_hosts_file": "/kh", "ssh_strict_host_key_checking": "yes",
                                            "k2_address": "10.213.0.15", "k2_nic": "eth0"})]
    assert "_COMMON" not in ns and "_ENV" not in ns


def test_pd_router_host_gets_the_real_router_and_a_gate_over_both_pools() -> None:
    from k2fleet.control.artifacts import read_control_artifacts
    from k2fleet.planning.desired import ENGINE_SIDE_CHECK, desired_state
    from k2fleet.deploy.gate import check_hosts
    from k2fleet.inventory.loader import inventory_host_data

    inv = ROOT / "inventories/h200-sglang-pd.py"
    dep, plan = check_hosts(str(inv), inventory_host_data(inv, {"k2_engine_doubles": True, "k2_simulated_gpus": True}))
    desired = desired_state(dep, plan, read_control_artifacts(dep, plan))
    router = desired["router-0"]
    assert ENGINE_SIDE_CHECK in router.checks and "sglang-router==0.3.2" in router.engine_side_install[2]
    argv = router.health_argv
    assert json.loads(argv[argv.index("--expect-pd") + 1]) == {"prefill": ["http://192.0.2.50:8000"],
                                                               "decode": ["http://192.0.2.52:8000"]}
    assert not any(desired[h].files["engine_side"] for h in ("prefill-0", "prefill-1", "decode-0", "decode-1"))


def test_failure_summary_names_host_unit_reason() -> None:
    log = ("    [router-0]  k2sb-5: k2-sglang-router.service: not healthy after 120s: /health answered 503\n"
           "    [router-0]  Error: executed 0 commands\n")
    assert failure_summary(log) == "router-0 k2-sglang-router: not healthy after 120s: /health answered 503"


def test_other_engines_in_containers_across_hosts_are_refused() -> None:
    inventory = "inventories/h200.py"
    proc, _ = rehearse(inventory, "--data", "k2_runtime=container", "--data", "k2_image=vllm/vllm-openai:v0.33.0",
                       timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    missing = "vllm in containers across hosts (only TensorRT-LLM's mpirun between containers is rehearsed)"
    assert proc.stderr.strip() == f"rehearse: {inventory} needs {missing} in sandbox hosts, not supported yet"
    assert proc.stdout == ""


def first_lines(monkeypatch: pytest.MonkeyPatch, tmp_path, inventory: str, data: list[str], **kwargs) -> list[str]:
    """What ``rehearse(inventory, data, **kwargs)`` prints before it would take the sandbox:
    it is stopped there (nothing is booted; the rehearsal checkpoint is a stand-in path)."""
    import io

    from k2sandbox import rehearse as rh

    class Stop(Exception):
        pass

    def no_lock():
        raise Stop  # stop where the sandbox would be taken: nothing is booted

    monkeypatch.setattr(rh, "rehearsal_checkpoint", lambda model, revision: (tmp_path / "ckpt", 1234))
    monkeypatch.setattr(rh.sandbox, "hold_sandbox_lock", no_lock)
    out = io.StringIO()
    with pytest.raises(Stop):
        rh.rehearse(inventory, data, out=out, **kwargs)
    return out.getvalue().splitlines()


def test_a_rehearsal_names_every_value_it_changes_in_its_first_lines(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """#34: the rehearsal changes k2_os to the sandbox's Debian (and simulates GPUs, ...): its
    first lines say so, one per value, before anything is booted; a value given with --data is
    the user's and not listed."""
    lines = first_lines(monkeypatch, tmp_path, "inventories/h200-k3-sglang.py", ["k2_health_timeout=300"])
    prefix = "rehearse inventories/h200-k3-sglang.py: changes "
    assert lines and all(line.startswith(prefix) for line in lines), lines
    changed = {line[len(prefix):].split(":", 1)[0]: line for line in lines}
    assert changed["k2_os"].endswith("k2_os: unset (ubuntu-22.04) -> 'debian-12' (the sandbox hosts' OS)")
    assert changed["k2_simulated_gpus"].endswith("False -> True (sandbox hosts have no GPUs)")
    assert changed["k2_checkpoint_source"].endswith(f"'hub' -> 'control:{tmp_path / 'ckpt'}' "
                                                     "(a synthetic rehearsal checkpoint, no Hub)")
    assert {"k2_engine_doubles", "k2_package_source", "k2_checkpoint_bytes"} <= set(changed)
    assert "k2_health_timeout" not in changed  # --data k2_health_timeout=300: the user's, kept


# ---------------------------------------------------------------- sandbox


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox fleet needs root")


@pytest.mark.sandbox
@needs_root
def test_bad_inventory_is_refused_before_anything_boots() -> None:
    proc, _ = rehearse("inventories/h200.py", "--data", "k2_tp=3", timeout=60)
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: inventories/h200.py: k2_tp:"), proc.stderr
    assert proc.stdout == ""
    assert sandbox_is_down()


@pytest.mark.sandbox
@needs_root
def test_rehearse_h200_as_a_sudo_user_on_a_custom_port_with_a_fetcher_host_pinned() -> None:
    """As written, and (#22) the way the inventory goes in — here a user with sudo on port
    2222 (only the address and key are the sandbox's): the sandbox hosts' sshd logs show that
    user's logins (the deploy and its re-run) and a listener on that port. In the same
    rehearsal (#33), ``k2_checkpoint_fetcher: h200-1``: h200-1 downloads from a Hub TEST DOUBLE
    on the sandbox bridge and feeds h200-0; the control machine pinned the manifest from the
    double's metadata, so every host's checkpoint gate names that digest."""
    def went_in_as_ops_and_pinned(proc: subprocess.CompletedProcess) -> None:
        digests = set()
        for host in sandbox.load_hosts():
            log = sandbox.ssh(host, "journalctl -u ssh --no-pager -o cat").stdout
            ops = [line for line in log.splitlines() if line.startswith("Accepted publickey for ops ")]
            assert len(ops) >= 2, log[-2000:]  # the deploy and its re-run went in as ops
            assert "Server listening on 0.0.0.0 port 2222." in log, log[-2000:]
            pre = sandbox.ssh(host, "systemctl show -p ExecStartPre --value k2-vllm.service").stdout
            found = re.findall(r"--manifest-digest ([0-9a-f]{64})", pre)
            assert found, pre[-2000:]
            digests.update(found)
        assert len(digests) == 1, digests  # one pin for the whole fleet

    proc = rehearse_kept("inventories/h200.py", 2, "--data", "ssh_user=ops", "--data", "_sudo=true",
                         "--data", "ssh_port=2222", "--data", "k2_checkpoint_fetcher=h200-1",
                         check=went_in_as_ops_and_pinned)
    curls = [line for line in proc.stdout.splitlines() if "curl " in line]
    assert len(curls) == 1 and "/v1/chat/completions" in curls[0] and "moonshotai/Kimi-K2-Thinking" in curls[0]
    assert f"http://{sandbox.host_address(1)}:8000/v1" in proc.stdout and f"http://{sandbox.host_address(2)}:8000/v1" in proc.stdout
    assert f"the Hub TEST DOUBLE at http://{sandbox.BRIDGE_ADDRESS}:" in proc.stdout and "h200-1 downloads it" in proc.stdout
    assert "-> control" not in proc.stdout  # the fetcher host is kept


@pytest.mark.sandbox
@needs_root
@pytest.mark.parametrize("inventory, endpoints", [("inventories/h200-dcp.py", 2),
                                                  # One rehearsal per seed inventory in the suite (the test
                                                  # calls the fleet where it serves). Elsewhere: h200-dp-ep, h200-sglang-tp16,
                                                  # h200-sglang-pd, h200-trtllm-mpi and h800-pp in
                                                  # tests/test_rehearse_restart.py; h200-k2-0905 (TP8xPP2) in
                                                  # tests/test_instance_watch_sandbox.py; h200-k25 offline from its
                                                  # bundle, and b200-trtllm twice from one lock, in
                                                  # tests/test_airgap.py. The newer Kimi models (issue #25) here:
                                                  # K2.6 with vLLM's --mm-encoder-tp-mode data, K3 on SGLang TP16
                                                  # over two nodes
                                                  ("inventories/h200-k26.py", 1), ("inventories/h200-k3-sglang.py", 1)])
def test_rehearse_scenario_as_written(inventory: str, endpoints: int) -> None:
    rehearse_kept(inventory, endpoints)


@pytest.mark.sandbox
@needs_root
def test_rehearse_gb200_slurm() -> None:
    """The login host from the inventory + the 12 compute hosts its job asks for; real
    slurmctld/slurmd/munge; the submit.py TEST DOUBLE's job (real sbatch/srun) serves the
    disaggregated front end + 4 ctx + 1 gen servers; topology as planned; re-run 0 changes."""
    inventory = "inventories/gb200-trtllm-disagg.py"
    proc = rehearse_kept(inventory, 6)  # the front end and 4 ctx + 1 gen servers, each called by this test
    out = proc.stdout
    assert "booting 13 bare sandbox hosts (1 from the inventory + 12 Slurm compute hosts" in out
    assert f"slurmctld on {sandbox.host_name(1)}, slurmd on {sandbox.host_name(2)}..{sandbox.host_name(13)}, partition rehearsal" in out
    assert "k2_slurm slurm.partition: '<partition>' -> 'rehearsal'" in out
    assert "slurm job topology: ctx/gen servers and parallel sizes as planned" in out
    assert "ctx4_gen1_dep32_batch128_eplb416_mtp0" in out
    assert len([line for line in out.splitlines() if line.startswith("  ok   slurm-job trtllm-serve ctx")]) == 4


@pytest.mark.sandbox
@pytest.mark.parametrize("inventory, image", [("inventories/mi300x.py", "vllm/vllm-openai-rocm:v0.33.0")])
def test_rehearse_container_scenario(inventory: str, image: str) -> None:
    """Docker from the offline bundle, the double image docker-loaded under the
    inventory's own reference, the planned ``docker run`` under systemd. (b200-trtllm's
    container: rehearsed twice from one lock in tests/test_airgap.py.)"""
    rehearse_kept(inventory, 1)


# ---------------------------------------------------------------- the rehearsal's own probe, against loopback servers


class _Endpoint:
    """A loopback HTTP server answering every POST with ``status`` and ``body`` (or never)."""

    def __init__(self, status: int, body: bytes, hang: bool = False) -> None:
        import http.server
        import threading

        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if hang:
                    outer.release.wait(30)
                    return
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.release = threading.Event()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("status, body, reason", [
    (200, b'{"choices": [{"message": {"content": "Hello!"}}]}', None),
    (200, b'{"choices": [{"message": {"content": null, "reasoning": "The user greets me."}}]}', None),
    (200, b'{"choices": []}', "no choices"),
    (200, b'{"choices": [{"message": {"content": "", "reasoning": null}}]}', "an empty answer"),
    (200, b'{"choices": [{"message": {"content": "   "}}]}', "an empty answer"),
    (200, b"<html>ok</html>", "not JSON"),
    (500, b'{"error": "engine dead"}', "HTTP 500"),
])
def test_the_rehearsal_probe_fails_a_broken_endpoint(status: int, body: bytes, reason: str | None) -> None:
    from k2fleet.planning.processes import Health
    from k2sandbox.rehearse import probe

    endpoint = _Endpoint(status, body)
    try:
        got = probe(endpoint.base, Health(8000), "m")
    finally:
        endpoint.close()
    assert got is None if reason is None else (got is not None and got.startswith(reason)), got


def test_the_rehearsal_probe_gives_up_on_an_endpoint_that_never_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    from k2fleet.planning.processes import Health
    from k2sandbox import rehearse as rehearse_module

    monkeypatch.setattr(rehearse_module, "PROBE_TIMEOUT_S", 1)
    endpoint = _Endpoint(200, b"", hang=True)
    started = time.monotonic()
    try:
        got = rehearse_module.probe(endpoint.base, Health(8000), "m")
    finally:
        endpoint.close()
    assert got is not None and got.startswith("no answer") and time.monotonic() - started < 10, got
