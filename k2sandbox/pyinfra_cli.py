"""Run the pyinfra CLI deploy as a user would, and read its results from pyinfra's own
``--json`` output. Used by ``k2fleet rehearse`` and by the test harness
(:mod:`k2sandbox.harness`).

pyinfra 3.10's ``--json`` for a real run prints ``{"plan": [...], "results": {...}}``
on stdout (its human log goes to stderr); ``results.operations`` lists per operation the
hosts it changed (``success``), left unchanged (``no_change``) or failed on (``error``),
and ``results.totals.success`` counts the (operation, host) pairs that changed a host.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEPLOY_FILE = "deploys/kimi.py"
RUN_STARTED = "--> Beginning operation run"  # pyinfra's log line once planning is over


def tool(name: str) -> str:
    """The console script ``name`` of this Python's environment (the venv's ``pyinfra``,
    ``k2fleet``) even when that is not on PATH; else ``name`` from PATH."""
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.is_file() else (shutil.which(name) or name)


@dataclass
class DeployResult:
    """One run of the pyinfra CLI: exit status, stdout (its ``--json`` payload), stderr
    (its log: ``--json`` keeps the human output off stdout)."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def log(self) -> str:
        """pyinfra's log (stderr), plus stdout when that holds no JSON document."""
        return self.stderr + ("" if self.payload is not None else self.stdout)

    def tail(self, chars: int = 4000) -> str:
        """The end of the log, for assertion messages; a failed run's first host error with the
        lines before it (the failed command's own output, e.g. a unit's journal) ahead of it."""
        first = ""
        lines = self.stderr.splitlines()
        at = next((i for i, line in enumerate(lines) if re.search(r"^\s*\[[^]]+\] Error", line)), None)
        if self.returncode != 0 and at is not None:
            first = "\n".join(lines[max(0, at - 30):at + 3])[-3000:] + "\n...\n"
        return f"$ {' '.join(self.argv)}\n(exit {self.returncode})\n{first}{self.stderr[-chars:]}"

    @property
    def ran_operations(self) -> bool:
        """pyinfra got past planning and started executing operations."""
        return RUN_STARTED in self.stderr

    @cached_property
    def payload(self) -> dict[str, Any] | None:
        """pyinfra's JSON document (``{"plan": [...], "results": {...} | None}``), or None
        when it printed none (it stopped before the run, e.g. a failure while planning).

        >>> DeployResult([], 0, '{"plan": [], "results": null}\\n', "").payload
        {'plan': [], 'results': None}
        """
        for line in reversed(self.stdout.splitlines()):
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except ValueError:
                    continue
        return None

    @property
    def results(self) -> dict[str, Any]:
        """``results`` of the JSON: ``operations`` (each with ``success``/``no_change``/
        ``error`` host lists), ``totals``, ``failed_hosts``."""
        if not self.payload or not self.payload.get("results"):
            raise AssertionError("pyinfra printed no --json results\n" + self.tail())
        return self.payload["results"]

    @property
    def changed(self) -> int:
        """(operation, host) pairs in which the operation changed the host.

        >>> out = {"results": {"operations": [{"name": "a", "success": ["h1", "h2"]}, {"name": "b", "success": []}],
        ...                    "totals": {"hosts": 4, "success": 2, "error": 0, "no_change": 2}, "failed_hosts": []}}
        >>> r = DeployResult([], 0, json.dumps(out), "")
        >>> r.changed, r.changed_operations
        (2, {'a': ['h1', 'h2']})
        """
        return int(self.results["totals"]["success"])

    @property
    def changed_operations(self) -> dict[str, list[str]]:
        """Operation name → hosts it changed, for the operations that changed any."""
        return {op["name"]: op["success"] for op in self.results["operations"] if op["success"]}


def cli_env(extra: Mapping[str, str] | None) -> dict[str, str]:
    """This environment + ``extra``, this Python's bin directory first on PATH."""
    env = {**os.environ, **(extra or {})}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", os.defpath)])
    return env


def run_pyinfra(argv: list[str], env: Mapping[str, str] | None = None, timeout: float = 900,
                cwd: Path = ROOT) -> DeployResult:
    """Run ``argv`` (a pyinfra command line) from ``cwd`` (the repository root: its
    ``config.py`` gate applies; another directory for a plain pyinfra deploy), no stdin;
    never raises on failure: a run past ``timeout`` seconds is exit status 124."""
    try:
        out = subprocess.run(argv, cwd=cwd, env=cli_env(env), capture_output=True, text=True,
                             stdin=subprocess.DEVNULL, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        return DeployResult(argv, 124, "", f"{stderr}\npyinfra did not finish in {timeout:.0f}s")
    return DeployResult(argv, out.returncode, out.stdout, out.stderr)
