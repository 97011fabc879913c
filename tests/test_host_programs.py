"""Host programs ship one way — one reproducible archive (``k2fleet-host.pyz``) — are
standard-library only, and run from it alone.

The archive is written into an empty directory as the engine role lays out
``/opt/k2fleet/lib`` and every program is started from it by an isolated interpreter
without site-packages (``python3 -S -E -s``), so an import of anything outside the archive
and the standard library (k2fleet's checkout, pydantic, ...) fails here.
"""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from k2fleet.deploy.facts import PROBE, probe_command
from k2fleet.hostprogs.hoststate import IN_PROCESS
from k2fleet.planning.host_archive import (ARCHIVE, ARCHIVE_MISMATCH, PROGRAMS, SOURCES, archive_bytes, archive_sha256,
                                          host_argv, probe_argv)

REPO = Path(__file__).resolve().parents[1]
ISOLATED = [sys.executable, "-S", "-E", "-s"]


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lib") / Path(ARCHIVE).name
    path.write_bytes(archive_bytes())
    return path


def test_the_archive_holds_every_host_programs_source_and_nothing_else() -> None:
    """Sources only: no bytecode of the control machine's Python (a host compiles for its own)."""
    with zipfile.ZipFile(__import__("io").BytesIO(archive_bytes())) as zf:
        names = zf.namelist()
        assert names == sorted(names)
        programs = {f"k2fleet/hostprogs/{p.name}": p for p in SOURCES.glob("*.py")}
        assert set(names) == {"__main__.py", "k2fleet/__init__.py", *programs} and set(IN_PROCESS) <= set(PROGRAMS)
        assert all(zf.read(name) == path.read_bytes() for name, path in programs.items())
        assert zf.read("k2fleet/__init__.py") == b""  # not the product's package: nothing of it but the programs
        assert {info.date_time for info in zf.infolist()} == {(1980, 1, 1, 0, 0, 0)}
        assert {info.compress_type for info in zf.infolist()} == {zipfile.ZIP_STORED}  # the probe inflates nothing


@pytest.mark.parametrize("loaded", ["", "import k2fleet.hostprogs.health, k2fleet.hostprogs.verify, tests.test_api_front; "])
def test_the_archive_is_reproducible_across_processes(loaded: str) -> None:
    """The same bytes whatever else a process has loaded (the plan, the deploy and a test
    must agree on the sha256: a pin that drifted would re-upload the archive every run)."""
    code = f"{loaded}from k2fleet.planning.host_archive import archive_bytes; import hashlib; " \
           "print(hashlib.sha256(archive_bytes()).hexdigest())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout.strip()
    assert other == hashlib.sha256(archive_bytes()).hexdigest()


def test_the_archive_is_the_same_whatever_the_control_machines_python(tmp_path: Path) -> None:
    """The same bytes from another interpreter (the system's python3 beside this venv's), with
    its bytecode cache empty or stale, another umask and another hash seed: nothing of the
    control machine's Python goes into the archive, so operators on different Pythons ship
    (and gate on) one archive."""
    import os

    code = ("import os, sys; os.umask(0o077); sys.path.insert(0, sys.argv[1]); "
            "from k2fleet.planning.host_archive import archive_bytes; import hashlib; "
            "print(hashlib.sha256(archive_bytes()).hexdigest())")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "1234",
           "PYTHONPYCACHEPREFIX": str(tmp_path / "pycache"), "PYTHONDONTWRITEBYTECODE": "1"}
    pythons = {sys.executable, "/usr/bin/python3"}
    seen = {subprocess.run([python, "-I", "-c", code, str(REPO)], capture_output=True, text=True, check=True,
                           env=env, cwd=tmp_path).stdout.strip() for python in pythons if Path(python).exists()}
    assert seen == {hashlib.sha256(archive_bytes()).hexdigest()}


@pytest.mark.parametrize("program", PROGRAMS)
def test_each_program_loads_from_the_archive_with_the_standard_library_only(archive: Path, program: str) -> None:
    out = subprocess.run([*ISOLATED, "-c", f"import sys; sys.path.insert(0, {str(archive)!r}); "
                          f"import k2fleet.hostprogs.{program} as m; print(m.__file__)"],
                         capture_output=True, text=True, cwd=archive.parent, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"{archive}/k2fleet/hostprogs/{program}.py", out.stderr


@pytest.mark.parametrize("program", ["relay", "verify", "health", "overlay", "raygate"])
def test_a_program_runs_as_the_archive_starts_it(archive: Path, program: str) -> None:
    out = subprocess.run([*ISOLATED, str(archive), program, "--help"], capture_output=True, text=True,
                         cwd=archive.parent, timeout=60)
    assert out.returncode == 0 and "usage" in out.stdout.lower(), (program, out.stdout, out.stderr)


def test_the_state_probe_answers_from_the_archive(archive: Path) -> None:
    query = '{"files": ["/etc/hostname"], "exists": ["/nonexistent"], "disk_path": "/"}'
    out = subprocess.run([*ISOLATED, str(archive), "hoststate", query], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and json.loads(out.stdout)["exists"] == {"/nonexistent": False}, out.stderr


def test_an_unknown_program_is_refused(archive: Path) -> None:
    out = subprocess.run([*ISOLATED, str(archive), "nope"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "usage: k2fleet-host.pyz" in out.stderr
    with pytest.raises(ValueError):
        host_argv("nope")


def test_a_same_named_module_of_the_host_cannot_stand_in_for_a_program(archive: Path, tmp_path: Path) -> None:
    """Exploit first: a host whose Python path holds a ``verify`` or ``swarm`` module (a
    stray file, another package) must not have it imported by the relay in place of the
    archive's (the relay used to try ``import swarm`` / ``import verify`` first)."""
    evil = tmp_path / "site"
    evil.mkdir()
    for name in ("swarm", "verify"):
        (evil / f"{name}.py").write_text("raise SystemExit('hostile module imported')\n")
    out = subprocess.run([*ISOLATED, str(archive), "relay", "--help"], capture_output=True, text=True,
                         env={"PYTHONPATH": str(evil)}, cwd=evil, timeout=60)
    assert out.returncode == 0 and "hostile" not in out.stdout + out.stderr, out.stderr


def test_verify_from_the_archive_checks_a_real_directory(archive: Path, tmp_path: Path) -> None:
    """Not only ``--help``: the shipped verify refuses a directory without a manifest."""
    out = subprocess.run([*ISOLATED, str(archive), "verify", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0


def test_hoststate_probe_runs_piped_with_the_standard_library_only(tmp_path: Path) -> None:
    query = '{"files": ["/etc/hostname"], "exists": ["/nonexistent"], "disk_path": "/"}'
    out = subprocess.run([*ISOLATED, "-", query], input=PROBE, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["exists"] == {"/nonexistent": False}


def test_the_desired_state_ships_the_archive_and_names_its_sha256() -> None:
    from k2fleet.cli import load_plan, plan_document
    from k2fleet.planning.desired import ControlArtifacts, desired_state

    dep, plan = load_plan(REPO / "inventories" / "h200.py")
    want = hashlib.sha256(archive_bytes()).hexdigest()
    for host in desired_state(dep, plan, ControlArtifacts()).values():
        assert host.files["engine"][ARCHIVE].content == archive_bytes()
        assert not any(p.startswith("/opt/k2fleet/lib/") and p != ARCHIVE for part in host.files.values() for p in part)
    doc = plan_document(dep, plan)
    assert {h["desired"]["files"][ARCHIVE]["sha256"] for h in doc["hosts"].values()} == {want}


def test_the_probe_runs_from_the_archive_as_the_fact_starts_it(archive: Path, tmp_path: Path) -> None:
    """The fact's argv (``-c``, no runpy): answers from the archive, and a ``json`` or
    ``k2fleet`` module in the working directory (the login's home) is never imported."""
    for name in ("json", "subprocess"):
        (tmp_path / f"{name}.py").write_text("raise SystemExit('hostile module imported')\n")
    (tmp_path / "k2fleet").mkdir()
    (tmp_path / "k2fleet" / "__init__.py").write_text("raise SystemExit('hostile package imported')\n")
    query = '{"exists": ["/nonexistent"], "disk_path": "/"}'
    python, *rest = probe_argv(archive=str(archive), unpacked=str(tmp_path / "unpacked"))
    out = subprocess.run([sys.executable, *rest, query], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0 and "hostile" not in out.stdout + out.stderr, out.stderr
    assert json.loads(out.stdout)["exists"] == {"/nonexistent": False}


def _probe_imports_from(argv: list[str], cwd: Path) -> str:
    """Where the probe started by ``argv`` imported hoststate from (the probe itself runs)."""
    program = argv[-1].replace("from k2fleet.hostprogs.hoststate import run\nrun()\n",
                               "import k2fleet.hostprogs.hoststate as h\nprint(h.__file__)\n")
    assert program != argv[-1]
    out = subprocess.run([sys.executable, *argv[1:-1], program], capture_output=True, text=True, cwd=cwd, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_host_compiles_the_probe_once_per_archive(archive: Path, tmp_path: Path) -> None:
    """The probe unpacks the archive it checked into a root-only directory named after its
    sha256 and imports from there, so the host's own Python keeps the bytecode it compiles
    (``__pycache__``): compiled at the first probe of an archive, reused after; an older
    archive's directory is removed."""
    unpacked = tmp_path / "unpacked"
    unpacked.mkdir(mode=0o700)
    (unpacked / ("0" * 64)).mkdir()  # an older archive's copy
    argv = probe_argv(archive=str(archive), unpacked=str(unpacked))
    where = unpacked / archive_sha256()
    assert _probe_imports_from(argv, tmp_path) == f"{where}/k2fleet/hostprogs/hoststate.py"
    assert sorted(p.name for p in unpacked.iterdir()) == [archive_sha256()]
    pyc = next((where / "k2fleet/hostprogs/__pycache__").glob("hoststate.*.pyc"))
    compiled = pyc.stat().st_mtime_ns
    query = '{"exists": ["/nonexistent"], "disk_path": "/"}'
    out = subprocess.run([sys.executable, *argv[1:], query], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0 and json.loads(out.stdout)["exists"] == {"/nonexistent": False}, out.stderr
    assert pyc.stat().st_mtime_ns == compiled  # the bytecode of the first probe, not compiled again
    assert (where / "k2fleet/hostprogs/hoststate.py").read_bytes() == (SOURCES / "hoststate.py").read_bytes()


def test_an_unpacked_copy_anyone_else_could_write_is_not_imported(archive: Path, tmp_path: Path) -> None:
    """Exploit first: a directory at the unpacked copy's place holding a forged hoststate, its
    parent writable by others (or a symlink to such a place): the probe imports from the
    archive itself, never from there."""
    import os

    for kind in ("world-writable", "symlink"):
        place = tmp_path / kind
        forged = place / "real" if kind == "symlink" else place / "unpacked"
        (forged / archive_sha256() / "k2fleet/hostprogs").mkdir(parents=True)
        (forged / archive_sha256() / "k2fleet/__init__.py").write_text("")
        (forged / archive_sha256() / "k2fleet/hostprogs/__init__.py").write_text("")
        (forged / archive_sha256() / "k2fleet/hostprogs/hoststate.py").write_text("raise SystemExit('forged')\n")
        if kind == "symlink":
            forged.chmod(0o700)
            os.symlink(forged, place / "unpacked")
        else:
            forged.chmod(0o777)
        argv = probe_argv(archive=str(archive), unpacked=str(place / "unpacked"))
        assert _probe_imports_from(argv, tmp_path) == f"{archive}/k2fleet/hostprogs/hoststate.py", kind


FULL_Q = """Driver Version : 580.95.05
Attached GPUs : 1
GPU 00000000:18:00.0
    Product Name : NVIDIA H200
    FB Memory Usage
        Total : 143771 MiB
    Fabric
        State : Completed
        Status : Success
"""


def _probe_with_nvidia_smi_double(archive: Path, tmp_path: Path, health_exit: int) -> tuple[dict, list[str]]:
    """The probe from the archive with an nvidia-smi TEST DOUBLE on PATH that logs each call,
    a stand-in health check exiting ``health_exit`` as the GPUs' proof, and the GPU gate."""
    bin_dir, log = tmp_path / f"bin{health_exit}", tmp_path / f"smi{health_exit}.log"
    bin_dir.mkdir()
    (bin_dir / "q.txt").write_text(FULL_Q)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec cat {bin_dir / "q.txt"}\n')
    smi.chmod(0o755)
    gate = {"vendor": "nvidia", "count": 1, "name": "H200", "branch": 580, "minimum": 580, "fabric": True,
            "driver_package": "nvidia-open", "services": [], "timeout": 0, "version": None}
    query = {"disk_path": "/", "gpus_proven_by": ["healthy"],
             "checks": {"gpu-ready": ["/usr/bin/python3", str(archive), "hoststate", "--gate", json.dumps(gate)],
                        "healthy": ["/bin/sh", "-c", f"sleep 0.2; exit {health_exit}"]}}  # the gate starts first
    python, *rest = probe_argv(archive=str(archive), unpacked=str(tmp_path / "unpacked"))
    out = subprocess.run([sys.executable, *rest, json.dumps(query)], capture_output=True, text=True, timeout=120,
                         env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), log.read_text().splitlines() if log.exists() else []


def test_a_healthy_engine_on_all_gpus_stands_in_for_nvml(archive: Path, tmp_path: Path) -> None:
    """Proof passed: nvidia-smi is never started (neither the report nor the GPU gate asks
    it); the report says what stood in for it. Failed: NVML is asked once, as before."""
    report, calls = _probe_with_nvidia_smi_double(archive, tmp_path, health_exit=0)
    assert calls == [] and report["gpus"]["proven_by"] == ["healthy"] and report["gpus"]["names"] == []
    assert report["checks"]["healthy"] == 0
    # the gate's other half still ran: this machine has no NVIDIA module loaded → it fails
    assert report["checks"]["gpu-ready"] == 1 and report["gpus"]["driver"] is None
    report, calls = _probe_with_nvidia_smi_double(archive, tmp_path, health_exit=1)
    assert calls == ["-q"], calls
    assert report["gpus"]["names"] == ["NVIDIA H200"] and "proven_by" not in report["gpus"]


def test_an_archive_of_other_bytes_is_not_run_and_the_fact_sends_the_source(archive: Path, tmp_path: Path) -> None:
    """The fact's argv refuses an archive whose sha256 is not the pinned one (exit 97), and
    the fact's whole command then answers from the source it carries (a bare host: here no
    archive at /opt/k2fleet/lib, or an old one). Exploit first: an archive at the path with other bytes
    (another version, or tampered) whose hoststate would answer differently."""
    other = tmp_path / Path(ARCHIVE).name
    with zipfile.ZipFile(other, "w") as zf:
        zf.writestr("k2fleet/__init__.py", "")
        zf.writestr("k2fleet/hostprogs/__init__.py", "")
        zf.writestr("k2fleet/hostprogs/hoststate.py", "def run():\n    print('{\"forged\": true}')\n")
    python, *rest = probe_argv(archive=str(other))
    out = subprocess.run([sys.executable, *rest, "{}"], capture_output=True, text=True, timeout=60)
    assert out.returncode == ARCHIVE_MISMATCH and "forged" not in out.stdout, (out.returncode, out.stdout)
    assert not Path(ARCHIVE).exists() or Path(ARCHIVE).read_bytes() != archive_bytes(), "needs no current archive"
    query = {"exists": ["/nonexistent"], "disk_path": "/"}
    out = subprocess.run(["sh", "-c", probe_command(query)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and json.loads(out.stdout)["exists"] == {"/nonexistent": False}, out.stderr
    assert len(probe_command(query)) < len(PROBE) // 2  # the source travels compressed


def test_the_probe_reads_packages_and_holds_with_dpkg_query(tmp_path: Path) -> None:
    """One ``dpkg-query -W`` answers every package question (here of a dpkg database of its
    own, ``--admindir``): installed versions by glob, holds, and a package removed but for its
    configuration files counted as not installed."""
    from k2fleet.hostprogs.hoststate import PackageDb, holds, package_versions

    (tmp_path / "updates").mkdir()
    (tmp_path / "status").write_text(
        "Package: nvidia-open\nStatus: hold ok installed\nArchitecture: amd64\nVersion: 580.95.05-1\n"
        "Maintainer: x\nDescription: d\n\n"
        "Package: nvidia-old\nStatus: deinstall ok config-files\nArchitecture: amd64\nVersion: 1\n"
        "Maintainer: x\nDescription: d\n\n"
        "Package: rsync\nStatus: install ok installed\nArchitecture: amd64\nVersion: 3.2.7-1\n"
        "Maintainer: x\nDescription: d\n")
    db = PackageDb(admindir=str(tmp_path))
    assert package_versions(["nvidia-*"], db) == {"nvidia-open": "580.95.05-1"}
    assert package_versions(["rsync"], db) == {"rsync": "3.2.7-1"} and holds(db) == ["nvidia-open"]


def test_the_probe_lists_every_interface_with_its_addresses() -> None:
    """The probe's NICs (``ip -j addr``): every interface of this machine's /sys/class/net,
    the loopback's addresses among them (the other xdist worker's sandbox fleet may add or
    delete links meanwhile: every link there before and after is listed, none that was in neither)."""
    from k2fleet.hostprogs.hoststate import nics

    before = {p.name for p in Path("/sys/class/net").iterdir()}
    mine = nics()
    after = {p.name for p in Path("/sys/class/net").iterdir()}
    assert before & after <= set(mine) <= before | after and "127.0.0.1" in mine["lo"], (mine, before, after)


@pytest.mark.parametrize("inventory, data, proven", [
    ("h200.py", (), {"h200-0": ["healthy"], "h200-1": ["healthy"]}),  # TP8 on each host
    ("h200.py", ("k2_tp=1", "k2_dp=8"), {"h200-0": [], "h200-1": []}),  # 8 replicas: a completion reaches one
    ("h800-pp.py", (), {"h800-0": [], "h800-1": []}),  # one instance over two hosts
    ("h200-sglang-pd.py", (), {"router-0": [], "prefill-0": [], "decode-0": []}),  # the router has no GPUs
])
def test_a_host_is_proven_by_its_health_only_when_one_completion_runs_on_all_its_gpus(
        inventory: str, data: tuple[str, ...], proven: dict[str, list[str]]) -> None:
    """Which hosts' health check stands in for NVML (planning.desired.gpus_proven_by), and the
    fact's query carries it (``k2fleet status`` asks NVML anyway)."""
    from k2fleet.cli import load_plan
    from k2fleet.planning.desired import ControlArtifacts, desired_state

    dep, plan = load_plan(REPO / "inventories" / inventory, list(data))
    desired = desired_state(dep, plan, ControlArtifacts())
    assert {name: desired[name].gpus_proven_by for name in proven} == proven
    for name, checks in proven.items():
        assert desired[name].fact_query("/").get("gpus_proven_by", []) == checks
        assert "gpus_proven_by" not in desired[name].fact_query("/", full_gpu_look=True)


def test_a_hung_health_check_keeps_the_probe_within_one_deadline(tmp_path: Path) -> None:
    """The proof (the health check) that never answers: the probe waits for it once, within
    its one deadline for every check (it used to wait for the proof, then again for the
    checks), then asks NVML as on a host without proof."""
    bin_dir, log = tmp_path / "bin", tmp_path / "smi.log"
    bin_dir.mkdir()
    (bin_dir / "q.txt").write_text(FULL_Q)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\necho "$*" >> {log}\n[ "$1" = -q ] && exec cat {bin_dir / "q.txt"}\n'
                   'echo "NVIDIA H200, 143771, 580.95.05"\n')
    smi.chmod(0o755)
    query = {"disk_path": "/", "gpus_proven_by": ["healthy"], "checks": {"healthy": ["/bin/sh", "-c", "sleep 30"]}}
    program = ("import sys; sys.path.insert(0, sys.argv[1]); from k2fleet.hostprogs import hoststate as h; "
               "h.CHECK_TIMEOUT_S = 2; sys.argv = ['probe', sys.argv[2]]; h.run()")
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-I", "-S", "-c", program, str(REPO), json.dumps(query)], capture_output=True,
                         text=True, timeout=60, env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    took = time.monotonic() - started
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["checks"] == {"healthy": None} and "proven_by" not in report["gpus"]
    assert report["gpus"]["names"] == ["NVIDIA H200"] and len(log.read_text().splitlines()) == 1
    assert took < 3.8, took  # 2 s once, not 2 + 2


@pytest.mark.parametrize("units", [["k2-vllm.service"], []])
def test_the_quick_health_look_at_a_unit_that_is_down_fails_at_once(archive: Path, tmp_path: Path,
                                                                    units: list[str]) -> None:
    """The fact's quick look (the archive's ``health``, run in the probe) at an engine whose unit
    the probe's one look at the units saw down (a ``systemctl`` TEST DOUBLE on PATH answers
    ``show`` with ``ActiveState=inactive``, as systemd prints it) fails at once, not after its
    ``--timeout``: nothing can answer while the unit is down, and a failed look only makes the
    deploy run the full gate. A unit the probe was not asked about is looked at the slow way:
    the health program polls until its deadline."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text('#!/bin/sh\n[ "$1" = show ] || exit 1\nfor u in "$@"; do case "$u" in *.service) '
                                       'printf "Id=%s\\nLoadState=loaded\\nActiveState=inactive\\nUnitFileState=enabled\\n\\n" '
                                       '"$u";; esac; done\n')
    (bin_dir / "systemctl").chmod(0o755)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    health = ["/usr/bin/python3", str(archive), "health", "--base", f"http://127.0.0.1:{port}", "--model", "m",
              "--unit", "k2-vllm.service", "--timeout", "4"]
    query = {"disk_path": "/", "units": units, "checks": {"healthy": health}}
    python, *rest = probe_argv(archive=str(archive), unpacked=str(tmp_path / "unpacked"))
    started = time.monotonic()
    out = subprocess.run([sys.executable, *rest, json.dumps(query)], capture_output=True, text=True, timeout=120,
                         env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    took = time.monotonic() - started
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["checks"] == {"healthy": 1}
    assert report["units"] == ({"k2-vllm.service": {"Id": "k2-vllm.service", "LoadState": "loaded", "ActiveState": "inactive",
                                                    "UnitFileState": "enabled"}} if units else {})
    assert (took < 3.5) if units else (took >= 4), took
