"""``k2fleet status`` on the sandbox fleet (issue #24, item 1, "Done when"): a healthy,
settled fleet → exit 0; after editing a unit file, unholding a held package and flipping a
bit in a checkpoint shard, status names each (exit 1); the next deploy repairs them and
status is clean again.

WRITTEN WITHOUT BEING RUN (the sandbox was owned by another run when it was written): run
it alone, as root, with the sandbox free:

    python -m pytest -q -p no:cacheprovider tests/test_status_sandbox.py

The bit flip: the fact's checkpoint check is the verified marker (``verify --marker-only``),
which compares each file's stat record (size, mtime_ns, ctime_ns, inode) with the marker's
and hashes nothing. A flip written in place keeps the size and inode but changes mtime and
ctime, so the marker check sees it; the shard's mtime is also touched explicitly, so the test
does not depend on the write's timestamp granularity. A flip whose mtime was put back
(``touch -r``) still changes ctime: only a re-hash (``verify`` without ``--marker-only``)
would find a flip that changed no stat field at all.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from k2fleet.cli import load_plan
from k2sandbox.harness import INVENTORY, SandboxFleet, ssh
from k2sandbox.pyinfra_cli import ROOT, cli_env

pytestmark = pytest.mark.sandbox

UNIT = "k2-vllm.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT}"


def status(fleet: SandboxFleet, *extra: str) -> tuple[int, dict]:
    """``k2fleet status INVENTORY --json`` from the repository root, with the deploy's own
    connection data and environment (its state directory holds the control machine's
    artifacts the plan reads: the relay secret, the mesh keys)."""
    out = subprocess.run([sys.executable, "-m", "k2fleet.cli", "status", INVENTORY, "--json", *extra], cwd=ROOT,
                         env=cli_env(fleet.env), capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert out.returncode in (0, 1), out.stderr
    return out.returncode, json.loads(out.stdout)


def drift(doc: dict, host: str) -> set[tuple[str, str]]:
    return {(d["kind"], d["subject"]) for d in doc["hosts"][host]["drift"]}


def test_status_names_an_edited_unit_a_lost_hold_and_a_flipped_bit_and_the_deploy_repairs_them(
        fleet: SandboxFleet) -> None:
    fleet.ensure_deployed()
    code, doc = status(fleet)
    assert code == 0 and doc["ok"], json.dumps(doc, indent=1)
    assert all(not h["drift"] for h in doc["hosts"].values())

    one, two = fleet.hosts[0], fleet.hosts[1]
    name_one, name_two = one["name"], two["name"]
    dep, _ = load_plan(str(ROOT / INVENTORY))
    # 1. a unit file edited by hand (on the first host)
    ssh(one, f"echo '# edited by hand' >> {UNIT_PATH}")
    # 2. a held package no longer held (on the first host): one the bootstrap holds
    held = ssh(one, "apt-mark showhold").stdout.split()
    assert held, "the bootstrap held no package on the sandbox host"
    package = sorted(held)[0]
    ssh(one, f"apt-mark unhold {package}")
    # 3. one bit flipped in one checkpoint shard (on the second host), size and inode kept;
    #    mtime touched too (see the module doc: the marker check compares stat, never hashes)
    shard = ssh(two, f"ls -1 {dep.checkpoint_path}/*.safetensors | head -1").stdout.strip()
    assert shard, f"no shard under {dep.checkpoint_path}"
    flip = ("import sys\nf = open(sys.argv[1], 'r+b'); f.seek(4096); b = f.read(1); f.seek(4096); "
            "f.write(bytes([b[0] ^ 1])); f.close()")
    ssh(two, f"python3 -c \"{flip}\" {shard} && touch {shard}")
    try:
        code, doc = status(fleet)
        assert code == 1 and not doc["ok"]
        seen_one, seen_two = drift(doc, name_one), drift(doc, name_two)
        assert ("file", UNIT_PATH) in seen_one, doc["hosts"][name_one]["drift"]
        assert ("hold", package) in seen_one, doc["hosts"][name_one]["drift"]
        assert ("checkpoint", "checkpoint-verified") in seen_two, doc["hosts"][name_two]["drift"]
        assert doc["hosts"][name_two]["checkpoint"]["checkpoint-verified"] == "not verified"
    finally:
        result = fleet.deploy()  # the next deploy repairs all three
    assert result.returncode == 0, result.tail()
    code, doc = status(fleet)
    assert code == 0 and doc["ok"], json.dumps(doc, indent=1)
    assert package in ssh(one, "apt-mark showhold").stdout.split()
    assert "# edited by hand" not in ssh(one, f"cat {UNIT_PATH}").stdout


def test_status_with_a_completion_through_the_endpoint(fleet: SandboxFleet) -> None:
    fleet.ensure_deployed()
    code, doc = status(fleet, "--completion")
    assert code == 0 and doc["completion"]["ok"], doc["completion"]


def test_the_probe_reads_unit_states_in_one_systemctl_show_as_systemctl_is_active_does(fleet: SandboxFleet) -> None:
    """On a real systemd (a sandbox host): the probe's units (one ``systemctl show`` for all of
    them, from the shipped archive) for running, oneshot, missing and escaped unit names: each
    under its own id, in the state ``systemctl is-active`` gives it."""
    fleet.ensure_deployed()
    host = fleet.hosts[0]
    names = ["k2-vllm.service", "k2-firewall.service", "nvidia-persistenced.service", "no-such-k2fleet.service",
             "systemd-journald.service", "getty@tty1.service"]
    program = ("import sys, json; sys.path.insert(0, '/opt/k2fleet/lib/k2fleet-host.pyz'); "
               "from k2fleet.hostprogs.hoststate import units; "
               f"print(json.dumps(units({names!r})))")
    mine = json.loads(ssh(host, f"python3 -I -S -c \"{program}\"").stdout)
    active = ssh(host, f"systemctl is-active {' '.join(names)}", check=False).stdout.split()
    assert sorted(mine) == sorted(names) and [mine[name]["ActiveState"] for name in names] == active
    assert mine["no-such-k2fleet.service"]["LoadState"] == "not-found" and mine["k2-vllm.service"]["ActiveState"] == "active"
