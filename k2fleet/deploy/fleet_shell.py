"""Commands on every host of an inventory through the deploy's own connections, outside a
deploy: ``k2fleet down`` (one command a host, its output read at the end) and ``k2fleet logs``
(each host's output streamed line by line, ``--follow`` until interrupted).

The inventory is loaded by pyinfra exactly as ``pyinfra INVENTORY deploys/kimi.py`` loads it
(:func:`k2fleet.deploy.status.pyinfra_state`), so each host is reached with the same connector
and connection data (``ssh_user``, ``ssh_port``, ``ssh_key``, ``ssh_known_hosts_file``,
``ssh_config_file`` with its ``ProxyJump``); each command is wrapped by pyinfra as an operation's
would be, with the host's ``_sudo``/``_sudo_user``/``_use_sudo_login`` data. Commands are given as
argv lists and quoted here (:func:`~k2fleet.planning.quoting.shell_line`): no value reaches a
shell unquoted. Hosts run in parallel (pyinfra's gevent pool).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from k2fleet.planning.quoting import shell_line

MAX_OUTPUT = 16 << 20  # bytes of one host's output kept by :func:`run_on_hosts`
MAX_LINE = 64 << 10  # characters of one streamed line (the rest is cut)


@dataclass
class HostResult:
    """One host's command: ``ok`` (exit 0), its stdout and stderr; ``error``: why it did not run."""

    ok: bool
    stdout: str = ""
    stderr: str = ""
    error: str = ""


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split()) or type(exc).__name__


def _executor_arguments(state: Any, host: Any) -> dict[str, Any]:
    """The connector arguments an operation on ``host`` gets from its data (``_sudo`` ...)."""
    from pyinfra.api.arguments import CONNECTOR_ARGUMENT_KEYS, pop_global_arguments

    arguments, _ = pop_global_arguments(state, host, {})
    return {k: v for k, v in arguments.items() if k in CONNECTOR_ARGUMENT_KEYS}


def _connected(state: Any, host: Any, reason: str) -> None:
    if not host.connected:
        host.connect(reason=reason, raise_exceptions=True)
        state.activate_host(host)


def _on_hosts(inventory: str, data: list[str] | tuple[str, ...], names: list[str], one: Callable[[Any, Any], Any],
              failed: Callable[[str], Any]) -> dict[str, Any]:
    """``one(state, host)`` for every host named, in parallel; host → its value, or
    ``failed(why)``. Every connection is closed at the end, also when interrupted."""
    from k2fleet.deploy.status import disconnect_all, pyinfra_state

    import gevent
    from pyinfra.context import ctx_host, ctx_state

    state = pyinfra_state(inventory, data)
    hosts = [h for h in state.inventory if h.name in names]

    def run(host: Any) -> Any:
        with ctx_state.use(state), ctx_host.use(host):
            try:
                return one(state, host)
            except Exception as exc:  # noqa: BLE001 - one host's failure is that host's result
                return failed(_one_line(exc))

    greenlets = {h.name: state.pool.spawn(run, h) for h in hosts}
    try:
        gevent.joinall(list(greenlets.values()))
    finally:
        for g in greenlets.values():
            g.kill(block=False)
        disconnect_all(hosts)
    return {name: g.value if g.successful() and g.value is not None else failed(_one_line(g.exception or
                                                                                          RuntimeError("interrupted")))
            for name, g in greenlets.items()}


def run_on_hosts(inventory: str, data: list[str] | tuple[str, ...], commands: dict[str, list[str]],
                 reason: str, timeout: float = 900) -> dict[str, HostResult]:
    """Run ``commands[host]`` (an argv) on each host named, through the deploy's connections
    (sudo as the host's data says); host → :class:`HostResult`."""
    from pyinfra.api import StringCommand

    def one(state: Any, host: Any) -> HostResult:
        _connected(state, host, reason)
        ok, output = host.run_shell_command(StringCommand(shell_line(commands[host.name])), print_output=False,
                                            **{**_executor_arguments(state, host), "_timeout": timeout})
        return HostResult(ok, output.stdout[:MAX_OUTPUT], output.stderr[:MAX_OUTPUT])

    return _on_hosts(inventory, data, list(commands), one, lambda why: HostResult(False, error=why))


def stream_on_hosts(inventory: str, data: list[str] | tuple[str, ...], commands: dict[str, list[str]],
                    emit: Callable[[str, str], None], reason: str) -> dict[str, HostResult]:
    """Run ``commands[host]`` on each host named and ``emit(host, line)`` for each line of its
    stdout as it comes (all hosts at once), until every command ends (or the caller is
    interrupted: KeyboardInterrupt propagates after the connections are closed). Over SSH the
    lines are read from the channel as they arrive; another connector's are emitted when its
    command ends. host → :class:`HostResult` (stdout not kept; stderr, capped)."""
    from pyinfra.api import StringCommand
    from pyinfra.connectors.util import make_unix_command_for_host

    def one(state: Any, host: Any) -> HostResult:
        _connected(state, host, reason)
        command = StringCommand(shell_line(commands[host.name]))
        arguments = _executor_arguments(state, host)
        client = getattr(host.connector, "client", None)
        if client is None or not hasattr(client, "exec_command"):  # @local, @docker ...: no line-by-line stream
            ok, output = host.run_shell_command(command, print_output=False, **arguments)
            for line in output.stdout_lines:
                emit(host.name, line[:MAX_LINE])
            return HostResult(ok, stderr=output.stderr[:MAX_OUTPUT])
        for key in ("_get_pty", "_timeout", "_stdin", "_success_exit_codes"):  # as the SSH connector does
            arguments.pop(key, None)
        unix = make_unix_command_for_host(state, host, command, **arguments)
        stdin, stdout, stderr = client.exec_command(unix.get_raw_value(), get_pty=False)
        stdin.close()
        import gevent

        errors = gevent.spawn(stderr.read, MAX_OUTPUT)
        try:
            for line in stdout:
                emit(host.name, line.rstrip("\r\n")[:MAX_LINE])
            status = stdout.channel.recv_exit_status()
            errors.join(5)
        finally:
            stdout.channel.close()
        err = errors.value if errors.successful() and errors.value else b""
        return HostResult(status == 0, stderr=err.decode(errors="replace") if isinstance(err, bytes) else str(err))

    return _on_hosts(inventory, data, list(commands), one, lambda why: HostResult(False, error=why))
