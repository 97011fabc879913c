"""The sandbox fleet harness for end-to-end tests and benches: real hosts, the real
pyinfra CLI, results read from pyinfra's own ``--json`` output.

- :class:`SandboxFleet`: the 3-host sandbox booted bare, plus what has been deployed to
  it, so a test can ask for a deployed fleet (:meth:`SandboxFleet.ensure_deployed`)
  instead of relying on an earlier test. The caller holds the one sandbox lock
  (:func:`k2sandbox.nspawn.hold_sandbox_lock`) while it uses one.
- :func:`deploy`: ``pyinfra -y --json [--data KEY=VALUE ...] INVENTORY deploys/kimi.py``
  from the repository root, through :func:`k2sandbox.pyinfra_cli.run_pyinfra`; its
  :class:`~k2sandbox.pyinfra_cli.DeployResult` reads pyinfra 3.10's JSON: ``changed`` is
  ``results.totals.success``, the same number as the Success column of the human
  "Grand total" row.
- :func:`ssh`, :func:`main_pid`, :func:`http_json`: probes of the hosts.

Nothing here reads ``K2FLEET_SANDBOX_*`` variables: variations are pyinfra's ``--data``.
"""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from k2sandbox import nspawn as sandbox
from k2fleet.inventory.loader import data_args
from k2sandbox.pyinfra_cli import DEPLOY_FILE, ROOT, DeployResult, cli_env, run_pyinfra, tool

INVENTORY = "inventories/sandbox.py"
TRTLLM_INVENTORY = "inventories/sandbox-trtllm-mpi.py"
DEPLOY_TIMEOUT_S = 900


def pyinfra_argv(inventory: str = INVENTORY, data: Mapping[str, Any] | None = None,
                 extra: tuple[str, ...] = (), deploy_file: str = DEPLOY_FILE) -> list[str]:
    """The deploy command line (run from the repository root).

    >>> " ".join(pyinfra_argv(data={"k2_nic": "eth9"})[1:])
    '-y --json --data k2_nic=eth9 inventories/sandbox.py deploys/kimi.py'
    """
    return [tool("pyinfra"), "-y", "--json", *extra, *data_args(data), inventory, deploy_file]


def deploy(data: Mapping[str, Any] | None = None, *, inventory: str = INVENTORY,
           env: Mapping[str, str] | None = None, extra: tuple[str, ...] = (),
           timeout: float = DEPLOY_TIMEOUT_S, deploy_file: str = DEPLOY_FILE) -> DeployResult:
    """Run the real pyinfra CLI deploy from the repository root; never raises on failure."""
    return run_pyinfra(pyinfra_argv(inventory, data, extra, deploy_file), env, timeout)


def start_deploy(data: Mapping[str, Any] | None = None, *, inventory: str = INVENTORY,
                 env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """The same deploy as :func:`deploy`, in the background, in its own process group
    (``os.killpg(proc.pid, SIGKILL)`` kills pyinfra and every child it started)."""
    return subprocess.Popen(pyinfra_argv(inventory, data), cwd=ROOT, env=cli_env(env),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                            start_new_session=True)


def ssh(host: Mapping[str, Any], command: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``command`` on a sandbox host (a ``hosts.json`` entry) as root."""
    argv = ["ssh", "-i", host["ssh_key"], "-o", "IdentitiesOnly=yes", "-o", f"UserKnownHostsFile={host['ssh_known_hosts_file']}",
            "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR",
            f"root@{host['address']}", command]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and result.returncode:
        raise AssertionError(f"{host['name']}: {command}: {result.stderr}")
    return result


def main_pid(host: Mapping[str, Any], unit: str) -> int:
    return int(ssh(host, f"systemctl show -p MainPID --value {unit}").stdout.strip())


def http_json(url: str, body: dict | None = None, timeout: float = 30) -> tuple[int, Any]:
    """(status, JSON body or text) of a GET (or a JSON POST when ``body`` is given)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw.strip().startswith((b"{", b"[")) else raw.decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _deploy_key(inventory: str, data: Mapping[str, Any] | None, env: Mapping[str, str]) -> tuple:
    return inventory, json.dumps(dict(data or {}), sort_keys=True), json.dumps(dict(env), sort_keys=True)


@dataclass
class SandboxFleet:
    """The sandbox fleet (``count`` hosts in the default state dir, which the sandbox
    inventories read) and what was last deployed to it.

    ``env`` is the environment of every deploy (``K2FLEET_STATE_DIR``: the control
    machine's per-deployment state; ``HF_*`` for the Hub source); ``data`` and the
    inventory vary per deploy. Hold :func:`k2sandbox.nspawn.hold_sandbox_lock` meanwhile.
    """

    count: int = 3
    env: dict[str, str] = field(default_factory=dict)
    docker: bool = True  # the hosts' nspawn flags for Docker inside (``sandbox up --no-docker``)
    hardware: dict[str, Any] | None = None  # simulated GPUs (``sandbox up --gpus``), in every host
    hosts: list[dict[str, Any]] = field(default_factory=list)
    _deployed: tuple | None = None  # the inventory/data/env of the last successful deploy
    _touched: bool = True  # a deploy may have changed a host since it was booted

    @property
    def sandbox_hosts(self) -> list[sandbox.SandboxHost]:
        return [sandbox.SandboxHost(**h) for h in self.hosts]

    def is_up(self) -> bool:
        rows = sandbox.status()
        return len(rows) == self.count and all(r["running"] and r["ssh"] for r in rows)

    def boot_bare(self) -> SandboxFleet:
        """Fresh hosts: nothing deployed on them."""
        sandbox.down()
        self.hosts = [asdict(h) for h in sandbox.up(self.count, docker=self.docker, hardware=self.hardware)]
        self._deployed, self._touched = None, False
        return self

    def ensure_up(self) -> SandboxFleet:
        """Up (booted bare if it was down); whatever is deployed stays."""
        if not self.is_up():
            return self.boot_bare()
        if not self.hosts:
            self.hosts = [asdict(h) for h in sandbox.load_hosts()]
        return self

    def ensure_bare(self) -> SandboxFleet:
        """Up with nothing deployed: rebooted bare if a deploy may have changed a host."""
        return self.boot_bare() if self._touched or not self.is_up() else self

    def forget(self) -> None:
        """The hosts' state is unknown (a test failed midway, or changed hosts by hand)."""
        self._deployed, self._touched = None, True

    def deploy(self, data: Mapping[str, Any] | None = None, *, inventory: str = INVENTORY,
               env: Mapping[str, str] | None = None, extra: tuple[str, ...] = (),
               deploy_file: str = DEPLOY_FILE) -> DeployResult:
        """Run the deploy and remember what the fleet now runs (dry runs change nothing, nor does
        a deploy that stopped before executing any operation: the fleet runs what it ran)."""
        full_env = {**self.env, **(env or {})}
        result = deploy(data, inventory=inventory, env=full_env, extra=extra, deploy_file=deploy_file)
        if "--dry" in extra:
            return result
        if result.returncode == 0 and deploy_file == DEPLOY_FILE:
            self._deployed = _deploy_key(inventory, data, full_env)
            self._touched = True
        elif result.ran_operations:
            self._deployed, self._touched = None, True
        return result

    def is_deployed(self, data: Mapping[str, Any] | None = None, *, inventory: str = INVENTORY,
                    env: Mapping[str, str] | None = None) -> bool:
        """Whether the fleet is up and exactly this (inventory, data, env) was its last successful deploy."""
        return self._deployed == _deploy_key(inventory, data, {**self.env, **(env or {})}) and self.is_up()

    def ensure_deployed(self, data: Mapping[str, Any] | None = None, *, inventory: str = INVENTORY,
                        env: Mapping[str, str] | None = None) -> DeployResult | None:
        """Deploy unless exactly this (inventory, data, env) was the last successful
        deploy; fail with pyinfra's log if the deploy fails. None when nothing ran."""
        self.ensure_up()
        if self._deployed == _deploy_key(inventory, data, {**self.env, **(env or {})}):
            return None
        result = self.deploy(data, inventory=inventory, env=env)
        if result.returncode != 0:
            raise AssertionError("deploy for the fixture failed:\n" + result.tail())
        return result
