"""What an engine venv needs beside the engine, and which Python it runs (pure tables).

The control step (:mod:`k2fleet.control.wheelhouse`) downloads what these tables name;
planning reads them to know what each host installs and checks.
"""

from __future__ import annotations

# engine → (first release, the oldest Python it installs on), from each release's
# Requires-Python on PyPI (read 2026-11: vllm 0.32.0 and 0.33.0 say ">=3.11,<3.15";
# sglang 0.5.23, sglang-kt/kt-kernel 0.7.2, ray 2.60.0 and sglang-router 0.3.2 install on 3.10)
ENGINE_REQUIRES_PYTHON: dict[str, tuple[tuple[str, str], ...]] = {"vllm": (("0.32.0", "3.11"),)}
# (engine, program the plan runs from k2_venv) -> the requirement that provides it.
# vLLM (>= 0.19) asks for ray[cgraph]>=2.48.0 (compiled graphs carry pipeline parallelism
# across Ray nodes); k2fleet pins one release so every node runs the same Ray.
ENGINE_SIDE_PINS = {
    ("vllm", "ray"): "ray[cgraph]==2.60.0",
    # SGLang's PD router (``python -m sglang_router.launch_router``); the package's last
    # release under that name (its successor is the model gateway ``smg``).
    ("sglang", "sglang_router.launch_router"): "sglang-router==0.3.2",
}
HOST_ARCH = {"gb200": "aarch64", "gb300": "aarch64"}  # GPU → CPU architecture (default x86_64)


def engine_side_requirements(engine: str, venv: str, argvs: list[list[str]]) -> list[str]:
    """Requirements a host's engine venv needs for the commands it runs from it (pure):
    a program ``k2_venv/bin/PROGRAM`` or a module (``python -m MODULE``) in the table.

    >>> engine_side_requirements("vllm", "/v", [["/v/bin/ray", "start", "--head"]])
    ['ray[cgraph]==2.60.0']
    >>> engine_side_requirements("vllm", "/v", [["/v/bin/vllm", "serve", "m"]])
    []
    """
    words = {word for argv in argvs if argv and argv[0].startswith(f"{venv}/bin/") for word in argv}
    return sorted({req for (eng, program), req in ENGINE_SIDE_PINS.items()
                   if eng == engine and (f"{venv}/bin/{program}" in words or program in words)})


def requirement_version(requirement: str) -> tuple[str, str]:
    """(distribution name, pinned version) of ``name[extras]==version``.

    >>> requirement_version("ray[cgraph]==2.60.0")
    ('ray', '2.60.0')
    """
    name, _, pinned = requirement.partition("==")
    return name.split("[", 1)[0], pinned


def host_python(os_name: str) -> str:
    """The Python version engine venvs run on a k2_os release (its OS table's), so the
    version the wheels shipped to it are for.

    >>> host_python("debian-12"), host_python("ubuntu-22.04"), host_python("rhel-9")
    ('3.11', '3.11', '3.12')
    """
    from k2fleet.planning.os_tables import OS_TABLES

    return OS_TABLES[os_name].python_version


def engine_min_python(engine: str, version: str) -> str | None:
    """The oldest Python ``engine`` at ``version`` installs on (None: no known floor).

    >>> engine_min_python("vllm", "0.33.0"), engine_min_python("vllm", "0.31.0"), engine_min_python("sglang", "0.5.23")
    ('3.11', None, None)
    """
    def key(v: str) -> tuple[int, ...]:
        return tuple(int(part) for part in v.split(".") if part.isdigit())

    floors = [py for since, py in ENGINE_REQUIRES_PYTHON.get(engine, ()) if key(version) >= key(since)]
    return max(floors, key=key) if floors else None
