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

from k2fleet.planning import gpu_exporter as plan_exporter
from k2fleet.planning.desired import HostDesired
from k2fleet.deploy.operations import command, start_or_explain, synced_files, unit_running
from k2fleet.planning.host_fact import HostReport
from k2fleet.planning.quoting import shell_line
from k2fleet.planning.units import image_pin_argv


@deploy("k2fleet: GPU exporter")
def run(desired: HostDesired, fact: HostReport, tracked: list) -> None:
    """
    Write dcgm-exporter's unit (and image archive), load its pinned image when the host does
    not hold it, start the unit; restart it when its files changed.

    + desired: this host's desired state (files of group ``gpu_exporter``, ``gpu_exporter`` pin)
    + fact: this host's HostState (digests, unit state, the image-pin check)
    + tracked: list the run's health gate watches; the file and start operations are appended

    **Example:**

    .. code:: python

        gpu_exporter.run(run.desired[host.name], fact, run.tracked)
    """
    files = desired.files.get("gpu_exporter", {})
    pin = desired.gpu_exporter
    if not files or pin is None:
        return
    unit = plan_exporter.UNIT
    written = synced_files(name="dcgm-exporter's unit and image archive", files=files, current=fact.files)
    tracked.append(written)
    load = "true"
    if pin.image_id:
        get = ["docker", "load", "--input", pin.archive] if pin.archive else ["docker", "pull", pin.ref]
        load = f"{shell_line(get)} && {shell_line(image_pin_argv(pin.ref, pin.image_id))}"
    tracked.append(command(name="docker load (or pull) dcgm-exporter's pinned image", argv=load,
                           _if=lambda: bool(pin.image_id) and not fact.passed(plan_exporter.CHECK)))
    command(name="reload systemd for dcgm-exporter's unit", argv=["systemctl", "daemon-reload"], _if=written.did_change)
    active = fact.unit_active(unit)
    tracked.append(unit_running(name=f"start dcgm-exporter ({unit})", unit=unit,
                                active=active and fact.unit_enabled(unit)))
    tracked.append(command(name="restart dcgm-exporter (its unit or image changed)", argv=start_or_explain(unit, "restart"),
                           _if=lambda: active and written.did_change()))
