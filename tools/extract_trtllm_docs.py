#!/usr/bin/env python3
"""Build the TensorRT-LLM flag table from its documentation build (the gh-pages branch).

TensorRT-LLM's wheels are not on PyPI, so ``tools/extract_engine_flags.py --trtllm-src`` needs a
source tree that is rarely at hand. The documentation build holds the same text:

- ``<version>/commands/trtllm-serve/trtllm-serve.html``: sphinx-click's rendering of the
  ``trtllm-serve`` click group; the options of ``trtllm-serve serve`` (the command k2fleet
  runs, and the one ``k2_engine_args`` feed) are the ``sig-name`` spans of its section.
- ``<version>/_modules/tensorrt_llm/llmapi/llm_args.html``: ``llm_args.py`` rendered by
  sphinx viewcode; the module source is the ``<pre>`` block with its tags stripped.

The LLM API tree is built like ``extract_engine_flags.extract_llm_api`` (root ``TorchLlmArgs``,
``extra`` from ``StrictBaseModel``/``model_config``), plus what that one-model rule misses:

- a field typed with several model classes, directly or through a module-level alias
  (``SpeculativeConfig``, ``SparseAttentionConfig``), gets the union of their fields and the
  key their common base's ``from_dict`` dispatches on (``decoding_type``, ``algorithm``);
- a model class named in ``Field(json_schema_extra={"type": "..."})`` counts as typed
  (``moe_config.load_balancer`` is converted from a dict to ``MoeLoadBalancerConfig``);
- ``alias=``/``validation_alias=AliasChoices(...)`` names are accepted beside the field name.

Usage::

    python tools/extract_trtllm_docs.py --version 1.2.0 --commit <gh-pages commit> \\
        --serve-html trtllm-serve.html --llm-args-html llm_args.html [--llm-args-py llm_args.py]

``--llm-args-py`` takes the module source directly instead of the HTML.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import html
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import extract_engine_flags as base  # noqa: E402

SERVE_PATH = "{v}/commands/trtllm-serve/trtllm-serve.html"
LLM_ARGS_PATH = "{v}/_modules/tensorrt_llm/llmapi/llm_args.html"


def serve_options(page: str, command: str = "serve") -> list[list[str]]:
    """Option strings of ``trtllm-serve <command>`` on the sphinx-click page, one list per
    option (its long name first, then its aliases: one ``<dt>`` each).

    >>> page = ('<section id="trtllm-serve-serve"><dl class="std option"><dt class="sig" id="x">'
    ...         '<span class="sig-name descname"><span class="pre">--config</span></span>'
    ...         '<span class="sig-prename descclassname"><span class="pre">,</span> </span>'
    ...         '<span class="sig-name descname"><span class="pre">--extra_llm_api_options</span></span>'
    ...         '<span class="sig-prename descclassname"> <span class="pre">&lt;x&gt;</span></span></dt>'
    ...         '<dt><span class="sig-name descname"><span class="pre">MODEL</span></span></dt></section>')
    >>> serve_options(page)
    [['--config', '--extra_llm_api_options'], ['--help']]
    """
    start = page.find(f'<section id="trtllm-serve-{command}">')
    if start < 0:
        raise ValueError(f"no section for trtllm-serve {command}")
    end = page.find("</section>", start)
    groups = []
    for dt in re.findall(r"<dt[ >].*?</dt>", page[start:end], re.S):
        names = re.findall(r'<span class="sig-name descname"><span class="pre">([^<]+)</span></span>', dt)
        names = [html.unescape(n) for n in names if n.startswith("-")]
        if names:
            groups.append(names)
    return groups + [["--help"]]


def module_source(page: str) -> str:
    """The Python source in a sphinx viewcode page (``[docs]`` back-links removed)."""
    m = re.search(r'<div class="highlight"><pre>(.*?)</pre></div>', page, re.S)
    if m is None:
        raise ValueError("no highlighted source block")
    body = re.sub(r'<a class="viewcode-back"[^>]*>\[docs\]</a>\n?', "", m.group(1))
    body = re.sub(r'<div class="viewcode-block"[^>]*>\n?', "", body)
    body = body.replace("</div>", "")
    return html.unescape(re.sub(r"<[^>]+>", "", body))


def _aliases(stmt: ast.AnnAssign) -> list[str]:
    call = stmt.value
    out: list[str] = []
    if isinstance(call, ast.Call):
        for kw in call.keywords:
            if kw.arg == "alias" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                out.append(kw.value.value)
            elif kw.arg == "validation_alias" and isinstance(kw.value, ast.Call):
                out += [a.value for a in kw.value.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return [a for a in out if a != stmt.target.id]


def _schema_type_names(stmt: ast.AnnAssign) -> set[str]:
    call = stmt.value
    if not isinstance(call, ast.Call):
        return set()
    for kw in call.keywords:
        if kw.arg == "json_schema_extra" and isinstance(kw.value, ast.Dict):
            for k, v in zip(kw.value.keys, kw.value.values):
                if isinstance(k, ast.Constant) and k.value == "type":
                    return base._names_in(v)
    return set()


def llm_api_tree(source: str, root: str = "TorchLlmArgs") -> dict:
    tree_ast = ast.parse(source)
    index = base.ClassIndex()
    index.add_module(tree_ast)
    aliases = {n.target.id: n.value for n in tree_ast.body
               if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value is not None}
    aliases |= {t.id: n.value for n in tree_ast.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}

    def forbids(name: str) -> bool:
        return base.forbids_extra(index, name)

    def is_model(name: str) -> bool:
        return name in index.classes and index.inherits(name, "BaseModel") and bool(index.fields(name))

    def models_in(names: set[str], seen: frozenset) -> list[str]:
        out: set[str] = set()
        for n in names:
            if n in aliases and n not in index.classes and n not in seen:
                out |= set(models_in(base._names_in(aliases[n]), seen | {n}))
            elif is_model(n):
                out.add(n)
        return sorted(out)

    def discriminator(variants: list[str]) -> str | None:
        common = [b for b in index.classes if all(index.inherits(v, b) for v in variants) and is_model(b)]
        for cname in common:
            for fn in index.classes[cname].body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "from_dict":
                    for node in ast.walk(fn):
                        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                                and node.args and isinstance(node.args[0], ast.Constant)):
                            return node.args[0].value
        return None

    def tree(names: list[str], seen: frozenset, label: str) -> dict:
        fields: dict = {}
        for name in names:
            for fname, stmt in sorted(index.fields(name).items()):
                models = [m for m in models_in(base._names_in(stmt.annotation) | _schema_type_names(stmt), seen) if m not in seen]
                sub = tree(models, seen | set(names), "|".join(models) if len(models) > 1 else "") if models else None
                for key in [fname, *_aliases(stmt)]:
                    if isinstance(fields.get(key), dict) and isinstance(sub, dict):
                        continue
                    fields[key] = sub
        node = {"model": label or names[0], "extra": "forbid" if all(forbids(n) for n in names) else "allow"}
        if len(names) > 1:
            node["variants"] = names
            key = discriminator(names)
            if key:
                fields.setdefault(key, None)
        node["fields"] = dict(sorted(fields.items()))
        return node

    return tree([root], frozenset(), root)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--version", required=True)
    p.add_argument("--commit", required=True, help="gh-pages commit of NVIDIA/TensorRT-LLM the pages come from")
    p.add_argument("--built-from", default="", help="TensorRT-LLM commit the pages name as generated from")
    p.add_argument("--serve-html", type=Path, required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--llm-args-html", type=Path)
    src.add_argument("--llm-args-py", type=Path)
    p.add_argument("--method", default="sphinx-click option spans; ast over the viewcode source")
    p.add_argument("--date", default=datetime.date.today().isoformat())
    args = p.parse_args(argv)
    groups = serve_options(args.serve_html.read_text())
    flags = {name for group in groups for name in group}
    source = args.llm_args_py.read_text() if args.llm_args_py else module_source(args.llm_args_html.read_text())
    v = args.version
    info = {
        "repo": "github.com/NVIDIA/TensorRT-LLM", "branch": "gh-pages", "commit": args.commit,
        "files": sorted([SERVE_PATH.format(v=v), LLM_ARGS_PATH.format(v=v)]),
        "entry_point": "trtllm-serve serve (flags); the --config YAML (llm_api, root TorchLlmArgs)",
        "method": args.method, "date": args.date,
    }
    if args.built_from:
        info["generated_from"] = args.built_from
    path = base.write("trtllm", v, flags, info, llm_api=llm_api_tree(source))
    data = json.loads(path.read_text())  # one option's names (an owned flag's alias is owned too)
    data["aliases"] = sorted(sorted(g) for g in groups if len(g) > 1)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
