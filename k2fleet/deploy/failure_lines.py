"""At the end of a deploy in which hosts failed: one line per failed host naming the
operation and the cause (:func:`k2fleet.planning.failures.failure_line`), after pyinfra's
own output.

:class:`FailureRecorder` is a pyinfra state callback (``State.add_callback_handler``): on
``operation_host_error`` it keeps the host's first failed operation and whether the host's
SSH connection is still there (a host that died, rebooted or left the network closes it).
:func:`say_failures` runs at exit (also when pyinfra stops with "No hosts remaining!") and
reads each failed operation's output from pyinfra's operation meta. A check of k2fleet's own
that fails without a command's output (a fleet barrier) leaves its reason with :func:`note`.
"""

from __future__ import annotations

import sys
from typing import Any

from pyinfra.api.state import BaseStateCallback

from k2fleet.planning.failures import failure_line

NOTES = "k2fleet_failure_notes"
FAILED = "k2fleet_failed_at"


def note(state: Any, host: Any, reason: str) -> None:
    """Why ``host`` is failing the operation now running (said if no output names a cause)."""
    vars(state).setdefault(NOTES, {})[host.name] = reason


def connection_lost(host: Any) -> bool:
    """Whether ``host``'s SSH connection is gone (pyinfra's SSH connector: paramiko's
    transport is closed); False for other connectors or when it cannot tell."""
    client = getattr(getattr(host, "connector", None), "client", None)
    try:
        transport = client.get_transport() if client is not None else None
    except Exception:  # noqa: BLE001 - a connector of another kind
        return False
    return transport is not None and not transport.is_active()


class FailureRecorder(BaseStateCallback):
    """Keeps each host's first failed operation (see the module doc)."""

    @staticmethod
    def operation_host_error(state: Any, host: Any, op_hash: Any, retry_count: int = 0, max_retries: int = 0) -> None:
        failed = vars(state).setdefault(FAILED, {})
        if host.name not in failed:
            failed[host.name] = (host, op_hash, connection_lost(host))


def failed_lines(state: Any) -> list[str]:
    """:func:`failure_line` for every host that failed an operation, in the inventory's order."""
    failed = vars(state).get(FAILED, {})
    notes = vars(state).get(NOTES, {})
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
