"""Control-machine effects, in one explicit step (:func:`.artifacts.prepare_control_artifacts`):
mesh keys, wheelhouses, offline .deb bundles (:mod:`.deb_bundles`, :mod:`.aptroot`), the
air-gapped bundle and its lock (:mod:`.airgap`, :mod:`.lockfile`) and the control copy of the
checkpoint served to the fleet (:mod:`.checkpoint_copy`). What the sandbox needs beyond a
real fleet comes in through one seam, :mod:`.stand_ins`."""


class ControlError(RuntimeError):
    """The control-machine step cannot make an artifact the deployment needs (one line, no traceback)."""


def failure_line(exc: BaseException, limit: int = 600) -> str:
    """One line saying why a control-machine step failed: its message's first line and, for a
    command's failure (its stderr follows), the last line, which names the cause.

    >>> failure_line(RuntimeError("command failed (100): apt-get download -q haproxy\\nE: Failed to fetch x\\n"
    ...                           "E: Temporary failure resolving 'deb.debian.org'\\n"))
    "command failed (100): apt-get download -q haproxy ... E: Temporary failure resolving 'deb.debian.org'"
    >>> failure_line(OSError(28, "No space left on device"))
    'OSError: [Errno 28] No space left on device'
    """
    lines = [" ".join(line.split()) for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    if not isinstance(exc, ControlError) and type(exc).__name__ in ("OSError", "FileNotFoundError", "PermissionError",
                                                                    "TimeoutError", "KeyError", "ValueError", "TypeError"):
        text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."
