"""Engine runtime role: k2fleet's host programs and the engine itself.

- always: ``/opt/k2fleet/lib`` (checkpoint ``verify.py``, ``overlay.py``,
  ``k2fleet-health.py``);
- ``k2_engine_doubles`` (sandbox only): the engine test doubles under
  ``/opt/k2fleet/doubles`` and, in ``k2_venv/bin``, wrappers named like the real
  entry points, so the planned argv runs unchanged;
- ``venv`` runtime: ``python3 -m venv k2_venv`` + ``pip install ENGINE==VERSION``
  (from ``k2_venv/wheelhouse`` when present, with no index) when the entry point is
  missing;
- ``container`` runtime: the image must be present (``docker load`` it from an offline
  bundle first on air-gapped fleets).
"""

from __future__ import annotations

from pyinfra.api import deploy

from k2fleet.desired import HostDesired
from k2fleet.operations import command, synced_files
from k2fleet.preflight import HostReport


@deploy("k2fleet: engine runtime")
def install(desired: HostDesired, fact: HostReport, tracked: list) -> None:
    """
    Sync the host programs (and doubles), install the engine venv when it is missing.

    + desired: this host's desired state (files of group ``engine``, ``venv_install``)
    + fact: this host's HostState (file digests, whether the engine entry point exists)
    + tracked: list the run's health gate watches; the file operation is appended

    **Example:**

    .. code:: python

        engine.install(run.desired[host.name], fact, run.tracked)
    """
    tracked.append(synced_files(name="k2fleet host programs and engine files",
                                files=desired.files.get("engine", {}), current=fact.files))
    argv = desired.venv_install
    needed = argv is not None and not fact.exists.get(desired.engine_entry)
    command(name=f"install the engine into {desired.engine_entry.rsplit('/bin/', 1)[0]}",
            argv=argv or ["true"], _if=lambda: needed)
