"""Old checkpoint revisions and engine venvs: keep the pinned one and the ones served last.

STANDARD LIBRARY ONLY; runs on fleet hosts from the host archive as::

    python3 k2fleet-host.pyz revisions ROOT --current NAME --keep N --kind checkpoint|venv [--check]

``ROOT`` holds one directory per revision (``k2_model_dir/<org>--<name>``: 40-hex commit
names, each with its ``<commit>.overlay-*`` config overlays) or per engine release
(``k2_venv``: ``<engine>-<version>``). ``ROOT/.k2fleet-served`` lists the names served, the
last served first, one a line. Without ``--check`` (after a deploy's health gate passed on
``NAME``): ``NAME`` goes first in that list, then every directory of the kind beyond the
first ``N`` (``NAME``, then the others in the list's order, then those never served, newest
first) is removed, each printed with its bytes. ``--check`` (read-only; the deploy's fact
runs it in its probe): exit 0 when ``NAME`` is first in the list and nothing would be removed.

Only direct children of ``ROOT`` whose names are of the kind are ever removed, each a real
directory (a symlink is not followed, and a symlink of such a name is left alone), its
tree walked with file descriptors (never through a symlink inside it). ``NAME`` must exist
as a directory, or nothing is removed (exit 1).

>>> kept(["b", "a"], "a", ["c"], 2)
(['a', 'b'], ['c'])
>>> kept(["b", "a"], "a", [], 1)
(['a'], ['b'])
"""

from __future__ import annotations

import os
import sys

from k2fleet.hostprogs.verify import is_hex, read_beneath, write_beneath

RECORD = ".k2fleet-served"
KINDS = ("checkpoint", "venv")
ENGINES = ("vllm", "sglang", "trtllm", "ktransformers")

def revision_of(name: str, kind: str) -> str | None:
    """The revision (or release) a directory name of ``kind`` belongs to; None: not of the kind.

    >>> revision_of("a" * 40, "checkpoint") == "a" * 40, revision_of("a" * 40 + ".overlay-deepseek_v3", "checkpoint") == "a" * 40
    (True, True)
    >>> revision_of("vllm-0.33.0", "venv"), revision_of("bin", "venv"), revision_of(".k2fleet", "checkpoint")
    ('vllm-0.33.0', None, None)
    """
    if kind == "checkpoint":
        head, dot, tail = name.partition(".")
        return head if is_hex(head, 40) and (not dot or (tail.startswith("overlay-") and len(tail) > 8)) else None
    engine, dash, version = name.partition("-")
    if engine in ENGINES and dash and version[:1].isdigit() and all(c.isalnum() or c in ".+_-" for c in version):
        return name
    return None


def kept(served: list[str], current: str, unserved: list[str], keep: int) -> tuple[list[str], list[str]]:
    """(revisions kept, revisions removed): ``current``, then the ``served`` ones (last served
    first) present, then ``unserved`` (newest first), the first ``keep`` kept."""
    order = list(dict.fromkeys([current, *served, *unserved]))
    present = {current, *unserved} | set(served)
    order = [r for r in order if r in present]
    return order[:keep], order[keep:]


def _read_record(root: str) -> list[str]:
    try:
        text = read_beneath(root, RECORD, 1 << 16).decode("utf-8", "replace")
    except OSError:
        return []
    return [line.strip() for line in text.splitlines() if line.strip()]


def _directories(fd: int, kind: str) -> dict[str, list[tuple[str, int]]]:
    """Revision → its directories (name, mtime_ns) among ROOT's direct children (real
    directories only, never a symlink)."""
    import stat as _stat
    found: dict[str, list[tuple[str, int]]] = {}
    for name in os.listdir(fd):
        rev = revision_of(name, kind)
        if rev is None:
            continue
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            continue
        if _stat.S_ISDIR(st.st_mode):
            found.setdefault(rev, []).append((name, st.st_mtime_ns))
    return found


def _remove_tree(parent: int, name: str) -> int:
    """Remove directory ``name`` under the open directory ``parent`` and everything in it,
    by file descriptors (no symlink inside is followed: a link is removed itself); its bytes."""
    freed = 0
    top = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=parent)
    try:
        for _, dirs, files, dfd in os.fwalk(".", topdown=False, dir_fd=top):
            for f in files:
                try:
                    st = os.stat(f, dir_fd=dfd, follow_symlinks=False)
                    freed += st.st_blocks * 512
                except OSError:
                    pass
                os.unlink(f, dir_fd=dfd)
            for d in dirs:
                try:
                    os.rmdir(d, dir_fd=dfd)
                except NotADirectoryError:  # a symlink to a directory: fwalk lists it among dirs
                    os.unlink(d, dir_fd=dfd)
    finally:
        os.close(top)
    os.rmdir(name, dir_fd=parent)
    return freed


def run(root: str, current: str, keep: int, kind: str, check: bool) -> int:
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        print(f"{root}: {e.strerror}", file=sys.stderr)
        return 1
    try:
        found = _directories(fd, kind)
        if current not in found:
            print(f"{root}/{current} is not there (a directory): nothing removed", file=sys.stderr)
            return 1
        served = [r for r in _read_record(root) if revision_of(r, kind) == r]
        unserved = sorted((r for r in found if r not in served and r != current),
                          key=lambda r: -max(m for _, m in found[r]))
        keeps, drops = kept([r for r in served if r in found], current, unserved, keep)
        if check:
            if served[:1] != [current]:
                print(f"{root}: {current} is not recorded as served last")
                return 1
            if drops:
                print(f"{root}: beyond the {keep} kept: {', '.join(drops)}")
                return 1
            return 0
        for rev in drops:
            freed = sum(_remove_tree(fd, name) for name, _ in sorted(found[rev]))
            print(f"removed {root}/{rev} ({freed} bytes)")
        write_beneath(root, RECORD, "".join(f"{n}\n" for n in keeps).encode())  # atomic, fsynced with ROOT
        return 0
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    """``ROOT --current NAME --keep N --kind KIND [--check]``, parsed by hand (the deploy's probe
    runs the check in its own process: no argparse import)."""
    args = list(sys.argv[1:] if argv is None else argv)
    check = "--check" in args
    if check:
        args.remove("--check")
    opts = dict(zip(args[1::2], args[2::2])) if len(args) == 7 else {}
    keep, current, kind = opts.get("--keep", ""), opts.get("--current", ""), opts.get("--kind", "")
    if set(opts) != {"--current", "--keep", "--kind"} or not keep.isdigit() or int(keep) < 1 \
            or kind not in KINDS or revision_of(current, kind) != current:
        print("usage: revisions ROOT --current NAME --keep N --kind checkpoint|venv [--check] "
              "(N at least 1, NAME a directory name of the kind)", file=sys.stderr)
        return 2
    return run(args[0], current, int(keep), kind, check)


if __name__ == "__main__":
    sys.exit(main())
