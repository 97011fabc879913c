"""The deploy's last lines when hosts fail: one per failed host, naming the operation and the
cause (k2fleet.deploy.failure_lines), from a real pyinfra run on @local (its API: the same
state callbacks and operation meta as the CLI's). The lost-connection and disk-full causes on
real hosts: tests/test_fault_drills_sandbox.py."""

from __future__ import annotations

import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.api.connect import connect_all
from pyinfra.api.exceptions import PyinfraError
from pyinfra.api.operation import add_op
from pyinfra.api.operations import run_ops
from pyinfra.operations import python, server

import logging

from k2fleet.deploy.failure_lines import FailureLog, FailureRecorder, failed_lines, say_failures


def run_local(*commands: str, name: str, function=None) -> State:
    state = State(Inventory((["@local"], {})), Config())
    state.add_callback_handler(FailureRecorder())
    log = FailureLog(state)
    logging.getLogger("pyinfra").addHandler(log)
    try:
        connect_all(state)
        add_op(state, server.shell, name="a step that works", commands=["true"])
        if function is not None:
            add_op(state, python.call, name=name, function=function)
        else:
            add_op(state, server.shell, name=name, commands=list(commands))
        add_op(state, server.shell, name="a step after it", commands=["true"])
        try:
            run_ops(state)
        except PyinfraError:  # the only host failed: "No hosts remaining!"
            pass
    finally:
        logging.getLogger("pyinfra").removeHandler(log)
    return state


def test_a_full_disk_is_named_with_the_host_and_the_operation(capsys: pytest.CaptureFixture[str]) -> None:
    state = run_local("echo landing shard 3 of 62", "echo 'relay fetch: model-3: [Errno 28] No space left on device' >&2",
                      "exit 1", name="k2fleet: checkpoint | fetch and verify")
    assert failed_lines(state) == ["k2fleet: @local failed at «k2fleet: checkpoint | fetch and verify»: disk full: "
                                   "relay fetch: model-3: [Errno 28] No space left on device"]
    say_failures(state)
    assert capsys.readouterr().err.splitlines()[-1] == failed_lines(state)[0]


def test_an_unknown_failure_quotes_its_last_line_and_a_run_without_failures_says_nothing() -> None:
    state = run_local("echo one; echo 'two' >&2; echo " + "x" * 500 + " >&2; exit 3", name="k2fleet: engine | start")
    [line] = failed_lines(state)
    assert line.startswith("k2fleet: @local failed at «k2fleet: engine | start»: xxx") and len(line) < 400
    assert failed_lines(run_local("true", name="fine")) == []


def test_an_operation_whose_python_raises_is_named_by_the_exceptions_message() -> None:
    """The checkpoint relay runs in the operation's Python: its error reaches the line although
    no command printed it (pyinfra logs it as "Unexpected error in Python callback")."""

    def relay():
        raise RuntimeError("checkpoint relay to root@10.0.0.2 failed: model-28: No space left on device writing "
                           "under /srv/k2fleet/models (free: 0.00 GiB)")

    [line] = failed_lines(run_local(name="k2fleet: checkpoint | receive", function=relay))
    assert line == ("k2fleet: @local failed at «k2fleet: checkpoint | receive»: disk full: checkpoint relay to "
                    "root@10.0.0.2 failed: model-28: No space left on device writing under /srv/k2fleet/models "
                    "(free: 0.00 GiB)"), line
