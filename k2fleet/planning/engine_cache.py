"""Warm restarts: the engines' compile and JIT caches in one persistent directory per host.

A restarted engine skips what it compiled before (torch.compile/Inductor graphs, Triton and
FlashInfer kernels, DeepGEMM's JIT) when it finds its caches. By default each cache lives
under the engine process's ``$HOME`` or ``/tmp`` (``/tmp/torchinductor_root``,
``~/.cache/vllm``, ``~/.triton``), which a container's ``--rm`` and a host's tmp cleaning throw
away. k2fleet points every cache at :func:`cache_dir` (``/var/cache/k2fleet/engine-cache/<engine>``,
made ``root:root 0700`` by each engine unit before it starts: the units run as root, and what
the engine loads from there is code no other user may plant) and binds it read-write into
containers at the same path. An operator's warmed copy of that directory travels in the
air-gapped bundle (``k2fleet bundle INVENTORY --out DIR --engine-cache SRC``,
:mod:`k2fleet.control.airgap`) and is unpacked on each host whose directory is empty
(:func:`unpack_argv`).

The variables, as the engines read them (checked in their sources at the pins):

- vLLM 0.32/0.33 ``vllm/envs.py``: ``VLLM_CACHE_ROOT`` (its torch.compile cache
  ``torch_compile_cache/`` and the Inductor/Triton caches vLLM points inside it,
  ``vllm/compilation/compiler_interface.py``);
- torch ``torch/_inductor/runtime/cache_dir_utils.py``: ``TORCHINDUCTOR_CACHE_DIR`` and
  ``TRITON_CACHE_DIR``;
- FlashInfer ``flashinfer/jit/env.py``: ``FLASHINFER_WORKSPACE_BASE`` (it appends
  ``.cache/flashinfer/<arch>``);
- SGLang ``srt/layers/deep_gemm_wrapper/compile_utils.py``: DeepGEMM's JIT cache from
  ``SGLANG_DG_CACHE_DIR`` (``SGL_DG_CACHE_DIR`` before the rename);
- the CUDA driver's PTX JIT cache: ``CUDA_CACHE_PATH``.

The engine-specific names are :data:`ENGINE_VARS` (one line per engine).
"""

from __future__ import annotations

from k2fleet.planning.host_archive import host_argv
from k2fleet.planning.processes import Plan

CACHE_ROOT = "/var/cache/k2fleet/engine-cache"
ARCHIVE_DIR = "/var/cache/k2fleet/engine-cache-archive"  # the bundle's archive on a host (k2_bundle)
# every engine: subdirectory of the engine's cache directory per variable
COMMON_VARS = {
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
    "CUDA_CACHE_PATH": "cuda",
}
ENGINE_VARS: dict[str, dict[str, str]] = {
    "vllm": {"VLLM_CACHE_ROOT": "vllm"},
    "sglang": {"SGLANG_DG_CACHE_DIR": "deep_gemm", "SGL_DG_CACHE_DIR": "deep_gemm"},
}


def cache_dir(engine: str, root: str = CACHE_ROOT) -> str:
    """The host directory that holds ``engine``'s caches.

    >>> cache_dir("vllm")
    '/var/cache/k2fleet/engine-cache/vllm'
    """
    return f"{root}/{engine}"


def cache_env(engine: str, root: str = CACHE_ROOT) -> dict[str, str]:
    """The environment that points ``engine``'s compile and JIT caches under :func:`cache_dir`.

    >>> cache_env("vllm")["VLLM_CACHE_ROOT"], cache_env("vllm")["TRITON_CACHE_DIR"]
    ('/var/cache/k2fleet/engine-cache/vllm/vllm', '/var/cache/k2fleet/engine-cache/vllm/triton')
    >>> "VLLM_CACHE_ROOT" in cache_env("sglang")
    False
    """
    base = cache_dir(engine, root)
    names = COMMON_VARS | ENGINE_VARS.get(engine, {})
    return {var: f"{base}/{sub}" for var, sub in sorted(names.items())}


def cache_subdirs(engine: str) -> frozenset[str]:
    """The entries of :func:`cache_dir` the engine's variables point at (what a warmed copy holds).

    >>> sorted(cache_subdirs("sglang"))
    ['cuda', 'deep_gemm', 'flashinfer', 'inductor', 'triton']
    """
    return frozenset(COMMON_VARS.values()) | frozenset(ENGINE_VARS.get(engine, {}).values())


def cache_dir_of(env: dict[str, str]) -> str | None:
    """The cache directory ``env`` points the engine at (None: the process keeps no engine cache).

    >>> cache_dir_of(cache_env("sglang")), cache_dir_of({"PYTHONUNBUFFERED": "1"})
    ('/var/cache/k2fleet/engine-cache/sglang', None)
    """
    path = env.get("TRITON_CACHE_DIR", "")
    if not path.startswith(CACHE_ROOT + "/"):
        return None
    return path.rsplit("/", 1)[0]


def make_dir_argv(path: str) -> list[str]:
    """The unit's ``ExecStartPre``: the cache root and ``path`` exist, root-only (``install -d``
    also resets the mode and owner of a directory that was there)."""
    return ["/usr/bin/install", "-d", "-m", "0700", "-o", "root", "-g", "root", CACHE_ROOT, path]


def archive_path(engine: str) -> str:
    """Where a host keeps the bundle's archive of ``engine``'s cache (outside the cache root:
    ``k2fleet down`` removes it, keeps the caches).

    >>> archive_path("vllm")
    '/var/cache/k2fleet/engine-cache-archive/vllm.tar.gz'
    """
    return f"{ARCHIVE_DIR}/{engine}.tar.gz"


def unpack_argv(engine: str, sha256: str) -> list[str]:
    """The host program that unpacks the bundle's archive (:func:`archive_path`) into
    :func:`cache_dir` when that is absent or empty, after checking the archive's sha256 is
    ``sha256`` (the bundle lock's): :mod:`k2fleet.hostprogs.cache_archive`."""
    return host_argv("cache_archive", "unpack", archive_path(engine), sha256, cache_dir(engine))


def add_cache_dirs(plan: Plan) -> None:
    """Every service whose environment points at an engine cache makes that directory, root-only,
    before anything else it runs before its start (the first ``pre_start``)."""
    for _, svc in plan.services():
        path = cache_dir_of(svc.env)
        if path and make_dir_argv(path) not in svc.pre_start:
            svc.pre_start.insert(0, make_dir_argv(path))
