"""vLLM: one replica per node, TP×PP across nodes (Ray or ``--nnodes``), DP+EP with
headless ranks, decode context parallel; CUDA venv or container, ROCm container.

Flag names are vLLM 0.33's (``vllm serve --help``); ``k2_engine_args`` renamed since
older pins are translated by the engine's ``renamed_flags`` (:meth:`~k2fleet.planning.engines.base.Engine.flag_words`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from k2fleet.planning.processes import Health, Service
from k2fleet.planning.catalog import version_tuple
from k2fleet.planning.render.common import container_argv, engine_env, extra_flags, pool_engine_args, venv_bin
from k2fleet.inventory.spec import HostEntry
from k2fleet.planning.host_archive import host_argv

if TYPE_CHECKING:
    from k2fleet.planning.deployment import Deployment, Pool

UNIT = "k2-vllm"
# The flags this renderer emits and so owns: flag -> the inventory key that sets it ("": none);
# k2_engine_args may not set them (k2fleet.planning.engine_flags checks).
OWNED_FLAGS = {
    "--tensor-parallel-size": "k2_tp", "-tp": "k2_tp",
    "--pipeline-parallel-size": "k2_pp", "-pp": "k2_pp",
    "--data-parallel-size": "k2_dp", "-dp": "k2_dp",
    "--data-parallel-size-local": "k2_dp", "-dpl": "k2_dp",
    "--data-parallel-address": "k2_dp", "-dpa": "k2_dp",
    "--data-parallel-rpc-port": "k2_dp_rpc_port", "-dpp": "k2_dp_rpc_port",
    "--data-parallel-start-rank": "k2_dp", "-dpr": "k2_dp",
    "--decode-context-parallel-size": "k2_dcp", "-dcp": "k2_dcp",
    "--enable-expert-parallel": "k2_ep", "-ep": "k2_ep",
    "--headless": "k2_multinode_backend", "--nnodes": "k2_multinode_backend",
    "--node-rank": "k2_multinode_backend", "--master-addr": "k2_multinode_backend",
    "--master-port": "k2_master_port", "--distributed-executor-backend": "k2_multinode_backend",
    "--port": "k2_port", "--host": "", "--model": "k2_model",
    "--served-model-name": "k2_served_model_name",
    "--api-key": "k2_api_key_file",  # a secret: never in argv (VLLM_API_KEY from a root-only env file)
    "--trust-remote-code": "", "--all2all-backend": "k2_moe_a2a_backend",
}
# vLLM 0.33.0 takes the all-to-all backend as --all2all-backend (vllm/engine/arg_utils.py, ParallelConfig);
# 0.10.0 and 0.11.0 only from the environment (vllm/envs.py VLLM_ALL2ALL_BACKEND; their flag tables have no
# --all2all-backend). k2fleet supports no pin between 0.11.0 and 0.33.0, so any version after 0.11 gets the flag.
ALL2ALL_FLAG_SINCE = (0, 12, 0)
ALL2ALL_ENV = "VLLM_ALL2ALL_BACKEND"


def keyed_flags(dep: Deployment, pool: Pool) -> dict[str, str]:
    """Flags this renderer emits for ``pool`` only when an inventory key asks (flag -> the key);
    ``k2_engine_args`` may set them when k2fleet does not (the owned flags are refused always)."""
    s = pool.settings
    out: dict[str, str] = {}
    if dep.s.max_model_len:
        out["--max-model-len"] = "k2_max_model_len"
    if s.gpu_memory_utilization:
        out["--gpu-memory-utilization"] = "k2_gpu_memory_utilization"
    if dep.tool_parser:
        out["--tool-call-parser"] = "k2_tool_parser"
        if dep.s.auto_tool_choice:
            out["--enable-auto-tool-choice"] = "k2_auto_tool_choice"
    if dep.reasoning_parser:
        out["--reasoning-parser"] = "k2_reasoning_parser"
    if dep.platform == "rocm":
        out["--no-enable-prefix-caching"] = "k2_platform"
        out["--enable-prefix-caching"] = "k2_platform"
    return out


def host_port(address: str, port: int) -> str:
    """``HOST:PORT`` for Ray's ``--address`` (an IPv6 address bracketed)."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _a2a_env(dep: Deployment, pool: Pool) -> dict[str, str]:
    backend = pool.settings.moe_a2a_backend
    if backend and pool.ep > 1 and version_tuple(dep.version) < ALL2ALL_FLAG_SINCE:
        return {ALL2ALL_ENV: backend}
    return {}
RAY_GATE_MAX_S = 600  # a worker that has not joined in 10 minutes will not (its unit restarts every 5 s)


def _ray_gate(dep: Deployment, nodes: tuple[HostEntry, ...]) -> list[str]:
    """Before ``vllm serve`` drives the cluster: every planned node alive in Ray with its
    GPUs, asked with the venv's Ray (fails naming the node that never joined)."""
    argv = host_argv("raygate", "--address", host_port(nodes[0].address, dep.s.ray_port), "--unit", f"{UNIT}.service",
                     "--timeout", str(min(dep.s.health_timeout, RAY_GATE_MAX_S)), python=venv_bin(dep, "python3"))
    for host in nodes:
        argv += ["--node", f"{host.name}={host.address}:{dep.gpus_per_node}"]
    return argv


def _serve_words(dep: Deployment, pool: Pool) -> list[str]:
    s = pool.settings
    words = [dep.serve_path, "--served-model-name", dep.served_model_name, "--trust-remote-code"]
    words += ["--host", "0.0.0.0", "--port", str(dep.s.port)]
    words += ["--tensor-parallel-size", str(pool.tp)]
    if pool.pp > 1:
        words += ["--pipeline-parallel-size", str(pool.pp)]
    if pool.dcp > 1:
        words += ["--decode-context-parallel-size", str(pool.dcp)]
    if pool.ep > 1:
        words += ["--enable-expert-parallel"]
        if s.moe_a2a_backend and version_tuple(dep.version) >= ALL2ALL_FLAG_SINCE:
            words += ["--all2all-backend", s.moe_a2a_backend]
    if dep.s.max_model_len:
        words += ["--max-model-len", str(dep.s.max_model_len)]
    if s.gpu_memory_utilization:
        words += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
    if dep.tool_parser:
        if dep.s.auto_tool_choice:
            words += ["--enable-auto-tool-choice"]
        words += ["--tool-call-parser", dep.tool_parser]
    if dep.reasoning_parser:
        words += ["--reasoning-parser", dep.reasoning_parser]
    if dep.platform == "rocm":
        words += ["--no-enable-prefix-caching"]
    words += list(dep.model_args)  # the model's own deployment flags (K2.5/K2.6: --mm-encoder-tp-mode data)
    return words + extra_flags(dep, pool_engine_args(dep, s))


def _platform_env(dep: Deployment) -> dict[str, str]:
    if dep.platform == "rocm":
        return {"SAFETENSORS_FAST_GPU": "1", "VLLM_ROCM_USE_AITER": "1"}
    return {}


def _command(dep: Deployment, words: list[str], env: dict[str, str], name: str) -> list[str]:
    if dep.runtime == "container":
        secret = [str(dep.engine_impl.api_key_env)] if dep.s.api_key_file else []
        return container_argv(dep, name, ["serve", *words], env, entrypoint="vllm", secret_env=secret,
                              **_ray_container_files(env))
    return [venv_bin(dep, "vllm"), "serve", *words]


def _service(dep: Deployment, pool: Pool, host: HostEntry, rank: int, words: list[str], env: dict[str, str], **kw) -> Service:
    return Service(
        name=kw.pop("name", UNIT),
        argv=_command(dep, words, env, kw.pop("container", UNIT)),
        env=env,
        rank=rank,
        role=pool.role,
        **kw,
    )


RAY_TOKEN = "/etc/k2fleet/ray/auth_token"  # the deployment's Ray token (root-only; made by the control step)
# Ray's token authentication (ray 2.60: ray/_private/authentication/authentication_token_setup.py,
# RAY_AUTH_MODE=token; the token from RAY_AUTH_TOKEN_PATH): every GCS/raylet/dashboard call
# needs it, so a peer that reaches Ray's ports cannot join the cluster or submit work.
RAY_AUTH_ENV = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": RAY_TOKEN}


# Ray's temporary root (its session directories: the raylet's and object store's sockets, the
# current cluster's address, logs). Not the shared /tmp/ray: any local user can make /tmp/ray
# first (Ray then uses theirs) or read and connect to the sockets Ray leaves there (Ray makes
# its temp dir 0777 for sharing). Under RAY_ROOT, a directory only root may enter (0700, made
# by each Ray unit before it starts), what Ray opens inside is out of other users' reach.
# ``RAY_TMPDIR`` (ray._private.utils.get_user_temp_dir) puts every Ray process's temp dir at
# RAY_ROOT/ray; the head's ``--temp-dir`` says so explicitly (worker nodes take the head's). In
# the container runtime the Ray head/worker and the vLLM driver are separate containers of one
# host: they share it from the host, as processes of a venv host do.
RAY_ROOT = "/var/lib/k2fleet/ray"
RAY_SESSION_DIR = f"{RAY_ROOT}/ray"
RAY_DIR_ARGV = ["/usr/bin/install", "-d", "-m", "0700", "-o", "root", "-g", "root", RAY_ROOT]


def _ray_auth(dep: Deployment) -> dict[str, str]:
    """Ray's token authentication and temp root, venv and container runtimes alike: names and
    paths only (a container gets the token file bound read-only, :func:`_ray_container_files`)."""
    return dict(RAY_AUTH_ENV) | {"RAY_TMPDIR": RAY_ROOT}


def _ray_container_files(env: dict[str, str]) -> dict[str, list[str]]:
    """A Ray process's container (head, worker, or the vLLM driver of a Ray cluster): the
    token file bound read-only at its path and Ray's session directory shared; nothing for
    a container that does not use Ray (no ``RAY_AUTH_TOKEN_PATH`` in its env)."""
    if "RAY_AUTH_TOKEN_PATH" not in env:
        return {}
    return {"mounts": [env["RAY_AUTH_TOKEN_PATH"]], "shared": [RAY_ROOT]}


def _ray_services(dep: Deployment, pool: Pool, nodes: tuple[HostEntry, ...]) -> Iterator[tuple[str, Service]]:
    head = nodes[0]
    for rank, host in enumerate(nodes):
        env = engine_env(dep, host, pool.settings.env) | {"VLLM_HOST_IP": host.address} | _ray_auth(dep)
        common = ["--node-ip-address", host.address, "--num-gpus", str(dep.gpus_per_node), "--block"]
        if rank == 0:
            words = ["start", "--head", "--port", str(dep.s.ray_port), "--temp-dir", RAY_SESSION_DIR, *common]
        else:
            words = ["start", "--address", host_port(head.address, dep.s.ray_port), *common]
        if dep.runtime == "container":  # the engine image's Ray, in the foreground under systemd
            argv = container_argv(dep, "k2-ray", words, env, entrypoint="ray", **_ray_container_files(env))
        else:
            argv = [venv_bin(dep, "ray"), *words]
        yield host.name, Service(
            name="k2-ray",
            argv=argv,
            env=env,
            ports={"k2_ray_port": dep.s.ray_port} if rank == 0 else {},
            stage=0 if rank == 0 else 1,
            rank=rank,
            role=pool.role,
            needs_checkpoint=False,
            pre_start=[list(RAY_DIR_ARGV)],
            description=f"Ray {'head' if rank == 0 else 'worker'} for vLLM TP×PP across nodes",
        )
    env = (engine_env(dep, head, pool.settings.env) | {"VLLM_HOST_IP": head.address} | _platform_env(dep) | _ray_auth(dep)
           | _a2a_env(dep, pool))
    env["RAY_ADDRESS"] = f"{head.address}:{dep.s.ray_port}"  # the cluster's GCS, not whatever /tmp/ray names
    words = _serve_words(dep, pool) + ["--distributed-executor-backend", "ray"]
    yield head.name, _service(
        dep, pool, head, 0, words, env,
        ports={"k2_port": dep.s.port}, stage=2, health=Health(dep.s.port),
        description="vLLM API server driving the Ray cluster",
        pre_start=[list(RAY_DIR_ARGV), *([_ray_gate(dep, nodes)] if dep.runtime == "venv" else [])],
    )


def _dp_services(dep: Deployment, pool: Pool, nodes: tuple[HostEntry, ...]) -> Iterator[tuple[str, Service]]:
    s = pool.settings
    head = nodes[0]
    local = dep.gpus_per_node // (pool.tp * pool.pp)
    for rank, host in enumerate(nodes):
        env = engine_env(dep, host, s.env) | {"VLLM_HOST_IP": host.address} | _platform_env(dep) | _a2a_env(dep, pool)
        words = _serve_words(dep, pool)
        words += ["--data-parallel-size", str(pool.dp), "--data-parallel-size-local", str(local)]
        if len(nodes) > 1:
            words += ["--data-parallel-address", head.address, "--data-parallel-rpc-port", str(dep.s.dp_rpc_port)]
        if rank == 0:
            ports = {"k2_port": dep.s.port} | ({"k2_dp_rpc_port": dep.s.dp_rpc_port} if len(nodes) > 1 else {})
            yield host.name, _service(
                dep, pool, host, 0, words, env, ports=ports, stage=0, health=Health(dep.s.port),
                description=f"vLLM DP head: ranks 0-{local - 1} of {pool.dp} and the API server",
            )
        else:
            start = rank * local
            words = [words[0], "--headless", "--data-parallel-start-rank", str(start), *words[1:]]
            yield host.name, _service(
                dep, pool, host, rank, words, env, stage=1,
                description=f"vLLM headless DP ranks {start}-{start + local - 1} of {pool.dp}",
            )


def _multinode_services(dep: Deployment, pool: Pool, nodes: tuple[HostEntry, ...]) -> Iterator[tuple[str, Service]]:
    head = nodes[0]
    for rank, host in enumerate(nodes):
        env = engine_env(dep, host, pool.settings.env) | {"VLLM_HOST_IP": host.address} | _platform_env(dep) | _a2a_env(dep, pool)
        words = _serve_words(dep, pool)
        words += ["--nnodes", str(len(nodes)), "--node-rank", str(rank)]
        words += ["--master-addr", head.address, "--master-port", str(dep.s.master_port)]
        if rank == 0:
            yield host.name, _service(
                dep, pool, host, 0, words, env,
                ports={"k2_port": dep.s.port, "k2_master_port": dep.s.master_port},
                stage=0, health=Health(dep.s.port),
                description=f"vLLM node 0 of {len(nodes)} (API server)",
            )
        else:
            words = [words[0], "--headless", *words[1:]]
            yield host.name, _service(
                dep, pool, host, rank, words, env, stage=1,
                description=f"vLLM headless node {rank} of {len(nodes)}",
            )


def render(dep: Deployment) -> Iterator[tuple[str, Service]]:
    for pool in dep.pools.values():
        for nodes in pool.instances:
            s = pool.settings
            if pool.dp > 1:
                yield from _dp_services(dep, pool, nodes)
            elif len(nodes) == 1:
                host = nodes[0]
                env = engine_env(dep, host, s.env) | _platform_env(dep) | _a2a_env(dep, pool)
                yield host.name, _service(
                    dep, pool, host, 0, _serve_words(dep, pool), env,
                    ports={"k2_port": dep.s.port}, stage=0, health=Health(dep.s.port),
                    description=f"vLLM replica, TP{pool.tp}" + (f"×PP{pool.pp}" if pool.pp > 1 else ""),
                )
            elif dep.engine_impl.needs_ray(pool):
                yield from _ray_services(dep, pool, nodes)
            else:
                yield from _multinode_services(dep, pool, nodes)
