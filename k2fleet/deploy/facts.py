"""Typed pyinfra facts of k2fleet.

:class:`HostState` is the only fact the deploy gathers: one round trip per host that
returns hardware (GPUs, driver, disk, RAM, /dev/shm, NICs, IB HCAs) and the state of
everything k2fleet manages there (file digests, units, packages, read-only checks such
as the checkpoint's verified marker and a short health probe). It changes nothing on
the host: the probe (:mod:`k2fleet.hostprogs.hoststate`) only reads, and its checks are
read-only programs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pyinfra.api import FactBase

from k2fleet.planning.host_archive import ARCHIVE, archive_sha256, probe_argv
from k2fleet.planning.host_fact import HostReport
from k2fleet.planning.quoting import shell_line, shell_word

PROBE = (Path(__file__).resolve().parents[1] / "hostprogs" / "hoststate.py").read_text()


def probe_command(query: dict[str, Any]) -> str:
    """The fact's shell command: the probe from the host's archive when that archive is
    byte for byte the one this control machine ships (its sha256), otherwise the same
    source piped to ``python3`` (a bare host, or an archive of another version)."""
    arg = shell_word(json.dumps(query, sort_keys=True))
    shipped = shell_line(probe_argv()) + " " + arg
    check = f"echo {archive_sha256()}'  '{shell_word(ARCHIVE)} | sha256sum --check --status 2>/dev/null"
    return f"if {check}; then {shipped}; else python3 - {arg} <<'K2FLEET_PROBE'\n{PROBE}\nK2FLEET_PROBE\nfi"


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
