"""The one seam between the product and what stands in for production parts.

An inventory with ``k2_simulated_gpus`` / ``k2_engine_doubles`` (the sandbox's) needs
artifacts no real fleet has: a repository of driver-package TEST DOUBLES in place of
NVIDIA's and AMD's, the engine TEST DOUBLES (their sources as host files, as a wheel and
as a container image) or, with simulated GPUs and no doubles, a wheelhouse of the real
engine's CPU build, a synthetic checkpoint for a rehearsal bundle, and the stand-in
hosts' Debian release. The product names none of them. It asks the provider registered
under the entry-point group ``k2fleet.stand_ins`` (the ``k2sandbox`` package registers
``sandbox`` in pyproject.toml) for the :class:`StandIns` below; the control step
(:mod:`k2fleet.control.artifacts`, :mod:`k2fleet.control.airgap`) is its only caller, and
what planning needs of it travels as data in :class:`k2fleet.planning.desired.ControlArtifacts`.

The same group mechanism adds CLI commands (group ``k2fleet.commands``: the sandbox's
``rehearse`` and ``sandbox``), so ``k2fleet`` never imports the sandbox either.
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Protocol

from k2fleet.control import ControlError
from k2fleet.planning.deployment import Deployment
from k2fleet.planning.desired import EngineDoubles

GROUP = "k2fleet.stand_ins"
COMMANDS = "k2fleet.commands"


class StandInsMissing(ControlError):
    """No stand-in provider is installed (a production install without the sandbox)."""


class StandIns(Protocol):
    """What a stand-in provider offers the control step."""

    host_os: str  # the k2_os of the stand-in hosts
    suite: str  # their Debian release (offline bundles resolve against it)
    engine_project: str  # the distribution name of the engine stand-ins' wheel

    def driver_repo(self, cache: Path | None = None) -> Path:
        """A flat apt repository (``deb [trusted=yes] file:DIR ./``) standing in for NVIDIA's and AMD's."""

    def engine_requirement(self) -> str:
        """The requirement (``NAME==VERSION``) that installs the engine stand-ins into a venv."""

    def engine_wheel(self) -> tuple[str, bytes, str]:
        """The engine stand-ins' wheel: (file name, bytes, version)."""

    def engine_files(self) -> dict[str, bytes]:
        """The engine stand-ins' sources a host holds: path relative to the doubles' root → bytes."""

    def image(self, ref: str, plan: Any, *, build: bool, cache: Path | None = None) -> tuple[Path, str] | None:
        """The engine stand-ins' image archive for ``ref`` (``docker load``-able) and its image ID:
        built when ``build``, else the cached one or None."""

    def engine_cpu_wheelhouse(self, requirements: list[str], python: str, *, build: bool) -> Path | None:
        """A wheelhouse (k2fleet's completion marker, ``*.whl``) from which ``pip install
        --no-index`` of ``requirements`` (the engine's pin: ``vllm==VERSION``) installs the
        engine's CPU build for CPython ``python``: what runs on simulated GPUs without engine
        test doubles. Made when ``build``, else the cached one or None; ControlError when the
        provider has no CPU build for them."""

    def gpu_exporter_image(self, ref: str, *, build: bool, cache: Path | None = None) -> tuple[Path, str] | None:
        """A TEST DOUBLE of NVIDIA's dcgm-exporter image tagged ``ref`` (``docker load``-able) and its
        image ID: its entry point serves DCGM metrics of the simulated GPUs on port 9400; built
        when ``build``, else the cached one or None."""

    def checkpoint(self, repo: str, revision: str) -> Path:
        """A synthetic checkpoint of ``repo``@``revision`` with its manifest, made once and
        cached; its directory."""

    def gguf(self, repo: str, revision: str, pattern: str | None) -> Path:
        """Synthetic GGUF files of ``repo``@``revision`` matching ``pattern`` with their
        manifest, made once and cached; their directory."""


@cache
def stand_ins() -> StandIns:
    """The installed provider (the first of the group by name; looked up once per process:
    scanning the installed distributions' entry points costs ~20 ms)."""
    found = sorted(entry_points(group=GROUP), key=lambda ep: ep.name)
    if not found:
        raise StandInsMissing("k2_simulated_gpus / k2_engine_doubles need the sandbox's stand-ins "
                              f"(entry point group {GROUP}); install k2fleet with its k2sandbox package")
    provider: StandIns = found[0].load()()
    return provider


def command_plugins() -> list[Any]:
    """The functions that add CLI commands (``add(subparsers)``), by entry-point name."""
    return [ep.load() for ep in sorted(entry_points(group=COMMANDS), key=lambda ep: ep.name)]


def engine_doubles_for(dep: Deployment) -> EngineDoubles | None:
    """``k2_engine_doubles``: the engine stand-ins as planning takes them (None otherwise)."""
    if not dep.s.engine_doubles:
        return None
    provider = stand_ins()
    return EngineDoubles(provider.engine_requirement(), provider.engine_files())
