"""TensorRT-LLM: ``trtllm-serve`` in the release container with an extra LLM API
options YAML (``--config``); multi-node through ``mpirun`` over k2fleet's SSH mesh on
``k2_mesh_port``; the SLURM disaggregated wide-EP ``config.yaml`` for ``submit.py``.

The YAML keys are TRT-LLM 1.2's ``LlmArgs`` (extra fields are rejected there, so the
renamed ``cuda_graph_config.padding_enabled`` is written as ``enable_padding``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import yaml

from k2fleet.planning.mesh_config import UNIT as MESH_UNIT
from k2fleet.planning.mesh_config import mesh_dir
from k2fleet.planning.processes import Health, Service
from k2fleet.planning.render.common import container_argv, engine_env, extra_flags, venv_bin
from k2fleet.inventory.spec import HostEntry

if TYPE_CHECKING:
    from k2fleet.planning.deployment import Deployment, Pool

RENAMED_KEYS = {("cuda_graph_config", "padding_enabled"): "enable_padding"}
# The flags this renderer emits and so owns: flag -> the inventory key that sets it ("": none).
OWNED_FLAGS = {
    "--tp_size": "k2_tp", "--pp_size": "k2_pp", "--ep_size": "k2_ep",
    "--host": "", "--port": "k2_port", "--config": "k2_trtllm_config",
    "--extra_llm_api_options": "k2_trtllm_config",
}


def keyed_flags(dep: Deployment, pool: Pool) -> dict[str, str]:
    """Flags this renderer emits for ``pool`` only when an inventory key asks (flag -> the key)."""
    out: dict[str, str] = {}
    if dep.tool_parser:
        out["--tool_parser"] = "k2_tool_parser"
    if dep.s.reasoning_parser:
        out["--reasoning_parser"] = "k2_reasoning_parser"
    return out
# The LLM API YAML keys it sets (api_options) -> the inventory key.
LLM_API_OWNED = {
    "tensor_parallel_size": "k2_tp", "pipeline_parallel_size": "k2_pp",
    "moe_expert_parallel_size": "k2_ep", "enable_attention_dp": "k2_attn_dp",
}


def mesh_paths(dep: Deployment) -> dict[str, str]:
    """Where the mesh role puts the deployment key and pinned known_hosts."""
    base = mesh_dir(dep)
    return {"key": f"{base}/id_ed25519", "known_hosts": f"{base}/known_hosts", "sshd_config": f"{base}/sshd_config"}


def _translate(options: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(options)
    for (section, old), new in RENAMED_KEYS.items():
        sub = out.get(section)
        if isinstance(sub, dict) and old in sub:
            sub[new] = sub.pop(old)
    return out


def api_options(dep: Deployment, pool: Pool) -> dict[str, Any]:
    """The extra LLM API options: the inventory's ``k2_trtllm_config`` over k2fleet's keys."""
    s = pool.settings
    base: dict[str, Any] = {
        "tensor_parallel_size": pool.tp,
        "pipeline_parallel_size": pool.pp,
        "moe_expert_parallel_size": pool.ep,
        "enable_attention_dp": s.attn_dp,
        "trust_remote_code": True,
    }
    if dep.s.max_model_len:
        base["max_seq_len"] = dep.s.max_model_len
    return base | dep.engine_impl.merged_llm_api(dep.version, dep.s.profile, _translate(s.trtllm_config))


def dump_yaml(data: dict[str, Any]) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def _serve_words(dep: Deployment, pool: Pool, config_path: str, cli_parallel: bool) -> list[str]:
    s = pool.settings
    words = ["serve", dep.serve_path, "--host", "0.0.0.0", "--port", str(dep.s.port)]
    if cli_parallel:
        words += ["--tp_size", str(pool.tp), "--ep_size", str(pool.ep)]
        if pool.pp > 1:
            words += ["--pp_size", str(pool.pp)]
    words += ["--config", config_path]
    if dep.tool_parser:
        words += ["--tool_parser", dep.tool_parser]
    if dep.s.reasoning_parser:  # only when set explicitly: 1.2's parser list is version-bound
        words += ["--reasoning_parser", dep.s.reasoning_parser]
    return words + extra_flags(dep, s.engine_args, dash="_")


def _single_node(dep: Deployment, pool: Pool, host: HostEntry, config_path: str, files: dict[str, str]) -> Service:
    env = engine_env(dep, host, pool.settings.env)
    words = _serve_words(dep, pool, config_path, cli_parallel=False)
    if dep.runtime == "container":
        argv = container_argv(dep, "k2-trtllm", ["trtllm-serve", *words], env, mounts=[f"{dep.s.config_dir}/trtllm"])
    else:
        argv = [venv_bin(dep, "trtllm-serve"), *words]
    return Service(
        name="k2-trtllm", argv=argv, env=env, files=files, ports={"k2_port": dep.s.port},
        role=pool.role, health=Health(dep.s.port),
        description=f"trtllm-serve, TP{pool.tp} EP{pool.ep}",
    )


def mpirun_words(dep: Deployment, nodes: tuple[HostEntry, ...], env: dict[str, str]) -> list[str]:
    """``mpirun`` over the mesh: deployment key, pinned known_hosts, port ``k2_mesh_port``."""
    mesh = mesh_paths(dep)
    per = dep.gpus_per_node
    rsh = (
        f"-p {dep.s.mesh_port} -i {mesh['key']} -o IdentitiesOnly=yes "
        f"-o UserKnownHostsFile={mesh['known_hosts']} -o StrictHostKeyChecking=yes -o BatchMode=yes"
    )
    words = ["mpirun", "--allow-run-as-root", "-np", str(per * len(nodes))]
    words += ["-H", ",".join(f"{h.address}:{per}" for h in nodes)]
    # no tree spawn: only the head logs into the rank hosts (only it holds a mesh key)
    words += ["-mca", "plm_rsh_args", rsh, "-mca", "plm_rsh_agent", "ssh", "-mca", "plm_rsh_no_tree_spawn", "1"]
    if nodes[0].settings.nic:
        words += ["-mca", "btl_tcp_if_include", nodes[0].settings.nic, "-mca", "oob_tcp_if_include", nodes[0].settings.nic]
    for key in sorted(env):
        words += ["-x", key]
    return words


def _multi_node(dep: Deployment, pool: Pool, nodes: tuple[HostEntry, ...], config_path: str, files: dict[str, str]) -> Iterator[tuple[str, Service]]:
    head = nodes[0]
    env = engine_env(dep, head, pool.settings.env)
    words = _serve_words(dep, pool, config_path, cli_parallel=True)
    if dep.runtime == "container":
        # Seed: sshd on the mesh port inside each container, mpirun across them. With host
        # networking that is the host's mesh port: the host's mesh sshd (checkpoint fan-out
        # before the engine) yields it to the container's, which runs the mesh's own
        # sshd_config, keys and known_hosts (the same host key, so the pins hold).
        mesh = mesh_paths(dep)
        for rank, host in enumerate(nodes):
            node_env = engine_env(dep, host, pool.settings.env)
            sshd = ["/usr/sbin/sshd", "-D", "-e", "-f", mesh["sshd_config"]]
            yield host.name, Service(
                name="k2-trtllm-node",
                argv=container_argv(dep, "k2-trtllm-node", sshd, node_env, mounts=[f"{dep.s.config_dir}/trtllm", f"{dep.s.config_dir}/mesh"]),
                env=node_env, files=files, stage=0, rank=rank, role=pool.role, conflicts=(MESH_UNIT,),
                description="TRT-LLM container holding the GPUs; its sshd on the mesh port lets mpirun in",
            )
        launch = ["/usr/bin/docker", "exec"] + [w for k in sorted(env) for w in ("-e", k)] + ["k2-trtllm-node"]
        argv = launch + mpirun_words(dep, nodes, env) + ["trtllm-llmapi-launch", "trtllm-serve", *words]
    else:
        argv = mpirun_words(dep, nodes, env) + [venv_bin(dep, "trtllm-llmapi-launch"), venv_bin(dep, "trtllm-serve"), *words]
        argv[0] = "/usr/bin/mpirun"
        for host in nodes[1:]:  # every rank reads the options YAML
            yield host.name, files
    yield head.name, Service(
        name="k2-trtllm", argv=argv, env=env, files=files, ports={"k2_port": dep.s.port},
        stage=1, role=pool.role, health=Health(dep.s.port), ssh_to=tuple(h.name for h in nodes[1:]),
        description=f"mpirun of trtllm-serve over {len(nodes)} nodes (TP{pool.tp} EP{pool.ep})",
    )


def slurm_config(dep: Deployment, pool: Pool) -> dict[str, Any]:
    """``config.yaml`` for ``examples/disaggregated/slurm/benchmark/submit.py``."""
    s = pool.settings
    assert s.slurm is not None and s.disagg is not None
    config = copy.deepcopy(s.slurm)
    config.setdefault("hardware", {}).setdefault("gpus_per_node", dep.gpus_per_node)
    env = config.setdefault("environment", {})
    env.setdefault("model_path", dep.serve_path)
    env.setdefault("container_image", dep.image)
    config["worker_config"] = {side: _translate(s.disagg[side]) for side in ("gen", "ctx")}
    return config


def _slurm_submit(dep: Deployment, pool: Pool) -> Service:
    config = slurm_config(dep, pool)
    path = f"{dep.s.config_dir}/trtllm/slurm/config.yaml"
    repo = config.get("environment", {}).get("trtllm_repo", "/opt/TensorRT-LLM")
    return Service(
        name="k2-trtllm-slurm-submit",
        argv=["/usr/bin/python3", "submit.py", "-c", path],
        files={path: dump_yaml(config)},
        oneshot=True,
        role=pool.role,
        workdir=f"{repo}/examples/disaggregated/slurm/benchmark",
        needs_checkpoint=False,
        description="submits the disaggregated wide-EP job (ctx + gen workers) to SLURM",
    )


def render(dep: Deployment) -> Iterator[tuple[str, Service]]:
    for role, pool in dep.pools.items():
        if role == "slurm-submit":
            yield pool.hosts[0].name, _slurm_submit(dep, pool)
            continue
        config_path = f"{dep.s.config_dir}/trtllm/extra-llm-api-config.yml"
        files = {config_path: dump_yaml(api_options(dep, pool))}
        for nodes in pool.instances:
            if len(nodes) == 1:
                yield nodes[0].name, _single_node(dep, pool, nodes[0], config_path, files)
            else:
                yield from _multi_node(dep, pool, nodes, config_path, files)
