#!/usr/bin/python3
"""k2fleet TEST DOUBLE of NVIDIA's dcgm-exporter (no GPU, no DCGM): Prometheus text on :9400.

The entry point of the sandbox's dcgm-exporter TEST DOUBLE image (``k2sandbox.double_image``,
tagged with ``k2_gpu_exporter_image``), run by k2fleet's ``k2-dcgm-exporter.service`` with the
host's ``/etc/k2fleet-doubles/gpus.json`` bind-mounted read-only. Python 3 standard library only.

``GET /metrics`` answers, per simulated GPU (``count`` of the file, NVIDIA only), the two
fields k2fleet's hosts dashboard reads under dcgm-exporter's own names and label set
(``gpu``, ``UUID``, ``device``, ``modelName``, ``Hostname``): ``DCGM_FI_DEV_GPU_UTIL``
(percent) and ``DCGM_FI_DEV_FB_USED`` (MiB), plus ``DCGM_FI_DEV_FB_FREE``. The values are
simulated: 0 % and 0 MiB used (a simulated GPU runs nothing). The file is read at every
scrape. Listens where the real one does: ``DCGM_EXPORTER_LISTEN`` (default ``:9400``).
Without NVIDIA GPUs in the file it exits 1 with one line, as dcgm-exporter fails without GPUs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HARDWARE = os.environ.get("K2FLEET_DOUBLE_HARDWARE", "/etc/k2fleet-doubles/gpus.json")
FIELDS = (  # (name, help as dcgm-exporter's default-counters.csv words it, value of one simulated GPU)
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", lambda hw: 0),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", lambda hw: int(hw.get("memory_mib", 0))),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", lambda hw: 0),
)


def hardware() -> dict | None:
    try:
        hw = json.loads(open(HARDWARE).read())
    except (OSError, ValueError):
        return None
    if hw.get("vendor") != "nvidia" or int(hw.get("count", 0)) < 1:
        return None
    return hw


def metrics_text(hw: dict, hostname: str) -> str:
    """The exposition text for the simulated GPUs ``hw`` of host ``hostname``."""
    lines = []
    for name, help_text, value in FIELDS:
        lines += [f"# HELP {name} {help_text} [k2fleet TEST DOUBLE: simulated GPUs]", f"# TYPE {name} gauge"]
        for i in range(int(hw["count"])):
            gpu_uuid = f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{hostname}/{i}')}"
            labels = (f'gpu="{i}",UUID="{gpu_uuid}",device="nvidia{i}",'
                      f'modelName="{hw.get("name", "NVIDIA GPU")}",Hostname="{hostname}"')
            lines.append(f"{name}{{{labels}}} {value(hw)}")
    return "\n".join(lines) + "\n"


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        hw = hardware()
        if self.path.split("?")[0] != "/metrics" or hw is None:
            status, body = (404, b"not found\n") if hw is not None else (503, b"no simulated NVIDIA GPUs\n")
        else:
            status, body = 200, metrics_text(hw, socket.gethostname()).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    if hardware() is None:
        print(f"dcgm-exporter TEST DOUBLE: no simulated NVIDIA GPUs in {HARDWARE}", file=sys.stderr)
        return 1
    host, _, port = os.environ.get("DCGM_EXPORTER_LISTEN", ":9400").rpartition(":")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # PID 1 in its container: `docker stop` ends it at once
    address = host.strip("[]") or "0.0.0.0"
    # the real exporter takes "[v6]:9400" too: the family follows the address
    server_class = type("Server", (ThreadingHTTPServer,), {"allow_reuse_address": True,
                                                          "address_family": socket.AF_INET6 if ":" in address else socket.AF_INET})
    server = server_class((address, int(port)), Handler)
    print(f"dcgm-exporter TEST DOUBLE serving /metrics on {host or '0.0.0.0'}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
