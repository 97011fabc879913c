"""Issue #22 on the sandbox: ``k2fleet rehearse inventories/corp-dp-ep.py`` builds a network
shaped like a company's — a bastion that is the only way in, the fleet on a subnet the
control machine has no route to, ``ops`` with sudo on port 2222, root refused, names served
by a resolver (dnsmasq) on the bastion — and deploys from bare hosts through it with the
inventory's connection settings as written (ProxyJump from its ``ssh_config_file``). The
rehearsal counts the fleet hosts' SSH logins by source (its own lines are checked here);
this test also tries what must fail: root over the bastion, and the fleet from the control
machine directly.

Own module: ``k2fleet rehearse`` takes the sandbox lock itself (see tests/test_rehearse.py).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import urllib.request
from pathlib import Path
from urllib.parse import unquote

import pytest

from k2sandbox import company_network, nspawn as sandbox
from k2sandbox.harness import ROOT, tool
from k2sandbox.rehearse import inside_netns

pytestmark = pytest.mark.sandbox
INVENTORY = "inventories/corp-dp-ep.py"


def test_a_fleet_behind_a_bastion_deploys_through_it_alone(tmp_path) -> None:
    """The seed inventory as written, with an API key, the node exporter and a
    ``k2_checkpoint_fetcher`` host (#33's second finding: such a rehearsal ended in a traceback,
    the control step's ``apt-get download`` run inside the company network's resolver, where
    deb.debian.org does not resolve; it now runs before the deploy enters that resolver; the
    sandbox has no Hub, so the fetcher host is said to be replaced by the control machine's
    synthetic copy)."""
    key = "k2-rehearsal-api-key-0123456789"
    key_path = tmp_path / "api-key"
    key_path.write_text(key + "\n")
    key_path.chmod(0o600)
    data = [f"k2_api_key_file={key_path}", "k2_metrics=true", "k2_node_exporter=true", "k2_checkpoint_fetcher=gpu-1"]
    proc = subprocess.run([tool("k2fleet"), "rehearse", INVENTORY, "--keep", *(w for d in data for w in ("--data", d))],
                          cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900)
    try:
        out = proc.stdout
        assert "Traceback" not in out + proc.stderr, (out + proc.stderr)[-4000:]
        assert proc.returncode == 0, out[-3000:] + proc.stderr[-2000:]
        assert "rehearse: the control machine's packages and wheels made before the company network" in out, out
        assert "k2_checkpoint_fetcher: gpu-1 -> control" in out, out
        last = out.strip().splitlines()[-1]
        assert last.startswith(f"rehearsal {INVENTORY}: ") and last.endswith("endpoints healthy, re-run 0 changes"), out
        # every login the fleet hosts accepted came through the bastion (counted on the hosts)
        counted = re.findall(r"^  (gpu-\d): (\d+) SSH logins, (\d+) of them through the bastion$", out, re.M)
        assert sorted(h for h, _, _ in counted) == ["gpu-0", "gpu-1"], out
        assert all(int(n) >= 3 and n == through for _, n, through in counted), counted
        bastion, *fleet = sandbox.load_hosts()
        for host in fleet:  # the control machine has no way to the fleet subnet
            with pytest.raises(OSError):
                socket.create_connection((company_network.fleet_address(host.address), 2222), timeout=3)
        # root is refused on the fleet hosts, even through the bastion; ops is let in and resolves
        # the fleet's names with the company network's resolver
        config = tmp_path / "ssh_config"
        config.write_text(f"Host *\n    IdentityFile {bastion.ssh_key}\n    IdentitiesOnly yes\n    BatchMode yes\n"
                          "    StrictHostKeyChecking no\n    UserKnownHostsFile /dev/null\n    LogLevel ERROR\n"
                          f"Host {company_network.FLEET_SUBNET}.*\n    ProxyJump ops@{bastion.address}:2222\n    Port 2222\n")

        def through_bastion(user: str, command: str, host: sandbox.SandboxHost | None = None) -> subprocess.CompletedProcess:
            where = company_network.fleet_address((host or fleet[0]).address)
            return subprocess.run(["ssh", "-F", str(config), f"{user}@{where}", command], capture_output=True,
                                  text=True, timeout=60)

        # the checkpoint reached both fleet hosts and is verified there (the verify program's own
        # read-only check of its marker, run as ops with sudo, as the deploy's fact does)
        for host in fleet:
            held = through_bastion("ops", "for d in /srv/k2fleet/models/*/*; do sudo -n /usr/bin/python3 "
                                   "/opt/k2fleet/lib/k2fleet-host.pyz verify --marker-only \"$d\" && echo \"$d\"; done",
                                   host)
            assert held.returncode == 0 and "/srv/k2fleet/models/moonshotai--Kimi-K2-Instruct/" in held.stdout, \
                (host.name, held.stdout, held.stderr)

        root = through_bastion("root", "true")
        assert root.returncode != 0 and "Permission denied" in root.stderr, root.stderr
        names = through_bastion("ops", "getent ahostsv4 gpu-1.fleet.corp.example bastion.corp.example")
        assert names.returncode == 0, names.stderr
        assert company_network.fleet_address(fleet[1].address) in names.stdout, names.stdout
        assert company_network.BASTION_FLEET_ADDRESS in names.stdout, names.stdout  # the address on the fleet's side
        assert bastion.address not in names.stdout, names.stdout
        # the engine serves inside the company network (from the bastion's side of the fleet subnet)
        base = f"http://{company_network.fleet_address(fleet[0].address)}:8000/v1"
        body = json.dumps({"model": "kimi-k2", "messages": [{"role": "user", "content": "Hi"}],
                           "max_tokens": 8}).encode()
        with inside_netns(bastion.name):
            request = urllib.request.Request(f"{base}/chat/completions", data=body,
                                             headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
            with urllib.request.urlopen(request, timeout=30) as answer:
                reply = json.load(answer)
        assert reply["choices"][0]["message"]["content"].strip(), reply
    finally:
        with sandbox.hold_sandbox_lock():
            sandbox.down()


def test_the_company_inventory_bundled_from_its_mirrors_deploys_offline(tmp_path) -> None:
    """#22: ``k2fleet bundle`` of the company inventory from the company's mirrors — the Debian
    archive, its security archive and a PyPI index on the sandbox network, over TLS signed by the
    company's CA (:mod:`k2sandbox.package_mirror`; the control machine trusts that CA in a mount
    namespace, as a company's machines do) — from empty caches, then an offline rehearsal from
    that bundle alone, through the bastion. Every Debian package in the bundle came through the
    mirror (its request log), none from the machine's own archives (the lock's origins)."""
    from k2fleet.control.lockfile import LOCK_NAME, Lock
    from k2sandbox import driver_doubles, package_mirror

    bundle = tmp_path / "corp-bundle"
    with sandbox.hold_sandbox_lock():
        sandbox.down()
        sandbox.setup_bridge()  # the mirror's address: the control machine's on the sandbox network
        try:
            with package_mirror.serving(sandbox.BRIDGE_ADDRESS, tmp_path / "mirror-cache") as mirror:
                env = {k: v for k, v in os.environ.items() if k != "PIP_FIND_LINKS"}
                env["PIP_CONFIG_FILE"] = "/dev/null"  # not this machine's own indexes and wheel directory
                proc = subprocess.run(
                    mirror.trusting([tool("k2fleet"), "bundle", INVENTORY, "--rehearsal", "--out", str(bundle),
                                     "--cache", str(tmp_path / "cache"),
                                     "--data", f"k2_os_mirror={mirror.debian_url}",
                                     "--data", f"k2_os_security_mirror={mirror.debian_security_url}",
                                     "--data", f"k2_pypi_index={mirror.pypi_index}"]),
                    cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900, env=env)
                # the company inventory's one wheel is the engine TEST DOUBLE (built here): the PyPI
                # mirror is proven with the Ray inventory's wheels, from the same index
                wheels = subprocess.run(
                    mirror.trusting([tool("k2fleet"), "bundle", "inventories/h800-pp.py", "--rehearsal", "--only", "wheels",
                                     "--out", str(tmp_path / "ray-wheels"), "--cache", str(tmp_path / "cache"),
                                     "--data", f"k2_pypi_index={mirror.pypi_index}"]),
                    cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900, env=env)
                served = mirror.log.entries()
        finally:
            sandbox.down()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lock = Lock.from_text((bundle / LOCK_NAME).read_text())
    debs = [a for a in lock.artifacts if a.kind == "deb"]
    assert debs and all(mirror.debian_url in a.origin and "deb.debian.org" not in a.origin for a in debs), debs[0].origin
    fetched = {unquote(path.rsplit("/", 1)[-1]) for method, path, status, _ in served
               if method == "GET" and status == 200 and path.startswith(("/debian/pool/", "/debian-security/pool/"))}
    doubles = {p.filename for p in driver_doubles.double_packages()}
    names = {Path(a.path.rsplit("!", 1)[-1]).name for a in debs}  # (a deb inside a tar: TAR!NAME)
    assert names - doubles and names - doubles <= fetched, sorted(names - doubles - fetched)[:10]
    assert wheels.returncode == 0, wheels.stdout[-3000:] + wheels.stderr[-3000:]
    from_index = {unquote(path.rsplit("/", 1)[-1]) for method, path, status, _ in served
                  if method == "GET" and status == 200 and path.startswith("/pypi/files/")}
    locked = [Path(a.path).name for a in Lock.from_text((tmp_path / "ray-wheels" / LOCK_NAME).read_text()).artifacts
              if a.kind == "wheel" and "k2fleet" not in a.origin]
    assert any(name.startswith("ray-2.60.0-") for name in locked) and set(locked) <= from_index, \
        sorted(set(locked) - from_index)[:10]
    # the air-gapped fleet: the deploy (pyinfra and its control step) in a namespace whose only
    # link is the sandbox bridge, every package, wheel and the checkpoint from the bundle
    proc = subprocess.run([tool("k2fleet"), "rehearse", INVENTORY, "--bundle", str(bundle), "--offline"], cwd=ROOT,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-2000:]
    assert out.strip().splitlines()[-1] == f"rehearsal {INVENTORY}: 1/1 endpoints healthy, re-run 0 changes", out
    assert f"everything from bundle {bundle}" in out and f"--offline: the deploy runs in netns {sandbox.OFFLINE_NS}" in out
    counted = re.findall(r"^  (gpu-\d): (\d+) SSH logins, (\d+) of them through the bastion$", out, re.M)
    assert sorted(h for h, _, _ in counted) == ["gpu-0", "gpu-1"] and all(n == t for _, n, t in counted), out


IP_SSH_CONFIG = """\
# the fleet behind the company's jump host, by address (issue #33: the rehearsal moved the hosts
# and this pattern stopped matching, so pyinfra went direct: "Network is unreachable")
Host jump
    HostName 203.0.113.5
    User ops
    Port 2222

Host 198.51.100.*
    ProxyJump jump
    User ops
    Port 2222
    ConnectTimeout 15
"""


def test_an_ip_pattern_bastion_inventory_rehearses_through_it(tmp_path) -> None:
    """#33: hosts by IP, reached through a jump host that an ssh_config pattern on their IPs
    names (``Host 198.51.100.*`` → ``ProxyJump jump``, the jump host itself by IP), the login
    user and port from the file alone. The rehearsal rewrites that file onto the sandbox's
    addresses; the evidence that every login went through the bastion is read here from the
    hosts' own sshd journals (not from the rehearsal's verdict): every login the fleet hosts
    accepted came from the bastion's fleet address, and the bastion's sshd accepted ``ops`` from
    the control machine."""
    inv_dir = tmp_path / "inv"
    (inv_dir / "group_data").mkdir(parents=True)
    config = inv_dir / "corp-ip.ssh_config"
    config.write_text(IP_SSH_CONFIG)
    inv = inv_dir / "corp-ip.py"
    inv.write_text('gpu_nodes = [("gpu-0", {"ssh_hostname": "198.51.100.10"}), '
                   '("gpu-1", {"ssh_hostname": "198.51.100.11"})]\n')
    group = (ROOT / "inventories/group_data/corp-dp-ep.py").read_text()
    group = "\n".join(line for line in group.splitlines() if not line.startswith(("ssh_user", "ssh_port", "ssh_config_file")))
    (inv_dir / "group_data" / "corp-ip.py").write_text(group + f"\nssh_config_file = {str(config)!r}\n")
    # the lock is held across the rehearsal (shared with it) and the checks, so no other sandbox
    # user takes the kept hosts down or boots its own in between
    lock = sandbox.hold_sandbox_lock()
    try:
        proc = subprocess.run([tool("k2fleet"), "rehearse", str(inv), "--keep"], cwd=ROOT, capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, timeout=900, pass_fds=(lock.fileno(),),
                              env={**os.environ, **sandbox.lock_env(lock)})
        out = proc.stdout
        assert proc.returncode == 0, out[-3000:] + proc.stderr[-2000:]
        assert out.strip().splitlines()[-1] == f"rehearsal {inv}: 1/1 endpoints healthy, re-run 0 changes", out
        bastion, *fleet = sandbox.load_hosts()
        for host in fleet:  # the control machine has no way to the fleet subnet
            with pytest.raises(OSError):
                socket.create_connection((company_network.fleet_address(host.address), 2222), timeout=3)
        ssh_config = tmp_path / "ssh_config"
        ssh_config.write_text(f"Host *\n    IdentityFile {bastion.ssh_key}\n    IdentitiesOnly yes\n    BatchMode yes\n"
                              "    StrictHostKeyChecking no\n    UserKnownHostsFile /dev/null\n    LogLevel ERROR\n"
                              f"Host {company_network.FLEET_SUBNET}.*\n    ProxyJump ops@{bastion.address}:2222\n"
                              "    Port 2222\n")
        for host in fleet:
            where = company_network.fleet_address(host.address)
            got = subprocess.run(["ssh", "-F", str(ssh_config), f"ops@{where}",
                                  "sudo -n journalctl -q -o cat -u ssh --no-pager | grep 'Accepted publickey for ops'"],
                                 capture_output=True, text=True, timeout=60)
            assert got.returncode == 0, got.stderr
            sources = [line.split(" from ", 1)[1].split()[0] for line in got.stdout.splitlines()]
            # the deploy's logins (pyinfra's and k2fleet's own side channels) plus this one, all from the bastion
            assert len(sources) >= 3 and set(sources) == {company_network.BASTION_FLEET_ADDRESS}, (host.name, sources)
        jumped = sandbox.ssh(bastion, "journalctl -q -o cat -u ssh --no-pager | grep -c 'Accepted publickey for ops from "
                             f"{sandbox.BRIDGE_ADDRESS} '", timeout=60)
        assert jumped.returncode == 0 and int(jumped.stdout.strip()) >= 3, (jumped.stdout, jumped.stderr)
    finally:
        try:
            sandbox.down()
        finally:
            lock.close()
