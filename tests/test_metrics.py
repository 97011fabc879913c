"""Metrics: scrape targets from the plan, prometheus.yml checked by the real promtool, the
exporter ports in k2fleet's firewall (nft -c), and a real Prometheus on loopback scraping a
stdlib server that serves vLLM-style metrics (bounded waits; everything stopped)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from k2fleet.cli import load_plan, main
from k2fleet.inventory.spec import SpecError
from k2fleet.planning import firewall as fw
from k2fleet.planning.dashboards import metric_names
from k2fleet.planning.host_packages import required_packages
from k2fleet.planning.metrics import DCGM_EXPORTER_PORT, NODE_EXPORTER_PORT, file_sd, prometheus_yml, scrape_targets
from tests.test_firewall import nft_check
from tests.inventory_factory import scenario_inventories

SCENARIOS = scenario_inventories()
ON = ["k2_metrics=true", "k2_node_exporter=true", 'k2_metrics_scrapers=["10.9.0.5", "fd00:9::5"]']
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")


@pytest.mark.parametrize("inventory", SCENARIOS)
def test_every_instance_is_a_target(inventory):
    try:
        dep, plan = load_plan(inventory, ON)
    except SpecError as exc:  # RHEL hosts: no node exporter package
        assert exc.key == "k2_node_exporter"
        dep, plan = load_plan(inventory, ON[:1] + ON[2:])
    targets = scrape_targets(dep, plan)
    engine = {(t.host, t.port) for t in targets if t.job == "k2-engine"}
    for role, pool in dep.pools.items():
        if role in ("router", "slurm-submit"):
            continue
        for nodes in pool.instances:
            head = nodes[0].name
            legacy_kt = dep.engine == "ktransformers" and dep.version.startswith("0.3")
            assert legacy_kt or any(h == head for h, _ in engine), (inventory, head)
    hosts = set(plan.hosts)
    if dep.s.node_exporter:
        assert {t.host for t in targets if t.job == "node"} == hosts
    if dep.platform == "cuda":
        assert {t.host for t in targets if t.job == "dcgm"} == {n for n, hp in plan.hosts.items()
                                                               if hp.role not in ("router", "slurm-submit")}
    for groups in file_sd(dep, targets).values():
        for g in groups:
            assert set(g["labels"]) >= {"instance", "role", "engine", "model"}


def test_sglang_metrics_flag_only_when_on():
    _, off = load_plan("inventories/h200-sglang-tp16.py")
    dep, on = load_plan("inventories/h200-sglang-tp16.py", ["k2_metrics=true"])
    argv = lambda plan: [w for hp in plan.hosts.values() for s in hp.services for w in s.argv]
    assert "--enable-metrics" not in argv(off) and "--enable-metrics" in argv(on)
    assert not [t for t in scrape_targets(*load_plan("inventories/h200-sglang-tp16.py")) if t.job == "k2-engine"]


@pytest.mark.skipif(PROMTOOL is None, reason="promtool missing (./dev.sh installs Debian's prometheus)")
@pytest.mark.parametrize("inventory", ["inventories/h200.py", "inventories/h200-sglang-pd.py", "inventories/b200-trtllm.py"])
def test_promtool_accepts_the_config(inventory, tmp_path):
    assert main(["metrics", inventory, "--out", str(tmp_path), *[w for d in ON for w in ("--data", d)]]) == 0
    proc = subprocess.run([PROMTOOL, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for f in (tmp_path / "targets").glob("*.json"):
        assert json.loads(f.read_text())
    for f in (tmp_path / "dashboards").glob("*.json"):
        assert "k2fleet" in json.loads(f.read_text())["description"]


@pytest.mark.parametrize("inventory", ["h200.py", "h200-sglang-pd.py", "h200-trtllm-mpi.py"])
def test_exporter_ports_closed_to_all_but_scrapers(inventory, tmp_path):
    dep, plan = load_plan(f"inventories/{inventory}", ON + ['k2_api_clients=["10.0.0.0/8"]'])
    for name, hp in plan.hosts.items():
        f = fw.host_firewall(dep, hp)
        ports = {o.first for o in f.openings if o.who == fw.SCRAPERS}
        assert NODE_EXPORTER_PORT in ports
        assert (DCGM_EXPORTER_PORT in ports) == (hp.role not in ("router", "slurm-submit"))
        text = f.rules()
        assert "@scrapers4" in text and "10.9.0.5" in text and "fd00:9::5" in text
        nft_check(text, tmp_path)
        assert "prometheus-node-exporter" in required_packages(dep, hp, mesh=False)


def test_metrics_off_changes_nothing():
    dep, plan = load_plan("inventories/h200.py")
    assert all(o.who != fw.SCRAPERS for hp in plan.hosts.values() for o in fw.host_firewall(dep, hp).openings)


# --- a real Prometheus on loopback ----------------------------------------------------------------
VLLM_TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="kimi"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="kimi"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="kimi"} 0.25
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model_name="kimi"} 1234.0
"""


class _Metrics(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        body = VLLM_TEXT.encode() if self.path == "/metrics" else b"not found"
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=2) as r:
        return json.loads(r.read())


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus missing (./dev.sh installs Debian's prometheus)")
def test_real_prometheus_scrapes_a_vllm_style_endpoint(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    groups = [{"targets": [f"127.0.0.1:{server.server_address[1]}"],
               "labels": {"instance": "gpu-0", "role": "serve", "engine": "vllm", "model": "kimi"}}]
    (tmp_path / "targets").mkdir()
    (tmp_path / "targets" / "k2-engine.json").write_text(json.dumps(groups))
    config = prometheus_yml(["k2-engine"]).replace("scrape_interval: 15s", "scrape_interval: 1s")
    (tmp_path / "prometheus.yml").write_text(config)
    port = _free_port()
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        health = None
        while time.monotonic() < deadline:
            try:
                active = _get(f"{base}/api/v1/targets")["data"]["activeTargets"]
                health = [t["health"] for t in active]
                if health == ["up"]:
                    break
            except OSError:
                pass
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            time.sleep(0.5)
        assert health == ["up"], health
        assert active[0]["labels"]["instance"] == "gpu-0" and active[0]["labels"]["engine"] == "vllm"
        value = None
        while time.monotonic() < deadline:
            q = urllib.parse.quote('vllm:num_requests_running{engine="vllm"}')
            result = _get(f"{base}/api/v1/query?query={q}")["data"]["result"]
            if result:
                value = result[0]["value"][1]
                break
            time.sleep(0.5)
        assert value == "3"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_dashboards_query_the_served_names():
    names = metric_names("vllm")
    served = {line.split("{")[0] for line in VLLM_TEXT.splitlines() if not line.startswith("#")}
    assert served <= names | {"vllm:generation_tokens_total"}
    assert "vllm:kv_cache_usage_perc" in names and "vllm:gpu_cache_usage_perc" not in names
