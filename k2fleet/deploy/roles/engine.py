"""Engine runtime role: k2fleet's host programs and the engine itself.

- always: the host archive ``/opt/k2fleet/lib/k2fleet-host.pyz`` (every host program:
  :mod:`k2fleet.planning.host_archive`);
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
- ``container`` runtime: when the HostState fact's image-pin check says the reference
  is not the pinned image ID, it is ``docker pull``-ed (``k2_image_id`` set) or, on the
  sandbox (engine test doubles), ``docker load``-ed from the image archive the
  control-machine step built and tagged as ``k2_image``; then checked once more. Simulated
  ROCm hosts get TEST DOUBLE ``/dev/kfd`` and ``/dev/dri`` nodes (systemd-tmpfiles) for
  ``--device``;
- ``k2_bundle`` with a warmed engine cache (``k2fleet bundle --engine-cache``): its archive,
  root-only, and the host program that checks its sha256 against the bundle lock's and
  unpacks it into the engine's cache directory only when that is absent or empty (never
  over the host's own cache), run when the archive changed or the directory is missing.
"""

from __future__ import annotations

from pyinfra.api import deploy

from k2fleet.planning.desired import DEVICE_DOUBLES_CONF
from k2fleet.deploy.operations import command, synced_files
from k2fleet.planning.role_actions import EngineActions


@deploy("k2fleet: engine runtime")
def install(actions: EngineActions, tracked: list) -> None:
    """
    Sync the host programs (and doubles), install the engine venv when it is missing,
    load the pinned container image when it is not there, and the engine-side wheels
    when they are not installed as pinned.

    + actions: this host's engine record (``role_actions(...).engine``: the files of groups
      ``engine``, ``image`` and ``engine_side`` to write, whether the TEST DOUBLE device nodes
      are made, the image loaded, the venv and the engine-side wheels installed, the bundle's
      engine cache archive written and unpacked)
    + tracked: list the run's health gate watches; the file operations are appended

    **Example:**

    .. code:: python

        engine.install(role_actions(run.dep, mine, fact).engine, run.tracked)
    """
    a = actions
    if a.files:
        tracked.append(synced_files(name="k2fleet host programs and engine files", files=a.files))
    if a.create_devices:
        command(name="create the TEST DOUBLE device nodes of the simulated GPUs",
                argv=["systemd-tmpfiles", "--create", DEVICE_DOUBLES_CONF])
    if a.image_files:
        tracked.append(synced_files(name="container image archive", files=a.image_files))
    if a.load_image is not None:
        tracked.append(command(name="docker load (or pull) the pinned container image", argv=a.load_image))
    if a.venv_install is not None:
        command(name=f"install the engine into {a.venv}", argv=list(a.venv_install))
    if a.side_files:
        synced_files(name="engine-side wheelhouse (hosts have no package index)", files=a.side_files)
    if a.side_install is not None:
        tracked.append(command(name=f"engine-side wheels into {a.venv} (no package index), versions checked",
                               argv=list(a.side_install)))
    if a.cache_files:
        tracked.append(synced_files(name="the bundle's engine cache archive", files=a.cache_files))
    if a.cache_unpack is not None:
        command(name="the bundle's engine cache into an empty cache directory (sha256 checked; never over the host's own)",
                argv=list(a.cache_unpack))
