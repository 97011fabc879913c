"""Host-side state probe: one round trip returns everything the deploy decides on.

This file is run ON THE HOST by the :class:`k2fleet.facts.HostState` fact (``python3 -``
with the source on stdin), so it is standard-library only and imports nothing from
k2fleet. Input: one JSON document (argv[1]) naming what to look at; output: one JSON
document with hardware facts (GPUs, driver, disk, RAM, /dev/shm, NICs, IB HCAs) and the
state of the files, units, packages and health endpoints the deploy manages.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys


def _run(argv: list[str]) -> str | None:
    if not shutil.which(argv[0]):
        return None
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def gpus() -> dict:
    out = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"])
    if out:
        rows = [[c.strip() for c in line.split(",")] for line in out.strip().splitlines() if line.strip()]
        return {
            "vendor": "nvidia",
            "names": [r[0] for r in rows],
            "memory_mib": [int(float(r[1])) for r in rows],
            "driver": rows[0][2] if rows else None,
        }
    out = _run(["rocm-smi", "--showproductname", "--showmeminfo", "vram", "--showdriverversion", "--json"])
    if out:
        try:
            data = json.loads(out)
        except ValueError:
            data = {}
        cards = {k: v for k, v in data.items() if k.startswith("card")}
        return {
            "vendor": "amd",
            "names": [v.get("Card series", v.get("Card SKU", "")) for v in cards.values()],
            "memory_mib": [int(v.get("VRAM Total Memory (B)", 0)) // 2**20 for v in cards.values()],
            "driver": data.get("system", {}).get("Driver version"),
        }
    return {"vendor": None, "names": [], "memory_mib": [], "driver": None}


def disk_free(path: str) -> int:
    while path and not os.path.exists(path):
        path = os.path.dirname(path.rstrip("/")) or "/"
    st = os.statvfs(path or "/")
    return st.f_bavail * st.f_frsize


def mem_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def shm_size() -> int:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return st.f_blocks * st.f_frsize


def nics() -> dict:
    out = {}
    addrs = _run(["ip", "-j", "addr"])
    if addrs:
        for link in json.loads(addrs):
            out[link["ifname"]] = [a["local"] for a in link.get("addr_info", [])]
    return out


def ib_hcas() -> list:
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def sha256_of(path: str) -> str | None:
    try:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()
    except OSError:
        return None


def units(names: list) -> dict:
    if not names:
        return {}
    out = _run(["systemctl", "show", *names, "-p", "Id,ActiveState,UnitFileState,LoadState"]) or ""
    result, current = {}, {}
    for line in out.splitlines() + [""]:
        if not line.strip():
            if current.get("Id"):
                result[current["Id"]] = current
            current = {}
            continue
        key, _, value = line.partition("=")
        current[key] = value
    return result


def packages(names: list) -> list:
    if not names:
        return []
    out = _run(["dpkg-query", "-W", "-f", "${Package} ${db:Status-Abbrev}\n", *names]) or ""
    return sorted(line.split()[0] for line in out.splitlines() if line.split()[1:2] == ["ii"])


def checks(named: dict) -> dict:
    """Run each named argv (when its program exists); return its exit code or None."""
    result = {}
    for name, argv in named.items():
        if not os.path.exists(argv[1] if argv[0].endswith("python3") else argv[0]):
            result[name] = None
            continue
        try:
            result[name] = subprocess.run(argv, capture_output=True, timeout=60).returncode
        except (OSError, subprocess.SubprocessError):
            result[name] = None
    return result


def main() -> None:
    query = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    report = {
        "gpus": gpus(),
        "disk_free": disk_free(query.get("disk_path", "/")),
        "mem_total": mem_total(),
        "shm_size": shm_size(),
        "nics": nics(),
        "ib_hcas": ib_hcas(),
        "files": {p: sha256_of(p) for p in query.get("files", [])},
        "exists": {p: os.path.exists(p) for p in query.get("exists", [])},
        "globs": {g: sorted(glob.glob(g)) for g in query.get("globs", [])},
        "units": units(query.get("units", [])),
        "packages": packages(query.get("packages", [])),
        "checks": checks(query.get("checks", {})),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
