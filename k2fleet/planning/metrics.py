"""Prometheus scrape targets derived from the plan, and the files ``k2fleet metrics`` writes (pure).

Per engine, where the serving processes publish Prometheus metrics (:data:`ENGINE_METRICS`,
with the source of each row); per host, node_exporter (``k2_node_exporter``: Debian/Ubuntu's
``prometheus-node-exporter``, port 9100) and NVIDIA's dcgm-exporter (port 9400, GPU hosts of a
CUDA fleet: run by k2fleet under ``k2_gpu_exporter``, :mod:`k2fleet.planning.gpu_exporter`, else
by the operator on real GPUs). The output is Prometheus's own file-based
service discovery: ``prometheus.yml`` with one job per kind of target reading
``targets/<job>.json`` (``file_sd_configs``), each target labelled ``instance`` (the host
name), ``role``, ``engine`` and ``model``; and ``dashboards/`` (Grafana JSON written by
k2fleet, :mod:`k2fleet.planning.dashboards`).

>>> ENGINE_METRICS["vllm"].path
'/metrics'
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import yaml

from k2fleet.planning import engines
from k2fleet.planning.deployment import Deployment
from k2fleet.planning.engines.base import EngineMetrics
from k2fleet.planning.processes import Plan

NODE_EXPORTER_PORT = 9100  # prometheus-node-exporter's default --web.listen-address (:9100)
DCGM_EXPORTER_PORT = 9400  # dcgm-exporter's default listen address (:9400)
SCRAPE_INTERVAL = "15s"
API_KEYS = ("k2_port", "k2_router_port")


# Where each engine publishes Prometheus metrics: its own (``Engine.metrics``, ``Engine.metrics_path``).
ENGINE_METRICS: dict[str, EngineMetrics] = {name: e.metrics for name, e in engines.ENGINES.items()}


@dataclass(frozen=True)
class Target:
    job: str
    host: str
    address: str
    port: int
    path: str
    role: str

    @property
    def endpoint(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"


def _engine_path(dep: Deployment) -> str | None:
    return dep.engine_impl.metrics_path(dep)


def scrape_targets(dep: Deployment, plan: Plan) -> list[Target]:
    """Every scrape target of the plan: each serving instance's metrics endpoint (its API
    port, where the health gate also calls it), node_exporter per host and dcgm-exporter per
    GPU host, in plan order."""
    out: list[Target] = []
    path = _engine_path(dep)
    for name, hp in plan.hosts.items():
        for svc in hp.services:
            if svc.role in ("router", "slurm-submit"):
                continue  # the PD router: k2fleet's tables have no metrics port for it (left)
            for key in API_KEYS:
                if key in svc.ports and path:
                    out.append(Target("k2-engine", name, hp.address, svc.ports[key], path, svc.role))
    out = list(dict.fromkeys(out))  # behind the API front, the front and the engine name the same port once
    if dep.s.metrics and dep.s.node_exporter:
        out += [Target("node", name, hp.address, NODE_EXPORTER_PORT, "/metrics", hp.role) for name, hp in plan.hosts.items()]
    out += [Target("dcgm", name, hp.address, DCGM_EXPORTER_PORT, "/metrics", hp.role)
            for name, hp in plan.hosts.items() if dcgm_on(dep, hp.role)]
    return out


def gpu_host(role: str) -> bool:
    return role not in ("router", "slurm-submit")


def dcgm_on(dep: Deployment, role: str) -> bool:
    """Is dcgm-exporter a target (and a firewall opening) on a host of ``role``: with
    ``k2_metrics`` on a GPU host of a CUDA fleet, run by k2fleet (``k2_gpu_exporter``: also
    the sandbox's TEST DOUBLE on simulated GPUs) or, without it, by the operator on real GPUs."""
    if not (dep.s.metrics and dep.platform == "cuda" and gpu_host(role)):
        return False
    return bool(dep.s.gpu_exporter or not dep.s.simulated_gpus)


def exporter_ports(dep: Deployment, role: str) -> list[tuple[int, str]]:
    """The exporter ports a host of ``role`` listens on (the firewall opens them to the scrapers)."""
    if not dep.s.metrics:
        return []
    ports = []
    if dep.s.node_exporter:
        ports.append((NODE_EXPORTER_PORT, "node_exporter (k2_node_exporter)"))
    if dcgm_on(dep, role):
        ports.append((DCGM_EXPORTER_PORT, "dcgm-exporter (GPU metrics)"))
    return ports


def file_sd(dep: Deployment, targets: list[Target]) -> dict[str, list[dict]]:
    """``targets/<job>.json``: Prometheus file_sd groups, one per target (its labels)."""
    jobs: dict[str, list[dict]] = {}
    for t in targets:
        labels = {"instance": t.host, "role": t.role, "engine": dep.engine, "model": dep.served_model_name}
        if t.job == "k2-engine":
            labels["__metrics_path__"] = t.path
        jobs.setdefault(t.job, []).append({"targets": [t.endpoint], "labels": labels})
    return jobs


def prometheus_yml(jobs: list[str], targets_dir: str = "targets") -> str:
    """``prometheus.yml``: one scrape job per file_sd file (paths relative to the config file)."""
    config = {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "scrape_configs": [
            {"job_name": job, "metrics_path": "/metrics",
             "file_sd_configs": [{"files": [f"{targets_dir}/{job}.json"], "refresh_interval": "1m"}]}
            for job in jobs
        ],
    }
    return "# Written by `k2fleet metrics` from the fleet plan; targets come from the file_sd files.\n" + \
        yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


def metrics_files(dep: Deployment, plan: Plan) -> dict[str, str]:
    """Every file of ``k2fleet metrics --out DIR``: relative path → content."""
    from k2fleet.planning.dashboards import dashboards

    jobs = file_sd(dep, scrape_targets(dep, plan))
    files = {"prometheus.yml": prometheus_yml(sorted(jobs))}
    files |= {f"targets/{job}.json": json.dumps(groups, indent=2) + "\n" for job, groups in sorted(jobs.items())}
    files |= {f"dashboards/{name}": text for name, text in dashboards(dep.engine).items()}
    return files
