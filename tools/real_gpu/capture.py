#!/usr/bin/env python3
"""Capture a real GPU host's answers for k2fleet's fixtures (run by hand on a GPU machine).

What the host probe and the GPU gate read on a real NVIDIA host, kept beside the sandbox's
TEST DOUBLES so that the doubles and the parsers are checked against the real thing:
``nvidia-smi -q``, the CSV question the probe asks, the driver's ``/proc`` and ``/sys`` files,
the GPUs on the PCI bus; then the real probe (the deploy's own argv, from the host archive
built from this checkout) with the h200 inventory's fact query (``h200-query.json``, made by
``k2fleet plan``'s code for host h200-0) and the GPU gate, with the h200 plan's expectations
(8 GPUs, NVLink fabric: fails on a smaller machine, which is the point: real failure lines)
and with this machine's own; wall times of each (5 runs); and, where PyTorch with CUDA is
installed, the memory a CUDA context takes (what the capacity model's runtime reserve covers).

Usage: ``python3 tools/real_gpu/capture.py OUTDIR`` (standard library only; nothing on the
host is changed: the archive and its unpacked copy go to a temporary directory).
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def run(argv, timeout=120, env=None):
    start = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=timeout, env=env)
        return done.returncode, done.stdout, done.stderr, time.monotonic() - start
    except FileNotFoundError:
        return 127, "", f"{argv[0]}: not found", 0.0
    except subprocess.TimeoutExpired:
        return 124, "", "timed out", time.monotonic() - start


def keep(out, name, argv, timeout=120):
    code, so, se, wall = run(argv, timeout)
    with open(os.path.join(out, name), "w") as f:
        f.write(so + (("\n--- stderr ---\n" + se) if se.strip() else ""))
    return {"argv": argv, "rc": code, "wall_s": round(wall, 4)}


def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError as exc:
        return f"<{exc.strerror}>"


def times(argv, n=5, timeout=120):
    walls, code = [], None
    for _ in range(n):
        code, _, _, wall = run(argv, timeout)
        walls.append(round(wall, 4))
    return {"argv": argv[:4] + (["..."] if len(argv) > 4 else []), "rc": code, "wall_s": walls}


def deployed_probe(prefix: str) -> tuple[list, str, dict]:
    """(the state probe's argv as the deploy runs it, the host archive it runs from, host h200-0's fact
    queries pointing at that archive): the archive built from this checkout into a new temporary
    directory (``prefix``), with its unpacked copy there too (nothing else on the host is written)."""
    spec = importlib.util.spec_from_file_location("host_archive", os.path.join(ROOT, "k2fleet/planning/host_archive.py"))
    ha = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ha)
    tmp = tempfile.mkdtemp(prefix=prefix)
    archive = os.path.join(tmp, "k2fleet-host.pyz")
    data = ha.archive_bytes()
    with open(archive, "wb") as f:
        f.write(data)
    probe = ha.probe_argv(python=sys.executable, archive=archive, sha256=hashlib.sha256(data).hexdigest(),
                          unpacked=os.path.join(tmp, "unpacked"))
    with open(os.path.join(HERE, "h200-query.json")) as f:
        queries = json.loads(f.read().replace(ha.ARCHIVE, archive).replace("/usr/bin/python3", sys.executable))
    return probe, archive, queries


def main(out):
    os.makedirs(out, exist_ok=True)
    meta = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "python": sys.version.split()[0]}
    meta["uname"] = list(os.uname())
    meta["os_release"] = read("/etc/os-release")
    meta["nproc"] = os.cpu_count()
    runs = {}
    runs["nvidia-smi-q"] = keep(out, "nvidia-smi-q.txt", ["nvidia-smi", "-q"])
    runs["nvidia-smi-csv"] = keep(out, "nvidia-smi-csv.txt", ["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                                              "--format=csv,noheader,nounits"])
    runs["nvidia-smi"] = keep(out, "nvidia-smi.txt", ["nvidia-smi"])
    runs["nvidia-smi-L"] = keep(out, "nvidia-smi-L.txt", ["nvidia-smi", "-L"])
    runs["topo"] = keep(out, "nvidia-smi-topo-m.txt", ["nvidia-smi", "topo", "-m"])
    runs["nvlink"] = keep(out, "nvidia-smi-nvlink-s.txt", ["nvidia-smi", "nvlink", "-s"])
    runs["lspci"] = keep(out, "lspci-nn.txt", ["lspci", "-nn"])
    files = {p: read(p) for p in ("/proc/driver/nvidia/version", "/proc/driver/nvidia/params",
                                  "/sys/module/nvidia/version", "/proc/cmdline")}
    files.update({p: read(p) for p in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information"))})
    pci = {}
    for dev in sorted(glob.glob("/sys/bus/pci/devices/*")):
        vendor = read(dev + "/vendor").strip()
        if vendor in ("0x10de", "0x15b3", "0x1002"):
            pci[os.path.basename(dev)] = {k: read(f"{dev}/{k}").strip() for k in
                                          ("vendor", "device", "class", "subsystem_vendor", "subsystem_device")}
    modules = sorted(m for m in os.listdir("/sys/module") if m.startswith(("nvidia", "gdrdrv", "ib_", "mlx", "rdma")))
    meta.update(files=files, pci=pci, modules=modules, dev_nvidia=sorted(glob.glob("/dev/nvidia*")),
                infiniband=sorted(glob.glob("/sys/class/infiniband/*")))

    # The probe and the gate as the deploy runs them: the archive built from this checkout.
    probe, archive, queries = deployed_probe("k2fleet-capture-")
    # the probe's own time on NVML: the GPU gate its only check (the others wait on absent services)
    queries["gpu-gate-only"] = dict(queries["status"], checks={"gpu-ready": queries["status"]["checks"]["gpu-ready"]})
    for name, query in queries.items():
        code, so, se, wall = run(probe + [json.dumps(query)])
        with open(os.path.join(out, f"probe-{name}.json"), "w") as f:
            f.write(so if code == 0 else so + se)
        runs[f"probe-{name}"] = {"rc": code, "wall_s": round(wall, 4), "stderr": se[-2000:]}
    runs["probe-gpu-gate-only-times"] = times(probe + [json.dumps(queries["gpu-gate-only"])])
    gate = [sys.executable, archive, "hoststate", "--gate"]
    h200_want = json.loads(queries["deploy"]["checks"]["gpu-ready"][4])
    code, so, se, wall = run(gate + [json.dumps(h200_want)])
    runs["gate-h200-plan"] = {"want": h200_want, "rc": code, "stdout": so, "stderr": se[-2000:], "wall_s": round(wall, 4)}
    csv = read(os.path.join(out, "nvidia-smi-csv.txt")).strip().splitlines()
    rows = [[c.strip() for c in line.split(",")] for line in csv if "," in line]
    own = {"vendor": "nvidia", "count": len(rows), "name": rows[0][0].replace("NVIDIA ", "") if rows else "?",
           "branch": None, "minimum": 580, "minimum_version": "580.65.06", "driver_package": None,
           "fabric": False, "services": [], "timeout": 0, "version": None}
    code, so, se, wall = run(gate + [json.dumps(own)])
    runs["gate-this-machine"] = {"want": own, "rc": code, "stdout": so, "stderr": se[-2000:], "wall_s": round(wall, 4)}
    runs["gate-this-machine-times"] = times(gate + [json.dumps(own)])
    runs["nvidia-smi-q-times"] = times(["nvidia-smi", "-q"])
    runs["nvidia-smi-csv-times"] = times(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                          "--format=csv,noheader,nounits"])

    # The CUDA context's own memory (PyTorch, where installed): what no KV cache can use.
    torch_probe = r"""
import json, time
t = time.monotonic()
import torch
imported = time.monotonic() - t
free0, total = torch.cuda.mem_get_info(0)
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
free1, _ = torch.cuda.mem_get_info(0)
p = torch.cuda.get_device_properties(0)
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "import_s": round(imported, 2),
  "name": p.name, "total_bytes": total, "free_after_context_bytes": free0,
  "used_by_context_bytes": total - free0, "free_after_1GiB_bytes": free1,
  "torch_reserved_bytes": torch.cuda.memory_reserved(0), "sm_count": p.multi_processor_count,
  "capability": [p.major, p.minor], "nccl": ".".join(map(str, torch.cuda.nccl.version()))}))
"""
    code, so, se, wall = run([sys.executable, "-c", torch_probe], timeout=180)
    runs["torch-cuda-context"] = {"rc": code, "stdout": so.strip(), "stderr": se[-1500:], "wall_s": round(wall, 2)}
    with open(os.path.join(out, "capture.json"), "w") as f:
        json.dump({"meta": meta, "runs": runs}, f, indent=1, sort_keys=True)
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk in ("rc", "wall_s", "stdout")} for k, v in runs.items()},
                     indent=0)[:9000])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.environ.get("OUT", "/tmp"), "real-gpu"))
