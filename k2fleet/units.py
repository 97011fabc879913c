"""systemd units and environment files for planned services (pure rendering)."""

from __future__ import annotations

import shlex

from k2fleet.deployment import Deployment
from k2fleet.plan import Service

UNIT_DIR = "/etc/systemd/system"
LIB_DIR = "/opt/k2fleet/lib"


def unit_name(svc: Service) -> str:
    return f"{svc.name}.service"


def unit_path(svc: Service) -> str:
    return f"{UNIT_DIR}/{unit_name(svc)}"


def env_path(dep: Deployment, svc: Service) -> str:
    return f"{dep.s.config_dir}/env/{svc.name}.env"


def _systemd_words(argv: list[str]) -> str:
    """argv as an ExecStart= line: shell-style quoting, ``%`` and ``$`` escaped for systemd."""
    return shlex.join(argv).replace("%", "%%").replace("$", "$$")


def env_file(svc: Service) -> str:
    lines = []
    for key in sorted(svc.env):
        value = svc.env[key].replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'{key}="{value}"')
    return "\n".join(lines) + "\n"


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
        f"Description=k2fleet: {svc.description or svc.name}",
        f"After={' '.join(after)}",
        "Wants=network-online.target",
        "",
        "[Service]",
        f"Type={'oneshot' if svc.oneshot else 'simple'}",
        f"EnvironmentFile={env_path(dep, svc)}",
    ]
    if svc.oneshot:
        lines.append("RemainAfterExit=yes")
    if svc.needs_checkpoint:
        lines.append(f"ExecStartPre={_systemd_words(gate_argv(dep))}")
    lines.append(f"ExecStart={_systemd_words(svc.argv)}")
    if svc.workdir:
        lines.append(f"WorkingDirectory={svc.workdir}")
    if not svc.oneshot:
        lines += ["Restart=on-failure", "RestartSec=5"]
    if not dep.s.simulated_gpus:
        lines += ["LimitMEMLOCK=infinity", "LimitNOFILE=1048576", "LimitSTACK=67108864"]
    lines += ["TimeoutStartSec=900", "", "[Install]", "WantedBy=multi-user.target", ""]
    return "\n".join(lines)
