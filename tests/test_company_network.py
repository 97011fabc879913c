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
import re
import socket
import subprocess
import urllib.request

import pytest

from k2sandbox import company_network, nspawn as sandbox
from k2sandbox.harness import ROOT, tool
from k2sandbox.rehearse import inside_netns

pytestmark = pytest.mark.sandbox
INVENTORY = "inventories/corp-dp-ep.py"


def test_a_fleet_behind_a_bastion_deploys_through_it_alone(tmp_path) -> None:
    proc = subprocess.run([tool("k2fleet"), "rehearse", INVENTORY, "--keep"], cwd=ROOT, capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=900)
    try:
        out = proc.stdout
        assert proc.returncode == 0, out[-3000:] + proc.stderr[-2000:]
        assert out.strip().splitlines()[-1] == f"rehearsal {INVENTORY}: 1/1 endpoints healthy, re-run 0 changes", out
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

        def through_bastion(user: str, command: str) -> subprocess.CompletedProcess:
            return subprocess.run(["ssh", "-F", str(config), f"{user}@{company_network.fleet_address(fleet[0].address)}",
                                   command], capture_output=True, text=True, timeout=60)

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
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as answer:
                reply = json.load(answer)
        assert reply["choices"][0]["message"]["content"].strip(), reply
    finally:
        with sandbox.hold_sandbox_lock():
            sandbox.down()
