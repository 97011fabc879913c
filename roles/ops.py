"""k2fleet's own pyinfra operations: decided from the one HostState fact, so a no-op
re-run costs no extra round trips.

Each operation yields commands only when the host differs from the plan; gate
follow-ups on them with ``_if=`` (evaluated at execution time).
"""

from __future__ import annotations

import hashlib
import posixpath
import shlex
from io import BytesIO

from pyinfra import host
from pyinfra.api import FileUploadCommand, StringCommand, operation


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@operation()
def synced_files(files: dict[str, tuple[bytes, str]], current: dict[str, str | None]):
    """Upload every ``path: (content, mode)`` whose sha256 differs from ``current[path]``.

    + files: desired content and octal mode per absolute path
    + current: sha256 per path as the HostState fact saw it (None: missing)

    **Example:**

    .. code:: python

        synced_files(name="mesh files", files={"/etc/k2fleet/x": (b"hi\\n", "600")},
                     current=report.files)
    """
    for path in sorted(files):
        data, mode = files[path]
        if current.get(path) == sha256(data):
            continue
        directory = posixpath.dirname(path)
        yield StringCommand(f"mkdir -p {shlex.quote(directory)}")
        yield FileUploadCommand(BytesIO(data), path, remote_temp_filename=host.get_temp_filename(path))
        yield StringCommand(f"chmod {mode} {shlex.quote(path)}")


@operation(is_idempotent=False)
def command(argv: list[str] | str):
    """Run one command (use with ``_if=`` to make it conditional).

    **Example:**

    .. code:: python

        command(name="reload units", argv=["systemctl", "daemon-reload"], _if=unit_op.did_change)
    """
    yield StringCommand(argv if isinstance(argv, str) else shlex.join(argv))


@operation()
def unit_running(unit: str, active: bool):
    """Enable and start ``unit`` unless the HostState fact saw it active.

    **Example:**

    .. code:: python

        unit_running(name="start k2-vllm", unit="k2-vllm.service",
                     active=report.unit_active("k2-vllm.service"))
    """
    if not active:
        yield StringCommand(f"systemctl enable --now {shlex.quote(unit)}")
