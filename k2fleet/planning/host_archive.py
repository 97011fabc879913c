"""k2fleet's host programs, shipped one way: one reproducible zipapp of their sources.

Every program in :mod:`k2fleet.hostprogs` runs on a host from one archive,
``/opt/k2fleet/lib/k2fleet-host.pyz``, as ``python3 ARCHIVE PROGRAM ARGS...`` (the Ray gate
with the engine venv's python, the Hub downloader with the Hub client's); the archive is a
file of the desired state, so its sha256 is in ``k2fleet plan --json`` and a host whose copy
differs gets it again. It holds sources only, no bytecode, and its bytes depend on those
sources alone (entries sorted, fixed timestamps and modes, stored): every control machine
with the same checkout ships the same archive, whatever its Python. Inside, the programs
import one another as ``k2fleet.hostprogs.NAME`` only: nothing on a host's own
``sys.path`` can stand in for one of them.

The host compiles them itself. Python's zip importer neither reads nor writes a bytecode
cache for sources, so the state probe, which runs at every deploy (:func:`probe_argv`),
imports from a copy of the archive unpacked once per archive by the host's own Python
(a directory named after its sha256, root's alone), where the import system keeps its
``__pycache__`` as for any module; where it cannot make one (not root), it imports from the
archive itself.

>>> host_argv("verify", "--marker-only", "/m/k2")
['/usr/bin/python3', '/opt/k2fleet/lib/k2fleet-host.pyz', 'verify', '--marker-only', '/m/k2']
>>> archive_bytes() == archive_bytes() and archive_bytes().startswith(b"#!/usr/bin/python3")
True
"""

from __future__ import annotations

import hashlib
import io
import zipfile
from functools import lru_cache
from pathlib import Path

ARCHIVE = "/opt/k2fleet/lib/k2fleet-host.pyz"
SOURCES = Path(__file__).resolve().parents[1] / "hostprogs"
PROGRAMS = ("cache_archive", "download", "groupwatch", "health", "hoststate", "image_pin", "lbctl", "manifest", "overlay",
            "raygate", "reach", "relay", "revisions", "verify")
ZIP_TIME = (1980, 1, 1, 0, 0, 0)
MAIN = '''"""k2fleet's host programs: python3 k2fleet-host.pyz PROGRAM ARGS..."""
import runpy
import sys

PROGRAMS = {programs!r}
if len(sys.argv) < 2 or sys.argv[1] not in PROGRAMS:
    sys.stderr.write("usage: k2fleet-host.pyz {{%s}} ARGS...\\n" % ",".join(PROGRAMS))
    sys.exit(2)
name = sys.argv.pop(1)
runpy.run_module("k2fleet.hostprogs." + name, run_name="__main__", alter_sys=True)
'''


def host_argv(program: str, *args: str, python: str = "/usr/bin/python3") -> list[str]:
    """The argv that runs host program ``program`` from the shipped archive."""
    if program not in PROGRAMS:
        raise ValueError(f"no host program {program!r}")
    return [python, ARCHIVE, program, *args]


ARCHIVE_MISMATCH = 97  # probe_argv's exit code when the host's archive is not the one it pins


UNPACKED = "/var/cache/k2fleet/host-programs"  # the probe's unpacked copies of the archive, one per sha256


def probe_argv(python: str = "/usr/bin/python3", archive: str = ARCHIVE, sha256: str | None = None,
               unpacked: str = UNPACKED) -> list[str]:
    """The state probe's argv (:mod:`k2fleet.hostprogs.hoststate`, its query appended): from
    the archive like :func:`host_argv`'s when the archive's bytes have ``sha256`` (default:
    this control machine's, :func:`archive_sha256`), else exit :data:`ARCHIVE_MISMATCH` (a bare
    host, or another version's archive: the fact then sends the probe's source). The programs
    are imported from ``unpacked/SHA256``, the bytes just checked unpacked there the first
    time (the directory and its parent root's alone), so that the host's Python compiles
    them once per archive and keeps their bytecode (``__pycache__``) like any module's;
    from the archive itself where that directory cannot be made. ``-I``: no ``PYTHON*``
    variables, no user site; ``-S``: no site-packages (stdlib only). That directory goes
    first on ``sys.path``, in place of the ``''`` (the working directory) that ``-c`` puts
    there before Python 3.11's ``-I`` drops it.

    >>> argv = probe_argv()
    >>> argv[:4] == ["/usr/bin/python3", "-I", "-S", "-c"] and archive_sha256() in argv[4]
    True
    """
    program = f"""import hashlib, os, sys
A, S, U = {archive!r}, {sha256 or archive_sha256()!r}, {unpacked!r}
try:
    with open(A, "rb") as f:
        data = f.read()
except OSError:
    data = b""
if hashlib.sha256(data).hexdigest() != S:
    sys.exit({ARCHIVE_MISMATCH})
D = os.path.join(U, S)
try:
    os.makedirs(U, mode=0o700, exist_ok=True)
    mine = os.lstat(U).st_uid == os.geteuid() and os.lstat(U).st_mode & 0o170077 == 0o040000
except OSError:
    mine = False
if mine and not os.path.isdir(D):
    import io, shutil, zipfile
    T = "%s.%d" % (D, os.getpid())
    for old in os.listdir(U):
        if not old.startswith(S):
            shutil.rmtree(os.path.join(U, old), ignore_errors=True)
    try:
        zipfile.ZipFile(io.BytesIO(data)).extractall(T)
        os.rename(T, D)
    except OSError:
        shutil.rmtree(T, ignore_errors=True)
sys.path[:1 if sys.path[0] == "" else 0] = [D if mine and os.path.isdir(D) else A]
from k2fleet.hostprogs.hoststate import run
run()
"""
    return [python, "-I", "-S", "-c", program]


@lru_cache(maxsize=1)
def archive_sha256() -> str:
    """sha256 of :func:`archive_bytes` (the desired state's and the fact's pin of the archive)."""
    return hashlib.sha256(archive_bytes()).hexdigest()


@lru_cache(maxsize=1)
def archive_bytes() -> bytes:
    """The zipapp: ``__main__.py``, ``k2fleet/__init__.py`` (empty) and the source of every
    module of :mod:`k2fleet.hostprogs`, entries stored (not deflated); reproducible: the same
    sources give the same bytes, whatever this interpreter."""
    entries = {"__main__.py": MAIN.format(programs=PROGRAMS).encode(), "k2fleet/__init__.py": b""}
    for path in sorted(SOURCES.glob("*.py")):
        entries[f"k2fleet/hostprogs/{path.name}"] = path.read_bytes()
    buf = io.BytesIO()
    buf.write(b"#!/usr/bin/python3\n")
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        for name in sorted(entries):
            info = zipfile.ZipInfo(name, ZIP_TIME)
            info.create_system = 3  # Unix, whatever the control machine's OS
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_STORED
            zf.writestr(info, entries[name])
    return buf.getvalue()
