"""The code's shape, checked: no import cycles (late imports included), no role imports
another, facts never import operations, roles keep no per-run state in module globals,
and every role is a documented packaged ``@deploy`` with ``+ arg:`` lines and an example."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROLES = sorted(p for p in (REPO / "roles").glob("*.py") if p.stem not in ("__init__", "pipeline"))


def _modules() -> dict[str, Path]:
    out = {}
    for path in [*(REPO / "k2fleet").rglob("*.py"), *(REPO / "roles").rglob("*.py")]:
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module → the k2fleet/roles modules it imports anywhere in its body (late ones too)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            graph[mod] |= {n for n in names if n in mods and n != mod}
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


def test_no_role_imports_another_and_facts_import_no_operations() -> None:
    graph = import_graph()
    for path in ROLES:
        mod = f"roles.{path.stem}"
        assert not {n for n in graph[mod] if n.startswith("roles")}, mod
    assert not {n for n in graph["k2fleet.facts"] if n.startswith(("k2fleet.operations", "roles"))}


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

    module = importlib.import_module(f"roles.{path.stem}")
    deploys = [f for f in vars(module).values()
               if inspect.isfunction(f) and getattr(f, "__wrapped__", f).__module__ == module.__name__ and hasattr(f, "deploy_name")]
    assert deploys, f"{path.stem} has no @deploy function"
    for func in deploys:
        doc = inspect.getdoc(func.__wrapped__) or ""
        assert "+ " in doc and "Example" in doc, func.__name__
        params = [p for p in inspect.signature(func.__wrapped__).parameters if p != "_inner"]
        for name in params:
            assert f"+ {name}:" in doc, (func.__name__, name)
