"""A real GPU host's answers against the probe's parsers, the GPU gate, the planning side and
the sandbox's TEST DOUBLES.

The fixtures in ``tests/fixtures/real_gpu_h200/`` were captured on 2026-11-27 by
``tools/real_gpu/capture.py`` on the GPU machine the device tool lent that session: one
NVIDIA H200 (PCIe pass-through into a Firecracker VM, a Docker container inside it), driver
580.159.04 (open kernel module), Ubuntu 24.04.3, kernel 6.18.44 (see ``host.json``; serial
number, UUID and PDI replaced by zeros). ``probe-*.json`` are the real probe's reports (the
deploy's own argv from the host archive of that commit) for host h200-0 of
``inventories/h200.py`` (``tools/real_gpu/h200-query.json``); ``runs.json`` holds the GPU
gate's real lines and the wall times of two runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k2fleet.hostprogs import hoststate
from k2fleet.planning import catalog
from k2fleet.planning.host_fact import HostReport

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures" / "real_gpu_h200"
REAL_Q = (FIX / "nvidia-smi-q.txt").read_text()
REAL_CSV = (FIX / "nvidia-smi-query-gpu.csv").read_text()
HOST = json.loads((FIX / "host.json").read_text())
RUNS = json.loads((FIX / "runs.json").read_text())
DOUBLE = ROOT / "k2sandbox" / "files" / "doubles" / "gpu_stack" / "gpu_double.py"
DRIVER = "580.159.04"
H200_PLAN = {"branch": 580, "count": 8, "driver_package": "nvidia-open", "fabric": True, "minimum": 580,
             "name": "H200", "services": [], "timeout": 0, "vendor": "nvidia", "version": None}


def real_smi(args: list) -> tuple[int, str]:
    """nvidia-smi as the real H200 answered the two questions the probe asks."""
    if list(args) == hoststate.SMI_QUERY:
        return 0, REAL_CSV.strip()
    if list(args) == ["-q"]:
        return 0, REAL_Q.strip()
    return 2, "Invalid combination of input arguments."


def test_the_probe_reads_the_real_nvidia_smi_q_as_the_real_csv_question_answers() -> None:
    # On NVLink hosts the probe asks `-q` once and reads the CSV answer from it (Memo.full_first)
    assert REAL_CSV.strip() == "NVIDIA H200, 143771, 580.159.04"
    assert hoststate.csv_from_full(REAL_Q) == REAL_CSV.strip()
    memo = hoststate.Memo(smi=real_smi, full_first=True)
    assert memo(hoststate.SMI_QUERY) == (0, REAL_CSV.strip())
    assert hoststate.gpus(memo) == {"vendor": "nvidia", "names": ["NVIDIA H200"], "memory_mib": [143771],
                                    "driver": DRIVER}


def test_a_gpu_without_nvswitch_has_no_fabric_and_the_gate_says_so() -> None:
    assert hoststate.fabric_states(REAL_Q) == [("N/A", "N/A")]
    problems = hoststate.nvidia_problems(dict(H200_PLAN, driver_package=None), real_smi)
    assert problems == ["1 GPUs visible, the plan needs 8",
                        "NVLink fabric not ready on 1 GPU(s) (('N/A', 'N/A')): CUDA would fail with error 802; "
                        "check nvidia-fabricmanager (its version must equal the driver's)"]
    # the same host against what it is: one H200, no NVLink fabric, the engine's oldest driver
    own = dict(H200_PLAN, count=1, fabric=False, driver_package=None, branch=None, minimum_version="580.65.06")
    assert hoststate.nvidia_problems(own, real_smi) == []
    assert hoststate.nvidia_problems(dict(own, minimum_version="580.200.01"), real_smi) == [
        "driver 580.159.04 is older than 580.200.01, the oldest the engine's CUDA build runs on"]


def test_a_driver_that_no_package_installed_is_named_as_such(monkeypatch: pytest.MonkeyPatch) -> None:
    # Found on the real machine: its driver came with the image (no nvidia-open package), and the gate
    # said "loaded kernel module 580.159.04 differs from the installed driver  (reboot)" (runs.json).
    assert "differs from the installed driver  (reboot)" in RUNS["run_1"]["gate-h200-plan"]["stdout"]
    monkeypatch.setattr(hoststate, "module_version", lambda module, simulated: DRIVER)
    monkeypatch.setattr(hoststate, "package_versions", lambda names, db=None: {})
    problems = hoststate.nvidia_problems(dict(H200_PLAN, count=1, fabric=False), real_smi)
    assert problems == ["driver package nvidia-open is not installed; the loaded module 580.159.04 came another way "
                        "(the image, a runfile): install the package, or keep that driver with k2_gpu_stack: provided"]
    monkeypatch.setattr(hoststate, "package_versions", lambda names, db=None: {"nvidia-open": "580.95.05-1ubuntu1"})
    assert hoststate.nvidia_problems(dict(H200_PLAN, count=1, fabric=False), real_smi) == [
        "loaded kernel module 580.159.04 differs from the installed driver 580.95.05-1ubuntu1 (reboot)"]


def test_the_loaded_modules_own_files(tmp_path: Path) -> None:
    for name in ("version", "params"):
        (tmp_path / name).write_text(HOST["files"][f"/proc/driver/nvidia/{name}"])
    assert hoststate.nvidia_driver(False, proc=str(tmp_path)) == {
        "open": True, "params": {"EnableStreamMemOPs": "0", "RegistryDwords": '""'}}
    assert HOST["files"]["/sys/module/nvidia/version"].strip() == DRIVER


def test_the_pci_bus_names_the_real_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for slot, attrs in HOST["pci_gpus"].items():
        dev = tmp_path / slot
        dev.mkdir()
        for name, value in attrs.items():
            (dev / name).write_text(value + "\n")
    (tmp_path / "0000:00:01.0").mkdir()  # a non-GPU device beside it (an Intel bridge)
    (tmp_path / "0000:00:01.0" / "vendor").write_text("0x8086\n")
    (tmp_path / "0000:00:01.0" / "class").write_text("0x060400\n")
    real_glob = hoststate.glob.glob
    monkeypatch.setattr(hoststate.glob, "glob", lambda pattern: real_glob(str(tmp_path / "*"))
                        if pattern == "/sys/bus/pci/devices/*" else real_glob(pattern))
    monkeypatch.setattr(hoststate, "SIMULATED_HARDWARE", str(tmp_path / "absent.json"))
    assert hoststate.hardware() == {"vendor": "nvidia", "count": 1, "name": None, "simulated": False}


def double_smi(tmp_path: Path, *args: str) -> str:
    """The sandbox's nvidia-smi TEST DOUBLE on hardware like the real machine's."""
    (tmp_path / "gpus.json").write_text(json.dumps({"vendor": "nvidia", "name": "NVIDIA H200", "count": 1,
                                                    "memory_mib": 143771, "nvswitch": False}))
    for d in ("state/nvidia", "lib/nvidia"):
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
    (tmp_path / "state/nvidia/module-version").write_text(DRIVER)
    (tmp_path / "lib/nvidia/installed-version").write_text(DRIVER)
    env = dict(os.environ, K2FLEET_DOUBLE_HARDWARE=str(tmp_path / "gpus.json"),
               K2FLEET_DOUBLE_STATE=str(tmp_path / "state"), K2FLEET_DOUBLE_LIB=str(tmp_path / "lib"))
    return subprocess.run([sys.executable, str(DOUBLE), "nvidia-smi", *args], env=env, capture_output=True,
                          text=True, check=True).stdout


def key_lines(text: str) -> dict[str, tuple[int, int]]:
    """key -> (indent, column of its colon) of the lines the probe's parsers read (first GPU)."""
    wanted = ("Driver Version", "CUDA Version", "Attached GPUs", "Product Name", "Total", "State", "Status")
    found: dict[str, tuple[int, int]] = {}
    for line in text.splitlines():
        key, sep, _ = line.partition(":")
        if sep and key.strip() in wanted and key.strip() not in found:
            found[key.strip()] = (len(line) - len(line.lstrip()), len(key))
        elif line.strip() in ("Fabric", "FB Memory Usage") and line.strip() not in found:
            found[line.strip()] = (len(line) - len(line.lstrip()), -1)
    return found


def test_the_nvidia_smi_double_answers_as_the_real_one(tmp_path: Path) -> None:
    fake_q = double_smi(tmp_path, "-q")
    assert double_smi(tmp_path, *hoststate.SMI_QUERY).strip() == REAL_CSV.strip()
    assert hoststate.csv_from_full(fake_q) == hoststate.csv_from_full(REAL_Q)
    assert hoststate.fabric_states(fake_q) == hoststate.fabric_states(REAL_Q)
    assert key_lines(fake_q) == key_lines(REAL_Q)  # same blocks, indents and column as the real layout
    def header(text: str) -> list[str]:
        return [line.split(":")[0].strip() for line in text.splitlines()[:8] if ":" in line]
    assert header(fake_q) == header(REAL_Q) == ["Timestamp", "Driver Version", "CUDA Version", "Attached GPUs"]
    assert "CUDA Version                                           : 13.0" in fake_q  # 580's CUDA, as the real one


def test_the_catalogs_h200_is_the_real_one() -> None:
    torch = json.loads(RUNS["run_1"]["torch-cuda-context"]["stdout"])
    h200 = catalog.GPUS["h200"]
    assert h200.smi_mib == int(REAL_CSV.split(",")[1])
    assert abs(h200.reported_gib - torch["total_bytes"] / 2**30) <= 0.011  # PyTorch's total, 2 decimals
    assert torch["name"] == "NVIDIA H200" and torch["capability"] == [9, 0]


def test_the_planning_side_reads_the_real_probe_report() -> None:
    report = HostReport.from_json(json.loads((FIX / "probe-status.json").read_text()))
    assert (report.gpus.vendor, report.gpus.names, report.gpus.memory_mib, report.gpus.driver) == (
        "nvidia", ("NVIDIA H200",), (143771,), DRIVER)
    assert report.boot.modules["nvidia"] == DRIVER and report.boot.nvidia_driver["open"] is True
    assert report.boot.hardware == {"vendor": "nvidia", "count": 1, "name": None, "simulated": False}
    assert report.boot.os == {"id": "ubuntu", "version_id": "24.04"}
    assert report.checks["gpu-ready"] == 1  # the h200 plan's gate (8 GPUs, NVSwitch) on a one-GPU machine
