"""Cache directories on the control machine, each built once: a directory is complete when
its marker file exists; it is built in a fresh sibling (``NAME.tmp``) and renamed into
place, under a lock file in its parent, so a reader never sees half of one and two
builders never build the same one at once."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable
from pathlib import Path

from k2fleet.hostprogs import locks


def build_once(target: Path, marker: str, make: Callable[[Path], None], lock: bool = True) -> Path:
    """``target`` when ``target/marker`` exists; otherwise ``make(tmp)`` fills the empty
    directory ``tmp`` (and writes ``marker`` in it last), which then replaces ``target``.
    ``lock``: hold ``target.parent/.lock`` while building (False: the caller holds its own).

    >>> import tempfile
    >>> scratch = tempfile.TemporaryDirectory()
    >>> root = Path(scratch.name)
    >>> made = build_once(root / "a", "DONE", lambda d: (d / "DONE").write_text("x"))
    >>> sorted(p.name for p in made.iterdir()), build_once(root / "a", "DONE", lambda d: 1 / 0) == made
    (['DONE'], True)
    >>> scratch.cleanup()
    """
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with locks.exclusive(target.parent / ".lock") if lock else contextlib.nullcontext():
        if (target / marker).is_file():
            return target
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        make(tmp)
        if not (tmp / marker).is_file():
            raise RuntimeError(f"{target}: the build wrote no {marker}")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    return target

