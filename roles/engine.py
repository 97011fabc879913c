"""Engine runtime role: k2fleet's host programs and the engine itself.

- always: ``/opt/k2fleet/lib`` (checkpoint ``verify.py``, ``overlay.py``,
  ``k2fleet-health.py``);
- ``k2_engine_doubles`` (sandbox only): the engine test doubles under
  ``/opt/k2fleet/doubles`` and, in ``k2_venv/bin``, wrappers named like the real
  entry points, so the planned argv runs unchanged;
- ``venv`` runtime: ``python3 -m venv k2_venv`` + ``pip install ENGINE==VERSION``
  (from ``k2_venv/wheelhouse`` when present, with no index) when the entry point is
  missing;
- engine-side wheels (what the plan runs from ``k2_venv`` beside the engine, e.g. Ray):
  the control machine's wheelhouse is uploaded and installed into ``k2_venv`` with
  ``pip install --no-index`` when the ``engine-side`` check (pinned versions, the fleet's
  Python) fails or a wheel changed; a host that still differs fails, named;
- ``container`` runtime: the image must be present (``docker load`` it from an offline
  bundle first on air-gapped fleets).
"""

from __future__ import annotations

from pyinfra.api import deploy

from k2fleet.desired import ENGINE_SIDE_CHECK, HostDesired
from k2fleet.operations import command, synced_files
from k2fleet.preflight import HostReport


@deploy("k2fleet: engine runtime")
def install(desired: HostDesired, fact: HostReport, tracked: list) -> None:
    """
    Sync the host programs (and doubles), install the engine venv when it is missing,
    and the engine-side wheels when they are not installed as pinned.

    + desired: this host's desired state (files of groups ``engine`` and ``engine_side``,
      ``venv_install``, ``engine_side_install``)
    + fact: this host's HostState (file digests, whether the engine entry point exists,
      the ``engine-side`` check)
    + tracked: list the run's health gate watches; the file operation is appended

    **Example:**

    .. code:: python

        engine.install(run.desired[host.name], fact, run.tracked)
    """
    tracked.append(synced_files(name="k2fleet host programs and engine files",
                                files=desired.files.get("engine", {}), current=fact.files))
    argv = desired.venv_install
    needed = argv is not None and not fact.exists.get(desired.engine_entry)
    venv = desired.engine_entry.rsplit('/bin/', 1)[0]
    command(name=f"install the engine into {venv}", argv=argv or ["true"], _if=lambda: needed)
    side = desired.files.get("engine_side", {})
    upload = synced_files(name="engine-side wheelhouse (hosts have no package index)", files=side, current=fact.files)
    side_ok = fact.passed(ENGINE_SIDE_CHECK)
    tracked.append(command(name=f"engine-side wheels into {venv} (no package index), versions checked",
                           argv=desired.engine_side_install or ["true"],
                           _if=lambda: bool(side) and (not side_ok or upload.did_change())))
