"""At the end of a deploy in which hosts failed: one line per failed host naming the
operation and the cause (:func:`k2fleet.planning.failures.failure_line`), after pyinfra's
own output.

:class:`FailureRecorder` is a pyinfra state callback (``State.add_callback_handler``): on
``operation_host_error`` it keeps the host's first failed operation and whether the host's
SSH connection is still there (a host that died, rebooted or left the network closes it).
:func:`say_failures` runs at exit (also when pyinfra stops with "No hosts remaining!") and
reads each failed operation's output from pyinfra's operation meta. An operation that fails
without a command's output leaves its reason as the host's :func:`note`: a fleet barrier says
it, and :class:`FailureLog` keeps what pyinfra logs for an operation whose Python raised (the
checkpoint relay's error) or whose command lost its connection. :func:`record_failures`
installs all three.
"""

from __future__ import annotations

import atexit
import logging
import re
import sys
from typing import Any

from pyinfra.api.state import BaseStateCallback

from k2fleet.planning.failures import failure_line

NOTES = "k2fleet_failure_notes"
FAILED = "k2fleet_failed_at"


def _kept(state: Any, name: str) -> dict:
    """A dict kept on pyinfra's state (through pyinfra's ``state`` context object too: getattr and
    setattr reach the State behind it, ``vars`` would not)."""
    kept = getattr(state, name, None)
    if kept is None:
        kept = {}
        setattr(state, name, kept)
    return kept


def note(state: Any, host: Any, reason: str) -> None:
    """Why ``host`` is failing the operation now running (said if no output names a cause)."""
    _kept(state, NOTES)[host.name] = reason


def connection_lost(host: Any) -> bool:
    """Whether ``host``'s SSH connection is gone (pyinfra's SSH connector: paramiko's
    transport is closed); False for other connectors or when it cannot tell."""
    client = getattr(getattr(host, "connector", None), "client", None)
    try:
        transport = client.get_transport() if client is not None else None
    except Exception:  # noqa: BLE001 - a connector of another kind
        return False
    return transport is not None and not transport.is_active()


_LOGGED = re.compile(r"^\s*\[(?P<host>[^\]]+)\]\s+(?:Unexpected error in Python callback|Command socket/SSH error): "
                     r"(?P<error>.*)$", re.S)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # pyinfra's colours in a logged line
_EXCEPTION = re.compile(r"^\w+\((?P<q>['\"])(?P<message>.*)(?P=q),?\)$", re.S)


class FailureLog(logging.Handler):
    """Keeps, as the host's :func:`note`, the error pyinfra logs when an operation's Python
    raises (``Unexpected error in Python callback: RuntimeError('...')``) or its command's
    connection fails (``Command socket/SSH error: ...``): such an operation has no output."""

    def __init__(self, state: Any) -> None:
        super().__init__(logging.WARNING)
        self.state = state

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = _ANSI.sub("", record.getMessage())
        except Exception:  # noqa: BLE001 - a record that does not format: not ours to judge
            return
        found = _LOGGED.match(text)
        if found:
            error = found["error"].strip()
            inner = _EXCEPTION.match(error)
            _kept(self.state, NOTES)[found["host"]] = inner["message"] if inner else error



def record_failures(state: Any) -> None:
    """From now on, keep what each host's first failed operation was and why (:class:`FailureRecorder`,
    :class:`FailureLog` on pyinfra's logger); :func:`say_failures` says it at exit."""
    state.add_callback_handler(FailureRecorder())
    logging.getLogger("pyinfra").addHandler(FailureLog(state))
    atexit.register(say_failures, state)


class FailureRecorder(BaseStateCallback):
    """Keeps each host's first failed operation (see the module doc)."""

    @staticmethod
    def operation_host_error(state: Any, host: Any, op_hash: Any, retry_count: int = 0, max_retries: int = 0) -> None:
        failed = _kept(state, FAILED)
        if host.name not in failed:
            failed[host.name] = (host, op_hash, connection_lost(host))


def failed_lines(state: Any) -> list[str]:
    """:func:`failure_line` for every host that failed an operation, in the inventory's order."""
    failed, notes = _kept(state, FAILED), _kept(state, NOTES)
    order = {host.name: i for i, host in enumerate(state.inventory)}
    out = []
    for name in sorted(failed, key=lambda n: order.get(n, len(order))):
        host, op_hash, lost = failed[name]
        meta = state.get_op_meta(op_hash)
        operation = ", ".join(sorted(meta.names)) or "an operation"
        lines: list[str] = []
        try:
            done = state.get_op_data_for_host(host, op_hash).operation_meta
            if done.is_complete():
                lines = [*done.stdout_lines, *done.stderr_lines]
        except Exception:  # noqa: BLE001 - no output kept: the cause comes from the connection or a note
            pass
        out.append(failure_line(name, operation, lines, lost or connection_lost(host), notes.get(name)))
    return out


def say_failures(state: Any) -> None:
    """Print :func:`failed_lines` on stderr (nothing when no host failed)."""
    lines = failed_lines(state)
    if lines:
        sys.stderr.write("".join(line + "\n" for line in lines))
        sys.stderr.flush()
