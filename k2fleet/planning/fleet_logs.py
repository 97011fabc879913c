"""``k2fleet logs``: which journals each host is asked for, and the ``journalctl`` argv (pure).

The units are the fleet's own — each host's :attr:`~k2fleet.planning.desired.HostDesired.units`
and the unit files k2fleet keeps there (:meth:`~k2fleet.planning.desired.HostDesired.kept_units`),
the ones ``k2fleet status`` reports —; ``--service`` must name one of them (with or without
``.service``) and only the hosts that have it are asked. ``--since`` takes the forms of
systemd.time(7) that ``journalctl --since`` accepts, checked here before any host is
contacted: ``YYYY-MM-DD [HH:MM[:SS]]``, ``HH:MM[:SS]``, ``now``/``today``/``yesterday``, ``@EPOCH``,
and relative spans (``-1h``, ``-30min``, ``2 hours ago``). The argv is a list; it is
quoted once, where it is sent.

>>> check_since("-1h"), check_since("2026-11-27 08:00"), check_since("3 days ago")
('-1h', '2026-11-27 08:00', '3 days ago')
>>> journal_argv(["k2-vllm.service"], since="-1h", follow=True)
['journalctl', '--no-pager', '--quiet', '--output=short-iso', '--unit=k2-vllm.service', '--since=-1h', '--follow']
"""

from __future__ import annotations

import datetime
import re

from k2fleet.planning.desired import HostDesired
from k2fleet.planning.preflight_checks import shown

MAX_SINCE = 64
_UNITS = (r"(?:usec|us|µs|msec|ms|seconds|second|sec|s|minutes|minute|min|m|hours|hour|hr|h|days|day|d|"
          r"weeks|week|w|months|month|M|years|year|y)")
_SPAN = rf"(?:\d+(?:\.\d+)?\s*{_UNITS}\s*)+"
RELATIVE = re.compile(rf"(?:[+-]\s*{_SPAN}|{_SPAN}\s*(?:ago|left))")
DATE = re.compile(r"(\d{4})-(\d{2})-(\d{2})(?: (\d{2}):(\d{2})(?::(\d{2})(?:\.\d{1,6})?)?)?(?: UTC)?")
TIME = re.compile(r"(\d{2}):(\d{2})(?::(\d{2})(?:\.\d{1,6})?)?(?: UTC)?")
WORDS = ("now", "today", "yesterday", "tomorrow")


class LogsError(ValueError):
    """A ``--service`` or ``--since`` that cannot be asked (one line)."""


def check_since(value: str) -> str:
    """``value`` when ``journalctl --since`` takes it (see the module doc); LogsError otherwise.

    >>> check_since("2026-13-01")
    Traceback (most recent call last):
    ...
    k2fleet.planning.fleet_logs.LogsError: --since 2026-13-01: not a date (month 1..12, day of the month, 00:00:00..23:59:59)
    """
    if len(value) > MAX_SINCE or not value.isprintable() or value != value.strip():
        raise LogsError(f"--since {shown(value)!r}: not a time journalctl takes ({FORMS})")
    if value in WORDS or re.fullmatch(r"@\d{1,12}(?:\.\d{1,6})?", value) or RELATIVE.fullmatch(value):
        return value
    date, clock = DATE.fullmatch(value), TIME.fullmatch(value)
    try:
        if date:
            y, mo, d, h, mi, s = (int(g) if g else 0 for g in date.groups())
            datetime.datetime(y, mo, d, h, mi, s)
            return value
        if clock:
            h, mi, s = (int(g) if g else 0 for g in clock.groups())
            datetime.time(h, mi, s)
            return value
    except ValueError:
        raise LogsError(f"--since {value}: not a date (month 1..12, day of the month, 00:00:00..23:59:59)") from None
    raise LogsError(f"--since {value!r}: not a time journalctl takes ({FORMS})")


FORMS = "YYYY-MM-DD [HH:MM[:SS]], HH:MM[:SS], now, today, yesterday, @EPOCH, -1h, -30min, '2 hours ago'"


def fleet_units(desired: dict[str, HostDesired]) -> dict[str, list[str]]:
    """Host → the units of k2fleet it has (:meth:`HostDesired.kept_units` with its planned units)."""
    return {name: sorted(d.kept_units()) for name, d in desired.items()}


def choose(units: dict[str, list[str]], service: str | None) -> dict[str, list[str]]:
    """Host → the units to read there: all of them, or ``service`` (``NAME`` or ``NAME.service``)
    on the hosts that have it; LogsError naming the fleet's units when none has it."""
    if service is None:
        return {h: u for h, u in units.items() if u}
    unit = service if service.endswith(".service") else f"{service}.service"
    out = {h: [unit] for h, u in units.items() if unit in u}
    if not out:
        known = sorted({x for u in units.values() for x in u})
        raise LogsError(f"--service {service!r}: not a unit of this fleet; its units: {', '.join(known) or 'none'}")
    return out


def journal_argv(units: list[str], since: str | None = None, follow: bool = False) -> list[str]:
    """``journalctl`` reading ``units`` (``--since`` checked by :func:`check_since`)."""
    argv = ["journalctl", "--no-pager", "--quiet", "--output=short-iso", *(f"--unit={u}" for u in units)]
    if since is not None:
        argv.append(f"--since={check_since(since)}")
    if follow:
        argv.append("--follow")
    return argv
