"""The engine TEST DOUBLES as one Python wheel, for bundles made with ``--rehearsal``.

A real venv fleet installs its engine from the bundle's wheelhouse (``vllm==0.33.0`` and
everything it pulls in); a rehearsal bundle puts this wheel in the engine's place, so the
sandbox hosts install it the same way (``pip install --no-index`` into ``k2_venv``) and run
the doubles from the venv: the packages ``k2fleet_doubles``, ``sglang`` and
``ktransformers`` of ``files/doubles`` and the scripts ``vllm``, ``trtllm-serve`` and
``trtllm-llmapi-launch`` (pip points their ``#!python`` line at the venv's interpreter).

The wheel is byte-reproducible: its version carries a hash of the doubles' files, and
its zip entries are sorted with fixed times and modes, so two builds from one checkout
have one sha256 (what ``k2fleet bundle --locked`` compares).

>>> name, data = build_wheel()
>>> name.startswith(f"{DIST}-{VERSION_BASE}+g") and name.endswith("-py3-none-any.whl")
True
>>> build_wheel() == (name, data)
True
"""

from __future__ import annotations

import base64
import hashlib
import io
import zipfile
from pathlib import Path

from k2sandbox import DOUBLES
DIST = "k2fleet_engine_doubles"
PROJECT = "k2fleet-engine-doubles"
VERSION_BASE = "1.0"
PACKAGES = ("k2fleet_doubles", "sglang", "ktransformers")  # directories of files/doubles the wheel carries
SCRIPTS = ("vllm", "trtllm-serve", "trtllm-llmapi-launch")  # files/doubles/bin → the venv's bin
ZIP_TIME = (1980, 1, 1, 0, 0, 0)


def _sources(root: Path = DOUBLES) -> list[tuple[str, bytes, bool]]:
    """(path in the wheel, bytes, executable) of every file the wheel carries, sorted."""
    files: list[tuple[str, bytes, bool]] = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                files.append((path.relative_to(root).as_posix(), path.read_bytes(), False))
    return files


def _script(path: Path) -> bytes:
    """A script with its first line made ``#!python`` (pip rewrites that to the venv's python)."""
    lines = path.read_bytes().split(b"\n", 1)
    return b"#!python\n" + (lines[1] if len(lines) > 1 else b"")


def version(root: Path = DOUBLES) -> str:
    """``1.0+g<hash>``: the wheel's version, a hash of what it carries."""
    digest = hashlib.sha256()
    for rel, data, _ in _sources(root):
        digest.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
    for name in SCRIPTS:
        digest.update(name.encode() + b"\0" + hashlib.sha256(_script(root / "bin" / name)).digest())
    return f"{VERSION_BASE}+g{digest.hexdigest()[:12]}"


def requirement(root: Path = DOUBLES) -> str:
    """The pin a host's venv install names: ``k2fleet-engine-doubles==<version>``."""
    return f"{PROJECT}=={version(root)}"


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(root: Path = DOUBLES) -> tuple[str, bytes]:
    """(file name, bytes) of the doubles' wheel."""
    ver = version(root)
    info = f"{DIST}-{ver}.dist-info"
    data_dir = f"{DIST}-{ver}.data/scripts"
    entries: list[tuple[str, bytes, bool]] = list(_sources(root))
    entries += [(f"{data_dir}/{name}", _script(root / "bin" / name), True) for name in SCRIPTS]
    entries.append((f"{info}/METADATA", (
        f"Metadata-Version: 2.1\nName: {PROJECT}\nVersion: {ver}\n"
        "Summary: k2fleet engine TEST DOUBLES (sandbox rehearsals only; not an engine)\n").encode(), False))
    entries.append((f"{info}/WHEEL", (
        "Wheel-Version: 1.0\nGenerator: k2fleet\nRoot-Is-Purelib: true\nTag: py3-none-any\n").encode(), False))
    record = "".join(f"{rel},{_record_hash(data)},{len(data)}\n" for rel, data, _ in entries)
    record += f"{info}/RECORD,,\n"
    entries.append((f"{info}/RECORD", record.encode(), False))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for rel, data, executable in entries:
            member = zipfile.ZipInfo(rel, date_time=ZIP_TIME)
            member.external_attr = (0o100755 if executable else 0o100644) << 16
            member.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(member, data)
    return f"{DIST}-{ver}-py3-none-any.whl", buf.getvalue()
