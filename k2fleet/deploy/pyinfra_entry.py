"""The inventory gate for ``pyinfra INVENTORY .../deploys/kimi.py`` started outside the
checkout (no ``config.py`` of k2fleet's is read), installed through pyinfra's own
entry-point group ``pyinfra.connectors`` (``pyproject.toml``).

pyinfra's CLI, in this order (pyinfra 3.10, ``pyinfra_cli/cli.py`` ``_main`` and
``pyinfra_cli/inventory.py`` ``make_inventory_from_files``): reads ``config.py`` from the
current directory; executes the inventory file; builds a provisional ``Inventory``, whose
constructor loads every ``pyinfra.connectors`` entry point (``get_all_connectors``);
executes the ``group_data/*.py`` files; calls ``State.init``; connects. An exception in a
group-data file becomes ``UnexpectedExternalError``, which click shows as pyinfra's
traceback (exit 1), and a group-data file that holds a bare list is dropped silently.

Loading this entry point is the first moment after the current directory's ``config.py``
at which k2fleet's code runs: ``entrypoint.load()`` reads :data:`K2fleetGate` through
this module's ``__getattr__``, which, under pyinfra's CLI running a deploy file that
is k2fleet's (it imports :data:`FLEET_RUN`) and when no gate is installed yet, installs the one ``config.py``
installs (:func:`k2fleet.deploy.gate.install_at_inventory_load`): the group-data files are
checked before pyinfra executes them, one that raises is the gate's one line naming it
(exit 2), and ``State.init`` validates the inventory before any connection. Any other
pyinfra run in the same environment is left alone (nothing but this module is imported),
a deploy that only uses k2fleet's operations on an inventory of its own included.

What remains out of reach: the inventory file itself runs before any entry point, so an
inventory file that raises still shows pyinfra's traceback outside the checkout.

``K2fleetGate`` is a connector in name only: ``@k2fleet`` as a host says so and stops.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

from pyinfra.connectors.base import BaseConnector

ENTRY_POINT = "k2fleet"  # [project.entry-points."pyinfra.connectors"] in pyproject.toml


class _K2fleetGate(BaseConnector):
    """Not a connector: its entry point installs k2fleet's inventory gate (module doc)."""

    handles_execution = False

    @staticmethod
    def make_names_data(name: str) -> Any:
        raise ValueError("@k2fleet is not a connector: k2fleet registers it only to check inventories "
                         "for its deploy before pyinfra connects")


def __getattr__(name: str) -> Any:
    """``K2fleetGate``: the entry point's object; reading it arms the gate (module doc)."""
    if name != "K2fleetGate":
        raise AttributeError(name)
    try:
        _arm()
    except SystemExit:
        raise
    except Exception:  # noqa: BLE001 - never break a pyinfra run over the optional early gate
        pass
    return _K2fleetGate


def _cli_params() -> dict[str, Any]:
    try:
        import click

        ctx = click.get_current_context(silent=True)
        return dict(ctx.params) if ctx is not None else {}
    except Exception:  # noqa: BLE001 - not under click
        return {}


FLEET_RUN = "k2fleet.deploy.fleet_run"  # what makes a deploy file k2fleet's deploy (deploys/kimi.py)


def names_k2fleet_deploy(operations: Any) -> bool:
    """Does pyinfra's ``operations`` argument name k2fleet's deploy — a deploy file that
    imports :data:`FLEET_RUN` (whose inventory must be a k2fleet inventory)? A deploy that
    only borrows k2fleet's operations is not one.

    >>> names_k2fleet_deploy(("server.shell", "echo hi"))
    False
    """
    for op in operations or ():
        path = Path(str(op))
        if path.suffix != ".py" or not path.is_file():
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if isinstance(node, ast.ImportFrom) and node.module == "k2fleet.deploy" and \
                    any(a.name == "fleet_run" for a in node.names):
                return True
            if FLEET_RUN in names:
                return True
    return False


def _arm() -> None:
    if "pyinfra_cli.cli" not in sys.modules:  # the API or k2fleet's own loader: not pyinfra's CLI
        return
    params = _cli_params()
    if "operations" not in params or "inventory" not in params:
        return
    from pyinfra.context import ctx_state

    if not ctx_state.isset():
        return
    state = ctx_state.get()
    if getattr(state, "_k2fleet_gate", False) or not names_k2fleet_deploy(params["operations"]):
        return
    from k2fleet.deploy.gate import install_at_inventory_load

    install_at_inventory_load(state, str(params["inventory"]))
