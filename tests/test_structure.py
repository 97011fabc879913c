"""The code's shape, checked: packages by where code runs, each importing only the layers
below it (late imports and ``importlib.import_module`` / ``__import__`` of a literal name
included); the product never imports the sandbox package; no import cycles; no role imports
another; facts never import operations; roles keep no per-run state in module globals; and
every role is a documented packaged ``@deploy`` with ``+ arg:`` lines and an example."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROLES = sorted(p for p in (REPO / "k2fleet" / "deploy" / "roles").glob("*.py") if p.stem != "__init__")

# Where code runs, lowest first: a module imports only from its own layer or a lower one.
LAYERS = (
    ("k2fleet.hostprogs", "host programs: standard library only (the Hub client on a fetcher host)"),
    ("k2fleet.inventory", "the inventory's grammar"),
    ("k2fleet.planning", "pure planning"),
    ("k2fleet.control", "control-machine effects"),
    ("k2fleet.deploy", "pyinfra glue: facts, operations, roles"),
    ("k2fleet.cli", "the command line"),
    ("k2sandbox", "the sandbox, rehearsal and test doubles: never imported by the product"),
)


def layer_of(module: str) -> int | None:
    """The index of ``module``'s layer in :data:`LAYERS` (None: ``k2fleet`` itself).

    >>> layer_of("k2fleet.planning.desired"), layer_of("k2sandbox.nspawn"), layer_of("k2fleet")
    (2, 6, None)
    """
    for index, (prefix, _) in enumerate(LAYERS):
        if module == prefix or module.startswith(prefix + "."):
            return index
    return None


def _modules() -> dict[str, Path]:
    out = {}
    paths = [*(REPO / "k2fleet").rglob("*.py"), *(p for p in (REPO / "k2sandbox").rglob("*.py") if "files" not in
                                                  p.relative_to(REPO / "k2sandbox").parts[:1])]
    for path in paths:
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _type_checking(node: ast.AST) -> bool:
    """An ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``) block with no ``else``: imports for
    annotations only, never executed."""
    if not isinstance(node, ast.If) or node.orelse:
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` outside ``if TYPE_CHECKING:`` blocks (:func:`_type_checking`)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        todo.extend(child for child in ast.iter_child_nodes(node) if not _type_checking(child))


def imported_names(tree: ast.AST) -> set[str]:
    """Every module name ``tree`` imports when it runs: statements anywhere in the body, and calls
    of ``import_module``/``__import__`` with a literal name; not the imports of an ``if
    TYPE_CHECKING:`` block (annotations only: they never run, so they make no cycle and cross no
    layer at run time).

    >>> sorted(imported_names(ast.parse("import a.b\\nfrom c import d\\ndef f():\\n    importlib.import_module('e.f')")))
    ['a.b', 'c', 'c.d', 'e.f']
    >>> sorted(imported_names(ast.parse("if TYPE_CHECKING:\\n    import t\\nif typing.TYPE_CHECKING:\\n    import u\\nimport v")))
    ['v']
    """
    names: set[str] = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__"):
                names.add(node.args[0].value)
    return names


def import_graph() -> dict[str, set[str]]:
    """Module → the k2fleet/k2sandbox modules it imports anywhere in its body (late ones too)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        graph[mod] |= {n for n in imported_names(ast.parse(path.read_text())) if n in mods and n != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert cycles(graph) == []
    assert cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]  # the check itself finds one


def test_each_package_imports_only_its_layer_and_those_below() -> None:
    graph = import_graph()
    upward = sorted((mod, dep) for mod, deps in graph.items() for dep in deps
                    if (layer_of(dep) or 0) > (layer_of(mod) or 0))
    assert upward == []
    hostprogs = sorted((mod, dep) for mod, deps in graph.items() if layer_of(mod) == 0 for dep in deps
                       if layer_of(dep) != 0)
    assert hostprogs == []  # not even k2fleet/__init__: they run on hosts from the shipped files alone


def test_the_product_never_names_the_sandbox() -> None:
    """Not in an import and not in a string a dynamic import could take: the seam is the
    entry-point groups of :mod:`k2fleet.control.stand_ins`."""
    named = sorted(str(path.relative_to(REPO)) for mod, path in _modules().items()
                   if mod.startswith("k2fleet") and any(n == "k2sandbox" or n.startswith("k2sandbox.")
                                                         for n in imported_names(ast.parse(path.read_text()))))
    assert named == []
    for path in [REPO / "config.py", REPO / "deploys" / "kimi.py"]:
        assert not any(n.startswith("k2sandbox") for n in imported_names(ast.parse(path.read_text()))), path


def test_no_role_imports_another_and_facts_import_no_operations() -> None:
    graph = import_graph()
    for path in ROLES:
        mod = f"k2fleet.deploy.roles.{path.stem}"
        assert not {n for n in graph[mod] if n.startswith("k2fleet.deploy.roles.")}, mod
    assert not {n for n in graph["k2fleet.deploy.facts"] if n.startswith(("k2fleet.deploy.operations",
                                                                           "k2fleet.deploy.roles"))}


@pytest.mark.parametrize("path", ROLES, ids=lambda p: p.stem)
def test_role_keeps_no_per_run_state_in_module_globals(path: Path) -> None:
    tree = ast.parse(path.read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Global)]
    mutable = [t.id for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, (ast.Dict, ast.List, ast.Set, ast.Call))
               for t in n.targets if isinstance(t, ast.Name)]
    assert mutable == [], mutable


@pytest.mark.parametrize("path", ROLES, ids=lambda p: p.stem)
def test_role_is_a_documented_deploy(path: Path) -> None:
    import importlib

    module = importlib.import_module(f"k2fleet.deploy.roles.{path.stem}")
    deploys = [f for f in vars(module).values()
               if inspect.isfunction(f) and getattr(f, "__wrapped__", f).__module__ == module.__name__ and hasattr(f, "deploy_name")]
    assert deploys, f"{path.stem} has no @deploy function"
    for func in deploys:
        doc = inspect.getdoc(func.__wrapped__) or ""
        assert "+ " in doc and "Example" in doc, func.__name__
        params = [p for p in inspect.signature(func.__wrapped__).parameters if p != "_inner"]
        for name in params:
            assert f"+ {name}:" in doc, (func.__name__, name)


# --------------------------------------------------------------------------
# one folder per engine (k2fleet/planning/engines/<name>/): nothing else compares an engine's name

ENGINES_DIR = REPO / "k2fleet" / "planning" / "engines"


def engine_name_comparisons(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines of ``tree`` that compare a string with an engine name: ``x == "vllm"``, ``x != "sglang"``,
    ``x in ("vllm", "sglang")`` (a tuple, list or set holding one), ``case "trtllm":``.

    >>> code = 'a == "vllm"\\nb in ("x", "sglang")\\nc != d\\nmatch e:\\n    case "trtllm": pass\\nf = {"vllm": 1}["vllm"]'
    >>> engine_name_comparisons(ast.parse(code), {"vllm", "sglang", "trtllm"})
    [1, 2, 5]
    """
    def named(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(named(e) for e in node.elts)

    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(named(n) for n in (node.left, *node.comparators)):
            found.add(node.lineno)
        elif isinstance(node, ast.MatchValue) and named(node.value):
            found.add(node.lineno)
    return sorted(found)


def test_no_engine_name_comparison_outside_the_engines() -> None:
    """Callers ask the engine object (``dep.engine_impl``, ``engines.get(name)``), never compare
    ``k2_engine``'s value: an engine's knowledge is its folder's. The sandbox's engine test doubles
    (k2sandbox/files) are the engines' stand-ins themselves and run on hosts without k2fleet."""
    from k2fleet.planning.engines import ENGINES

    names = set(ENGINES)
    paths = [*_modules().values(), REPO / "config.py", *(REPO / "deploys").glob("*.py")]
    found = {str(path.relative_to(REPO)): lines for path in sorted(paths)
             if ENGINES_DIR not in path.parents
             and (lines := engine_name_comparisons(ast.parse(path.read_text()), names))}
    assert found == {}
    scanned = {str(p.relative_to(REPO)) for p in paths}  # the product, the sandbox package, the deploy entry points
    assert {"k2fleet/planning/deployment.py", "k2fleet/control/bench_run.py", "k2sandbox/rehearse.py",
            "config.py", "deploys/kimi.py"} <= scanned
    assert not any(p.startswith("k2sandbox/files/") for p in scanned)


def test_each_engine_is_one_folder_registered_once() -> None:
    """``k2fleet/planning/engines/<name>/`` per engine: its ``__init__`` defines ``ENGINE`` (an
    :class:`~k2fleet.planning.engines.base.Engine` named as its folder, whose renderer is its own
    ``render.py``), the registry holds each folder's engine once, and ``k2_engine`` takes exactly
    the registered names."""
    import importlib
    import typing

    from k2fleet.inventory.spec import HostSettings
    from k2fleet.planning import engines
    from k2fleet.planning.engines.base import Engine

    folders = sorted(p.name for p in ENGINES_DIR.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == sorted(engines.ENGINES)
    for name in folders:
        package = importlib.import_module(f"k2fleet.planning.engines.{name}")
        engine = package.ENGINE
        assert isinstance(engine, Engine) and type(engine) is not Engine, name
        assert engine.name == name and engines.get(name) is engine
        assert (ENGINES_DIR / name / "render.py").is_file(), name
        assert type(engine).render is not Engine.render, name  # renders with its own module
        assert engine.label and engine.unit and engine.package and engine.entry, name
    assert len({id(e) for e in engines.ENGINES.values()}) == len(engines.ENGINES)
    assert set(typing.get_args(typing.get_type_hints(HostSettings)["engine"])) == set(engines.ENGINES)
