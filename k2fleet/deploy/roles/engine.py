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

from k2fleet.planning.desired import DEVICE_DOUBLES_CONF, ENGINE_SIDE_CHECK, IMAGE_CHECK, HostDesired
from k2fleet.deploy.operations import command, synced_files
from k2fleet.planning.host_fact import HostReport
from k2fleet.planning.quoting import shell_line
from k2fleet.planning.units import image_pin_argv


@deploy("k2fleet: engine runtime")
def install(desired: HostDesired, fact: HostReport, tracked: list) -> None:
    """
    Sync the host programs (and doubles), install the engine venv when it is missing,
    load the pinned container image when it is not there, and the engine-side wheels
    when they are not installed as pinned.

    + desired: this host's desired state (files of groups ``engine``, ``image`` and
      ``engine_side``, ``engine_cache``, ``venv_install``, ``engine_side_install``, ``engine_cache_unpack``,
      ``image``, ``device_doubles``)
    + fact: this host's HostState (file digests, whether the engine entry point, the
      device nodes and the engine cache directory exist, the image-pin and ``engine-side`` checks)
    + tracked: list the run's health gate watches; the file operation is appended

    **Example:**

    .. code:: python

        engine.install(run.desired[host.name], fact, run.tracked)
    """
    programs = synced_files(name="k2fleet host programs and engine files",
                            files=desired.files.get("engine", {}), current=fact.files)
    tracked.append(programs)
    devices = desired.device_doubles
    command(name="create the TEST DOUBLE device nodes of the simulated GPUs",
            argv=["systemd-tmpfiles", "--create", DEVICE_DOUBLES_CONF],
            _if=lambda: bool(devices) and (programs.did_change() or not all(fact.exists.get(d) for d in devices)))
    pin = desired.image
    tracked.append(synced_files(name="container image archive", files=desired.files.get("image", {}),
                                current=fact.files))
    load = "true"
    if pin is not None and pin.image_id:
        get = ["docker", "load", "--input", pin.archive] if pin.archive else ["docker", "pull", pin.ref]
        load = f"{shell_line(get)} && {shell_line(image_pin_argv(pin.ref, pin.image_id))}"
    tracked.append(command(name="docker load (or pull) the pinned container image", argv=load,
                           _if=lambda: pin is not None and not fact.passed(IMAGE_CHECK)))
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
    unpack = desired.engine_cache_unpack
    shipped = synced_files(name="the bundle's engine cache archive", files=desired.files.get("engine_cache", {}),
                           current=fact.files)
    tracked.append(shipped)
    cold = unpack is not None and not fact.exists.get(unpack[-1])
    command(name="the bundle's engine cache into an empty cache directory (sha256 checked; never over the host's own)",
            argv=unpack or ["true"], _if=lambda: unpack is not None and (cold or shipped.did_change()))
