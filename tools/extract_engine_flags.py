#!/usr/bin/env python3
"""Extract the CLI flags each serving engine accepts at a pinned version, from its real source.

Nothing is imported from the engines: their source is read with :mod:`ast` straight out of
the release wheel (``pip download --no-deps``) or a git tag, and the resulting tables are
written to ``k2fleet/planning/data/engine_flags/<engine>-<version>.json`` (sorted, deterministic).

Sources per engine:

- vLLM: ``vllm/engine/arg_utils.py`` (``add_argument`` literals; ``**kwargs["field"]`` from
  ``get_kwargs(ConfigClass)`` gets ``--no-X`` when the config field is a ``bool``, as
  vLLM's ``_compute_kwargs`` gives it ``BooleanOptionalAction``), the frontend arg files
  (``FrontendArgs`` fields turned into ``--kebab-case`` by ``get_kwargs(cls)``) and
  ``vllm/entrypoints/cli/serve.py``.
- SGLang ≤ 0.5.x and sglang-kt: ``add_argument`` literals of ``sglang/srt/server_args.py``;
  SGLang 0.5.23 also its declarative fields (``A[T, Arg(cli_name=, aliases=, no_cli=)]``
  in ``sglang/srt/arg_groups/fields/*.py``, registered by ``add_cli_args_from_dataclass``).
- KTransformers 0.3.2: ``ktransformers/server/args.py`` of kvcache-ai/ktransformers at
  tag ``v0.3.2`` (a bare git dir, e.g. from the ``fetch`` tool), not on PyPI.
- TensorRT-LLM: ``tensorrt_llm/commands/serve.py`` (click options) and
  ``tensorrt_llm/llmapi/llm_args.py`` (pydantic models) from a source tree given with
  ``--trtllm-src VERSION=DIR`` (PyPI only has a stub sdist; the wheel lives on
  pypi.nvidia.com and in the release container image).

Usage::

    python tools/extract_engine_flags.py --wheels /tmp/wheels \\
        --ktransformers-git /work/.mirror/kvcache-ai+ktransformers/repo \\
        [--trtllm-src 1.2.0=/path/to/site-packages] [--download]
"""

from __future__ import annotations

import argparse
import ast
import datetime
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "k2fleet" / "planning" / "data" / "engine_flags"

VLLM_VERSIONS = ("0.33.0", "0.11.0", "0.10.0")
SGLANG_VERSIONS = ("0.5.23", "0.5.4", "0.4.9")
KT_SGLANG_VERSION = "0.7.2"  # sglang-kt / kt-kernel
KT_LEGACY_TAG = "v0.3.2"


# --------------------------------------------------------------------------- sources
class Source:
    """A set of source files: a wheel (zip) or a git tree at a revision, or a directory."""

    def __init__(self, kind: str, where: str, rev: str | None = None):
        self.kind, self.where, self.rev = kind, where, rev
        self._zip = zipfile.ZipFile(where) if kind == "wheel" else None

    def names(self) -> list[str]:
        if self._zip is not None:
            return self._zip.namelist()
        if self.kind == "git":
            out = subprocess.run(["git", f"--git-dir={self.where}", "ls-tree", "-r", "--name-only", self.rev],
                                 check=True, capture_output=True, text=True).stdout
            return out.splitlines()
        return [str(p.relative_to(self.where)) for p in Path(self.where).rglob("*.py")]

    def read(self, name: str) -> str:
        if self._zip is not None:
            return self._zip.read(name).decode()
        if self.kind == "git":
            return subprocess.run(["git", f"--git-dir={self.where}", "show", f"{self.rev}:{name}"],
                                  check=True, capture_output=True, text=True).stdout
        return (Path(self.where) / name).read_text()

    def describe(self, files: list[str]) -> dict:
        d: dict = {"files": sorted(files)}
        if self.kind == "wheel":
            data = Path(self.where).read_bytes()
            d |= {"wheel": os.path.basename(self.where), "sha256": hashlib.sha256(data).hexdigest(), "registry": "pypi.org"}
        elif self.kind == "git":
            commit = subprocess.run(["git", f"--git-dir={self.where}", "rev-parse", f"{self.rev}^{{commit}}"],
                                    check=True, capture_output=True, text=True).stdout.strip()
            d |= {"git_ref": self.rev, "commit": commit}
        else:
            d |= {"directory": self.where}
        return d


# --------------------------------------------------------------------------- AST helpers
def _names_in(node: ast.AST | None) -> set[str]:
    """Type names mentioned in an annotation (string annotations are parsed too)."""
    out: set[str] = set()
    if node is None:
        return out
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            out.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            out.add(sub.attr)
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            try:
                out |= _names_in(ast.parse(sub.value, mode="eval"))
            except SyntaxError:
                pass
        elif isinstance(sub, ast.Constant) and sub.value is None:
            out.add("None")
    return out


def _is_bool_option(ann: ast.AST | None) -> bool:
    """vLLM ``_compute_kwargs``: ``bool`` (optionally ``| None``) → BooleanOptionalAction;
    ``bool | str | None`` is an optional-valued flag instead."""
    names = _names_in(ann)
    return "bool" in names and "str" not in names and "dict" not in names


class ClassIndex:
    """Every class of a set of modules: its bases and annotated fields (in order)."""

    def __init__(self):
        self.classes: dict[str, ast.ClassDef] = {}
        self.dupes: dict[str, list[ast.ClassDef]] = {}

    def add_module(self, tree: ast.Module) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                if node.name in self.classes and self.classes[node.name] is not node:
                    self.dupes.setdefault(node.name, []).append(node)
                else:
                    self.classes[node.name] = node

    def bases(self, name: str) -> list[str]:
        cls = self.classes.get(name)
        if cls is None:
            return []
        return [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in cls.bases]

    def fields(self, name: str, _seen: frozenset = frozenset()) -> dict[str, ast.AnnAssign]:
        if name in _seen or name not in self.classes:
            return {}
        out: dict[str, ast.AnnAssign] = {}
        for base in self.bases(name):
            out.update(self.fields(base, _seen | {name}))
        for stmt in [st for c in [self.classes[name], *self.dupes.get(name, [])] for st in c.body]:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if "ClassVar" in _names_in(stmt.annotation) or stmt.target.id.startswith("_"):
                    continue
                out[stmt.target.id] = stmt
        return out

    def inherits(self, name: str, target: str, _seen: frozenset = frozenset()) -> bool:
        if name == target:
            return True
        if name in _seen:
            return False
        return any(self.inherits(b, target, _seen | {name}) for b in self.bases(name))


def _negations(opts: list[str]) -> list[str]:
    return [f"--no-{o[2:]}" for o in opts if o.startswith("--")]


def _is_bool_action(call: ast.Call) -> bool:
    for kw in call.keywords:
        if kw.arg == "action" and "BooleanOptionalAction" in _names_in(kw.value):
            return True
    return False


def add_argument_flags(tree: ast.AST, kwargs_bool=None) -> set[str]:
    """Option strings of every ``*.add_argument(...)`` call in ``tree``.

    ``kwargs_bool(func, var, field)`` says whether ``**var["field"]`` yields a
    BooleanOptionalAction (vLLM's derived kwargs)."""
    flags: set[str] = set()
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))] or [tree]
    for func in funcs:
        for call in ast.walk(func):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument"):
                continue
            opts = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("-")]
            if not opts:
                continue
            flags.update(opts)
            boolean = _is_bool_action(call)
            for kw in call.keywords:
                if kw.arg is not None or kwargs_bool is None:
                    continue
                # ``**x_kwargs["field"]`` or ``**{**x_kwargs["field"], "default": None}``
                subs = [kw.value] if isinstance(kw.value, ast.Subscript) else (
                    [v for k, v in zip(kw.value.keys, kw.value.values) if k is None and isinstance(v, ast.Subscript)]
                    if isinstance(kw.value, ast.Dict) else [])
                for sub in subs:
                    if isinstance(sub.value, ast.Name) and isinstance(sub.slice, ast.Constant):
                        boolean = boolean or kwargs_bool(func, sub.value.id, sub.slice.value)
            if boolean:
                flags.update(_negations(opts))
    return flags


def _get_kwargs_targets(func: ast.AST) -> dict[str, str]:
    """``x_kwargs = get_kwargs(SomeConfig)`` assignments in a function: var → class."""
    out: dict[str, str] = {}
    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            callee = node.value.func
            cname = callee.id if isinstance(callee, ast.Name) else callee.attr if isinstance(callee, ast.Attribute) else ""
            if cname == "get_kwargs" and node.value.args and isinstance(node.value.args[0], ast.Name):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        out[t.id] = node.value.args[0].id
    return out


# --------------------------------------------------------------------------- vLLM
def extract_vllm(src: Source) -> tuple[set[str], list[str]]:
    names = set(src.names())
    index = ClassIndex()
    config_files = sorted(n for n in names if (n.startswith("vllm/config/") or n == "vllm/config.py") and n.endswith(".py"))
    arg_files = [n for n in ("vllm/engine/arg_utils.py", "vllm/entrypoints/openai/cli_args.py",
                             "vllm/entrypoints/common/cli_args.py", "vllm/entrypoints/cli/serve.py") if n in names]
    trees = {}
    for n in config_files + arg_files:
        trees[n] = ast.parse(src.read(n))
        index.add_module(trees[n])

    def kwargs_bool(func, var, field):
        cls = _get_kwargs_targets(func).get(var)
        if cls is None:
            cls = "EngineArgs"
        ann = index.fields(cls).get(field)
        return ann is not None and _is_bool_option(ann.annotation)

    flags: set[str] = {"-h", "--help"}
    for n in arg_files:
        tree = trees[n]
        flags |= add_argument_flags(tree, kwargs_bool)
        # FrontendArgs: ``for k, v in get_kwargs(X).items(): add_argument(f"--{k...}")``
        # (X is ``cls`` inside ``FrontendArgs.add_cli_args`` or a class named in ``make_arg_parser``)
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        file_classes = {d.name for d in ast.walk(tree) if isinstance(d, ast.ClassDef)}
        for fn in [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)]:
            dynamic = any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "add_argument"
                          and any(isinstance(a, ast.JoinedStr) for a in c.args) for c in ast.walk(fn))
            if not dynamic:
                continue
            for target in set(_get_kwargs_targets(fn).values()):
                if target == "cls":
                    owner = parents.get(fn)
                    if not isinstance(owner, ast.ClassDef):
                        continue
                    owners = [owner.name] + [c for c in file_classes if c != owner.name and index.inherits(c, owner.name)]
                else:
                    owners = [target]
                for name in owners:
                    for field, ann in index.fields(name).items():
                        opt = "--" + field.replace("_", "-")
                        flags.add(opt)
                        if _is_bool_option(ann.annotation):
                            flags.add("--no-" + opt[2:])
    return flags, arg_files + config_files


# --------------------------------------------------------------------------- SGLang
def _sglang_field_flags(tree: ast.Module) -> set[str]:
    """Declarative fields ``name: A[T, "help" | Arg(...)]`` (SGLang ≥ 0.5.23)."""
    flags: set[str] = set()
    for cls in [c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)]:
        for stmt in cls.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            ann = stmt.annotation
            if not (isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id in ("A", "Annotated")):
                continue
            parts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
            meta = parts[1] if len(parts) > 1 else None
            if meta is None:
                continue
            name = "--" + stmt.target.id.replace("_", "-")
            aliases: list[str] = []
            boolean = False
            if isinstance(meta, ast.Call):
                kws = {k.arg: k.value for k in meta.keywords}
                if isinstance(kws.get("no_cli"), ast.Constant) and kws["no_cli"].value is True:
                    continue
                if isinstance(kws.get("cli_name"), ast.Constant):
                    name = kws["cli_name"].value
                if isinstance(kws.get("aliases"), (ast.List, ast.Tuple)):
                    aliases = [e.value for e in kws["aliases"].elts if isinstance(e, ast.Constant)]
                boolean = "BooleanOptionalAction" in _names_in(kws.get("action"))
            elif not (isinstance(meta, ast.Constant) and isinstance(meta.value, str)):
                continue
            opts = [name, *aliases]
            flags.update(opts)
            if boolean:
                flags.update(_negations(opts))
    return flags


def extract_sglang(src: Source) -> tuple[set[str], list[str]]:
    names = set(src.names())
    files = ["sglang/srt/server_args.py"]
    flags = {"-h", "--help"} | add_argument_flags(ast.parse(src.read(files[0])))
    field_files = sorted(n for n in names if n.startswith("sglang/srt/arg_groups/fields/") and n.endswith(".py"))
    for n in field_files:
        flags |= _sglang_field_flags(ast.parse(src.read(n)))
    return flags, files + field_files


# --------------------------------------------------------------------------- KTransformers legacy
def extract_argparse_file(src: Source, path: str) -> tuple[set[str], list[str]]:
    return {"-h", "--help"} | add_argument_flags(ast.parse(src.read(path))), [path]


# --------------------------------------------------------------------------- TensorRT-LLM
def extract_trtllm_serve(src: Source, path: str = "tensorrt_llm/commands/serve.py") -> set[str]:
    """click options of the ``serve`` command: ``@click.option("--tp_size", ...)``;
    ``"--flag/--no-flag"`` spellings are split."""
    tree = ast.parse(src.read(path))
    flags: set[str] = {"--help"}
    for fn in [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "serve"]:
        for dec in fn.decorator_list:
            if isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.func.attr == "option":
                for a in dec.args:
                    if isinstance(a, ast.Constant) and isinstance(a.value, str):
                        flags.update(p for p in a.value.split("/") if p.startswith("-"))
    return flags


def forbids_extra(index: "ClassIndex", name: str) -> bool:
    """Does pydantic model ``name`` (or a base) refuse unknown keys: a StrictBaseModel, or
    ``model_config`` with ``extra="forbid"``?"""
    if index.inherits(name, "StrictBaseModel"):
        return True
    for cname in [name, *index.bases(name)]:
        cls = index.classes.get(cname)
        for stmt in (cls.body if cls else []):
            if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "model_config" for t in stmt.targets):
                if "forbid" in ast.unparse(stmt.value):
                    return True
    return False


def extract_llm_api(src: Source, path: str = "tensorrt_llm/llmapi/llm_args.py", root: str = "TorchLlmArgs") -> dict:
    """Field tree of ``root``: each field is ``None`` or the nested tree of a model class it
    is typed with (first model class named in its annotation)."""
    index = ClassIndex()
    index.add_module(ast.parse(src.read(path)))

    def forbids(name: str) -> bool:
        return forbids_extra(index, name)

    def is_model(name: str) -> bool:
        return name in index.classes and (index.inherits(name, "BaseModel") or index.inherits(name, "StrictBaseModel")) and bool(index.fields(name))

    def tree(name: str, seen: frozenset) -> dict:
        fields: dict = {}
        for fname, ann in sorted(index.fields(name).items()):
            models = [n for n in _names_in(ann.annotation) if is_model(n) and n not in seen]
            fields[fname] = tree(sorted(models)[0], seen | {name}) if models else None
        return {"model": name, "extra": "forbid" if forbids(name) else "allow", "fields": fields}

    return tree(root, frozenset())


# --------------------------------------------------------------------------- output
def write(engine: str, version: str, flags: set[str], source: dict, llm_api: dict | None = None) -> Path:
    data = {"engine": engine, "version": version, "source": source, "flags": sorted(flags)}
    if llm_api is not None:
        data["llm_api"] = llm_api
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{engine}-{version}.json"
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


def find_wheel(wheels: Path, dist: str, version: str, download: bool) -> Path | None:
    pattern = f"{dist.replace('-', '_')}-{version}-*.whl"
    hits = sorted(wheels.glob(pattern))
    if not hits and download:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                        f"{dist}=={version}", "-d", str(wheels)], check=False)
        hits = sorted(wheels.glob(pattern))
    return hits[0] if hits else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--wheels", type=Path, required=True, help="directory of engine wheels (pip download --no-deps)")
    p.add_argument("--download", action="store_true", help="pip download missing wheels into --wheels")
    p.add_argument("--ktransformers-git", help="bare git dir of kvcache-ai/ktransformers (tag v0.3.2)")
    p.add_argument("--trtllm-src", action="append", default=[], metavar="VERSION=DIR",
                   help="TensorRT-LLM source/site-packages dir holding tensorrt_llm/ for VERSION")
    p.add_argument("--date", default=datetime.date.today().isoformat(), help="extraction date recorded in the JSON")
    args = p.parse_args(argv)
    missing: list[str] = []

    wheel_tables = [  # (engine, PyPI package, version, extractor, extra source fields)
        *(("vllm", "vllm", v, extract_vllm, {}) for v in VLLM_VERSIONS),
        *(("sglang", "sglang", v, extract_sglang, {}) for v in SGLANG_VERSIONS),
        ("ktransformers", "sglang-kt", KT_SGLANG_VERSION, extract_sglang,
         {"entry_point": "python -m sglang.launch_server (sglang-kt; the --kt-* flags live in its server_args.py)"}),
    ]
    for engine, package, v, extract, extra in wheel_tables:
        whl = find_wheel(args.wheels, package, v, args.download)
        if whl is None:
            missing.append(f"{engine} {v}")
            continue
        src = Source("wheel", str(whl))
        flags, files = extract(src)
        write(engine, v, flags, {"package": f"{package}=={v}", "method": "ast", "date": args.date, **extra,
                                 **src.describe(files)})

    if args.ktransformers_git:
        src = Source("git", args.ktransformers_git, KT_LEGACY_TAG)
        flags, files = extract_argparse_file(src, "ktransformers/server/args.py")
        write("ktransformers", KT_LEGACY_TAG.lstrip("v"), flags, {
            "repo": "github.com/kvcache-ai/ktransformers", "method": "ast", "date": args.date,
            "entry_point": "python -m ktransformers.server.main", **src.describe(files)})
    else:
        missing.append("ktransformers 0.3.2")

    trt = dict(item.split("=", 1) for item in args.trtllm_src)
    for v in ("1.2.0", "1.0.0"):
        if v not in trt:
            missing.append(f"trtllm {v}"); continue
        src = Source("dir", trt[v])
        flags = extract_trtllm_serve(src)
        llm_api = extract_llm_api(src)
        write("trtllm", v, flags, {"package": f"tensorrt-llm=={v}", "method": "ast", "date": args.date,
                                   **src.describe(["tensorrt_llm/commands/serve.py", "tensorrt_llm/llmapi/llm_args.py"])},
              llm_api=llm_api)

    if missing:
        print("not extracted (no source): " + ", ".join(missing), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
