"""Offline wheelhouses: the Hub client for the checkpoint fetcher, and engine-side wheels.

With ``k2_checkpoint_fetcher: HOST`` that one host talks to the Hub, so it needs
huggingface_hub — but fleet hosts are often air-gapped apart from the Hub (or its
mirror). The control machine therefore downloads ``huggingface_hub`` at *its own*
version (the code k2fleet is tested with) and every dependency as wheels, for CPython
3.10–3.13 on manylinux x86_64 and aarch64, once, into a cache keyed by the pins; the
wheels are shipped to the host and installed there with ``pip install --no-index``.

Engine-side wheels are what a host's engine venv (``k2_venv``) needs next to the engine
for the parts the plan runs there (the pure table in :mod:`k2fleet.planning.engine_side`,
e.g. Ray for vLLM's Ray backend), downloaded for the fleet hosts' interpreter only (the
``python3`` of the hosts' OS release) and CPU architecture.

On an air-gapped control machine, build the cache on a connected one and copy it:

    python -m k2fleet.control.wheelhouse            # prints the directory

Example:
    >>> hub_client_requirement().startswith("huggingface_hub==")
    True
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import version
from pathlib import Path

from k2fleet.control.cache_dirs import build_once

DEFAULT_CACHE_DIR = Path(os.environ.get("K2FLEET_WHEELHOUSE_CACHE", "/var/cache/k2fleet/wheelhouses"))
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
PLATFORMS = {
    "x86_64": ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64"),
    "aarch64": ("manylinux2014_aarch64", "manylinux_2_17_aarch64", "manylinux_2_28_aarch64"),
}
DONE = "k2fleet-wheelhouse.json"
DEFAULT_INDEX = "https://pypi.org/simple"
def wheel_name_version(filename: str) -> tuple[str, str]:
    """(distribution, version) of a wheel file name.

    >>> wheel_name_version("ray-2.60.0-cp311-cp311-manylinux2014_x86_64.whl")
    ('ray', '2.60.0')
    """
    name, version = filename.split("-")[:2]
    return name, version


def index_url(index: str | None = None) -> str:
    """The package index pip downloads from: ``index`` (``k2_pypi_index``), else env
    ``PIP_INDEX_URL``, pip's config, or PyPI."""
    if index:
        return index
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"]
    out = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                         capture_output=True, text=True, stdin=subprocess.DEVNULL)
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else DEFAULT_INDEX


def hub_client_requirement() -> str:
    """``huggingface_hub==<the control machine's version>``."""
    return f"huggingface_hub=={version('huggingface_hub')}"


def wheelhouse_key(requirements: list[str], pythons: tuple[str, ...] = PYTHONS,
                   archs: tuple[str, ...] = tuple(PLATFORMS), constraints: tuple[str, ...] = ()) -> str:
    """Cache key of a wheelhouse: the pins, interpreter versions, platforms (and the
    versions it was constrained to, if any)."""
    platforms = sorted((arch, PLATFORMS[arch]) for arch in archs)
    parts: list[object] = [sorted(requirements), list(pythons), platforms]
    if constraints:
        parts.append(sorted(constraints))
    blob = json.dumps(parts).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def pip_download_argv(requirements: list[str], dest: Path, python: str, platforms: tuple[str, ...],
                      constraints_file: Path | None = None, index: str | None = None) -> list[str]:
    """``pip download`` of binary wheels for one interpreter version and one architecture,
    from ``index`` (``k2_pypi_index``; None: pip's own configuration).

    Example:
        >>> argv = pip_download_argv(["huggingface_hub==2.4.0"], Path("/w"), "3.11", PLATFORMS["x86_64"])
        >>> argv[argv.index("--python-version") + 1], "--only-binary=:all:" in argv, "--index-url" in argv
        ('3.11', True, False)
        >>> argv = pip_download_argv(["x==1"], Path("/w"), "3.11", PLATFORMS["x86_64"], index="https://pypi.corp/simple")
        >>> argv[argv.index("--index-url") + 1]
        'https://pypi.corp/simple'
    """
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
            "--only-binary=:all:", "--python-version", python, "--implementation", "cp", "-d", str(dest)]
    if index:
        argv += ["--index-url", index]
    for platform in platforms:
        argv += ["--platform", platform]
    if constraints_file is not None:
        argv += ["-c", str(constraints_file)]
    return argv + requirements


def cached_wheelhouse(requirements: list[str], cache_dir: Path = DEFAULT_CACHE_DIR,
                      pythons: tuple[str, ...] = PYTHONS, archs: tuple[str, ...] = tuple(PLATFORMS),
                      constraints: Sequence[str] = ()) -> Path | None:
    """The complete cached wheelhouse directory for ``requirements``, if one exists (reads only)."""
    target = cache_dir / wheelhouse_key(requirements, pythons, archs, tuple(constraints))
    return target if (target / DONE).is_file() else None


def ensure_wheelhouse(requirements: list[str] | None = None, cache_dir: Path = DEFAULT_CACHE_DIR,
                      pythons: tuple[str, ...] = PYTHONS, archs: tuple[str, ...] = tuple(PLATFORMS),
                      constraints: Sequence[str] = (), progress: Callable[[str], None] | None = None,
                      index: str | None = None) -> Path:
    """The cached wheelhouse directory for ``requirements`` (default: the Hub client) for
    CPython ``pythons`` on ``archs``, downloaded with ``pip download`` the first time
    (needs a package index then). ``constraints``: ``name==version`` lines every
    dependency must keep (``k2fleet bundle --locked`` passes the lock's); ``progress``
    gets pip's Collecting/Downloading lines as they come; ``index``: the package index
    (``k2_pypi_index``; None: pip's configuration). The index is not part of the cache key: the
    same pins from a mirror are the same wheels."""
    requirements = requirements or [hub_client_requirement()]
    target = cache_dir / wheelhouse_key(requirements, pythons, archs, tuple(constraints))

    def make(tmp: Path) -> None:
        pinned = None
        if constraints:
            pinned = tmp / "constraints.txt"
            pinned.write_text("".join(f"{c}\n" for c in sorted(constraints)))
        for python in pythons:
            for platforms in (PLATFORMS[arch] for arch in archs):
                argv = pip_download_argv(requirements, tmp, python, platforms, pinned, index)
                run_pip(argv, progress, f"pip (CPython {python}, {platforms[0]})",
                        f"pip download of {' '.join(requirements)} for CPython {python} {platforms[0]}")
        if pinned is not None:
            pinned.unlink()
        wheels = sorted(p.name for p in tmp.glob("*.whl"))
        (tmp / DONE).write_text(json.dumps({"requirements": requirements, "wheels": wheels}, indent=1) + "\n")

    return build_once(target, DONE, make)


def run_pip(argv: list[str], progress: Callable[[str], None] | None, label: str, what: str,
            shown: tuple[str, ...] = ("Collecting", "Downloading", "Saved")) -> None:
    """Run pip's ``argv``; with ``progress``, pip's own lines starting with ``shown`` go to it as
    they come (``label: LINE``; pip's ``--quiet`` taken out), else pip stays quiet. Raises
    RuntimeError naming ``what`` with the end of pip's stderr when pip fails."""
    if progress is not None and "--quiet" in argv:
        argv = [a for a in argv if a != "--quiet"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    assert proc.stdout is not None and proc.stderr is not None
    for line in proc.stdout:
        if progress is not None and line.lstrip().startswith(shown):
            progress(f"  {label}: {line.strip()}")
    stderr = proc.stderr.read()
    if proc.wait():
        raise RuntimeError(f"{what} failed:\n{stderr.strip()[-2000:]}")


def wheel_files(directory: Path) -> dict[str, bytes]:
    """``{wheel file name: bytes}`` of a wheelhouse (what is shipped to the host)."""
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.whl"))}


if __name__ == "__main__":
    print(ensure_wheelhouse())
