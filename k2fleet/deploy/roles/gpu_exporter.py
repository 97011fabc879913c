"""GPU exporter role: NVIDIA's dcgm-exporter as ``k2-dcgm-exporter.service`` (``k2_gpu_exporter``,
:mod:`k2fleet.planning.gpu_exporter`).

The unit and (sandbox TEST DOUBLE, ``k2_bundle``) the image archive are in the desired state
(group ``gpu_exporter``); Docker and the NVIDIA container toolkit come from the bootstrap,
which runs before. The pinned image is ``docker load``-ed (or pulled) when the fact's
``gpu-exporter-image-pinned`` check fails, then checked once more; the unit is enabled and
started, and restarted when its unit or image changed. With the key off the group is empty
and the services role removes a unit left from before (any ``k2-*.service`` the plan no
longer has).
"""

from __future__ import annotations

from pyinfra.api import deploy
from pyinfra.operations import systemd

from k2fleet.planning import gpu_exporter as plan_exporter
from k2fleet.deploy.operations import command, start_or_explain, synced_files, unit_running
from k2fleet.planning.role_actions import ExporterActions


@deploy("k2fleet: GPU exporter")
def run(actions: ExporterActions, tracked: list) -> None:
    """
    Write dcgm-exporter's unit (and image archive), load its pinned image when the host does
    not hold it, start the unit; restart it when its files changed.

    + actions: this host's record (``role_actions(...).exporter``: files to write, the image
      load line when the pin's check failed, whether the unit starts or restarts)
    + tracked: list the run's health gate watches; the file and start operations are appended

    **Example:**

    .. code:: python

        gpu_exporter.run(role_actions(run.dep, mine, fact).exporter, run.tracked)
    """
    unit = plan_exporter.UNIT
    if actions.files:
        tracked.append(synced_files(name="dcgm-exporter's unit and image archive", files=actions.files))
    if actions.load_image is not None:
        tracked.append(command(name="docker load (or pull) dcgm-exporter's pinned image", argv=actions.load_image))
    if actions.files:
        systemd.daemon_reload(name="reload systemd for dcgm-exporter's unit")
    if actions.start:
        tracked.append(unit_running(name=f"start dcgm-exporter ({unit})", unit=unit))
    if actions.restart:
        tracked.append(command(name="restart dcgm-exporter (its unit or image changed)",
                               argv=start_or_explain(unit, "restart")))
