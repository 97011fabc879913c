"""Helpers for the end-to-end tests on the sandbox fleet (real hosts, real pyinfra CLI)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LOCK = "/tmp/k2sb.lock"


def hold_sandbox_lock():
    """Exclusive use of the (globally named) sandbox fleet for the caller's lifetime."""
    handle = open(LOCK, "w")
    fcntl.flock(handle, fcntl.LOCK_EX)
    return handle


@dataclass
class DeployResult:
    returncode: int
    output: str

    @property
    def changed(self) -> int:
        """Operations that changed a host, from pyinfra's 'Grand total' row (Success column)."""
        for line in self.output.splitlines():
            if "Grand total" in line:
                cols = re.split(r"\s{2,}", line.strip())
                return 0 if cols[2] == "-" else int(cols[2])
        raise AssertionError("no results table in pyinfra output:\n" + self.output[-3000:])


def deploy(env: dict[str, str] | None = None, *extra: str, inventory: str = "inventories/sandbox.py") -> DeployResult:
    argv = ["pyinfra", "-y", *extra, inventory, "deploys/kimi.py"]
    full_env = os.environ | (env or {})
    out = subprocess.run(argv, cwd=ROOT, env=full_env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900)
    return DeployResult(out.returncode, out.stdout + out.stderr)


def start_deploy(env: dict[str, str] | None = None, inventory: str = "inventories/sandbox.py") -> subprocess.Popen:
    """The same deploy as :func:`deploy`, in the background, in its own process group
    (``os.killpg(proc.pid, SIGKILL)`` kills pyinfra and every child it started)."""
    return subprocess.Popen(["pyinfra", "-y", inventory, "deploys/kimi.py"], cwd=ROOT, env=os.environ | (env or {}),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                            start_new_session=True)


def ssh(host: dict[str, Any], command: str, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ssh", "-i", host["ssh_key"], "-o", "IdentitiesOnly=yes", "-o", f"UserKnownHostsFile={host['ssh_known_hosts_file']}",
            "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", f"root@{host['address']}", command]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if check and result.returncode:
        raise AssertionError(f"{host['name']}: {command}: {result.stderr}")
    return result


def main_pid(host: dict[str, Any], unit: str) -> int:
    return int(ssh(host, f"systemctl show -p MainPID --value {unit}").stdout.strip())


def http_json(url: str, body: dict | None = None, timeout: float = 30) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw.strip().startswith((b"{", b"[")) else raw.decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
