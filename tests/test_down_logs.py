"""``k2fleet down`` and ``k2fleet logs`` without hosts: argument validation before any
connection, the placed list computed from the desired state (one owner: what the deploy
writes is what ``down`` removes), and the host program's teardown on a real directory tree
of this machine (links not followed, kept paths kept, pre-existing directories left).
The commands on the sandbox: ``tests/test_down_logs_sandbox.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k2fleet.cli import _fleet_desired
from k2fleet.hostprogs import teardown as host_teardown
from k2fleet.planning.engine_cache import CACHE_ROOT as ENGINE_CACHE_ROOT
from k2fleet.planning.fleet_logs import LogsError, check_since, choose, journal_argv
from k2fleet.planning.teardown import placed, program_argv, safe_tree

ROOT = Path(__file__).resolve().parents[1]


def k2fleet(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k2fleet.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=120)


@pytest.mark.parametrize("args, says", [
    (["logs", "inventories/h200.py", "--service", "sshd"], "not a unit of this fleet; its units: k2-firewall.service, "
                                                           "k2-vllm.service"),
    (["logs", "inventories/h200.py", "--since", "-1h; touch /tmp/k2-owned"], "not a time journalctl takes"),
    (["logs", "inventories/h200.py", "--since", "$(id)"], "not a time journalctl takes"),
    (["logs", "inventories/h200.py", "--since", "2026-02-30"], "not a date"),
    (["down", "inventories/h200.py", "--data", "k2_tp=7"], "k2_tp"),
    (["logs", "inventories/h200.py", "--data", "k2_tp=7"], "k2_tp"),
    (["down", "inventories/h200.py", "--host", "h200-9"], "--host h200-9: not a host of this inventory "
                                                          "(hosts: h200-0, h200-1)"),
    (["down", "inventories/h200.py", "--host", "h200-0", "--data", "k2_load_balancer=h200-0"],
     "--host h200-0: it runs the load balancer (k2_load_balancer) for the hosts that stay"),
    (["down", "inventories/h200-sglang-tp16.py", "--host", "h200-1"], "--host h200-1: it is part of the instance "
                                                                      "serve-0 (h200-0, h200-1), which serves only whole"),
])
def test_bad_arguments_one_line_exit_2_no_host_contacted(args: list[str], says: str) -> None:
    # h200.py's hosts are TEST-NET addresses (192.0.2.0/24): a connection attempt would hang
    # for pyinfra's connect timeout, not answer in seconds
    start = time.monotonic()
    out = k2fleet(*args)
    assert out.returncode == 2 and says in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert out.stdout == "" and time.monotonic() - start < 60


def test_since_forms_journalctl_takes_and_argv_is_a_list() -> None:
    for ok in ("-1h", "-30min", "2 hours ago", "today", "yesterday", "@1700000000", "2026-11-27", "2026-11-27 08:00:05",
               "08:00"):
        assert check_since(ok) == ok
    for bad in ("", " -1h", "-1h\n", "1h; id", "`id`", "'x'", "2026-11-27T08:00", "25:00", "x" * 65):
        with pytest.raises(LogsError):
            check_since(bad)
    argv = journal_argv(["k2-vllm.service"], "2 hours ago", follow=True)
    assert argv[-2:] == ["--since=2 hours ago", "--follow"]


def test_service_chooses_the_hosts_that_run_it() -> None:
    units = {"a": ["k2-lb.service", "k2-vllm.service"], "b": ["k2-vllm.service"]}
    assert choose(units, "k2-lb") == {"a": ["k2-lb.service"]}
    assert choose(units, "k2-vllm.service") == {"a": ["k2-vllm.service"], "b": ["k2-vllm.service"]}
    assert choose(units, None) == units
    with pytest.raises(LogsError, match="its units: k2-lb.service, k2-vllm.service"):
        choose(units, "k2-vllm; id")


def _desired(inventory: str, *data: str):
    import argparse

    return _fleet_desired(argparse.Namespace(inventory=inventory, data=list(data)))


def test_placed_holds_every_file_of_the_desired_state_and_what_the_roles_make_beside_them() -> None:
    dep, plan, desired = _desired("inventories/h200.py", "k2_load_balancer=h200-0")
    for name, d in desired.items():
        p = placed(dep, plan.hosts[name], d)
        covered = set(p.files) | {f for f in d.all_paths() for t in p.trees if f.startswith(t + "/")}
        assert set(d.all_paths()) <= covered, set(d.all_paths()) - covered  # one owner: the desired state
        assert set(d.units) <= set(p.units) and "k2-firewall.service" in p.units
        assert "/etc/sysctl.d/60-k2fleet-privileged-ports.conf" in p.files
        assert "/etc/k2fleet" in p.trees and "/var/lib/k2fleet" in p.trees and "/opt/k2fleet/venv" in p.trees
        assert p.nft_tables == ["inet k2fleet"] and p.kept == sorted([ws.path for ws in dep.weight_sets] + [ENGINE_CACHE_ROOT])
        assert not any(t in ("/etc", "/opt", "/srv", "/var/lib", "/usr") for t in p.trees)
        spec = p.down_spec(purge=True)
        assert spec["kept"] == [] and spec["purge"] == p.kept
    assert "k2-lb.service" in placed(dep, plan.hosts["h200-0"], desired["h200-0"]).units
    assert "/etc/k2fleet/lb.cfg" in {f for f in desired["h200-0"].all_paths()}


def test_mesh_keys_are_placed_and_a_config_dir_in_etc_is_emptied_file_by_file() -> None:
    dep, plan, desired = _desired("inventories/h200-trtllm-mpi.py", "k2_config_dir=/etc/mycorp")
    for name, d in desired.items():
        p = placed(dep, plan.hosts[name], d)
        assert "/etc/mycorp" not in p.trees and "/etc/mycorp" in p.dirs
        assert any("/mesh/" in f for f in p.files), p.files
    assert not safe_tree("/etc/mycorp") and safe_tree("/etc/k2fleet") and not safe_tree("/var/lib")


def test_the_host_program_records_then_tears_down_a_real_tree(tmp_path: Path) -> None:
    root = tmp_path / "host"
    (root / "etc").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("not k2fleet's\n")
    record = root / "var/lib/k2fleet/before.json"
    tree, config = root / "opt/k2fleet", root / "etc/k2fleet"
    models = root / "srv/k2fleet/models"
    dirs = [str(root / "etc"), str(config), str(root / "srv/k2fleet"), str(models), str(models / "org--name"),
            str(root / "var/lib/k2fleet")]
    rec = host_teardown.record({"record": str(record), "dirs": dirs, "groups": [], "sysctl": [], "k2fleet_marks": [str(tree)]})
    assert rec["written"] and oct(record.stat().st_mode & 0o777) == "0o600"
    assert json.loads(record.read_text())["dirs"] == [str(root / "etc")] and not json.loads(record.read_text())["after_k2fleet"]
    assert not host_teardown.record({"record": str(record)})["written"]  # kept as it is
    # what a deploy places
    (tree / "lib").mkdir(parents=True)
    (tree / "lib/k2fleet-host.pyz").write_bytes(b"x")
    os.symlink(outside, tree / "lib/link")  # a link inside a tree is removed, never followed
    config.mkdir()
    (config / "lb.cfg").write_text("cfg\n")
    (root / "etc/keep.conf").write_text("the host's own\n")
    checkpoint = models / "org--name/rev"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text("{}\n")
    spec = {"record": str(record), "files": [str(config / "lb.cfg")], "trees": [str(tree)], "dirs": dirs,
            "kept": [str(checkpoint)], "purge": [], "units": [], "unit_globs": [], "transient": []}
    report = host_teardown.down(spec)
    assert not report["errors"], report
    assert not tree.exists() and not config.exists() and not record.exists()
    assert (outside / "precious").read_text() == "not k2fleet's\n"
    assert (root / "etc/keep.conf").exists() and (checkpoint / "config.json").exists()
    assert report["kept"] == [str(checkpoint)] and report["packages_from"] == "record"
    report = host_teardown.down({**spec, "kept": [], "purge": [str(checkpoint)]})  # --purge, the record gone
    assert report["purged"] == [str(checkpoint)] and not (root / "srv/k2fleet").exists()
    assert (root / "etc").is_dir() and report["packages_from"] == "planned"


def test_the_program_argv_carries_the_spec_as_one_word() -> None:
    argv = program_argv("down", {"files": ["/etc/k2fleet/a b'c"]})
    assert argv[:4] == ["python3", "-I", "-S", "-c"] and json.loads(argv[6]) == {"files": ["/etc/k2fleet/a b'c"]}
    out = subprocess.run([sys.executable, *argv[1:5], "record", json.dumps({"record": "/nonexistent/../x"}), "extra"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "usage" in out.stderr
    with pytest.raises(ValueError):
        program_argv("rm", {})


def test_held_packages_count_as_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """dpkg's abbreviated status is desired state then status: ``ii`` installed, ``hi`` installed
    and held (the bootstrap holds the driver), ``rc`` removed with its config left. A held
    package is installed: ``down`` must name the driver k2fleet installed and held. The
    dpkg-query here is a TEST DOUBLE printing lines in dpkg-query's own format (its
    ``-f '${db:Status-Abbrev}\\t${binary:Package}\\t${Version}\\n'`` output on Debian 12)."""
    from k2fleet.hostprogs import teardown

    fake = tmp_path / "dpkg-query"
    fake.write_text("#!/bin/sh\nprintf 'ii \\tbash\\t5.2.15-2+b7\\nhi \\tnvidia-open\\t580.95.05-1\\n"
                    "rc \\tgone\\t1.0\\nun \\tnever\\t\\n'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert teardown.installed_packages() == {"bash": "5.2.15-2+b7", "nvidia-open": "580.95.05-1"}


@pytest.mark.parametrize("args", [
    ["down", "inventories/h200.py", "--host", "h200-9\nforged: second line"],
    ["down", "inventories/h200.py", "--host", "h" * 100_000],
    ["logs", "inventories/h200.py", "--since", "-1h\nforged: second line"],
    ["logs", "inventories/h200.py", "--since", "1" * 100_000],
])
def test_a_hostile_argument_is_refused_in_one_short_line(args: list[str]) -> None:
    out = k2fleet(*args)
    assert out.returncode == 2 and out.stdout == "", out.stderr[:300]
    assert out.stderr.count("\n") == 1 and len(out.stderr) < 400, out.stderr[:300]
    assert "forged" not in out.stderr.split(":", 1)[0]
