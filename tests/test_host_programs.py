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
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from k2fleet.deploy.facts import PROBE, probe_command
from k2fleet.hostprogs.hoststate import IN_PROCESS
from k2fleet.planning.host_archive import (ARCHIVE, ARCHIVE_MISMATCH, PROBE_IMPORTS, PROGRAMS, SOURCES, archive_bytes,
                                          host_argv, probe_argv)

REPO = Path(__file__).resolve().parents[1]
ISOLATED = [sys.executable, "-S", "-E", "-s"]


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lib") / Path(ARCHIVE).name
    path.write_bytes(archive_bytes())
    return path


def test_the_archive_holds_every_host_program_and_nothing_else() -> None:
    with zipfile.ZipFile(__import__("io").BytesIO(archive_bytes())) as zf:
        names = zf.namelist()
        assert names == sorted(names)
        sources = {"__main__.py", "k2fleet/__init__.py", *(f"k2fleet/hostprogs/{p.name}" for p in SOURCES.glob("*.py"))}
        # the probe's programs and the modules they import, with their bytecode
        probe = {f"k2fleet/hostprogs/{p}.pyc" for p in (*IN_PROCESS, *PROBE_IMPORTS)}
        assert set(names) == sources | probe and len(probe) == 6
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


def test_the_archive_is_the_same_from_the_bytecode_cache_or_compiled(tmp_path: Path) -> None:
    """The probe's bytecode taken from the interpreter's own cache (``__pycache__``, here
    under a private ``PYTHONPYCACHEPREFIX``, checked hash-based pycs as ./dev.sh writes them)
    or compiled (no cache): the same archive."""
    programs = [f"k2fleet/hostprogs/{p}.py" for p in (*IN_PROCESS, *PROBE_IMPORTS)]
    code = ("from k2fleet.planning import host_archive as ha; import hashlib; "
            "used = [ha.cached_code(ha.SOURCES / p.rsplit('/', 1)[1], (ha.SOURCES / p.rsplit('/', 1)[1]).read_bytes()) "
            f"is not None for p in {programs!r}]; print(hashlib.sha256(ha.archive_bytes()).hexdigest(), all(used), any(used))")
    base = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    warm, cold = tmp_path / "warm", tmp_path / "cold"
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-f", "--invalidation-mode", "checked-hash", *programs],
                   check=True, cwd=REPO, env={**base, "PYTHONPYCACHEPREFIX": str(warm)}, stdout=subprocess.DEVNULL)
    runs = {}
    for name, prefix in (("warm", warm), ("cold", cold)):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                             env={**base, "PYTHONPYCACHEPREFIX": str(prefix), "PYTHONDONTWRITEBYTECODE": "1"})
        runs[name] = out.stdout.split()
    assert runs["warm"][1:] == ["True", "True"] and runs["cold"][1:] == ["False", "False"], runs
    assert runs["warm"][0] == runs["cold"][0] == hashlib.sha256(archive_bytes()).hexdigest()


def test_a_stale_or_foreign_bytecode_cache_is_never_shipped(tmp_path: Path) -> None:
    """:func:`cached_code` takes a cached pyc only when it proves it is of exactly the source:
    a checked hash-based pyc of these bytes. Exploit first: a timestamp pyc of other source
    whose file was put back with the same size and second (``cp -p``) — the import system's
    own rule takes it — is not shipped; nor an unchecked hash pyc, one of other source, or
    another interpreter's."""
    import os
    import py_compile
    from importlib.util import cache_from_source

    from k2fleet.planning.host_archive import cached_code

    src = tmp_path / "m.py"
    src.write_bytes(b"X = 1\n")
    then = int(src.stat().st_mtime) - 10
    os.utime(src, (then, then))
    pyc = Path(cache_from_source(str(src), optimization=""))
    py_compile.compile(str(src), cfile=str(pyc), doraise=True)  # a timestamp pyc of X = 1
    src.write_bytes(b"X = 2\n")  # the same size, its old time put back
    os.utime(src, (then, then))
    assert cached_code(src, b"X = 2\n") is None
    py_compile.compile(str(src), cfile=str(pyc), doraise=True,
                       invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
    code = cached_code(src, b"X = 2\n")
    assert code is not None and code.co_consts == compile(b"X = 2\n", "m", "exec").co_consts
    assert cached_code(src, b"X = 3\n") is None  # a hash-based pyc of other source
    py_compile.compile(str(src), cfile=str(pyc), doraise=True,
                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    assert cached_code(src, b"X = 2\n") is None
    py_compile.compile(str(src), cfile=str(pyc), doraise=True,
                       invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
    data = pyc.read_bytes()
    pyc.write_bytes(b"\x00\x00\r\n" + data[4:])  # another interpreter's magic number
    assert cached_code(src, b"X = 2\n") is None


@pytest.mark.parametrize("program", PROGRAMS)
def test_each_program_loads_from_the_archive_with_the_standard_library_only(archive: Path, program: str) -> None:
    out = subprocess.run([*ISOLATED, "-c", f"import sys; sys.path.insert(0, {str(archive)!r}); "
                          f"import k2fleet.hostprogs.{program} as m; print(m.__file__)"],
                         capture_output=True, text=True, cwd=archive.parent, timeout=60)
    # this interpreter compiled the archive's bytecode of the probe's programs, so it loads their pyc
    suffix = ".pyc" if program in IN_PROCESS else ".py"
    assert out.returncode == 0 and out.stdout.strip() == f"{archive}/k2fleet/hostprogs/{program}{suffix}", out.stderr


def _rezip(archive: Path, out: Path, change: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(archive) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, change.get(info.filename, src.read(info.filename)))
    return out


def test_bytecode_of_another_python_is_skipped_for_the_source(archive: Path, tmp_path: Path) -> None:
    """A host whose Python has another bytecode version (another magic number) compiles the
    source instead: the pyc is an optimisation, never a requirement."""
    name = "k2fleet/hostprogs/health.py"
    with zipfile.ZipFile(archive) as zf:
        pyc = zf.read(name + "c")
    other = _rezip(archive, tmp_path / "other.pyz", {name + "c": b"\x00\x00\r\n" + pyc[4:]})
    out = subprocess.run([*ISOLATED, "-c", f"import sys; sys.path.insert(0, {str(other)!r}); "
                          "import k2fleet.hostprogs.health as m; print(m.__file__)"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f"{other}/{name}", out.stderr


def test_bytecode_of_another_source_is_never_run(archive: Path, tmp_path: Path) -> None:
    """Bytecode whose source hash does not match the source beside it (a pyc left from an
    edit) is not run: the source is. (Bytes planted in the archive itself are the archive
    pin's matter: the fact runs the archive only when its sha256 is the plan's.)"""
    name = "k2fleet/hostprogs/image_pin.py"
    from k2fleet.planning.host_archive import checked_pyc
    stale = _rezip(archive, tmp_path / "stale.pyz", {name + "c": checked_pyc(b"PLANTED = True\n", f"{ARCHIVE}/{name}")})
    out = subprocess.run([*ISOLATED, "-c", f"import sys; sys.path.insert(0, {str(stale)!r}); "
                          "import k2fleet.hostprogs.image_pin as m; print(hasattr(m, 'PLANTED'), m.__file__)"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["False", f"{stale}/{name}"], (out.stdout, out.stderr)


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
    python, *rest = probe_argv(archive=str(archive))
    out = subprocess.run([sys.executable, *rest, query], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0 and "hostile" not in out.stdout + out.stderr, out.stderr
    assert json.loads(out.stdout)["exists"] == {"/nonexistent": False}


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
    python, *rest = probe_argv(archive=str(archive))
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


def test_the_probe_reads_dpkgs_database_as_dpkg_query_does(tmp_path: Path) -> None:
    """The probe reads dpkg's status file itself (no dpkg-query process); on this Debian
    machine every row equals dpkg-query's. With entries in dpkg's journal (an interrupted
    run) it asks dpkg-query, which merges them."""
    from k2fleet.hostprogs.hoststate import Dpkg

    out = subprocess.run(["dpkg-query", "-W", "-f", "${db:Status-Abbrev}\t${Package}\t${Version}\n"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    theirs = sorted(tuple(r) for r in (line.split("\t") for line in out.splitlines()) if len(r) == 3)
    mine = Dpkg()._from_status_file()
    assert mine is not None and len(theirs) > 50 and sorted(tuple(r) for r in mine) == theirs
    (tmp_path / "updates").mkdir()
    (tmp_path / "status").write_text("Package: a\nStatus: install ok installed\nVersion: 1\n")
    assert Dpkg(str(tmp_path))._from_status_file() == [["ii ", "a", "1"]]
    (tmp_path / "updates" / "0001").write_text("Package: a\nStatus: deinstall ok config-files\n")
    assert Dpkg(str(tmp_path))._from_status_file() is None


def test_the_probe_reads_addresses_over_netlink_as_ip_shows_them() -> None:
    """The probe's NICs come from one netlink dump (no ``ip`` process): every interface and
    address in the order ``ip -j addr`` gives, on this machine (the sandbox bridge and its
    veths too when a fleet is up)."""
    from k2fleet.hostprogs.hoststate import netlink_addresses

    links = json.loads(subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, check=True,
                                      timeout=60).stdout)
    theirs = {link["ifname"]: [a["local"] for a in link.get("addr_info", [])] for link in links}
    mine = netlink_addresses()
    assert list(mine.items()) == list(theirs.items()) and "lo" in mine


def _dbus_reply(serial: int, text: str, kind: int = 2, signature: str = "v", claimed: int | None = None) -> bytes:
    """A little-endian D-Bus answer to call ``serial``: a variant string ``text`` (a test's
    stand-in for systemd's PID 1 on its private socket)."""
    fields = bytearray([5, 1]) + b"u\0" + bytes(-4 % 4) + serial.to_bytes(4, "little")
    fields += bytes(-len(fields) % 8) + bytes([8, 1]) + b"g\0" + bytes([len(signature)]) + signature.encode() + b"\0"
    size = len(text.encode()) if claimed is None else claimed  # claimed: a length that lies
    body = b"\x01s\x00\x00" + size.to_bytes(4, "little") + text.encode() + b"\0"
    head = bytearray(b"l" + bytes([kind, 1, 1])) + len(body).to_bytes(4, "little") + (900 + serial).to_bytes(4, "little")
    head += len(fields).to_bytes(4, "little") + fields
    return bytes(head + bytes(-len(head) % 8) + body)


def _fake_systemd(answer) -> str:
    """A Unix socket that authenticates like PID 1's and then sends ``answer(calls)`` (calls:
    how many requests arrived); its path."""
    import socket
    import threading

    import tempfile

    path = tempfile.mkdtemp(prefix="k2dbus", dir="/tmp") + "/private"  # a Unix socket's path is short
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(5)
            got = b""
            while b"\r\n" not in got:
                got += conn.recv(4096)
            conn.sendall(b"OK 0123456789abcdef\r\n")
            time.sleep(0.2)
            got = conn.recv(1 << 20)
            try:
                conn.sendall(answer(got.count(b"org.freedesktop.DBus.Properties")))
                time.sleep(1)
            except OSError:
                pass
        server.close()

    threading.Thread(target=serve, daemon=True).start()
    return path


def test_unit_states_come_from_systemds_bus_and_hostile_answers_are_refused() -> None:
    """The probe asks PID 1 for its units over D-Bus (no systemctl process): answers out of
    order are matched by serial; an error reply, a string past the end, a flood past the cap
    and silence each end in ValueError/OSError (then systemctl answers), never a hang or a
    wrong state. (Against the real systemd: tests/test_status_sandbox.py.)"""
    from k2fleet.hostprogs.hoststate import UNIT_PROPERTIES, units_over_dbus

    values = {"Id": "k2-vllm.service", "LoadState": "loaded", "ActiveState": "active", "UnitFileState": "enabled"}
    good = lambda n: b"".join(_dbus_reply(i, values[UNIT_PROPERTIES[(i - 1) % 4]]) for i in reversed(range(1, n + 1)))
    assert units_over_dbus(["k2-vllm.service"], 5, _fake_systemd(good)) == {"k2-vllm.service": values}
    hostile = {
        "error reply": lambda n: _dbus_reply(1, "org.freedesktop.DBus.Error.AccessDenied", kind=3, signature="s"),
        "string past the end": lambda n: _dbus_reply(1, "k2-vllm.service", claimed=99),
        "flood": lambda n: b"l\x02\x01\x01" + (1 << 30).to_bytes(4, "little") + bytes(8) + bytes(2 << 20),
        "silence": lambda n: b"",
    }
    for what, answer in hostile.items():
        started = time.monotonic()
        with pytest.raises((ValueError, OSError)):
            units_over_dbus(["k2-vllm.service"], 0.8, _fake_systemd(answer))
        assert time.monotonic() - started < 5, what


def test_the_probes_json_falls_back_to_the_json_module_without_the_accelerator() -> None:
    """Without ``_json`` (an interpreter built without it) the probe's JSON helpers are
    json's own: same answers, no recursion."""
    program = ("import sys; sys.modules['_json'] = None; sys.path.insert(0, sys.argv[1]); "
               "from k2fleet.hostprogs.hoststate import json_dumps, json_loads; "
               "v = json_loads(' {\"b\": [1, 2.5, null], \"a\": \"\\\\u00e9\"} '); "
               "print(json_dumps(v, sort_keys=True)); json_loads('[1] x')")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", program, str(REPO)], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout == '{"a":"\\u00e9","b":[1,2.5,null]}\n' and "JSONDecodeError: Extra data" in out.stderr, \
        (out.stdout, out.stderr)  # json's own error (a ValueError), from json's own loads
    assert "RecursionError" not in out.stderr


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


def test_a_child_past_its_time_is_killed_and_reaped() -> None:
    """The probe's children (its own posix_spawn runner): past the timeout, one still
    writing and one that closed its pipes but did not exit are both killed and reaped."""
    from k2fleet.hostprogs.hoststate import Child, Timeout, run_child

    for script in ("while :; do echo x; sleep 0.05; done", "exec >&- 2>&-; sleep 30"):
        started = time.monotonic()
        with pytest.raises(Timeout):
            run_child(["sh", "-c", script], 0.5)
        assert time.monotonic() - started < 5, script
    child = Child(["sleep", "30"], capture=True)
    with pytest.raises(Timeout):
        child.communicate(0.3)
    assert child.wait(5) == -9 and not Path(f"/proc/{child.pid}").exists()
    assert run_child(["sh", "-c", "kill -PIPE $$"], 5)[0] == -13  # SIGPIPE at its default (subprocess's)


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
