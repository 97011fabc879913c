"""``k2_gpu_exporter``: NVIDIA's dcgm-exporter on every GPU host, as a systemd unit (pure).

NVIDIA ships dcgm-exporter as a container image (not a Debian package). Its README
(github.com/NVIDIA/dcgm-exporter, README.md "Quickstart", at commit dcbb9276) runs it as::

    docker run -d --gpus all --cap-add SYS_ADMIN --rm -p 9400:9400 nvcr.io/nvidia/k8s/dcgm-exporter:4.2.3-4.1.3-ubuntu22.04

(tag: ``<DCGM version>-<exporter version>-ubuntu22.04``; it listens on ``:9400`` and serves
``/metrics``). k2fleet runs the same image and capabilities in the foreground under
``k2-dcgm-exporter.service`` (systemd supervises it, as the engine containers), with two
changes: ``--network host`` in place of ``-p 9400:9400`` (Docker's published ports are
DNAT-ed past the ``input`` hook k2fleet's nftables table filters, so ``-p`` would leave the
port open to anyone; on the host's network the firewall opening to ``k2_metrics_scrapers``
and the fleet is what lets scrapers in; under ``k2_bind_address: fleet`` it listens on the
host's fleet address alone, :func:`listen`), and no ``-d`` (systemd is the supervisor). The image
reference is pinned to ``k2_gpu_exporter_image_id`` when set (the unit refuses another image,
:mod:`k2fleet.hostprogs.image_pin`), as the engine's ``k2_image_id``.

``--gpus all`` needs Docker and the NVIDIA container toolkit: the bootstrap installs both on
a host that runs this unit, whatever the engine's runtime
(:func:`k2fleet.planning.desired.host_bootstrap`).

Simulated GPUs (the sandbox): the image is a TEST DOUBLE the stand-ins build and tag with the
same reference (its entry point serves ``DCGM_FI_DEV_GPU_UTIL`` / ``DCGM_FI_DEV_FB_USED`` per
simulated GPU read from ``/etc/k2fleet-doubles/gpus.json``), the unit gets that file
bind-mounted read-only, and no ``--gpus`` (there is no GPU, as for the engine containers).

>>> UNIT, PORT
('k2-dcgm-exporter.service', 9400)
"""

from __future__ import annotations

from k2fleet.hostprogs.hoststate import SIMULATED_HARDWARE
from k2fleet.planning.deployment import Deployment
from k2fleet.planning.metrics import DCGM_EXPORTER_PORT as PORT, gpu_host
from k2fleet.planning.quoting import systemd_exec
from k2fleet.planning.render.common import DOCKER
from k2fleet.planning.units import CONTAINER_STOP_S, image_pin_argv

NAME = "k2-dcgm-exporter"
UNIT = f"{NAME}.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT}"
CHECK = "gpu-exporter-image-pinned"  # HostState check: the reference is the pinned image ID
ARCHIVE = "/var/cache/k2fleet/images/dcgm-exporter.tar.gz"  # sandbox double / k2_bundle: the archive hosts load
SOURCE = ("NVIDIA/dcgm-exporter README.md, Quickstart (commit dcbb9276): docker run -d --gpus all --cap-add SYS_ADMIN "
          "--rm -p 9400:9400 nvcr.io/nvidia/k8s/dcgm-exporter:4.2.3-4.1.3-ubuntu22.04")


def runs_on(dep: Deployment, role: str) -> bool:
    """Does a host of ``role`` run the exporter (``k2_gpu_exporter``, a host with GPUs)?"""
    return bool(dep.s.metrics and dep.s.gpu_exporter and gpu_host(role))


def listen(dep: Deployment, address: str) -> str | None:
    """dcgm-exporter's listen address under ``k2_bind_address: fleet``: the host's fleet
    address (its ``-a``/``--address`` option, env ``DCGM_EXPORTER_LISTEN``, default ``:9400``;
    pkg/cmd/app.go), None under ``all`` (every interface; the firewall limits who reaches it).

    >>> from types import SimpleNamespace as NS
    >>> listen(NS(s=NS(bind_address="fleet")), "10.0.0.1"), listen(NS(s=NS(bind_address="fleet")), "fd00::1")
    ('10.0.0.1:9400', '[fd00::1]:9400')
    >>> listen(NS(s=NS(bind_address="all")), "10.0.0.1") is None
    True
    """
    if dep.s.bind_address != "fleet":
        return None
    return f"[{address}]:{PORT}" if ":" in address else f"{address}:{PORT}"


def argv(dep: Deployment, address: str) -> list[str]:
    """The unit's ``docker run`` on the host at fleet ``address`` (in the foreground, host
    network; see the module doc), listening where :func:`listen` says.

    >>> from types import SimpleNamespace as NS
    >>> s = NS(simulated_gpus=False, bind_address="all", gpu_exporter_image="nvcr.io/nvidia/k8s/dcgm-exporter:4.2.3-4.1.3-ubuntu22.04")
    >>> argv(NS(s=s), "10.0.0.1")[-5:]
    ['--gpus', 'all', '--cap-add', 'SYS_ADMIN', 'nvcr.io/nvidia/k8s/dcgm-exporter:4.2.3-4.1.3-ubuntu22.04']
    >>> argv(NS(s=NS(**{**vars(s), "bind_address": "fleet"})), "10.0.0.1")[6:9]
    ['host', '-e', 'DCGM_EXPORTER_LISTEN=10.0.0.1:9400']
    """
    out = [DOCKER, "run", "--rm", "--name", NAME, "--network", "host"]
    where = listen(dep, address)
    if where is not None:
        out += ["-e", f"DCGM_EXPORTER_LISTEN={where}"]
    if dep.s.simulated_gpus:  # the TEST DOUBLE reads the simulated GPUs; there is no GPU to give it
        out += ["-v", f"{SIMULATED_HARDWARE}:{SIMULATED_HARDWARE}:ro"]
    else:
        out += ["--gpus", "all"]
    return out + ["--cap-add", "SYS_ADMIN", dep.s.gpu_exporter_image]


def unit_file(dep: Deployment, address: str, image_id: str | None) -> str:
    """``k2-dcgm-exporter.service`` of the host at fleet ``address``: a leftover container
    removed first, the image pin checked (when ``image_id``), stop removes the container."""
    ref = dep.s.gpu_exporter_image
    pre = [f"ExecStartPre=-{systemd_exec([DOCKER, 'rm', '--force', NAME])}"]
    if image_id:
        pre.append(f"ExecStartPre={systemd_exec(image_pin_argv(ref, image_id))}")
    lines = [
        "# Rendered by k2fleet from the fleet plan; edits are overwritten.",
        "[Unit]",
        "Description=k2fleet: NVIDIA dcgm-exporter (GPU metrics on port 9400)",
        "After=network-online.target docker.service",
        "Wants=network-online.target",
        "Requires=docker.service",
        "",
        "[Service]",
        "Type=simple",
        *pre,
        f"ExecStart={systemd_exec(argv(dep, address))}",
        f"ExecStop={systemd_exec([DOCKER, 'stop', '--time', str(CONTAINER_STOP_S), NAME])}",
        f"ExecStopPost=-{systemd_exec([DOCKER, 'rm', '--force', NAME])}",
        "Restart=on-failure",
        "RestartSec=5",
        "TimeoutStartSec=900",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ]
    return "\n".join(lines)
