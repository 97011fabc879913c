"""k2fleet's own pyinfra operations, for what pyinfra's own do not do without facts of their
own: the roles decide from their records (:mod:`k2fleet.planning.role_actions`, made from the
one HostState fact), so a no-op re-run costs no extra round trips.

Each operation yields commands only when its arguments say the host differs; ``_if=`` is left
for what the run itself decides (another host's outcome).
"""

from __future__ import annotations

import posixpath
import time
from collections.abc import Callable
from io import BytesIO

from pyinfra import host, logger
from pyinfra.api import FileUploadCommand, FunctionCommand, StringCommand, operation
from pyinfra.connectors.util import clear_askpass_cache

from k2fleet.deploy import failure_lines
from k2fleet.planning.desired import FileSpec, HostDesired
from k2fleet.planning.rollout import Step
from k2fleet.planning.quoting import shell_line, shell_word


@operation()
def synced_files(files: dict[str, FileSpec], current: dict[str, str | None] | None = None):
    """Upload every file of ``files`` whose sha256 differs from ``current[path]`` (every one
    without ``current``: a role record's files are those that differ already).

    Not ``files.put``: that operation asks the host for each file's digest (two facts per
    file) where the HostState fact saw them already, and a private file (mode ``?00``) here
    has its final mode before any byte lands (below).

    + files: :class:`~k2fleet.planning.desired.FileSpec` (content, octal mode) per absolute path
    + current: sha256 per path as the HostState fact saw it (None: missing)

    A spec without content (a control artifact not made yet, only under ``--dry``) yields
    one no-op command, ``true`` with a comment naming the path, so pyinfra reports a change
    and uploads nothing.

    **Example:**

    .. code:: python

        synced_files(name="mesh files", files=actions.mesh.files)
    """
    for path in sorted(files):
        spec = files[path]
        if spec.content is None:
            yield StringCommand(f"true  # {shell_word(path)}: made by the control-machine step")
            continue
        data, mode = spec.content, spec.mode
        if current is not None and current.get(path) == spec.sha256:
            continue
        directory = posixpath.dirname(path)
        temp = host.get_temp_filename()  # a random name: nobody can plant a link at it beforehand
        if int(mode, 8) & 0o077 == 0:  # private (a key, a secret): the file has its final mode before any byte lands
            yield StringCommand(f"mkdir -p -m 700 {shell_word(directory)} && ( umask 077 && touch {shell_word(path)} ) "
                                f"&& chmod {mode} {shell_word(path)}")
            # Over sudo, pyinfra uploads as the SSH user to ``temp`` and then ``sudo cp``s it: that
            # copy too exists only as 0600, created exclusively (no link followed) and handed to
            # the SSH user ($SUDO_USER); as root over SSH the upload goes straight to ``path``.
            yield StringCommand(f"( umask 077 && set -C && : > {shell_word(temp)} ) && "
                                f"{{ [ -z \"${{SUDO_USER:-}}\" ] || chown \"$SUDO_USER\" {shell_word(temp)}; }}")
        else:
            yield StringCommand(f"mkdir -p {shell_word(directory)}")
        yield FileUploadCommand(BytesIO(data), path, remote_temp_filename=temp)
        yield StringCommand(f"chmod {mode} {shell_word(path)} && rm -f {shell_word(temp)}")


@operation(is_idempotent=False)
def command(argv: list[str] | str, run: bool = True):
    """Run one command: a k2fleet program or a shell line nothing in pyinfra's operations does.

    + argv: the command (a list is quoted word by word; a string is one shell line)
    + run: False: yield nothing. For a step of the fleet's order (a stage's start, a relay
      that must serve before any host fetches): the operation exists on every host, so that
      pyinfra runs it on all of them before any host's next one, and the hosts that need
      nothing from it (known before the run) get no command, and no change under ``--dry``

    **Example:**

    .. code:: python

        command(name="stage 0: stop k2-vllm", argv=["systemctl", "stop", "k2-vllm.service"],
                run=(0, "k2-vllm") in actions.changed)
    """
    if run:
        yield StringCommand(argv if isinstance(argv, str) else shell_line(argv))


@operation()
def unit_running(unit: str, active: bool = False):
    """Enable and start ``unit`` unless ``active`` (the HostState fact saw it active and
    enabled); when it fails to start (e.g. an ``ExecStartPre`` gate failed), its last journal
    lines say why.

    **Example:**

    .. code:: python

        unit_running(name="start k2-vllm", unit="k2-vllm.service",
                     active=(0, "k2-vllm") not in actions.start)
    """
    if not active:
        yield StringCommand(start_or_explain(unit, "enable --now"))


# A start that fails within this many seconds is tried once more (the cgroup race below fails
# at once); one that failed later ran its ExecStartPre gate out, and a second try would only
# double the wait before the deploy names the failure (a Ray gate: up to 10 minutes more).
QUICK_FAILURE_S = 10
START_CLOCK = "k2_t0=$(date +%s); "  # start_or_explain's first words for a start: when it began
TIMED_VERBS = ("start", "enable --now")  # a restart's or reload's own stop may take long: always tried again


def start_or_explain(unit: str, verb: str = "start", retry_within_s: int = QUICK_FAILURE_S) -> str:
    """``systemctl VERB UNIT``, tried a second time after ``reset-failed`` (a start right after a
    stop can fail while the old run's cgroup is still being torn down, as seen on nspawn hosts
    with Docker): for a start (:data:`TIMED_VERBS`) only when it failed within
    ``retry_within_s`` seconds, since one that failed later waited out a gate in its
    ``ExecStartPre``; when it still fails, or is not tried again, the unit's last journal lines
    go to stderr and the command fails.

    >>> start_or_explain("k2-vllm.service")  # doctest: +NORMALIZE_WHITESPACE
    'k2_t0=$(date +%s); systemctl start k2-vllm.service || { [ $(( $(date +%s) - k2_t0 )) -lt 10 ]
     && { systemctl reset-failed k2-vllm.service; systemctl start k2-vllm.service; }; }
     || { journalctl -u k2-vllm.service -n 30 --no-pager -o cat >&2; exit 1; }'
    >>> start_or_explain("k2-lb.service", "restart")  # doctest: +NORMALIZE_WHITESPACE
    'systemctl restart k2-lb.service || { systemctl reset-failed k2-lb.service; systemctl restart k2-lb.service; }
     || { journalctl -u k2-lb.service -n 30 --no-pager -o cat >&2; exit 1; }'
    """
    word = shell_word(unit)
    explain = f"|| {{ journalctl -u {word} -n 30 --no-pager -o cat >&2; exit 1; }}"
    if verb not in TIMED_VERBS:
        return f"systemctl {verb} {word} || {{ systemctl reset-failed {word}; systemctl {verb} {word}; }} {explain}"
    return (f"{START_CLOCK}systemctl {verb} {word} || "
            f"{{ [ $(( $(date +%s) - k2_t0 )) -lt {int(retry_within_s)} ] "
            f"&& {{ systemctl reset-failed {word}; systemctl {verb} {word}; }}; }} {explain}")


REBOOT_MARKER = "/run/k2fleet-reboot-pending"


@operation(is_idempotent=False)
def rebooted(reason: str, reboot_timeout: float = 600, interval: float = 1.0, run: bool = True):
    """Reboot the host, wait until it is back and carry on (the deploy goes on with it).

    "Back" means it answers over SSH and a marker written to ``/run`` before the reboot
    is gone (``/run`` is a tmpfs, emptied at every boot). pyinfra's ``server.reboot``
    compares ``/proc/uptime`` instead, which a container host shares with its kernel, so
    it never sees a sandbox host reboot. With ``_serial=True`` the hosts reboot one at
    a time (a rolling reboot).

    + reason: why (shown in the operation's name and in a timeout's error)
    + reboot_timeout: seconds to wait for the host before failing
    + interval: seconds between reconnection attempts
    + run: False: yield nothing (a step of a rolling change on a host it does not reboot)

    **Example:**

    .. code:: python

        rebooted(name="reboot: driver 580.95.05 is loaded", reason="driver change", _serial=True)
    """
    if not run:
        return
    yield StringCommand(f"touch {REBOOT_MARKER}")
    yield StringCommand("( sleep 1 && systemctl reboot ) </dev/null >/dev/null 2>&1 &")

    def wait_until_back(state, host) -> None:
        time.sleep(2)
        clear_askpass_cache(host)
        host.disconnect()
        deadline = time.monotonic() + reboot_timeout
        while True:
            host.connect(show_errors=False)
            if host.connected:
                back, _ = host.run_shell_command(StringCommand(f"test ! -e {REBOOT_MARKER}"))
                if back:  # sshd answers early in the boot: wait for the rest of it
                    host.run_shell_command(StringCommand("systemctl is-system-running --wait >/dev/null 2>&1 || true"))
                    return
                host.disconnect()  # still going down
            if time.monotonic() > deadline:
                why = f"did not come back within {reboot_timeout:.0f}s of its reboot ({reason})"
                failure_lines.note(state, host, why)
                raise Exception(f"{host.name} {why}")
            time.sleep(interval)

    yield FunctionCommand(wait_until_back, (), {})


def rolling_step(desired: HostDesired, step: Step, tag: str, tracked: list, reason: str = "",
                 reboot_timeout: float = 600) -> None:
    """One step of a rolling change (:mod:`k2fleet.planning.rollout`), the same operations on
    every host, each yielding commands only on the step's hosts (``run``): drain the instance at the
    load balancer (on its host; ``lbctl`` waits, capped, for its requests in flight), reboot
    the step's hosts (``step.reboot``, with ``reason``), stop its units (reverse stage order),
    start them (stage order), its health gate (the hosts of ``step.gate``), put it back at
    the load balancer (``lbctl`` waits until the health checks see it UP). Start and reboot
    operations are appended to ``tracked`` (they re-run the final health gate).

    **Example:**

    .. code:: python

        for k, step in enumerate(steps, 1):
            rolling_step(desired, step, f"rolling {k}/{len(steps)} ({step.instance})", run.tracked)
    """
    lb = desired.rollout.balancer
    me = desired.name
    mine = set(step.units.get(me, ()))
    at_lb = lb is not None and me == lb.host
    if step.server and lb:
        command(name=f"{tag}: drain {step.server} at the load balancer (its requests in flight finish)",
                argv=lb.argv("drain", step.server), run=at_lb)
    if step.reboot:
        tracked.append(rebooted(name=f"{tag}: reboot (the loaded driver module changes)", reason=reason,
                                reboot_timeout=reboot_timeout, run=me in step.reboot))
    for stage, name in reversed(desired.slots):
        command(name=f"{tag}: stop {name} (stage {stage})", argv=["systemctl", "stop", f"{name}.service"],
                run=(stage, name) in mine)
    for stage, name in desired.slots:
        tracked.append(command(name=f"{tag}: start {name} (stage {stage})", argv=start_or_explain(f"{name}.service"),
                               run=(stage, name) in mine))
    gate = me in step.gate and desired.health_argv is not None
    command(name=f"{tag}: health gate of {step.instance}: /health 200 and a real chat completion",
            argv=desired.health_argv or ["true"], run=gate)
    if step.server and lb:
        command(name=f"{tag}: put {step.server} back at the load balancer (UP in its health checks)",
                argv=lb.argv("ready", step.server), run=at_lb)


@operation(is_idempotent=False)
def fleet_barrier(failed: Callable[[], list[str]], what: str):
    """Fail this host when ``failed()``, called at execution time, names hosts: a step every
    host of the fleet must pass before any goes on (pyinfra runs each operation on every host
    before the next, so ``failed`` sees every host's outcome of the step before).

    **Example:**

    .. code:: python

        fleet_barrier(name="every host reached its peers", failed=lambda: [...], what="reachability")
    """

    def check(state, host) -> bool:
        names = failed()
        if names:  # a failure of this operation (pyinfra's status False), said in one line
            failure_lines.note(state, host, f"{what} failed on {', '.join(sorted(names))}: the fleet stops here")
            host.log_styled(f"{what} failed on {', '.join(sorted(names))}: {host.name} stops here too, "
                            "so no engine of the fleet starts", fg="red", log_func=logger.error)
            return False
        return True

    yield FunctionCommand(check, (), {})
