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

from k2fleet.planning.host_fact import HostReport
from k2fleet.planning.quoting import shell_word

PROBE = (Path(__file__).resolve().parents[1] / "hostprogs" / "hoststate.py").read_text()


class HostState(FactBase[HostReport]):
    """Hardware and managed state of a host, as a :class:`~k2fleet.planning.host_fact.HostReport`.

    .. code:: python

        report = host.get_fact(HostState, query={"disk_path": "/srv", "units": ["k2-vllm.service"]})
        report.gpus.count, report.units["k2-vllm.service"]["ActiveState"]
    """

    def command(self, query: dict[str, Any]) -> str:  # type: ignore[override]
        return f"python3 - {shell_word(json.dumps(query, sort_keys=True))} <<'K2FLEET_PROBE'\n{PROBE}\nK2FLEET_PROBE"

    def process(self, output: list[str]) -> HostReport:  # type: ignore[override]
        return HostReport.from_json(json.loads("\n".join(output)))
