"""k2fleet's host programs, shipped one way: one reproducible zipapp.

Every program in :mod:`k2fleet.hostprogs` runs on a host from one archive,
``/opt/k2fleet/lib/k2fleet-host.pyz``, as ``python3 ARCHIVE PROGRAM ARGS...`` (the Ray gate
with the engine venv's python, the Hub downloader with the Hub client's); the archive is a
file of the desired state, so its sha256 is in ``k2fleet plan --json`` and a host whose copy
differs gets it again. The bytes depend on the programs' sources alone (entries sorted,
fixed timestamps and modes), so every control machine with the same checkout ships the
same archive. Inside, the programs import one another as ``k2fleet.hostprogs.NAME`` only:
nothing on a host's own ``sys.path`` can stand in for one of them.

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
PROGRAMS = ("download", "health", "hoststate", "image_pin", "manifest", "overlay", "raygate", "relay", "verify")
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


@lru_cache(maxsize=1)
def archive_sha256() -> str:
    """sha256 of :func:`archive_bytes` (the desired state's and the fact's pin of the archive)."""
    return hashlib.sha256(archive_bytes()).hexdigest()


@lru_cache(maxsize=1)
def archive_bytes() -> bytes:
    """The zipapp: ``__main__.py``, ``k2fleet/__init__.py`` (empty) and every module of
    :mod:`k2fleet.hostprogs` (reproducible: the same sources give the same bytes)."""
    entries = {"__main__.py": MAIN.format(programs=PROGRAMS).encode(), "k2fleet/__init__.py": b""}
    for path in sorted(SOURCES.glob("*.py")):
        entries[f"k2fleet/hostprogs/{path.name}"] = path.read_bytes()
    buf = io.BytesIO()
    buf.write(b"#!/usr/bin/python3\n")
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in sorted(entries):
            info = zipfile.ZipInfo(name, ZIP_TIME)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, entries[name])
    return buf.getvalue()
