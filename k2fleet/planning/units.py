"""systemd units and environment files for planned services (pure rendering)."""

from __future__ import annotations

from k2fleet.planning import api_front, instance_watch, load_balancer
from k2fleet.planning.deployment import Deployment, WeightSet
from k2fleet.planning.host_archive import host_argv
from k2fleet.planning.processes import Service
from k2fleet.planning.render.common import DOCKER
from k2fleet.planning.quoting import env_file_line, systemd_exec, systemd_value

UNIT_DIR = "/etc/systemd/system"
CONTAINER_STOP_S = 30


def unit_name(svc: Service) -> str:
    return f"{svc.name}.service"


def unit_path(svc: Service) -> str:
    return f"{UNIT_DIR}/{unit_name(svc)}"


def env_path(dep: Deployment, svc: Service) -> str:
    return f"{dep.s.config_dir}/env/{svc.name}.env"


def api_key_paths(dep: Deployment) -> tuple[str, str]:
    """(the key alone, for the health gate's ``--api-key-file``; the env file the unit reads)
    of ``k2_api_key_file`` on hosts: both root-only (0600), written by the services role."""
    return f"{dep.s.config_dir}/api-key", f"{dep.s.config_dir}/env/api-key.env"


def holds_api_key(dep: Deployment, svc: Service) -> bool:
    """``svc`` reads the key (and restarts when it changes): under vLLM a service that serves
    the API (``EnvironmentFile=``), under the other engines the API front
    (:mod:`k2fleet.planning.api_front`, its pattern file); ranks, Ray, sshd nodes and the
    fronted engines themselves do not get it (nor vLLM's TLS-only front: vLLM checks the key)."""
    if dep.s.api_key_file is None:
        return False
    if api_front.checks_key(dep):
        return svc.name == api_front.FRONT
    return svc.health is not None and svc.name != api_front.FRONT


def sends_api_key(dep: Deployment, svc: Service) -> bool:
    """The health gate of ``svc`` sends the key (it calls the engine, or its front)."""
    return dep.s.api_key_file is not None and svc.health is not None


def env_file(svc: Service) -> str:
    return "\n".join(env_file_line(key, svc.env[key]) for key in sorted(svc.env)) + "\n"


def gate_argv(ws: WeightSet) -> list[str]:
    """The checkpoint gate of one weight set: a stat-fast re-verify against the verified
    marker, of a manifest of the pinned repository, revision and (once the control machine
    pinned it) manifest digest only."""
    return host_argv("verify", "--repo", ws.repo, "--revision", ws.revision, *pin_args(ws), ws.path)


def pin_args(ws: WeightSet) -> list[str]:
    """``--manifest-digest D`` of a weight set whose manifest the control machine pinned ([] before)."""
    return ["--manifest-digest", ws.manifest_sha256] if ws.manifest_sha256 else []


def container_name(svc: Service) -> str | None:
    """The ``--name`` of the container ``svc`` runs in the foreground (None: not a container).

    >>> container_name(Service("k2-vllm", ["/usr/bin/docker", "run", "--rm", "--name", "k2-vllm", "img"]))
    'k2-vllm'
    """
    argv = svc.argv
    if len(argv) > 2 and argv[0] == DOCKER and argv[1] == "run" and "--name" in argv:
        return argv[argv.index("--name") + 1]
    return None


def image_pin_argv(image: str, image_id: str) -> list[str]:
    """Exit 0 only when Docker's ``image`` reference is ``image_id`` (:mod:`k2fleet.hostprogs.image_pin`)."""
    return host_argv("image_pin", image, image_id)


def container_lines(svc: Service, image: str | None, image_id: str | None) -> tuple[list[str], list[str]]:
    """(lines before ExecStart, lines after) of a container unit: a container left by a
    crash is removed before start, the image reference must be the pinned image ID, and
    stop/restart stops and removes the container (``docker run --rm`` is in the foreground:
    systemd's SIGTERM to the client alone could leave it running)."""
    name = container_name(svc)
    if name is None:
        return [], []
    pre = [f"ExecStartPre=-{systemd_exec([DOCKER, 'rm', '--force', name])}"]
    if image and image_id:
        pre.append(f"ExecStartPre={systemd_exec(image_pin_argv(image, image_id))}")
    post = [f"ExecStop={systemd_exec([DOCKER, 'stop', '--time', str(CONTAINER_STOP_S), name])}",
            f"ExecStopPost=-{systemd_exec([DOCKER, 'rm', '--force', name])}"]
    return pre, post


def unit_file(dep: Deployment, svc: Service, image_id: str | None = None) -> str:
    """The unit of ``svc``; ``image_id``: the image ID a container service's image
    reference is pinned to (the unit refuses to start any other)."""
    if svc.name == api_front.FRONT:
        return api_front.unit_file(dep, svc, env_path(dep, svc))
    if svc.name == load_balancer.LB:
        return api_front.unit_file(dep, svc, env_path(dep, svc), load_balancer.config_path(dep), load_balancer.RUNTIME_DIR)
    after = ["network-online.target"]
    after += dep.engine_impl.after_units  # TensorRT-LLM: the mesh sshd mpirun logs in through
    pre, post = container_lines(svc, dep.image, image_id)
    if pre:
        after.append("docker.service")
    lines = [
        "# Rendered by k2fleet from the fleet plan; edits are overwritten.",
        "[Unit]",
        f"Description={systemd_value(f'k2fleet: {svc.description or svc.name}')}",
        f"After={' '.join(after)}",
        "Wants=network-online.target",
        *(["Requires=docker.service"] if pre else []),
        *([f"Conflicts={' '.join(svc.conflicts)}"] if svc.conflicts else []),
        "",
        "[Service]",
        f"Type={'oneshot' if svc.oneshot else 'simple'}",
        f"EnvironmentFile={systemd_value(env_path(dep, svc), path=True)}",
    ]
    if holds_api_key(dep, svc) and dep.engine_impl.api_key_env:  # the key's own root-only file: never in the plan's env, argv or this unit
        lines.append(f"EnvironmentFile={systemd_value(api_key_paths(dep)[1], path=True)}")
    if svc.oneshot:
        lines.append("RemainAfterExit=yes")
    if svc.needs_checkpoint:
        lines += [f"ExecStartPre={systemd_exec(gate_argv(ws))}" for ws in dep.weight_sets]
    lines += pre
    lines += [f"ExecStartPre={systemd_exec(argv)}" for argv in svc.pre_start]
    lines.append(f"ExecStart={systemd_exec(svc.argv)}")
    lines += post
    if svc.workdir:
        lines.append(f"WorkingDirectory={systemd_value(svc.workdir, path=True)}")
    if instance_watch.watched(svc):
        lines += instance_watch.unit_lines(svc)
    if not svc.oneshot:
        lines += ["Restart=on-failure", "RestartSec=5"]
    if not dep.s.simulated_gpus:
        lines += ["LimitMEMLOCK=infinity", "LimitNOFILE=1048576", "LimitSTACK=67108864"]
    lines += ["TimeoutStartSec=900", "", "[Install]", "WantedBy=multi-user.target", ""]
    return "\n".join(lines)
