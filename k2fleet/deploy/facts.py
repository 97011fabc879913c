"""Typed pyinfra facts of k2fleet.

:class:`HostState` is the only fact the deploy gathers: one round trip per host that
returns hardware (GPUs, driver, disk, RAM, /dev/shm, NICs, IB HCAs) and the state of
everything k2fleet manages there (file digests, units, packages, read-only checks such
as the checkpoint's verified marker and a short health probe). It changes nothing on
the host: the probe (:mod:`k2fleet.hostprogs.hoststate`) only reads, and its checks are
read-only programs.
"""

from __future__ import annotations

import base64
import json
import zlib
from pathlib import Path
from typing import Any

from pyinfra.api import FactBase

from k2fleet.planning.host_archive import ARCHIVE_MISMATCH, probe_argv
from k2fleet.planning.host_fact import HostReport
from k2fleet.planning.quoting import shell_line, shell_word

PROBE = (Path(__file__).resolve().parents[1] / "hostprogs" / "hoststate.py").read_text()
# the probe's source for a host without this control machine's archive: compressed, so that
# a settled host's command carries ~15 KB of it rather than ~35 KB (the shells parse it all);
# zlib's default level: 40 bytes more than level 9, and half its time (0.7 ms instead of 1.5
# ms, at every deploy's start)
PROBE_FROM_SOURCE = ["python3", "-I", "-S", "-c", "import base64, zlib; exec(compile(zlib.decompress(base64.b64decode("
                     f"{base64.b64encode(zlib.compress(PROBE.encode())).decode()!r})), 'hoststate.py', 'exec'))"]


def probe_command(query: dict[str, Any]) -> str:
    """The fact's shell command: the probe from the host's archive when that archive is
    byte for byte the one this control machine ships (:func:`~k2fleet.planning.host_archive.probe_argv`
    checks its sha256), otherwise (exit :data:`~k2fleet.planning.host_archive.ARCHIVE_MISMATCH`,
    or no ``/usr/bin/python3``) the same source, sent in the command (a bare host, or an
    archive of another version)."""
    return (f"q={shell_word(json.dumps(query, sort_keys=True))}; {shell_line(probe_argv())} \"$q\" || "
            f"case $? in {ARCHIVE_MISMATCH}|127) {shell_line(PROBE_FROM_SOURCE)} \"$q\" ;; *) false ;; esac")


class HostState(FactBase[HostReport]):
    """Hardware and managed state of a host, as a :class:`~k2fleet.planning.host_fact.HostReport`.

    .. code:: python

        report = host.get_fact(HostState, query={"disk_path": "/srv", "units": ["k2-vllm.service"]})
        report.gpus.count, report.units["k2-vllm.service"]["ActiveState"]
    """

    def command(self, query: dict[str, Any]) -> str:  # type: ignore[override]
        return probe_command(query)

    def process(self, output: list[str]) -> HostReport:  # type: ignore[override]
        return HostReport.from_json(json.loads("\n".join(output)))


class HubReach(FactBase[bool]):
    """Does this host open a TCP connection to the Hub endpoint (read-only; ``argv`` from
    :func:`k2fleet.planning.fetcher_plan.reach_argv`)? True or False.

    .. code:: python

        host.get_fact(HubReach, argv=reach_argv("https://huggingface.co"))
    """

    def command(self, argv: list[str]) -> str:  # type: ignore[override]
        return shell_line(argv)

    def process(self, output: list[str]) -> bool:  # type: ignore[override]
        return [line.strip() for line in output if line.strip()] == ["1"]
