"""Fault drills on the sandbox fleet (real sshd, systemd, pyinfra, the relay; two hosts, each a
vLLM replica, engine TEST DOUBLE): each fault is named at the end of the deploy in one line
with the host and the cause (k2fleet.deploy.failure_lines), nothing is served from a
checkpoint that was not verified, and the next deploy converges to a healthy fleet (checked by
calling each host's endpoint).

- A disk that fills during the checkpoint: k2sb-2's model directory is a 2 MiB tmpfs, the
  checkpoint 4.2 MB, while the inventory declares 1 MB (the preflight's free-space check
  passes, as when the estimate is wrong or another process fills the disk).
- A host lost mid-deploy: k2sb-2's container init is killed (the drill of ../shared/NOTES.md)
  while the deploy runs there.
- A partition between the hosts during the rendezvous of an instance spanning them (TP8 × PP2:
  k2sb-2 is the ``--headless`` rank): when k2sb-2's engine unit starts, an nftables table of the
  drill's drops every packet between it and k2sb-1 (a systemd drop-in's ``ExecStartPre``), so
  the rank never reaches the head's rendezvous port; the head's health gate names the rank
  host and that the network between them is cut.
- A reboot in the middle of the driver install, as a power cut: a dpkg hook on k2sb-2
  (``pre-invoke``; dpkg sets ``DPKG_HOOK_ACTION``) starts a watcher when dpkg's configure run
  begins with ``nvidia-open`` (the driver TEST DOUBLE) unpacked; as soon as dpkg's journal
  (``/var/lib/dpkg/updates``) records it mid-configure, the watcher freezes dpkg and reboots the
  host at once (``systemctl reboot -ff``). The host comes back with the journal dirty, on which
  apt refuses every install ("dpkg was interrupted"): the next deploy finishes dpkg's run first
  (``dpkg --configure -a``), then the install, and serves.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from k2sandbox import nspawn as sandbox
from k2sandbox.harness import SandboxFleet, http_json, pyinfra_argv, ssh
from k2sandbox.pyinfra_cli import DeployResult, ROOT, cli_env

pytestmark = pytest.mark.sandbox
SANDBOX_HOSTS = 2
SANDBOX_DOCKER = False
MODEL_DIR = "/srv/k2fleet/models"  # k2_model_dir's default
ENGINE = "k2-vllm.service"
# the drill's dpkg hook (/etc/dpkg/dpkg.cfg.d/k2-drill: pre-invoke=REBOOT_HOOK); /root survives the reboot
REBOOT_HOOK = "/usr/local/sbin/k2-drill-reboot"
REBOOT_HOOK_SCRIPT = r"""#!/bin/sh
[ "$DPKG_HOOK_ACTION" = configure ] || exit 0
[ -e /root/k2-drill-rebooted ] && exit 0
dpkg-query -W -f='${db:Status-Abbrev}${Package}\n' 2>/dev/null | grep -q '^iU nvidia-open$' || exit 0
touch /root/k2-drill-rebooted
# the journal's record of nvidia-open half-configured (dpkg may first journal it still unpacked:
# stopped then, under load, the host came back with it "iU", not "iF"); given up after 120 s
half() { for f in /var/lib/dpkg/updates/0*; do
  grep -qsx 'Package: nvidia-open' "$f" && grep -qsx 'Status: [a-z]* ok half-configured' "$f" && return 0; done; return 1; }
end=$(( $(date +%s) + 120 ))
( until half; do [ "$(date +%s)" -lt "$end" ] || exit 0; done
  pkill -STOP -x dpkg; echo "k2-drill: power cut with dpkg's journal holding nvidia-open" >&2
  systemctl reboot -ff ) </dev/null >&2 &
"""


def model_name(host: dict) -> str:
    status, body = http_json(f"http://{host['address']}:8000/v1/models", None, 15)
    assert status == 200, body
    return body["data"][0]["id"]


def failure_lines(result: DeployResult) -> list[str]:
    lines = [line for line in result.stderr.splitlines() if line.startswith("k2fleet: ") and " failed at «" in line]
    print("\n" + "\n".join(lines))
    return lines


def converges(fleet: SandboxFleet, data: dict | None = None, serving: list[dict] | None = None) -> DeployResult:
    """The next deploy ends healthy and every host that serves (default: all) answers a completion."""
    again = fleet.deploy(data)
    assert again.returncode == 0, again.tail()
    for host in serving or fleet.hosts:
        status, body = http_json(f"http://{host['address']}:8000/v1/chat/completions",
                                 {"model": model_name(host), "max_tokens": 4,
                                  "messages": [{"role": "user", "content": "hi"}]}, 15)
        assert status == 200 and body.get("choices"), (host["name"], status, body)
    return again


def test_a_disk_that_fills_during_the_checkpoint_is_named_and_nothing_is_served_from_it(fleet: SandboxFleet) -> None:
    fleet.ensure_bare()
    one, two = fleet.hosts
    ssh(two, f"mkdir -p {MODEL_DIR} && mount -t tmpfs -o size=2m k2-drill-disk {MODEL_DIR}")
    try:
        full = fleet.deploy({"k2_checkpoint_bytes": 1_000_000})
        assert full.returncode != 0, full.tail()
        lines = failure_lines(full)
        assert len(lines) == 1 and lines[0].startswith(f"k2fleet: {two['name']} failed at «"), (lines, full.tail())
        assert "disk full: " in lines[0] and "No space left on device" in lines[0] and MODEL_DIR in lines[0], lines
        assert "no source answered" not in full.stderr  # the source is not blamed for this host's disk
        # nothing served from it: its engine never started; the other host's did, from a verified copy
        assert ssh(two, f"systemctl is-active {ENGINE}", check=False).stdout.strip() != "active"
        assert ssh(one, f"systemctl is-active {ENGINE}", check=False).stdout.strip() == "active"
    finally:
        ssh(two, f"umount {MODEL_DIR}", check=False)
    converges(fleet)


def test_a_host_lost_mid_deploy_is_named_and_the_next_deploy_converges(fleet: SandboxFleet, tmp_path: Path) -> None:
    fleet.ensure_bare()
    one, two = fleet.hosts
    log = tmp_path / "deploy.log"
    with log.open("w") as out:
        deploy = subprocess.Popen(pyinfra_argv(), cwd=ROOT, env=cli_env(fleet.env), stdout=subprocess.DEVNULL,
                                  stderr=out, stdin=subprocess.DEVNULL)
        try:
            # the host is lost once the deploy is well at work on it: at its checkpoint stage
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and deploy.poll() is None:
                if ssh(two, f"test -d {MODEL_DIR}", check=False).returncode == 0:
                    break
                time.sleep(0.5)
            assert deploy.poll() is None, log.read_text()[-3000:]
            fleet.forget()  # the test takes a host down by hand
            sandbox.crash_host(2)
            code = deploy.wait(timeout=600)
        finally:
            if deploy.poll() is None:
                deploy.kill()
    stderr = log.read_text()
    result = DeployResult(deploy.args, code, "", stderr)
    assert code != 0, result.tail()
    lines = failure_lines(result)
    assert len(lines) == 1 and lines[0].startswith(f"k2fleet: {two['name']} failed at «"), (lines, result.tail())
    assert "lost: its SSH connection closed" in lines[0], lines
    sandbox.start_again(2)
    converges(fleet)


def test_a_power_cut_in_the_middle_of_the_driver_install_is_named_and_the_next_deploy_finishes_it(
        fleet: SandboxFleet) -> None:
    fleet.ensure_bare()
    one, two = fleet.hosts
    ssh(two, f"cat > {REBOOT_HOOK} <<'EOF'\n{REBOOT_HOOK_SCRIPT}EOF\nchmod 755 {REBOOT_HOOK} && "
             f"echo 'pre-invoke={REBOOT_HOOK}' > /etc/dpkg/dpkg.cfg.d/k2-drill")
    rebooted = fleet.deploy()
    assert rebooted.returncode != 0 and "k2-drill: power cut with dpkg's journal" in rebooted.stderr, rebooted.tail()
    lines = failure_lines(rebooted)
    assert lines == [f"k2fleet: {two['name']} failed at «k2fleet: bootstrap | install the GPU stack at its pins»: "
                     "lost: its SSH connection closed during the operation (the host went down, rebooted or left "
                     "the network); nothing after it ran there"], (lines, rebooted.tail())
    deadline = time.monotonic() + 60
    while ssh(two, "systemctl is-system-running", check=False).stdout.strip() not in ("running", "degraded"):
        assert time.monotonic() < deadline, "k2sb-2 did not come back from its reboot"
        time.sleep(0.5)
    journal = ssh(two, "ls /var/lib/dpkg/updates").stdout.split()
    assert "0000" in journal, journal  # dpkg's run did not finish: apt refuses every install now
    assert ssh(two, "dpkg-query -W -f='${db:Status-Abbrev}' nvidia-open").stdout.startswith("iF")  # half-configured
    assert ssh(two, f"systemctl is-active {ENGINE}", check=False).stdout.strip() != "active"
    again = converges(fleet)  # without its dpkg --configure -a, apt's "dpkg was interrupted" fails it
    finished = [op for op, hosts in again.changed_operations.items() if "dpkg --configure -a" in op]
    assert finished and again.changed_operations[finished[0]] == [two["name"]], again.changed_operations
    assert not ssh(two, "ls /var/lib/dpkg/updates").stdout.split()
    assert ssh(two, "dpkg-query -W -f='${db:Status-Abbrev}' nvidia-open").stdout.startswith("hi")  # configured, held


INSTANCE = {"k2_pp": 2, "k2_health_timeout": 40}  # one TP8 x PP2 instance over both hosts (k2sb-1 its head)


def test_a_partition_during_the_rendezvous_names_the_rank_host_and_the_next_deploy_converges(
        fleet: SandboxFleet) -> None:
    fleet.ensure_bare()
    one, two = fleet.hosts
    cut = (f"nft add table inet k2drill && nft add chain inet k2drill o '{{ type filter hook output priority 0; }}' && "
           f"nft add chain inet k2drill i '{{ type filter hook input priority 0; }}' && "
           f"nft add rule inet k2drill o ip daddr {one['address']} drop && "
           f"nft add rule inet k2drill i ip saddr {one['address']} drop")
    ssh(two, "mkdir -p /etc/systemd/system/k2-vllm.service.d && cat > /etc/systemd/system/k2-vllm.service.d/k2-drill.conf"
             f" <<'EOF'\n[Service]\nExecStartPre=/bin/sh -c \"{cut}\"\nEOF")
    try:
        # a gate that cannot pass waits out k2_health_timeout: 15 s is enough to name the cut
        parted = fleet.deploy({**INSTANCE, "k2_health_timeout": 15})
        assert parted.returncode != 0, parted.tail()
        lines = failure_lines(parted)
        assert len(lines) == 1 and lines[0].startswith(
            f"k2fleet: {one['name']} failed at «k2fleet: health gate | health gate: /health 200 and a real chat "
            f"completion»: not healthy: {one['name']}: k2-vllm.service: rank host {two['name']} ({two['address']}) "
            "never connected to the rendezvous port "), (lines, parted.tail())
        assert "does not answer from here (TCP to port 22 timed out after 3s): the network between the hosts is cut" \
            in lines[0], lines
    finally:  # the network heals
        ssh(two, "rm -f /etc/systemd/system/k2-vllm.service.d/k2-drill.conf && systemctl daemon-reload && "
                 "{ nft delete table inet k2drill || true; }")
    converges(fleet, INSTANCE, serving=[one])
