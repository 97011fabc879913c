"""Pieces every engine renderer shares: environment, extra flags, container wrapping."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from k2fleet.planning import engine_cache
from k2fleet.inventory.spec import HostEntry

if TYPE_CHECKING:  # types only: the engines' renderers import this module
    from k2fleet.planning.deployment import Deployment


def extra_flags(dep: Deployment, engine_args: dict[str, Any], dash: str = "-") -> list[str]:
    """``k2_engine_args`` as argv words, each translated for the pin when it was renamed
    (:meth:`~k2fleet.planning.engines.base.Engine.flag_words`)."""
    words: list[str] = []
    for name, value in engine_args.items():
        words += dep.engine_impl.flag_words(dep.version, name, value, dash)
    return words


def pool_engine_args(dep: Deployment, settings: Any) -> dict[str, Any]:
    """A pool's engine flags: ``k2_profile``'s table under its ``k2_engine_args`` (which win)."""
    return dep.engine_impl.merged_args(dep.version, dep.s.profile, settings.engine_args)


def rdma_env(host: HostEntry) -> dict[str, str]:
    """NCCL's and NVSHMEM's (DeepEP's) view of the host's RDMA fabric (``k2_ib_hcas``): the
    HCAs (``NCCL_IB_HCA``, ``NVSHMEM_HCA_LIST``, both ``mlx5_0,mlx5_1:1`` lists), the RoCE GID
    index (``k2_ib_gid_index``: ``NCCL_IB_GID_INDEX``, ``NVSHMEM_IB_GID_INDEX``) and NVSHMEM's
    bootstrap socket on ``k2_nic`` (``NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME``: DeepEP bootstraps NVSHMEM
    by unique ID). ``NVSHMEM_IB_ENABLE_IBGDA`` is not set here: DeepEP's ``Buffer`` sets it (and
    ``NVSHMEM_IBGDA_NIC_HANDLER``) itself when it spans RDMA ranks (deepseek-ai/DeepEP
    ``deep_ep/buffer.py``), overriding the environment. Empty without HCAs."""
    s = host.settings
    if not s.ib_hcas:
        return {}
    hcas = ",".join(s.ib_hcas)
    env = {"NCCL_IB_HCA": hcas, "NVSHMEM_HCA_LIST": hcas}
    if s.ib_gid_index is not None:
        env["NCCL_IB_GID_INDEX"] = env["NVSHMEM_IB_GID_INDEX"] = str(s.ib_gid_index)
    if s.nic:
        env["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] = s.nic
    return env


def engine_env(dep: Deployment, host: HostEntry, pool_env: dict[str, str]) -> dict[str, str]:
    """Environment every engine process gets: sockets on the right NIC, offline Hub, the
    compile and JIT caches in the host's persistent engine cache (:mod:`k2fleet.planning.engine_cache`;
    the pool's ``k2_env`` may point one elsewhere)."""
    env: dict[str, str] = {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    nic = host.settings.nic
    if nic:
        env["NCCL_SOCKET_IFNAME"] = nic
        env["GLOO_SOCKET_IFNAME"] = nic
    env.update(rdma_env(host))
    env.update(engine_cache.cache_env(dep.engine))
    env.update({k: str(v) for k, v in pool_env.items()})
    return env


def venv_bin(dep: Deployment, name: str) -> str:
    return f"{dep.venv}/bin/{name}"


DOCKER = "/usr/bin/docker"  # Debian's docker.io (k2fleet.planning.host_packages installs it where a service runs this)
# --ulimit memlock per GPU kind: unlimited on real GPUs (RDMA/NCCL pin memory). Simulated
# GPUs live on the sandbox machine, whose hard memlock limit is 8 MiB and which has no
# CAP_SYS_RESOURCE to raise it (runc's setrlimit fails), so the sandbox asks for exactly that.
SIMULATED_MEMLOCK = 8 * 2**20
MEMLOCK = {False: "memlock=-1", True: f"memlock={SIMULATED_MEMLOCK}"}


RDMA_DEVICES = "/dev/infiniband"  # uverbs*, rdma_cm, umad*: what libibverbs opens


def rdma_docker_args(simulated: bool) -> list[str]:
    """``docker run`` words for a container that uses the host's HCAs: the verbs devices
    (not on a sandbox host: it has none, its HCAs are TEST DOUBLE sysfs trees) and
    ``IPC_LOCK`` (ibv_reg_mr pins memory; ``--ulimit memlock`` is set for every container).

    >>> rdma_docker_args(False), rdma_docker_args(True)
    (['--device', '/dev/infiniband', '--cap-add', 'IPC_LOCK'], ['--cap-add', 'IPC_LOCK'])
    """
    return ([] if simulated else ["--device", RDMA_DEVICES]) + ["--cap-add", "IPC_LOCK"]


def container_argv(
    dep: Deployment,
    name: str,
    command: list[str],
    env: dict[str, str],
    mounts: Iterable[str] = (),
    entrypoint: str | None = None,
    secret_env: Iterable[str] = (),
    shared: Iterable[str] = (),
) -> list[str]:
    """``docker run`` in the foreground (systemd supervises it), host network and IPC; with
    the host's HCAs in ``env`` (``NCCL_IB_HCA``, from ``k2_ib_hcas``) the RDMA devices and
    ``IPC_LOCK`` (:func:`rdma_docker_args`).
    ``mounts``: host paths bound read-only at the same path (a secret file among them is
    read there by name: its content never reaches argv); ``shared``: host directories bound
    read-write at the same path (state containers of one host share, e.g. Ray's session
    directory; the host's engine cache when ``env`` points there); ``secret_env``: variables passed by name only from the unit's root-only
    ``EnvironmentFile=`` (the API key), never in the plan's env."""
    assert dep.image is not None
    argv = [DOCKER, "run", "--rm", "--name", name, "--network", "host", "--ipc", "host"]
    argv += ["--ulimit", MEMLOCK[dep.s.simulated_gpus], "--ulimit", "stack=67108864"]
    if dep.platform == "rocm":
        argv += ["--device", "/dev/kfd", "--device", "/dev/dri", "--group-add", "video"]
        argv += ["--cap-add", "SYS_PTRACE", "--security-opt", "seccomp=unconfined"]
    elif not dep.s.simulated_gpus:
        argv += ["--gpus", "all"]
    if "NCCL_IB_HCA" in env:  # the host's k2_ib_hcas (rdma_env): verbs devices, pinned memory
        argv += rdma_docker_args(dep.s.simulated_gpus)
    paths = sorted({dep.serve_path, dep.checkpoint_path, *mounts})
    for path in paths:
        argv += ["-v", f"{path}:{path}:ro"]
    cache = engine_cache.cache_dir_of(env)
    for path in sorted({*shared, *([cache] if cache else [])}):
        argv += ["-v", f"{path}:{path}"]
    for key in sorted({*env, *secret_env}):
        argv += ["-e", key]  # value comes from the unit's Environment=, not argv
    if entrypoint:
        argv += ["--entrypoint", entrypoint]
    return argv + [dep.image, *command]
