"""Read a pyinfra inventory file into a :class:`~k2fleet.inventory.spec.Fleet` without connecting.

pyinfra's own loader is used, so host data, group data, ``group_data/<group>.py`` files
next to the inventory and the implicit group named after the file all merge exactly as
they will during ``pyinfra INVENTORY deploys/kimi.py``.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
import types
from pathlib import Path
from collections.abc import Iterable, Mapping
from typing import Any

from k2fleet.inventory.spec import Fleet, SpecError, build_fleet, parse_host

HostData = tuple[str, dict[str, Any], tuple[str, ...]]  # (host name, merged data, groups)


def _import_pyinfra_cli_inventory() -> types.ModuleType:
    """Import ``pyinfra_cli.inventory`` without running ``pyinfra_cli/__init__``.

    That ``__init__`` calls ``gevent.monkey.patch_all()``, which must not happen as a
    side effect of planning (it turns the caller's threads into greenlets). Under the
    pyinfra CLI the package is already imported and this is a plain import.
    """
    if "pyinfra_cli" not in sys.modules:
        spec = importlib.util.find_spec("pyinfra_cli")
        assert spec is not None and spec.submodule_search_locations is not None
        package = types.ModuleType("pyinfra_cli")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["pyinfra_cli"] = package
    import pyinfra_cli.inventory

    return pyinfra_cli.inventory


def parse_data_overrides(items: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """``--data KEY=VALUE`` items parsed exactly as pyinfra's CLI parses them.

    >>> parse_data_overrides(["k2_port=9000", 'k2_engine_args={"max-num-seqs": 64}'])
    {'k2_port': 9000, 'k2_engine_args': {'max-num-seqs': 64}}
    """
    _import_pyinfra_cli_inventory()
    from pyinfra_cli.util import parse_cli_arg

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SpecError("--data", f"{item!r} is not KEY=VALUE")
        out[key] = parse_cli_arg(value)
    return out


def inventory_host_data(path: str | Path, override_data: dict[str, Any] | None = None) -> list[HostData]:
    """``[(host name, merged data, groups)]`` in inventory order, with pyinfra's
    ``--data`` overrides applied the way pyinfra applies them; no connection is made."""
    from pyinfra.api import State
    from pyinfra.context import ctx_state
    make_inventory_from_files = _import_pyinfra_cli_inventory().make_inventory_from_files

    path = Path(path)
    if not path.is_file():
        raise SpecError("inventory", f"no inventory file at {path}", str(path))
    check_group_data(path)
    with ctx_state.use(State()):
        try:
            inventory = make_inventory_from_files(str(path), override_data or None)
        except (SystemExit, Exception) as exc:  # user Python (may stop itself): report, don't trace
            raise SpecError("inventory", f"could not be loaded: {load_failure(exc)}", str(path)) from None
    return host_data(inventory)


def group_data_files(inventory: str | Path, cwd: str | Path | None = None) -> list[Path]:
    """The ``group_data/*.py`` files pyinfra executes for ``inventory`` (next to it, and in
    ``cwd`` when pyinfra runs with one), in pyinfra's order."""
    folders = [Path(cwd) / "group_data"] if cwd else []
    here = Path(inventory).parent.resolve() / "group_data"
    if here not in [f.resolve() for f in folders]:
        folders.append(here)
    return [f for folder in folders if folder.is_dir() for f in sorted(folder.iterdir()) if f.suffix == ".py"]


def check_group_data(inventory: str | Path, cwd: str | Path | None = None) -> None:
    """Each group-data file is a module of values (``k2_port = 9000`` statements): one that
    holds a bare list or mapping (its values would be silently dropped), does not parse,
    or has an ``__all__`` that is not a list of the names it defines is refused naming the
    file, before pyinfra executes it."""
    for file in group_data_files(inventory, cwd):
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
        except (SyntaxError, ValueError, UnicodeDecodeError) as exc:
            line = getattr(exc, "lineno", None)
            raise SpecError("inventory", f"group data file {file} does not parse"
                            f"{f' (line {line})' if line else ''}: {type(exc).__name__}", str(inventory)) from None
        for node in tree.body:
            if isinstance(node, ast.Expr) and not isinstance(node.value, (ast.Call, ast.Await)):
                if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                    continue  # a docstring
                what = type(node.value).__name__.lower()
                raise SpecError("inventory", f"group data file {file} holds a bare {what} (line {node.lineno}), not "
                                "values: pyinfra would drop it silently; write each key as `k2_port = 9000`",
                                str(inventory))
        defined = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        defined |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        defined |= {(a.asname or a.name).split(".")[0] for n in ast.walk(tree)
                    if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                value = node.value
                names = [e.value for e in getattr(value, "elts", []) if isinstance(e, ast.Constant)]
                if not isinstance(value, (ast.List, ast.Tuple)) or not all(isinstance(n, str) for n in names) \
                        or len(names) != len(value.elts):
                    raise SpecError("inventory", f"group data file {file}: __all__ must be a list of the names "
                                    "it exports", str(inventory))
                missing = [n for n in names if n not in defined]
                if missing:
                    raise SpecError("inventory", f"group data file {file}: __all__ names {', '.join(missing)[:80]}, "
                                    "which the file does not define", str(inventory))


def load_failure(exc: BaseException) -> str:
    """One line saying why an inventory or group-data file did not load: pyinfra wraps the
    file's own exception (and its wrapper has no usable ``str``), so say which file raised what.

    >>> load_failure(ValueError("bad"))
    'ValueError: bad'
    """
    inner = getattr(exc, "exception", None)
    where = getattr(exc, "filename", None)
    if isinstance(inner, BaseException):
        exc = inner
    text = " ".join(str(arg) for arg in getattr(exc, "args", ())) or type(exc).__name__
    if isinstance(exc, SystemExit):  # the file stopped itself with its own message
        line = text
    else:
        line = f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text
    return f"{where} raised {line}" if where else line


def host_data(inventory: Iterable[Any]) -> list[HostData]:
    """``[(name, merged data, groups)]`` of a loaded pyinfra ``Inventory``, in order."""
    return [(h.name, h.data.dict(), tuple(h.groups)) for h in inventory]


def fleet_from_hosts(source: str, hosts: list[HostData]) -> Fleet:
    return build_fleet(source, [parse_host(name, data, source, groups) for name, data, groups in hosts])


def data_args(data: Mapping[str, Any] | None) -> list[str]:
    """pyinfra ``--data KEY=VALUE`` arguments; non-strings as JSON (pyinfra parses them
    back with ``parse_cli_arg``: ``true``, numbers, objects).

    >>> data_args({"k2_nic": "eth9", "k2_engine_args": {"max-num-seqs": 64}, "k2_shared_storage": True})
    ['--data', 'k2_nic=eth9', '--data', 'k2_engine_args={"max-num-seqs": 64}', '--data', 'k2_shared_storage=true']
    """
    argv: list[str] = []
    for key, value in (data or {}).items():
        argv += ["--data", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    return argv
