"""Engine runtime role: k2fleet's host-side helpers and the engine itself.

- always: ``/opt/k2fleet/lib`` (checkpoint ``verify.py``, ``k2fleet-health.py``);
- ``k2_engine_doubles`` (sandbox only): the engine test doubles under
  ``/opt/k2fleet/doubles`` and, in ``k2_venv/bin``, wrappers named like the real
  entry points (``vllm``, ``python``, ``trtllm-serve``, ``trtllm-llmapi-launch``), so
  the planned argv runs unchanged;
- ``venv`` runtime: ``python3 -m venv k2_venv`` + ``pip install ENGINE==VERSION``
  (from ``k2_wheelhouse`` when set, with no index);
- ``container`` runtime: the image must be present (``docker load`` it from an offline
  bundle first on air-gapped fleets).

.. code:: python

    from roles import engine
    engine.install()
"""

from __future__ import annotations

from pathlib import Path

from pyinfra.api import deploy

from k2fleet.units import LIB_DIR
from roles.context import FILES, REPO, FleetContext, fleet
from roles.ops import command, synced_files
from roles.state import report, track

DOUBLES_DIR = "/opt/k2fleet/doubles"
PIP_NAMES = {"vllm": "vllm", "sglang": "sglang[all]", "ktransformers": "ktransformers", "trtllm": "tensorrt_llm"}
ENTRY = {"vllm": "vllm", "sglang": "python", "ktransformers": "python", "trtllm": "trtllm-serve"}


def _lib_files() -> dict[str, tuple[bytes, str]]:
    return {
        f"{LIB_DIR}/verify.py": ((REPO / "k2fleet/checkpoint/verify.py").read_bytes(), "755"),
        f"{LIB_DIR}/overlay.py": ((REPO / "k2fleet/checkpoint/overlay.py").read_bytes(), "755"),
        f"{LIB_DIR}/k2fleet-health.py": ((FILES / "k2fleet-health.py").read_bytes(), "755"),
    }


def _double_files(ctx: FleetContext) -> dict[str, tuple[bytes, str]]:
    root = FILES / "doubles"
    files: dict[str, tuple[bytes, str]] = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            mode = "755" if path.parent.name == "bin" else "644"
            files[f"{DOUBLES_DIR}/{path.relative_to(root)}"] = (path.read_bytes(), mode)
    venv = ctx.dep.s.venv
    for name in ("vllm", "trtllm-serve", "trtllm-llmapi-launch"):
        wrapper = f'#!/bin/sh\n# k2fleet engine TEST DOUBLE wrapper (sandbox only)\nexec {DOUBLES_DIR}/bin/{name} "$@"\n'
        files[f"{venv}/bin/{name}"] = (wrapper.encode(), "755")
    python = f'#!/bin/sh\n# k2fleet engine TEST DOUBLE python (sandbox only)\nPYTHONPATH={DOUBLES_DIR} exec /usr/bin/python3 "$@"\n'
    files[f"{venv}/bin/python"] = (python.encode(), "755")
    return files


def desired_files(ctx: FleetContext) -> dict[str, tuple[bytes, str]]:
    files = _lib_files()
    if ctx.dep.s.engine_doubles:
        files |= _double_files(ctx)
    return files


def exists_paths(ctx: FleetContext) -> list[str]:
    paths = [f"{ctx.dep.s.venv}/bin/{ENTRY[ctx.dep.engine]}"]
    if ctx.dep.s.model_type_override:
        paths.append(f"{ctx.dep.serve_path}/config.json")
    return paths


def _venv_install(ctx: FleetContext) -> list[str]:
    dep = ctx.dep
    pip = [f"{dep.s.venv}/bin/pip", "install", f"{PIP_NAMES[dep.engine]}=={dep.version}"]
    wheelhouse = Path(dep.s.venv) / "wheelhouse"
    return ["sh", "-c", f"python3 -m venv {dep.s.venv} && {' '.join(pip)} --no-index --find-links {wheelhouse} || {' '.join(pip)}"]


@deploy("k2fleet: engine runtime")
def install() -> None:
    ctx = fleet()
    rep = report()
    track(synced_files(name="k2fleet host helpers and engine files", files=desired_files(ctx), current=rep.files))
    entry = exists_paths(ctx)[0]
    needs_venv = ctx.dep.runtime == "venv" and not ctx.dep.s.engine_doubles and not rep.exists.get(entry)
    command(name=f"install {ctx.dep.engine} {ctx.dep.version} into {ctx.dep.s.venv}", argv=_venv_install(ctx),
            _if=lambda: needs_venv)
