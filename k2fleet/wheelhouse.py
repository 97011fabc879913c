"""Offline wheelhouse of the Hub client, for a fleet host that downloads the checkpoint.

With ``k2_checkpoint_fetcher: HOST`` that one host talks to the Hub, so it needs
huggingface_hub — but fleet hosts are often air-gapped apart from the Hub (or its
mirror). The control machine therefore downloads ``huggingface_hub`` at *its own*
version (the code k2fleet is tested with) and every dependency as wheels, for CPython
3.10–3.13 on manylinux x86_64 and aarch64, once, into a cache keyed by the pins; the
wheels are shipped to the host and installed there with ``pip install --no-index``.

On an air-gapped control machine, build the cache on a connected one and copy it:

    python -m k2fleet.wheelhouse            # prints the directory

Example:
    >>> hub_client_requirement().startswith("huggingface_hub==")
    True
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

DEFAULT_CACHE_DIR = Path(os.environ.get("K2FLEET_WHEELHOUSE_CACHE", "/var/cache/k2fleet/wheelhouses"))
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
PLATFORMS = {
    "x86_64": ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64"),
    "aarch64": ("manylinux2014_aarch64", "manylinux_2_17_aarch64", "manylinux_2_28_aarch64"),
}
DONE = "k2fleet-wheelhouse.json"


def hub_client_requirement() -> str:
    """``huggingface_hub==<the control machine's version>``."""
    return f"huggingface_hub=={version('huggingface_hub')}"


def wheelhouse_key(requirements: list[str]) -> str:
    """Cache key of a wheelhouse: the pins, interpreter versions and platforms."""
    blob = json.dumps([sorted(requirements), PYTHONS, sorted(PLATFORMS.items())]).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def pip_download_argv(requirements: list[str], dest: Path, python: str, platforms: tuple[str, ...]) -> list[str]:
    """``pip download`` of binary wheels for one interpreter version and one architecture.

    Example:
        >>> argv = pip_download_argv(["huggingface_hub==2.4.0"], Path("/w"), "3.11", PLATFORMS["x86_64"])
        >>> argv[argv.index("--python-version") + 1], "--only-binary=:all:" in argv
        ('3.11', True)
    """
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
            "--only-binary=:all:", "--python-version", python, "--implementation", "cp", "-d", str(dest)]
    for platform in platforms:
        argv += ["--platform", platform]
    return argv + requirements


def cached_wheelhouse(requirements: list[str], cache_dir: Path = DEFAULT_CACHE_DIR) -> Path | None:
    """The complete cached wheelhouse directory for ``requirements``, if one exists (reads only)."""
    target = cache_dir / wheelhouse_key(requirements)
    return target if (target / DONE).is_file() else None


def ensure_wheelhouse(requirements: list[str] | None = None, cache_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    """The cached wheelhouse directory for ``requirements`` (default: the Hub client),
    downloaded with ``pip download`` the first time (needs a package index then)."""
    requirements = requirements or [hub_client_requirement()]
    cached = cached_wheelhouse(requirements, cache_dir)
    if cached is not None:
        return cached
    target = cache_dir / wheelhouse_key(requirements)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / ".lock", "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if (target / DONE).is_file():
            return target
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for python in PYTHONS:
            for platforms in PLATFORMS.values():
                out = subprocess.run(pip_download_argv(requirements, tmp, python, platforms),
                                     capture_output=True, text=True, stdin=subprocess.DEVNULL)
                if out.returncode:
                    raise RuntimeError(f"pip download of {' '.join(requirements)} for CPython {python} "
                                       f"{platforms[0]} failed:\n{out.stderr.strip()[-2000:]}")
        wheels = sorted(p.name for p in tmp.glob("*.whl"))
        (tmp / DONE).write_text(json.dumps({"requirements": requirements, "wheels": wheels}, indent=1) + "\n")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    return target


def wheel_files(directory: Path) -> dict[str, bytes]:
    """``{wheel file name: bytes}`` of a wheelhouse (what is shipped to the host)."""
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.whl"))}


if __name__ == "__main__":
    print(ensure_wheelhouse())
