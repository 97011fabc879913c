"""``k2_gpu_exporter`` on the sandbox (issue #24, item 3): the deploy runs
``k2-dcgm-exporter.service`` on every host — the dcgm-exporter TEST DOUBLE image, tagged with
``k2_gpu_exporter_image`` and pinned by its ID, under Docker and the container toolkit's
double that the bootstrap adds to this venv-runtime fleet — and the control machine (the
declared scraper, through k2fleet's firewall) scrapes each host's :9400: one
``DCGM_FI_DEV_GPU_UTIL`` and ``DCGM_FI_DEV_FB_USED`` sample per simulated GPU of the host's
``/etc/k2fleet-doubles/gpus.json``; under ``k2_bind_address: fleet`` it listens on the host's
fleet address alone; ``k2fleet metrics`` names every host as a ``dcgm`` target.
Written offline; run by the lead on the sandbox.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from k2sandbox.harness import INVENTORY, SandboxFleet, ssh
from k2sandbox.nspawn import BRIDGE_ADDRESS
from k2sandbox.pyinfra_cli import ROOT, cli_env
from tests.test_gpu_exporter import REF, parse_exposition

pytestmark = pytest.mark.sandbox
SANDBOX_HOSTS = 1  # read by the sandbox_fleet fixture (tests/conftest.py): every host is checked alike
DATA = {"k2_metrics": True, "k2_gpu_exporter": True, "k2_metrics_scrapers": [BRIDGE_ADDRESS], "k2_bind_address": "fleet"}


def _scrape(address: str, deadline: float) -> str:
    while True:
        try:
            with urllib.request.urlopen(f"http://{address}:9400/metrics", timeout=5) as resp:
                return resp.read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def test_dcgm_exporter_double_serves_every_simulated_gpu(fleet: SandboxFleet, tmp_path: Path) -> None:
    fleet.ensure_deployed(DATA)
    deadline = time.monotonic() + 60
    for host in fleet.hosts:
        assert ssh(host, "systemctl is-active k2-dcgm-exporter.service", check=False).stdout.strip() == "active"
        label = ssh(host, f"docker image inspect --format '{{{{index .Config.Labels \"org.k2fleet.test-double\"}}}}' {REF}")
        assert label.stdout.strip() == "true"
        # k2_bind_address: fleet — the exporter listens on the host's fleet address alone
        listening = ssh(host, "ss -ltnH 'sport = :9400'").stdout.split()
        assert [w for w in listening if w.endswith(":9400")] == [f"{host['address']}:9400"], listening
        hw = json.loads(ssh(host, "cat /etc/k2fleet-doubles/gpus.json").stdout)
        samples = parse_exposition(_scrape(host["address"], deadline))
        for name in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED"):
            gpus = sorted(int(labels["gpu"]) for n, labels, _ in samples if n == name)
            assert gpus == list(range(int(hw["count"]))), (host["name"], name, gpus)

    data = [f"--data={k}={json.dumps(v)}" for k, v in DATA.items()]
    out = subprocess.run([sys.executable, "-m", "k2fleet.cli", "metrics", INVENTORY, *data, "--out", str(tmp_path / "m")],
                         cwd=ROOT, env=cli_env(fleet.env), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    groups = json.loads((tmp_path / "m" / "targets" / "dcgm.json").read_text())
    assert sorted(g["targets"][0] for g in groups) == sorted(f"{h['address']}:9400" for h in fleet.hosts)

    # a settled fleet: the next deploy changes nothing (the exporter's unit and image included)
    again = fleet.deploy(DATA)
    assert again.returncode == 0 and again.changed == 0, again.changed_operations or again.tail()
