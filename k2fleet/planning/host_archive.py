"""k2fleet's host programs, shipped one way: one reproducible zipapp.

Every program in :mod:`k2fleet.hostprogs` runs on a host from one archive,
``/opt/k2fleet/lib/k2fleet-host.pyz``, as ``python3 ARCHIVE PROGRAM ARGS...`` (the Ray gate
with the engine venv's python, the Hub downloader with the Hub client's); the archive is a
file of the desired state, so its sha256 is in ``k2fleet plan --json`` and a host whose copy
differs gets it again. The bytes depend on the programs' sources alone (entries sorted,
fixed timestamps and modes), so every control machine with the same checkout and the same
Python minor version ships the same archive. Inside, the programs import one another as
``k2fleet.hostprogs.NAME`` only: nothing on a host's own ``sys.path`` can stand in for one of
them.

The programs the state probe runs at every deploy, on every host (hoststate's
``IN_PROCESS``: the probe itself and its read-only checks, and :data:`PROBE_IMPORTS`, the
modules they import) are there twice: their source and
their bytecode (``NAME.pyc`` beside ``NAME.py``, a hash-checked pyc of PEP 552, compiled by
the control machine's interpreter). Python's zip importer never writes bytecode, so without
it every probe would compile them again; the others (the relay, the downloader, ...) run
once per transfer, where a compile does not count, and are shipped as source alone. A host whose Python has
another bytecode version skips the pyc (its magic number differs) and compiles the
source, as before; a pyc is used only while the source beside it has the hash it was
compiled from.

Making the archive is on every deploy's path (the fact's command pins its sha256), so it
costs little: the bytecode is this interpreter's own cache of those modules
(``__pycache__``, :func:`cached_code`) when that is valid for the source — the same code
``compile`` gives, so the same bytes — and compiled otherwise (~11 ms); the entries are
stored, not deflated (~7 ms less here, and the probe inflates nothing on the host).

>>> host_argv("verify", "--marker-only", "/m/k2")
['/usr/bin/python3', '/opt/k2fleet/lib/k2fleet-host.pyz', 'verify', '--marker-only', '/m/k2']
>>> archive_bytes() == archive_bytes() and archive_bytes().startswith(b"#!/usr/bin/python3")
True
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import marshal
import types
import zipfile
from functools import lru_cache
from pathlib import Path

from k2fleet.hostprogs.hoststate import IN_PROCESS

ARCHIVE = "/opt/k2fleet/lib/k2fleet-host.pyz"
SOURCES = Path(__file__).resolve().parents[1] / "hostprogs"
PROGRAMS = ("download", "health", "hoststate", "image_pin", "lbctl", "manifest", "overlay", "raygate", "reach", "relay",
            "revisions", "verify")
PROBE_IMPORTS = ("quick_args",)  # host modules the probe's programs import (their bytecode ships too)
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


def probe_argv(python: str = "/usr/bin/python3", archive: str = ARCHIVE, sha256: str | None = None) -> list[str]:
    """The state probe's argv (:mod:`k2fleet.hostprogs.hoststate`, its query appended): from
    the archive like :func:`host_argv`'s when the archive's bytes have ``sha256`` (default:
    this control machine's, :func:`archive_sha256`), else exit :data:`ARCHIVE_MISMATCH` (a bare
    host, or another version's archive: the fact then sends the probe's source). The check
    and the start are one small ``-c`` program rather than ``sha256sum`` and the archive's
    ``__main__`` (runpy and importlib.util): ~4 ms less of every probe. ``-I``: no
    ``PYTHON*`` variables, no user site; ``-S``: no site-packages (stdlib only). The archive
    goes first on ``sys.path``, in place of the ``''`` (the working directory) that ``-c``
    puts there before Python 3.11's ``-I`` drops it.

    >>> argv = probe_argv()
    >>> argv[:4] == ["/usr/bin/python3", "-I", "-S", "-c"] and archive_sha256() in argv[4]
    True
    """
    program = f"""import sys
A = {archive!r}
try:
    from _sha2 import sha256
except ImportError:
    try:
        from _sha256 import sha256
    except ImportError:
        from hashlib import sha256
try:
    with open(A, "rb") as f:
        same = sha256(f.read()).hexdigest() == {sha256 or archive_sha256()!r}
except OSError:
    same = False
if not same:
    sys.exit({ARCHIVE_MISMATCH})
sys.path[:1 if sys.path[0] == "" else 0] = [A]
from k2fleet.hostprogs.hoststate import run
run()
"""
    return [python, "-I", "-S", "-c", program]


@lru_cache(maxsize=1)
def archive_sha256() -> str:
    """sha256 of :func:`archive_bytes` (the desired state's and the fact's pin of the archive)."""
    return hashlib.sha256(archive_bytes()).hexdigest()


def checked_pyc(source: bytes, filename: str, code: types.CodeType | None = None) -> bytes:
    """``source`` compiled by this interpreter as a hash-checked pyc (PEP 552: magic number,
    flags 0b11, the source's hash, the marshalled code), ``filename`` being where the host
    imports it from (what its tracebacks name); ``code``: ``source``'s code already compiled
    (:func:`cached_code`), whose file name is replaced by ``filename``.

    >>> pyc = checked_pyc(b"x = 1\\n", "/opt/k2fleet/lib/k2fleet-host.pyz/m.py")
    >>> pyc[:4] == importlib.util.MAGIC_NUMBER and pyc[4:8] == b"\\x03\\0\\0\\0"
    True
    >>> src = b"def f():\\n    return 'a b', 1\\n"
    >>> checked_pyc(src, "/a/m.py", compile(src, "m.py", "exec", dont_inherit=True)) == checked_pyc(src, "/a/m.py")
    True
    """
    if code is None:
        code = compile(source, filename, "exec", dont_inherit=True, optimize=0)
    else:
        code = _with_filename(code, filename)
    # marshal format 2: no back-references. Formats 3+ mark an object as shared when its
    # reference count says so, and an interned name's count depends on what else this
    # process has loaded: the same source then marshals to other bytes (seen: the archive's
    # sha256 changed after a test module imported the health program)
    return (importlib.util.MAGIC_NUMBER + (0b11).to_bytes(4, "little") + importlib.util.source_hash(source)
            + marshal.dumps(code, 2))


def _with_filename(code: types.CodeType, filename: str) -> types.CodeType:
    """``code`` and the code objects nested in it, with ``filename`` as their file name."""
    consts = tuple(_with_filename(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def cached_code(path: Path, source: bytes) -> types.CodeType | None:
    """The code of module source ``path`` (whose bytes are ``source``) from this interpreter's
    bytecode cache (``__pycache__``, non-optimised), when the cache holds it for exactly
    this source: a checked hash-based pyc (PEP 552) whose hash is ``source``'s —
    ``./dev.sh`` compiles :mod:`k2fleet.hostprogs` so. A timestamp pyc is never taken: its
    rule (the source's size and modification second) cannot tell a same-size file restored
    with its old time (``cp -p``, ``rsync -t``) from the source it was compiled from, and the
    archive's pyc claims the current source's hash, which every host then trusts. None
    otherwise (no cache, another interpreter's, stale, unreadable): the caller compiles.
    Reads only; nothing is written.

    >>> cached_code(Path("/nonexistent/m.py"), b"") is None
    True
    """
    try:
        cache = Path(importlib.util.cache_from_source(str(path), optimization=""))
        data = cache.read_bytes()
    except (OSError, NotImplementedError, ValueError):
        return None
    if len(data) < 16 or data[:4] != importlib.util.MAGIC_NUMBER or int.from_bytes(data[4:8], "little") != 0b11 \
            or data[8:16] != importlib.util.source_hash(source):  # a checked hash-based pyc of this very source
        return None
    try:
        code = marshal.loads(memoryview(data)[16:])
    except (EOFError, ValueError, TypeError):
        return None
    return code if isinstance(code, types.CodeType) else None


@lru_cache(maxsize=1)
def archive_bytes() -> bytes:
    """The zipapp: ``__main__.py``, ``k2fleet/__init__.py`` (empty) and every module of
    :mod:`k2fleet.hostprogs`, the probe's programs with their bytecode (:func:`checked_pyc`,
    from :func:`cached_code` when it has it); entries stored (not deflated); reproducible:
    the same sources and interpreter give the same bytes."""
    sources = {"__main__.py": MAIN.format(programs=PROGRAMS).encode(), "k2fleet/__init__.py": b""}
    for path in sorted(SOURCES.glob("*.py")):
        sources[f"k2fleet/hostprogs/{path.name}"] = path.read_bytes()
    entries = dict(sources)
    for program in (*IN_PROCESS, *PROBE_IMPORTS):
        name = f"k2fleet/hostprogs/{program}.py"
        code = cached_code(SOURCES / f"{program}.py", sources[name])
        entries[name + "c"] = checked_pyc(sources[name], f"{ARCHIVE}/{name}", code)
    buf = io.BytesIO()
    buf.write(b"#!/usr/bin/python3\n")
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        for name in sorted(entries):
            info = zipfile.ZipInfo(name, ZIP_TIME)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_STORED
            zf.writestr(info, entries[name])
    return buf.getvalue()
