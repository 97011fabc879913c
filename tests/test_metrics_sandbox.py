"""A real Prometheus (Debian's package) scrapes every target ``k2fleet metrics`` writes for
a deployed sandbox fleet (issue #24, item 3): each engine's ``/metrics`` (the vLLM TEST
DOUBLE serves vLLM's family names) and each host's node exporter (Debian's
``prometheus-node-exporter``, installed by the deploy from the offline bundle under
``k2_node_exporter``), through k2fleet's firewall, which lets the declared scraper (the
control machine's sandbox address) in. Prometheus runs on the control machine, on loopback,
with bounded waits, and is stopped at the end.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from k2sandbox.harness import INVENTORY, SandboxFleet, ssh
from k2sandbox.nspawn import BRIDGE_ADDRESS
from k2sandbox.pyinfra_cli import ROOT, cli_env
from tests.test_doubles import free_port

pytestmark = pytest.mark.sandbox
DATA = {"k2_metrics": True, "k2_node_exporter": True, "k2_metrics_scrapers": [BRIDGE_ADDRESS]}
SANDBOX_DOCKER = False
SANDBOX_HOSTS = 2  # read by the sandbox_fleet fixture (tests/conftest.py)


def _api(base: str, path: str, **query: str) -> dict:
    url = f"{base}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def test_prometheus_scrapes_every_target_of_the_fleet(fleet: SandboxFleet, tmp_path: Path) -> None:
    prometheus = shutil.which("prometheus")
    assert prometheus, "Debian's prometheus package (./dev.sh installs it)"
    fleet.ensure_deployed(DATA)
    data = [f"--data={k}={json.dumps(v)}" for k, v in DATA.items()]
    out = subprocess.run([sys.executable, "-m", "k2fleet.cli", "metrics", INVENTORY, *data, "--out", str(tmp_path / "m")],
                         cwd=ROOT, env=cli_env(fleet.env), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    targets = [t for f in sorted((tmp_path / "m" / "targets").glob("*.json")) for group in json.loads(f.read_text())
               for t in group["targets"]]
    addresses = {h["address"] for h in fleet.hosts}
    assert {t.rsplit(":", 1)[0] for t in targets} == addresses
    assert {t.rsplit(":", 1)[1] for t in targets} == {"8000", "9100"}, targets  # engine API port, node exporter
    for host in fleet.hosts:  # the exporter is the deploy's: the OS package's unit, active
        assert ssh(host, "systemctl is-active prometheus-node-exporter", check=False).stdout.strip() == "active"

    # the scrape interval is the operator's choice (k2fleet writes 15 s): 1 s here, so the first
    # scrape of every target comes within a second, not within 15 (Prometheus spreads them)
    config = yaml.safe_load((tmp_path / "m" / "prometheus.yml").read_text())
    assert config["global"]["scrape_interval"] == "15s", config
    config["global"].update(scrape_interval="1s", scrape_timeout="1s")
    (tmp_path / "m" / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'm' / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            cwd=tmp_path / "m", stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("w"))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline, health = time.monotonic() + 90, {}
        while time.monotonic() < deadline:
            try:
                active = _api(base, "/api/v1/targets")["data"]["activeTargets"]
            except OSError:
                active = []
            health = {t["scrapeUrl"]: (t["health"], t.get("lastError", "")) for t in active}
            if len(health) == len(targets) and all(h == "up" for h, _ in health.values()):
                break
            time.sleep(0.5)
        assert len(health) == len(targets) and all(h == "up" for h, _ in health.values()), health
        # the engine's own families reached Prometheus, one series per host (instance: the host's
        # inventory name), each counting at least the health gate's own completion
        found = _api(base, "/api/v1/query", query="vllm:request_success_total")["data"]["result"]
        assert {r["metric"]["instance"] for r in found} == {h["name"] for h in fleet.hosts}, found
        assert all(float(r["value"][1]) >= 1 for r in found), found
        up = _api(base, "/api/v1/query", query="node_load1")["data"]["result"]
        assert len(up) == len(fleet.hosts), up
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
