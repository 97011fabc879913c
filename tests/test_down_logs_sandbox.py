"""``k2fleet logs`` and ``k2fleet down`` on the sandbox fleet (issue #36, items 3 and 4), with
one deploy: two vLLM replicas (engine TEST DOUBLES) behind k2fleet's load balancer, with its
firewall, sysctl drop-in and offline package bundle.

Each host is snapshot while bare (its unit files with their state, every entry of /etc with
its type, mode and sha256 or link target, ``dpkg-query -W``); then the deploy; ``logs``
(every line prefixed by its host, each host's engine unit there, ``--since`` limiting them,
``--follow`` streaming from both hosts until interrupted); ``down``; the snapshot again:
equal, bar the packages ``down`` lists for that host (those stay installed, with the files
they own) — and the checkpoint is still there. A second ``down --purge`` removes it.
"""

from __future__ import annotations

import base64
import json
import posixpath
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from k2fleet.cli import load_plan
from k2sandbox.harness import INVENTORY, SandboxFleet, ssh
from k2sandbox.pyinfra_cli import ROOT, cli_env

pytestmark = pytest.mark.sandbox
SANDBOX_HOSTS = 2
SANDBOX_DOCKER = False

ACCOUNTS = [f"/etc/{name}{suffix}" for name in ("passwd", "group", "shadow", "gshadow") for suffix in ("", "-")]
SNAPSHOT = f"ACCOUNTS = {ACCOUNTS!r}\n" + r'''
import hashlib, json, os, stat, subprocess
etc = {}
for top, dirs, files in os.walk("/etc"):
    for name in dirs + files:
        p = os.path.join(top, name)
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            etc[p] = "l " + os.readlink(p)
        elif stat.S_ISDIR(st.st_mode):
            etc[p] = "d %o" % stat.S_IMODE(st.st_mode)
        elif stat.S_ISREG(st.st_mode):
            with open(p, "rb") as f:
                etc[p] = "f %o %s" % (stat.S_IMODE(st.st_mode), hashlib.sha256(f.read()).hexdigest())
        else:
            etc[p] = "o %o" % st.st_mode
units = subprocess.run(["systemctl", "list-unit-files", "--no-legend", "--no-pager"], capture_output=True,
                       text=True).stdout.split("\n")
pkgs = subprocess.run(["dpkg-query", "-W"], capture_output=True, text=True).stdout.split("\n")
accounts = {}
for p in ACCOUNTS:
    try:
        with open(p) as f:
            accounts[p] = f.read().splitlines()
    except OSError:
        accounts[p] = None
print(json.dumps({"etc": etc, "accounts": accounts, "units": sorted(" ".join(u.split()[:2]) for u in units if u.strip()),
                  "packages": sorted(p for p in pkgs if p.strip())}))
'''


def snapshot(host: dict) -> dict:
    program = base64.b64encode(SNAPSHOT.encode()).decode()
    out = ssh(host, f"python3 -c 'import base64; exec(base64.b64decode(\"{program}\"))'", timeout=120)
    return json.loads(out.stdout)


def k2fleet(fleet: SandboxFleet, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k2fleet.cli", *args], cwd=ROOT, env=cli_env(fleet.env),
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout)


def package_effects(before: dict, after: dict, owned: set[str]) -> set[str]:
    """The /etc entries that differ because of what the listed packages did when installed:
    their own files; the enablement links of the units they ship (``*.wants/UNIT`` → one of
    their unit files); account files where lines were only added (their system users and
    groups: a line removed or changed is not theirs); the linker cache, when they ship a
    shared library; the SysV runlevel links update-rc.d made to their init scripts; the CA
    configuration and hashed certificate links update-ca-certificates made (ca-certificates)."""
    units = {posixpath.basename(p) for p in owned if "/systemd/system/" in p}
    out = {p for p in owned}
    for path in set(before["etc"]) | set(after["etc"]):
        if before["etc"].get(path) == after["etc"].get(path):
            continue
        if ".wants/" in path and posixpath.basename(path) in units and before["etc"].get(path) is None:
            out.add(path)
        if path.endswith(".wants") and before["etc"].get(path) is None:
            out.add(path)
        if path in before["accounts"]:
            was, now = before["accounts"][path] or [], after["accounts"][path] or []
            if set(was) <= set(now):
                out.add(path)
        if path == "/etc/ld.so.cache" and any(".so" in posixpath.basename(p) for p in owned):
            out.add(path)
        # update-rc.d in a listed package's postinst: /etc/rcN.d/{S,K}NNname -> ../init.d/name, its init script
        link = after["etc"].get(path) or ""
        if re.fullmatch(r"/etc/rc[0-6S]\.d/[SK]\d\d[\w.-]+", path) and before["etc"].get(path) is None \
                and link.startswith("l ../init.d/") and f"/etc/init.d/{link[len('l ../init.d/'):]}" in owned:
            out.add(path)
        # update-ca-certificates in ca-certificates' postinst: its config and the hashed links it makes
        if "/usr/sbin/update-ca-certificates" in owned and before["etc"].get(path) is None and (
                path == "/etc/ca-certificates.conf" or path.startswith("/etc/ssl/certs/")):
            out.add(path)
    return out


def owned_by(host: dict, packages: list[str]) -> set[str]:
    """Every path the packages' own file lists name (dpkg -L), and their conffiles."""
    if not packages:
        return set()
    out = ssh(host, "dpkg -L " + " ".join(packages), check=False)
    return {line.strip() for line in out.stdout.splitlines() if line.startswith("/")}


ISO = re.compile(r"^(\S+) +\| (\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})")


def test_logs_then_down_gives_each_host_back_as_it_was_bar_the_listed_packages(fleet: SandboxFleet) -> None:
    fleet.ensure_bare()
    before = {h["name"]: snapshot(h) for h in fleet.hosts}
    head = fleet.hosts[0]["name"]
    data = {"k2_load_balancer": head}
    result = fleet.deploy(data)
    assert result.returncode == 0, result.tail()
    names = [h["name"] for h in fleet.hosts]
    data_args = ["--data", f"k2_load_balancer={head}"]

    # --- logs: every host's engine unit, prefixed by the host
    started = ssh(fleet.hosts[0], "date '+%Y-%m-%d %H:%M:%S'").stdout.strip()
    everything = k2fleet(fleet, "logs", INVENTORY, *data_args)
    assert everything.returncode == 0, everything.stderr
    lines = everything.stdout.splitlines()
    for name in names:
        mine = [line for line in lines if line.split(" ", 1)[0] == name]
        assert any(" k2-vllm" in line or "vllm" in line for line in mine), (name, lines[-20:])
    assert all(line.split(" ", 1)[0] in names for line in lines), lines[:5]
    assert any(line.split(" ", 1)[0] == head and "haproxy" in line.lower() or "k2-lb" in line for line in lines)
    engine = k2fleet(fleet, "logs", INVENTORY, *data_args, "--service", "k2-vllm")
    assert engine.returncode == 0, engine.stderr
    assert {line.split(" ", 1)[0] for line in engine.stdout.splitlines()} == set(names)
    assert all("k2-lb" not in line for line in engine.stdout.splitlines())
    # --since: a time before the deploy's units started gives their lines; one after them, fewer, none older
    time.sleep(2)
    later = ssh(fleet.hosts[0], "date '+%Y-%m-%d %H:%M:%S'").stdout.strip()
    since_old = k2fleet(fleet, "logs", INVENTORY, *data_args, "--service", "k2-vllm.service", "--since=-1h")
    since_new = k2fleet(fleet, "logs", INVENTORY, *data_args, "--service", "k2-vllm.service", "--since", later)
    assert since_old.returncode == 0 and since_new.returncode == 0, (since_old.stderr, since_new.stderr)
    assert len(since_new.stdout.splitlines()) < len(since_old.stdout.splitlines()), (since_new.stdout, started)
    for line in since_new.stdout.splitlines():
        m = ISO.match(line)
        assert m and m.group(2).replace("T", " ") >= later, (line, later)
    # --follow: both hosts stream at once until interrupted
    follow = subprocess.Popen([sys.executable, "-m", "k2fleet.cli", "logs", INVENTORY, *data_args, "--service",
                               "k2-vllm", "--follow"], cwd=ROOT, env=cli_env(fleet.env), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    seen: set[str] = set()
    deadline = time.monotonic() + 120
    try:
        while seen != set(names) and time.monotonic() < deadline:
            ready, _, _ = select.select([follow.stdout], [], [], 1)
            if ready:
                line = follow.stdout.readline()
                if not line:
                    break
                seen.add(line.split(" ", 1)[0])
        assert seen == set(names), seen
        assert follow.poll() is None  # still following
        follow.send_signal(signal.SIGINT)
        assert follow.wait(30) == 130, follow.stderr.read()
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()

    # --- down
    dep, _ = load_plan(INVENTORY, [f"k2_load_balancer={head}"])
    checkpoint = dep.weight_sets[0].path
    down = k2fleet(fleet, "down", INVENTORY, *data_args)
    print(down.stdout)
    assert down.returncode == 0, down.stdout + down.stderr
    listed = {}
    for name in names:
        rows = [line for line in down.stdout.splitlines() if line.startswith(f"{name}: packages k2fleet installed")]
        assert len(rows) == 1, down.stdout
        # "NAME" (installed since the record) or "NAME (version changed)" (upgraded as a dependency)
        listed[name] = [p for p in rows[0].split(": ", 2)[2].replace(" (version changed)", "").split() if p != "none"]
    afters = {}
    for host in fleet.hosts:
        name = host["name"]
        after = afters[name] = snapshot(host)
        new = set(after["packages"]) - set(before[name]["packages"])
        gone = set(before[name]["packages"]) - set(after["packages"])
        new_names, gone_names = {p.split("\t")[0] for p in new}, {p.split("\t")[0] for p in gone}
        assert new_names == set(listed[name]), (new, listed[name])
        assert gone_names <= new_names, gone  # an old version gone only where down listed the package (upgraded)
        owned = owned_by(host, listed[name])
        shipped = {posixpath.basename(p) for p in owned if "/systemd/system/" in p}
        units = set(after["units"]) ^ set(before[name]["units"])
        assert {u.split()[0] for u in units} <= shipped, (units, shipped)  # only the listed packages' own units
        assert not any(u.split()[0].startswith("k2-") for u in after["units"]), after["units"]
        differ = {p for p in set(before[name]["etc"]) | set(after["etc"])
                  if before[name]["etc"].get(p) != after["etc"].get(p)}
        allowed = package_effects(before[name], after, owned)
        print(f"{name}: /etc entries that differ: {len(differ)}, all from the listed packages {listed[name]}")
        assert differ - allowed == set(), sorted((p, before[name]["etc"].get(p), after["etc"].get(p))
                                                 for p in differ - allowed)
        assert ssh(host, f"test -f {checkpoint}/config.json", check=False).returncode == 0  # kept without --purge
        assert ssh(host, "nft list table inet k2fleet", check=False).returncode != 0
        assert ssh(host, "test -e /opt/k2fleet || test -e /var/lib/k2fleet || test -e /etc/k2fleet",
                   check=False).returncode != 0
    fleet.forget()

    purge = k2fleet(fleet, "down", INVENTORY, *data_args, "--purge")
    assert purge.returncode == 0, purge.stdout + purge.stderr
    assert f"purged {checkpoint}" in purge.stdout, purge.stdout
    for host in fleet.hosts:
        assert ssh(host, f"test -e {checkpoint}", check=False).returncode != 0
        assert snapshot(host)["etc"] == afters[host["name"]]["etc"]  # a second down changes nothing else

