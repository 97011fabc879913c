"""``quick_args``: a host program's argv parsed as argparse would, without importing argparse
(~1 ms, + ~1 ms of shutil for its help formatter) in every deploy's host probe, when the argv
has only the forms k2fleet writes. ``verify`` and ``health`` (run in the probe's process,
:data:`k2fleet.hostprogs.hoststate.IN_PROCESS`) call it first and fall back to their argparse
parser for anything else. Standard library only.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is not imported on the probe's path
    from typing import Any


class _Args:
    """What :func:`quick_args` parsed: one attribute an option, as argparse names them."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)


def quick_args(argv: list[str] | None, options: dict[str, Any], flags: tuple[str, ...] = (),
               positionals: tuple[str, ...] = (), required: tuple[str, ...] = ()) -> Any:
    """``argv`` parsed as argparse would, without importing it (~1 ms, + ~1 ms of shutil for its
    help formatter, in every deploy's host probe), when it has only the forms k2fleet writes:
    ``--option VALUE`` of ``options`` (name → (its ``type`` or None, its default)), ``--flag``s
    of ``flags`` (default False) and exactly ``positionals``, no value starting with ``-``, every
    option of ``required`` given; None for anything else (``--option=VALUE``, abbreviations,
    ``-h``, a missing value, a value ``type`` refuses...): then argparse parses it, with its own
    errors and help. verify and health parse their argv with it.

    >>> vars(quick_args(["--marker-only", "--repo", "m/k", "/m/k2"], {"--repo": (None, None), "--workers": (int, 4)},
    ...                 ("--marker-only", "--full"), ("dir",)))
    {'repo': 'm/k', 'workers': 4, 'marker_only': True, 'full': False, 'dir': '/m/k2'}
    >>> [quick_args(a, {"--workers": (int, None)}, (), ("dir",), ("--workers",))
    ...  for a in (["d", "--workers"], ["d", "--workers", "x"], ["-h"], ["d"], ["d", "--work", "1"])]
    [None, None, None, None, None]
    """
    args = list(sys.argv[1:] if argv is None else argv)
    values: dict[str, Any] = {o[2:].replace("-", "_"): default for o, (_, default) in options.items()}
    values.update({f[2:].replace("-", "_"): False for f in flags})
    given: list[str] = []
    seen: set[str] = set()
    while args:
        arg = args.pop(0)
        if arg in flags:
            values[arg[2:].replace("-", "_")] = True
        elif arg in options:
            if not args or args[0].startswith("-"):
                return None
            kind, value = options[arg][0], args.pop(0)
            try:
                values[arg[2:].replace("-", "_")] = kind(value) if kind else value
            except (TypeError, ValueError):
                return None
            seen.add(arg)
        elif arg.startswith("-"):
            return None
        else:
            given.append(arg)
    if len(given) != len(positionals) or not seen.issuperset(required):
        return None
    values.update(zip(positionals, given))
    return _Args(**values)
