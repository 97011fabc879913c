"""systemd units and environment files for planned services (pure rendering)."""

from __future__ import annotations

from k2fleet.deployment import Deployment
from k2fleet.plan import Service
from k2fleet.quoting import env_file_line, systemd_exec, systemd_value

UNIT_DIR = "/etc/systemd/system"
LIB_DIR = "/opt/k2fleet/lib"
RAY_GATE = f"{LIB_DIR}/k2fleet-ray-gate.py"


def unit_name(svc: Service) -> str:
    return f"{svc.name}.service"


def unit_path(svc: Service) -> str:
    return f"{UNIT_DIR}/{unit_name(svc)}"


def env_path(dep: Deployment, svc: Service) -> str:
    return f"{dep.s.config_dir}/env/{svc.name}.env"


def env_file(svc: Service) -> str:
    return "\n".join(env_file_line(key, svc.env[key]) for key in sorted(svc.env)) + "\n"


def gate_argv(dep: Deployment) -> list[str]:
    """The checkpoint gate: a stat-fast re-verify against the verified marker."""
    return ["/usr/bin/python3", f"{LIB_DIR}/verify.py", dep.checkpoint_path]


def unit_file(dep: Deployment, svc: Service) -> str:
    after = ["network-online.target"]
    if dep.engine == "trtllm":
        after.append("k2-mesh-sshd.service")
    lines = [
        "# Rendered by k2fleet from the fleet plan; edits are overwritten.",
        "[Unit]",
        f"Description={systemd_value(f'k2fleet: {svc.description or svc.name}')}",
        f"After={' '.join(after)}",
        "Wants=network-online.target",
        "",
        "[Service]",
        f"Type={'oneshot' if svc.oneshot else 'simple'}",
        f"EnvironmentFile={systemd_value(env_path(dep, svc), path=True)}",
    ]
    if svc.oneshot:
        lines.append("RemainAfterExit=yes")
    if svc.needs_checkpoint:
        lines.append(f"ExecStartPre={systemd_exec(gate_argv(dep))}")
    lines += [f"ExecStartPre={systemd_exec(argv)}" for argv in svc.pre_start]
    lines.append(f"ExecStart={systemd_exec(svc.argv)}")
    if svc.workdir:
        lines.append(f"WorkingDirectory={systemd_value(svc.workdir, path=True)}")
    if not svc.oneshot:
        lines += ["Restart=on-failure", "RestartSec=5"]
    if not dep.s.simulated_gpus:
        lines += ["LimitMEMLOCK=infinity", "LimitNOFILE=1048576", "LimitSTACK=67108864"]
    lines += ["TimeoutStartSec=900", "", "[Install]", "WantedBy=multi-user.target", ""]
    return "\n".join(lines)
