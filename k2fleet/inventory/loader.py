"""Read a pyinfra inventory file into a :class:`~k2fleet.inventory.spec.Fleet` without connecting.

pyinfra's own loader is used, so host data, group data, ``group_data/<group>.py`` files
next to the inventory and the implicit group named after the file all merge exactly as
they will during ``pyinfra INVENTORY deploys/kimi.py``.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import json
import sys
import types
from pathlib import Path
from collections.abc import Iterable, Mapping
from typing import Any

from k2fleet.inventory.spec import Fleet, SpecError, build_fleet, parse_host, show

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
    with ctx_state.use(State()), checked_groups(str(path)):
        try:
            inventory = make_inventory_from_files(str(path), override_data or None)
        except SpecError:
            raise
        except (SystemExit, Exception) as exc:  # user Python (may stop itself): report, don't trace
            raise SpecError("inventory", f"could not be loaded: {load_failure(exc)}", str(path)) from None
    check_group_conflicts(inventory, str(path))
    return host_data(inventory)


@contextlib.contextmanager
def checked_groups(source: str):
    """While pyinfra's CLI loader reads an inventory file in this block, its groups are checked
    (:func:`check_inventory_groups`) as soon as the file has run, before pyinfra builds hosts
    from them."""
    cli = _import_pyinfra_cli_inventory()
    original = cli._get_groups_from_filename
    if getattr(original, "_k2fleet_checked", False):  # already checking (the gate's)
        yield
        return

    def checking(filename: str) -> Any:
        groups = original(filename)
        check_inventory_groups(source, groups)
        return groups

    checking._k2fleet_checked = True  # type: ignore[attr-defined]
    cli._get_groups_from_filename = checking
    try:
        yield
    finally:
        cli._get_groups_from_filename = original


_GROUP_FIX = "write a group as [hosts] or ([hosts], {'k2_port': 9000}), a host as 'name' or ('name', {'ssh_port': 22})"


def check_inventory_groups(source: str, groups: Mapping[str, Any]) -> None:
    """The groups of an inventory file as pyinfra reads them (``{name: hosts | (hosts, data)}``):
    each group's data and each host's data is a dict (pyinfra ends in a traceback on a list),
    a host is a name or a ``(name, data)`` pair; a host named in several groups may carry host
    data in more than one of them only when they agree (pyinfra keeps the last group's value
    of a key silently).

    >>> check_inventory_groups("inv.py", {"gpus": [("n0", {"k2_nic": "eth0"})], "heads": ["n0"]})
    >>> for bad in ({"gpus": (["n0"], ["k2_port", 9000])}, {"gpus": ("n0", "n1")},
    ...             {"a": [("n0", {"k2_nic": "eth0"})], "b": [("n0", {"k2_nic": "eth1"})]}):
    ...     try:
    ...         check_inventory_groups("inv.py", bad)
    ...     except SpecError as exc:
    ...         print(str(exc)[:96])
    inv.py: inventory: group gpus's data is a list, not a dict of values; write a group as [hosts] o
    inv.py: inventory: group gpus is a tuple but not ([hosts], data); write a group as [hosts] or ([
    inv.py: inventory: host n0 is in groups a and b with different k2_nic ('eth0' and 'eth1'); pyinf
    """
    first: dict[str, tuple[str, dict[str, Any]]] = {}  # host → (group, host data) where it first had data
    for group, value in groups.items():
        hosts = value
        if isinstance(value, tuple):
            if len(value) != 2 or not isinstance(value[0], (list, tuple)):
                raise SpecError("inventory", f"group {group} is a tuple but not ([hosts], data); {_GROUP_FIX}", source)
            hosts, data = value
            if not isinstance(data, dict):
                raise SpecError("inventory", f"group {group}'s data is a {type(data).__name__}, not a dict of "
                                f"values; {_GROUP_FIX}", source)
        for entry in hosts:
            if isinstance(entry, str):
                continue
            if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)):
                raise SpecError("inventory", f"group {group} lists {show(entry)}, which is not a host; {_GROUP_FIX}",
                                source)
            name, data = entry
            if not isinstance(data, dict):
                raise SpecError("inventory", f"host {name}'s data in group {group} is a {type(data).__name__}, not "
                                f"a dict of values; {_GROUP_FIX}", source)
            if not data:
                continue
            if name not in first:
                first[name] = (group, data)
                continue
            other, before = first[name]
            if other == group:  # twice in one group: refused as such (build_fleet: "listed twice")
                continue
            for key in sorted(set(before) & set(data), key=str):
                if before[key] != data[key]:
                    raise SpecError("inventory", f"host {name} is in groups {other} and {group} with different "
                                    f"{key} ({show(before[key])} and {show(data[key])}); pyinfra would keep one "
                                    "silently: give the host's own data in one group only", source)


def check_group_conflicts(inventory: Any, source: str) -> None:
    """A host in several groups of the inventory file whose group data (inline or
    ``group_data/<group>.py``) give one key different values, where neither the host's own data
    nor ``--data`` decides it, is refused: pyinfra would take the last group's value silently.
    The group named after the file (the fleet's data, applied over the others) and ``all``
    (defaults) are layers, not rivals."""
    file_group = Path(source).name.rsplit(".", 1)[0]
    decided = set(getattr(inventory, "override_data", None) or {})
    for host in inventory:
        own = set(inventory.get_host_data(host.name) or {}) | decided
        seen: dict[str, tuple[str, Any]] = {}
        for group in host.groups:
            if group in ("all", file_group):
                continue
            for key, value in (inventory.get_group_data(group) or {}).items():
                if key in own:
                    continue
                if key in seen and seen[key][1] != value:
                    raise SpecError("inventory", f"host {host.name} is in groups {seen[key][0]} and {group}, whose "
                                    f"data give {key} different values ({show(seen[key][1])} and {show(value)}); "
                                    "pyinfra would keep one silently: set it in one of the groups, or in the "
                                    "host's own data", source)
                seen.setdefault(key, (group, value))


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
    entries = []
    for name, data, groups in hosts:
        entries.append(parse_host(name, data, source, groups))
        check_pyinfra_types(name, data, source)
    return build_fleet(source, entries)


@functools.cache
def _pyinfra_types() -> dict[str, tuple[Any, Any]]:
    """pyinfra's own host-data keys → (type, default): its SSH connector's data (checked
    whenever given) and its global arguments (checked when not the default), as pyinfra 3.10
    checks them (``host_to_connector_data``, ``pop_global_arguments``); read once a process
    (``get_type_hints`` over every global argument took 1.0 of 3.8 s of a 1,024-host plan),
    not to be changed by callers."""
    from typing import get_type_hints

    from pyinfra.api.arguments import all_argument_meta, all_global_arguments
    from pyinfra.api.config import Config
    from pyinfra.connectors.ssh import ConnectorData

    unset = object()
    config = Config()
    out: dict[str, tuple[Any, Any]] = {key: (type_, unset) for key, type_ in get_type_hints(ConnectorData).items()}
    for key, type_ in all_global_arguments():
        try:
            default = all_argument_meta[key].default(config)
        except Exception:  # noqa: BLE001 - a default that needs a run: check every value given
            default = unset
        out.setdefault(key, (type_, default))
    return out


def check_pyinfra_types(name: str, data: Mapping[str, Any], where: str = "") -> None:
    """The host data keys pyinfra itself reads (``ssh_password``, ``ssh_connect_timeout``,
    ``_sudo``, ``_su_user``, ...) have pyinfra's own types: a wrong one is one line naming the
    key here, not pyinfra's error after the gate (the value is not shown: it may be a password).

    >>> check_pyinfra_types("n1", {"_sudo": True, "ssh_password": "pw", "ssh_strict_host_key_checking": "yes"})
    >>> try:
    ...     check_pyinfra_types("n1", {"_sudo": ["yes"]}, "inv.py")
    ... except SpecError as exc:
    ...     print(exc)
    inv.py: _sudo: must be bool (pyinfra's type for it), not list, on host n1
    """
    from typeguard import TypeCheckError, check_type

    types = _pyinfra_types()
    for key, value in data.items():
        if key not in types:
            continue
        type_, default = types[key]
        try:
            if value == default:
                continue
        except Exception:  # noqa: BLE001 - a value that cannot be compared: check its type
            pass
        try:
            check_type(value, type_)
        except TypeCheckError:
            what = getattr(type_, "__name__", None) or str(type_).replace("typing.", "")
            raise SpecError(key, f"must be {what} (pyinfra's type for it), not {type(value).__name__}, on host {name}",
                            where) from None


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
