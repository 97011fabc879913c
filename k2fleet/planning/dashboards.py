"""Grafana dashboards ``k2fleet metrics`` writes (pure): written by k2fleet, not the engines'
published ones (those could not be fetched here: no network but package registries, and the
engines' wheels are too large to take them from). Each dashboard's ``description`` states
its provenance; the metric names are the engines' documented ones:

- vLLM (0.33.0; ``docs/design/metrics.md``, ``vllm/v1/metrics/loggers.py``):
  ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
  (0.33's name; releases before 0.10 called it ``vllm:gpu_cache_usage_perc``),
  ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
  ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``;
- SGLang (``python/sglang/srt/metrics/collector.py``): ``sglang:num_running_reqs``,
  ``sglang:num_queue_reqs``, ``sglang:token_usage``, ``sglang:time_to_first_token_seconds``,
  ``sglang:inter_token_latency_seconds``, ``sglang:prompt_tokens_total``,
  ``sglang:generation_tokens_total``;
- node_exporter and dcgm-exporter: ``node_load1``, ``DCGM_FI_DEV_GPU_UTIL``, ``DCGM_FI_DEV_FB_USED``.

>>> sorted(dashboards("vllm"))
['k2fleet-hosts.json', 'k2fleet-vllm.json']
"""

from __future__ import annotations

import json

from k2fleet.planning import engines

PROVENANCE = ("Written by k2fleet (k2fleet/planning/dashboards.py) from the metric names the engine documents "
              "at its pinned version; not the engine's published dashboard.")

# dashboard -> (title, [(panel title, unit, [PromQL])]): each engine's own (``Engine.dashboard_panels``,
# under its ``Engine.dashboard`` key) and the hosts'
_PANELS = {key: panels for key, panels in ((e.dashboard, e.dashboard_panels) for e in engines.ENGINES.values())
           if key and panels} | {
    "hosts": ("hosts (node_exporter, dcgm-exporter)", [
        ("Load (1m)", "short", ["node_load1"]),
        ("GPU utilisation", "percent", ["avg by (instance) (DCGM_FI_DEV_GPU_UTIL)"]),
        ("GPU memory used", "decmbytes", ["sum by (instance) (DCGM_FI_DEV_FB_USED)"]),
    ]),
}


def _dashboard(key: str) -> dict:
    title, panels = _PANELS[key]
    return {
        "title": f"k2fleet: {title}",
        "uid": f"k2fleet-{key}",
        "description": PROVENANCE,
        "tags": ["k2fleet"],
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus"}]},
        "panels": [
            {"id": i + 1, "type": "timeseries", "title": ptitle,
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "gridPos": {"h": 8, "w": 12, "x": (i % 2) * 12, "y": (i // 2) * 8},
             "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
             "targets": [{"refId": chr(65 + j), "expr": expr} for j, expr in enumerate(exprs)]}
            for i, (ptitle, unit, exprs) in enumerate(panels)
        ],
    }


def dashboards(engine: str) -> dict[str, str]:
    """File name → Grafana dashboard JSON for ``engine`` (TRT-LLM: hosts only) and the hosts."""
    out = {}
    key = engines.get(engine).dashboard
    if key:
        out[f"k2fleet-{key}.json"] = json.dumps(_dashboard(key), indent=2) + "\n"
    out["k2fleet-hosts.json"] = json.dumps(_dashboard("hosts"), indent=2) + "\n"
    return out


def metric_names(engine: str) -> set[str]:
    """The engine metric names the dashboard queries (tests compare them with a scrape)."""
    import re

    key = engines.get(engine).dashboard
    exprs = [e for _, _, es in _PANELS.get(key or "", ("", []))[1] for e in es]
    return {re.sub(r"_bucket$", "", m) for e in exprs for m in re.findall(r"[a-z]+:[a-z_]+", e)}
