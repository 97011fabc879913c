"""Exclusive file locks on the control machine's caches, safe under pyinfra's gevent.

pyinfra runs every host's deploy in greenlets of one process. A blocking ``flock(2)``
that another greenlet of the same process holds (through another open file) blocks the
whole process, so the holder never runs again: a deadlock. :func:`exclusive` polls a
non-blocking attempt instead and sleeps between tries (gevent's patched sleep lets the
holder run); between processes it is an ordinary ``flock``.
"""

from __future__ import annotations

import fcntl
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

POLL_S = 0.05


@contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file ``path`` (created, with its directory).

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as top, exclusive(Path(top) / "x" / ".lock"):
    ...     pass
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(POLL_S)
        yield
