"""Why a host failed a deploy's operation, in one line (pure).

pyinfra prints a failed command's whole output, host by host, interleaved with every other
host's progress; with 8-20 hosts the cause is easy to lose. At the end of a failed deploy
k2fleet says, for each host that failed, the operation and the cause
(:mod:`k2fleet.deploy.failure_lines` collects them); this module decides the cause from what
the operation printed and from whether the host's connection is still there.

>>> failure_line("h200-1", "k2fleet: checkpoint | fetch", ["relay fetch: x: [Errno 28] No space left on device"], False)
'k2fleet: h200-1 failed at «k2fleet: checkpoint | fetch»: disk full: relay fetch: x: [Errno 28] No space left on device'
>>> failure_line("h200-0", "apt", [], True)
'k2fleet: h200-0 failed at «apt»: lost: its SSH connection closed during the operation (the host went down, rebooted or left the network); nothing after it ran there'
"""

from __future__ import annotations

LINE_CAP = 300  # characters of a quoted output line

# What an operation's output says → the cause it names; the first match wins. Sources: the
# C library's strerror texts (errno(3): ENOSPC, EDQUOT, EROFS) as Python and coreutils print them,
# apt-get's and dpkg's own messages (apt-pkg/deb/debsystem.cc, "dpkg was interrupted, you must
# manually run 'dpkg --configure -a'"; "Could not get lock").
CAUSES: tuple[tuple[str, str], ...] = (
    ("No space left on device", "disk full"),
    ("Disk quota exceeded", "disk quota exceeded"),
    ("Read-only file system", "read-only file system"),
    ("dpkg was interrupted", "an earlier package install was interrupted"),
    ("Could not get lock", "another package manager holds apt's lock"),
    ("not healthy after ", "not healthy"),  # k2fleet's health gate (k2fleet.hostprogs.health), before its log lines
)

LOST = ("lost: its SSH connection closed during the operation (the host went down, rebooted or left the network); "
        "nothing after it ran there")


def shorten(line: str, cap: int = LINE_CAP) -> str:
    """``line`` on one line, at most ``cap`` characters.

    >>> shorten("a\\nb"), len(shorten("x" * 1000))
    ('a b', 300)
    """
    flat = " ".join(line.split())
    return flat if len(flat) <= cap else flat[:cap - 1] + "…"


def failure_cause(lines: list[str], connection_lost: bool, note: str | None = None) -> str:
    """The cause of a failed operation: a known message among ``lines`` (the operation's
    output, stderr last) or ``note`` (what the operation's Python said: an exception's
    message, a fleet barrier's reason), else a lost connection, else ``note``, else the
    output's last line.

    >>> failure_cause(["ok", "E: Could not get lock /var/lib/dpkg/lock-frontend"], False)
    "another package manager holds apt's lock: E: Could not get lock /var/lib/dpkg/lock-frontend"
    >>> failure_cause(["first", "", "last words"], False)
    'last words'
    >>> print(failure_cause([], False))
    see pyinfra's output above
    """
    for needle, cause in CAUSES:
        for line in [*lines, *([note] if note else [])]:
            if needle in line:
                return f"{cause}: {shorten(line)}"
    if connection_lost:
        return LOST
    if note:
        return shorten(note)
    last = next((line for line in reversed(lines) if line.strip()), None)
    return shorten(last) if last is not None else "see pyinfra's output above"


def failure_line(host: str, operation: str, lines: list[str], connection_lost: bool, note: str | None = None) -> str:
    """``k2fleet: HOST failed at «OPERATION»: CAUSE`` (:func:`failure_cause`)."""
    return f"k2fleet: {host} failed at «{shorten(operation, 120)}»: {failure_cause(lines, connection_lost, note)}"
