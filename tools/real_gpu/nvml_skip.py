#!/usr/bin/env python3
"""The probe's wall time on a real GPU host with and without NVML (run by hand on a GPU machine).

Side by side, alternating, N rounds: the state probe (the deploy's argv from the host archive
of this checkout) with host h200-0's status query (tools/real_gpu/h200-query.json) reduced to the GPU gate, (a) asking
NVML (``nvidia-smi``) and (b) with ``gpus_proven_by`` naming a check that passes (``/bin/true``
standing in for a healthy engine), so that neither the report nor the gate asks NVML.
Prints the median of each and ``ratios: probe_with_nvml_vs_without=...``.
Usage: ``python3 tools/real_gpu/nvml_skip.py [ROUNDS]`` (standard library only).
"""
import json, os, statistics, subprocess, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from capture import deployed_probe  # noqa: E402

probe, archive, queries = deployed_probe("k2fleet-nvml-")
query = queries["status"]
want = json.loads(query["checks"]["gpu-ready"][4])
want.update(count=1, fabric=False, services=[], driver_package=None, branch=None)
gate = [sys.executable, archive, "hoststate", "--gate", json.dumps(want)]
with_nvml = dict(query, checks={"gpu-ready": gate})
without = dict(query, checks={"gpu-ready": gate, "healthy": ["/bin/true"]}, gpus_proven_by=["healthy"])
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
walls = {"with_nvml": [], "without_nvml": []}
reports = {}
for _ in range(rounds):
    for name, q in (("with_nvml", with_nvml), ("without_nvml", without)):
        t = time.monotonic()
        out = subprocess.run(probe + [json.dumps(q)], capture_output=True, text=True)
        walls[name].append(time.monotonic() - t)
        reports[name] = json.loads(out.stdout)
for name, w in walls.items():
    print(f"{name}: median {statistics.median(w) * 1000:.0f} ms, min {min(w) * 1000:.0f}, max {max(w) * 1000:.0f} "
          f"(gpus {reports[name]['gpus']}, checks {reports[name]['checks']})")
print(f"ratios: probe_with_nvml_vs_without={statistics.median(walls['with_nvml']) / statistics.median(walls['without_nvml']):.2f}")
