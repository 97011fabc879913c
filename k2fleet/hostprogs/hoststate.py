"""Host-side state probe: one round trip returns everything the deploy decides on.

This file is run ON THE HOST by the :class:`k2fleet.deploy.facts.HostState` fact: from the host archive when the
host's copy is the pinned one, else from its source carried in the fact's command (a bare host), so it is
standard-library only and imports nothing from k2fleet. Input: one JSON document (argv[1]) naming what to look
at; output: one JSON document with hardware facts (GPUs, driver, disk, RAM, /dev/shm, NICs, RDMA devices and
their ports: :func:`ib_ports`) and the state of the files, units, packages and health endpoints the deploy
manages, plus what the bootstrap decides on (OS release, kernel, Secure Boot, the GPUs on the PCI bus, the
loaded kernel module's version, installed package versions and holds). It asks the system's own tools, each once
whatever the number of questions: ``systemctl show`` for every unit, ``dpkg-query -W`` (``rpm -qa``) for every
package, ``ip -j addr`` for the addresses; the checks of the query run meanwhile (the archive's read-only
programs as threads of this process, the others as processes).

NVML is asked once per probe (one ``nvidia-smi -q`` on NVLink hosts) unless the query's
``gpus_proven_by`` checks pass: a host whose engine answers its health check on all its GPUs
is not asked again at every re-run (see :func:`gpus`, :func:`nvidia_problems`).

``--gate JSON`` runs the same probe after the bootstrap and compares it with the expectations in JSON (GPU count
and type, driver branch — any when ``branch`` is null —, the oldest driver version, loaded module = installed
driver when a ``driver_package`` is named, NVLink fabric state, services); it prints one line per mismatch and
exits 1 (0: every expectation holds). Still read-only.

Simulated GPUs (the sandbox, TEST DOUBLES): a host whose ``/etc/k2fleet-doubles/gpus.json`` exists (written by
the sandbox when it boots the host) reports that hardware instead of the PCI bus, and the loaded module's
version from the NVIDIA/AMD double packages' ``/run/k2fleet-doubles/*/module-version`` (``/run`` is emptied at
every boot, like a loaded module).
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time


def _run(argv: list[str], timeout: float = 20) -> str | None:
    """stdout of ``argv`` (whatever its exit code), or None when it cannot be started or
    does not finish within ``timeout`` seconds."""
    try:
        return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace",
                              timeout=timeout).stdout
    except (OSError, subprocess.SubprocessError):
        return None


SMI_QUERY = ["--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"]


def gpus(smi=None) -> dict:
    """The GPUs as NVML sees them (nvidia-smi; rocm-smi for AMD): vendor, names, memory, driver. When the
    probe's proof checks passed (:meth:`Memo.proven`), NVML is not asked: the vendor comes from the PCI bus, the
    driver is the loaded kernel module's version, no names or memory, and ``proven_by`` names the checks."""
    if smi is not None and getattr(smi, "proven", None) and smi.proven():
        hw = hardware()
        module = {"nvidia": "nvidia", "amd": "amdgpu"}.get(hw["vendor"] or "")
        return {"vendor": hw["vendor"], "names": [], "memory_mib": [],
                "driver": module_version(module, hw["simulated"]) if module else None, "proven_by": smi.proof}
    code, out = (smi or _smi)(SMI_QUERY)
    if code == 0 and out:
        rows = [[c.strip() for c in line.split(",")] for line in out.strip().splitlines() if line.strip()]
        return {"vendor": "nvidia", "names": [r[0] for r in rows], "memory_mib": [int(float(r[1])) for r in rows],
                "driver": rows[0][2] if rows else None}
    out = _run(["rocm-smi", "--showproductname", "--showmeminfo", "vram", "--showdriverversion", "--json"])
    if out:
        try:
            data = json.loads(out)
        except ValueError:
            data = {}
        cards = {k: v for k, v in data.items() if k.startswith("card")}
        return {"vendor": "amd", "names": [v.get("Card series", v.get("Card SKU", "")) for v in cards.values()],
                "memory_mib": [int(v.get("VRAM Total Memory (B)", 0)) // 2**20 for v in cards.values()],
                "driver": data.get("system", {}).get("Driver version")}
    return {"vendor": None, "names": [], "memory_mib": [], "driver": None}


SIMULATED_HARDWARE = "/etc/k2fleet-doubles/gpus.json"
DOUBLE_MODULE = "/run/k2fleet-doubles/{module}/module-version"
PCI_VENDORS = {"0x10de": "nvidia", "0x1002": "amd"}
PCI_GPU_CLASSES = ("0x0300", "0x0302", "0x0380")  # VGA, 3D controller, display (AMD Instinct)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def hardware() -> dict:
    """The GPUs on the PCI bus (no driver needed): vendor and count; simulated ones from
    the sandbox's hardware file (marked ``simulated``)."""
    text = _read(SIMULATED_HARDWARE)
    if text is not None:
        try:
            sim = json.loads(text)
        except ValueError:
            sim = {}
        return {"vendor": sim.get("vendor"), "count": int(sim.get("count", 0)), "name": sim.get("name"),
                "simulated": True}
    found: dict = {}
    for dev in glob.glob("/sys/bus/pci/devices/*"):
        vendor = PCI_VENDORS.get(_read(dev + "/vendor") or "")
        if vendor and (_read(dev + "/class") or "")[:6] in PCI_GPU_CLASSES:
            found[vendor] = found.get(vendor, 0) + 1
    vendor = max(found, key=found.get) if found else None
    return {"vendor": vendor, "count": found.get(vendor, 0) if vendor else 0, "name": None, "simulated": False}


def module_version(module: str, simulated: bool) -> str | None:
    """Version of the loaded kernel module (None: not loaded)."""
    if simulated:
        return _read(DOUBLE_MODULE.format(module=module))
    if not os.path.isdir(f"/sys/module/{module}"):
        return None
    return _read(f"/sys/module/{module}/version") or "loaded"


NVIDIA_PROC = "/proc/driver/nvidia"  # the loaded NVIDIA module's own files (version, params)
NVIDIA_PARAMS = ("EnableStreamMemOPs", "RegistryDwords")  # DeepEP's IBGDA option ([deepep] in os_tables)
RDMA_MODULES = ("nvidia_peermem", "gdrdrv")  # GPUDirect RDMA (legacy) and GDRCopy (os_tables [nvidia-peermem], [gdrcopy])


def nvidia_driver(simulated: bool, proc: str = NVIDIA_PROC) -> dict:
    """What GPUDirect RDMA depends on in the loaded NVIDIA module: ``open`` (True: the open kernel modules,
    whose ``version`` file reads ``NVIDIA UNIX Open Kernel Module``; False: the proprietary ones; None: no
    module loaded, or a sandbox host) and ``params``: the :data:`NVIDIA_PARAMS` lines of its ``params`` file
    (``EnableStreamMemOPs: 1``, ``RegistryDwords: "PeerMappingOverride=1;"``), each capped."""
    if simulated:
        return {"open": None, "params": {}}
    version = _read(f"{proc}/version")
    params = {}
    for line in (_read(f"{proc}/params") or "").splitlines()[:400]:
        key, sep, value = line.partition(":")
        if sep and key.strip() in NVIDIA_PARAMS:
            params[key.strip()] = value.strip()[:200]
    return {"open": None if version is None else "Open Kernel Module" in version.splitlines()[0], "params": params}


def os_release() -> dict:
    out = {}
    for line in (_read("/etc/os-release") or "").splitlines():
        key, _, value = line.partition("=")
        if key in ("ID", "VERSION_ID"):
            out[key.lower()] = value.strip('"')
    return out


def secure_boot() -> bool | None:
    """UEFI Secure Boot on (True), off (False), or no UEFI variables (None)."""
    try:
        with open(glob.glob("/sys/firmware/efi/efivars/SecureBoot-*")[0], "rb") as f:
            return f.read()[4:5] == b"\x01"
    except (IndexError, OSError):
        return None

DPKG_QUERY = ["dpkg-query", "-W", "-f", "${db:Status-Abbrev}\t${Package}\t${Version}\n"]
RPM_QUERY = ["rpm", "-qa", "--qf", "ii \t%{NAME}\t%|EPOCH?{%{EPOCH}:}:{}|%{VERSION}-%{RELEASE}\n"]


def package_rows(text: str) -> list:
    """The rows of :data:`DPKG_QUERY`'s (or :data:`RPM_QUERY`'s) output: (status abbreviation
    — dpkg's want, status and error letters —, package, version).

    >>> package_rows("ii \\tnvidia-open\\t580.95.05-1\\nhi \\tnvidia-fabricmanager\\t1\\nbroken line\\n")
    [['ii ', 'nvidia-open', '580.95.05-1'], ['hi ', 'nvidia-fabricmanager', '1']]
    """
    return [row for row in (line.split("\t") for line in text.splitlines()) if len(row) == 3]


class PackageDb:
    """The host's package database, asked once per probe (one ``dpkg-query -W`` answers every question: the
    report's package versions, the holds and the GPU gate's installed driver; ``rpm -qa`` where there is no
    dpkg, every package installed, none held). ``rows()``: see :func:`package_rows`; None with neither tool.
    ``admindir``: another dpkg database's directory than the system's."""

    def __init__(self, admindir: str | None = None):
        self.lock, self.seen = threading.Lock(), None
        self.queries = [DPKG_QUERY + ([f"--admindir={admindir}"] if admindir else []), RPM_QUERY]

    def rows(self):
        with self.lock:
            if self.seen is None:
                for query in self.queries:
                    out = _run(query, 60)
                    if out is not None:
                        self.seen = package_rows(out)
                        break
            return self.seen


def package_versions(patterns: list, db=None) -> dict:
    """Installed version of every installed package matching ``patterns`` (dpkg globs).

    >>> class Db: rows = lambda self: [["ii ", "nvidia-open", "580.95.05-1"], ["rc ", "nvidia-old", "1"],
    ...                                 ["hi ", "nvidia-fabricmanager", "580.95.05-1"], ["ii ", "rsync", "3"]]
    >>> package_versions(["nvidia-*"], Db())
    {'nvidia-open': '580.95.05-1', 'nvidia-fabricmanager': '580.95.05-1'}
    """
    if not patterns:
        return {}
    rows = (db or PackageDb()).rows() or []
    return {r[1]: r[2] for r in rows if r[0][1:2] == "i" and any(fnmatch.fnmatchcase(r[1], p) for p in patterns)}


def holds(db=None) -> list:
    """Packages on hold (dpkg's selection ``hold``, what ``apt-mark showhold`` lists)."""
    return sorted(r[1] for r in (db or PackageDb()).rows() or [] if r[0][:1] == "h")


def reboot_required() -> list:
    """Packages that asked for a reboot (Debian/Ubuntu's /run/reboot-required.pkgs)."""
    if not os.path.exists("/run/reboot-required"):
        return []
    return sorted(set((_read("/run/reboot-required.pkgs") or "").split())) or ["(unnamed)"]


def bootstrap_state(query: dict, db=None) -> dict:
    hw = hardware()
    db = db or PackageDb()
    return {
        "os": os_release(),
        "kernel": os.uname().release,
        "secure_boot": secure_boot(),
        "hardware": hw,
        "modules": {m: module_version(m, hw["simulated"]) for m in ("nvidia", "amdgpu", *RDMA_MODULES)},
        "nvidia_driver": nvidia_driver(hw["simulated"]),
        "nouveau": os.path.isdir("/sys/module/nouveau"),
        "package_versions": package_versions(query.get("package_versions", []), db),
        "holds": holds(db),
        "reboot_required": reboot_required(),
    }


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
    """Interface name → its addresses (``ip -j addr``'s ``ifname`` → ``addr_info[].local``)."""
    try:
        links = json.loads(_run(["ip", "-j", "addr", "show"]) or "[]")
    except ValueError:
        return {}
    return {link["ifname"]: [a["local"] for a in link.get("addr_info", []) if "local" in a] for link in links}


IB_SYSFS = "/sys/class/infiniband"  # Documentation/ABI/stable/sysfs-class-infiniband (the kernel's)
SIMULATED_IB = "/etc/k2fleet-doubles/infiniband"  # a sandbox host's TEST DOUBLE of that tree (k2sandbox.fabric_doubles)
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
IB_MAX_NAME = 64
IB_MAX_DEVICES = 64  # ports read of at most this many RDMA devices (a host has ~10)


def ib_root() -> tuple:
    """(the RDMA devices' sysfs directory, simulated): the sandbox's TEST DOUBLE tree where it
    exists (the preflight refuses it outside a sandbox inventory), else the kernel's."""
    return (SIMULATED_IB, True) if os.path.isdir(SIMULATED_IB) else (IB_SYSFS, False)


def _listdir(path: str) -> list:
    try:
        return sorted(n for n in os.listdir(path) if len(n) <= IB_MAX_NAME)
    except OSError:
        return []


def ib_hcas(root: str) -> list:
    return _listdir(root)


def ib_port(path: str) -> dict:
    """One port of an RDMA device (``<root>/<dev>/ports/<n>``), as ``ibstat``/``ibv_devinfo`` see it: ``state``
    ("4: ACTIVE"), ``phys_state`` ("5: LinkUp"), ``link_layer`` (InfiniBand or Ethernet), ``rate`` ("400 Gb/sec
    (4X NDR)"); on an Ethernet (RoCE) port also ``gids``: index → [GID, type ("RoCE v2", "IB/RoCE v1"), netdev]
    of every non-zero GID (an IB port's GID table is not read: the gate needs none there). Read-only; a file
    that cannot be read is left out."""
    port = {}
    for name in ("state", "phys_state", "link_layer", "rate"):
        value = _read(f"{path}/{name}")
        if value is not None:
            port[name] = value[:IB_MAX_NAME]
    if port.get("link_layer") == "Ethernet":
        gids = {}
        for index in _listdir(f"{path}/gids"):
            gid = _read(f"{path}/gids/{index}")
            if index.isdigit() and gid and gid != ZERO_GID:
                gids[index] = [gid[:IB_MAX_NAME], (_read(f"{path}/gid_attrs/types/{index}") or "")[:IB_MAX_NAME],
                               (_read(f"{path}/gid_attrs/ndevs/{index}") or "")[:IB_MAX_NAME]]
        port["gids"] = gids
    return port


def ib_ports(devices: list, root: str) -> dict:
    """Device → port number → :func:`ib_port`, for each of ``devices`` present under ``root``
    (:func:`ib_root`'s): what the preflight's fabric gate decides on
    (:func:`k2fleet.planning.preflight_checks.check_fabric`)."""
    found = {}
    for dev in devices:
        if "/" in dev or dev in (".", "..") or not os.path.isdir(f"{root}/{dev}"):
            continue
        found[dev] = {n: ib_port(f"{root}/{dev}/ports/{n}") for n in _listdir(f"{root}/{dev}/ports") if n.isdigit()}
    return found


def sha256_of(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            h = hashlib.sha256()
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()
    except OSError:
        return None


UNIT_PROPERTIES = ("Id", "LoadState", "ActiveState", "UnitFileState")


def units(names: list) -> dict:
    """Unit id → its :data:`UNIT_PROPERTIES`, all units in one ``systemctl show`` ({} without systemctl).

    >>> units([])
    {}
    """
    if not names:
        return {}
    out = _run(["systemctl", "show", "-p", ",".join(UNIT_PROPERTIES), "--", *names]) or ""
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


def unit_id(name: str) -> str:
    """systemd's id of ``name``: ``X`` is ``X.service``."""
    return name if "." in name else name + ".service"


class Systemd:
    """The probe's units as :func:`units` saw them (one ``systemctl show``), asked once (the
    report and the GPU gate check both read it).

    >>> sd = Systemd(["k2-vllm.service", "nvidia-fabricmanager.service"])
    >>> sd.seen = {"nvidia-fabricmanager.service": {"ActiveState": "failed"}}
    >>> sd.states(["nvidia-fabricmanager", "k2-vllm.service"]), sd.states(["nvidia-persistenced"])
    (['failed', 'unknown'], None)
    """

    def __init__(self, names: list):
        self.names, self.lock, self.seen = list(names), threading.Lock(), None

    def show(self) -> dict:
        with self.lock:
            if self.seen is None:
                self.seen = units(self.names)
            return self.seen

    def states(self, names: list) -> list | None:
        """ActiveState of each of ``names`` (``X`` or ``X.service``), or None when one of
        them is not among the probe's units (then ask :func:`units` for them)."""
        full = [unit_id(n) for n in names]
        if not all(n in self.names for n in full):
            return None
        shown = self.show()
        return [shown.get(n, {}).get("ActiveState") or "unknown" for n in full]


CHECK_TIMEOUT_S = 60
ARCHIVE_SUFFIX = "/k2fleet-host.pyz"  # k2fleet.planning.host_archive.ARCHIVE's name
IN_PROCESS = ("health", "hoststate", "image_pin", "revisions", "verify")  # read-only programs run as threads here


def _archive_program(argv: list) -> tuple | None:
    """(archive, program) when ``argv`` runs a read-only program of the shipped archive
    (``python3 ARCHIVE PROGRAM ARGS``): the probe imports it from that archive and calls
    its ``main(ARGS)`` in a thread instead of starting another interpreter."""
    if len(argv) >= 3 and argv[0].endswith("python3") and argv[1].endswith(ARCHIVE_SUFFIX) \
            and argv[2] in IN_PROCESS and os.path.isfile(argv[1]):
        return argv[1], argv[2]
    return None


DOWN_STATES = ("inactive", "failed", "deactivating")  # nothing of the unit's serves (not "unknown": not seen)


def unit_not_running(args: list, systemd) -> bool:
    """The health check ``args`` names (``--unit U``) a unit the probe's one look at the units
    (``systemd``) saw down (:data:`DOWN_STATES`); False when it was not looked at, or the look
    did not answer for it (the health program decides).

    >>> sd = Systemd(["k2-vllm.service"])
    >>> sd.seen = {"k2-vllm.service": {"ActiveState": "failed"}}
    >>> unit_not_running(["--base", "http://h:8000", "--unit", "k2-vllm.service"], sd), unit_not_running([], sd)
    (True, False)
    >>> unit_not_running(["--unit", "k2-sglang.service"], sd)  # not looked at: the health program decides
    False
    >>> sd.seen = {}  # systemctl did not answer: "unknown"
    >>> unit_not_running(["--unit", "k2-vllm.service"], sd)
    False
    """
    unit = args[args.index("--unit") + 1] if "--unit" in args[:-1] else None
    states = systemd.states([unit]) if unit and systemd is not None else None
    return bool(states) and states[0] in DOWN_STATES


class _Check:
    """One check run in a thread of this process: ``code`` is its exit code once done. The GPU gate (``hoststate
    --gate``) is this module's own :func:`gate`, sharing the probe's nvidia-smi answers (``smi``), its one read
    of the package database (``db``) and its one look at the units (``systemd``)."""

    def __init__(self, archive: str, program: str, args: list, smi=None, db=None, systemd=None):
        if archive not in sys.path:
            sys.path.insert(0, archive)  # the archive's own modules, never the host's
        self.code, self.smi, self.db, self.systemd = None, smi, db, systemd
        self.done = threading.Event()  # set once the check has its code
        # a daemon: it dies with the probe (os._exit) when it runs past the deadline
        threading.Thread(target=self._run, args=(program, args), daemon=True).start()

    def _run(self, program: str, args: list) -> None:
        code = 1  # a check that breaks has failed
        try:
            if program == "hoststate" and args[:1] == ["--gate"] and len(args) == 2:
                code = gate(json.loads(args[1]), self.smi, self.db, self.systemd)
            elif program == "health" and unit_not_running(args, self.systemd):
                code = 1  # nothing answers for a unit that is down: no need to wait out --timeout
            else:
                import importlib
                code = importlib.import_module("k2fleet.hostprogs." + program).main(list(args))
            code = 0 if code is None else int(code)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except Exception:  # noqa: BLE001 - a check that breaks has failed
            code = 1
        finally:
            self.code = code
            self.done.set()

    def wait(self, timeout: float):
        if not self.done.wait(max(0.0, timeout)):
            raise subprocess.TimeoutExpired(self.__class__.__name__, timeout)
        return self.code

    def kill(self) -> None:  # a thread cannot be killed: it is a daemon and dies with the probe
        pass


def start_checks(named: dict, smi=None, db=None, systemd=None) -> dict:
    """Start every named argv at once (when its program exists): name → running check or None. The archive's
    read-only programs run as threads of this process (their output discarded: stdout and stderr point at
    /dev/null until :func:`finish_checks`), other argv as processes (``subprocess.Popen``, their output
    discarded). They run while the rest of the report is gathered."""
    started = {}
    quiet = None
    for name, argv in named.items():
        inside = _archive_program(argv)
        if inside:
            if quiet is None:
                quiet = open(os.devnull, "w")
                sys.stdout, sys.stderr = quiet, quiet
            started[name] = _Check(inside[0], inside[1], argv[3:], smi, db, systemd)
            continue
        if not os.path.exists(argv[1] if argv[0].endswith("python3") and len(argv) > 1 else argv[0]):
            started[name] = None
            continue
        try:
            started[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL)
        except OSError:
            started[name] = None
    return started


def finish_checks(started: dict, deadline: float) -> dict:
    """Each started check's exit code (None: not run, or past the probe's ``deadline``, a
    ``time.monotonic()``); the probe's own stdout and stderr are back when it returns."""
    result = {}
    for name, proc in started.items():
        if proc is None:
            result[name] = None
            continue
        try:
            result[name] = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            if isinstance(proc, subprocess.Popen):
                proc.wait()
            result[name] = None
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    return result


def _smi(args: list) -> tuple:
    """(exit code, output) of nvidia-smi (127: not installed)."""
    try:
        done = subprocess.run(["nvidia-smi", *args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              errors="replace", timeout=60)
    except FileNotFoundError:
        return 127, "nvidia-smi: not installed"
    except (OSError, subprocess.SubprocessError) as exc:
        return 1, str(exc) or "nvidia-smi: no answer in 60 s"
    return done.returncode, (done.stdout if done.returncode == 0 else done.stdout + done.stderr).strip()


class Memo:
    """``_smi`` remembered for one probe: the report and the GPU gate check ask nvidia-smi the same questions
    once (one lock per question: different ones run at once). With ``full_first`` (the probe will read
    ``nvidia-smi -q`` anyway: the gate checks the NVLink fabric), the CSV question is answered from that one
    ``-q`` (:func:`csv_from_full`): one nvidia-smi, so one NVML start, per probe; it is asked itself only when
    ``-q`` cannot answer it."""

    def __init__(self, smi=None, full_first: bool = False, awaits_proof: bool = False, deadline: float | None = None):
        self.smi, self.lock, self.locks, self.seen = smi or _smi, threading.Lock(), {}, {}
        self.full_first, self.verdict_lock = full_first, threading.Lock()
        self.deadline = time.monotonic() + CHECK_TIMEOUT_S if deadline is None else deadline  # the probe's, for its checks
        self.proof, self.started, self.verdict = [], {}, None  # see proven()
        self.proof_given = threading.Event()  # set by prove_by()
        if not awaits_proof:
            self.proof_given.set()

    def prove_by(self, names: list, started: dict) -> None:
        """Let the checks ``names`` (of the probe's ``started`` ones, every one started by
        now) stand in for NVML. Until this is called, :meth:`proven` waits (a check started
        before the proof, e.g. the GPU gate, must not decide without it)."""
        self.proof, self.started = [n for n in names if n in started], started
        self.proof_given.set()

    def proven(self) -> bool:
        """Did every proof check run and pass (waiting for them; once per probe)? Then the
        report and the GPU gate do not ask NVML (see
        :func:`k2fleet.planning.desired.gpus_proven_by`: a healthy engine on all the host's GPUs).

        >>> class Done:
        ...     def __init__(self, code): self.code = code
        ...     def wait(self, timeout): return self.code
        >>> m = Memo(awaits_proof=True); m.prove_by(["healthy", "absent"], {"healthy": Done(0)}); m.proof, m.proven()
        (['healthy'], True)
        >>> m = Memo(); m.prove_by(["healthy"], {"healthy": Done(1)}); m.proven()
        False
        >>> m = Memo(); m.prove_by(["healthy"], {"healthy": None}); m.proven()
        False
        """
        if not self.proof_given.wait(max(0.0, self.deadline - time.monotonic())):
            return False
        with self.verdict_lock:  # not self.lock: the wait must not hold up other nvidia-smi questions
            if self.verdict is None:
                self.verdict = bool(self.proof) and all(_passes(self.started[n], self.deadline) for n in self.proof)
            return self.verdict

    def __call__(self, args: list) -> tuple:
        if self.full_first and list(args) == SMI_QUERY:
            code, out = self(["-q"])
            rows = csv_from_full(out) if code == 0 else None
            if rows:
                return 0, rows
        key = tuple(args)
        with self.lock:
            mine = self.locks.setdefault(key, threading.Lock())
        with mine:
            if key not in self.seen:
                self.seen[key] = self.smi(args)
            return self.seen[key]


def _passes(check, deadline: float) -> bool:
    """Did a started check (None: not run) exit 0 before ``deadline`` (``time.monotonic()``)?"""
    if check is None:
        return False
    try:
        return check.wait(max(0.0, deadline - time.monotonic())) == 0
    except subprocess.TimeoutExpired:
        return False


def csv_from_full(text: str) -> str | None:
    """The :data:`SMI_QUERY` answer (``name, memory.total MiB, driver_version`` a GPU) read
    from ``nvidia-smi -q`` output, or None when a GPU lacks one of them.

    >>> q = "Driver Version : 580.95.05\\nAttached GPUs : 1\\nGPU 00000000:18:00.0\\n"
    >>> q += "    Product Name : NVIDIA H200\\n    FB Memory Usage\\n        Total : 143771 MiB\\n        Used : 0 MiB\\n"
    >>> csv_from_full(q)
    'NVIDIA H200, 143771, 580.95.05'
    >>> csv_from_full("Driver Version : 580.95.05\\nGPU 00000000:18:00.0\\n    Product Name : NVIDIA H200\\n") is None
    True
    """
    driver, gpus, current, in_fb = None, [], None, False
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        name, value, depth = key.strip(), value.strip(), len(line) - len(line.lstrip())
        if line.startswith("GPU "):
            current, in_fb = {}, False
            gpus.append(current)
        elif sep and depth == 0 and name == "Driver Version":
            driver = value
        elif current is None:
            continue
        elif not sep and depth == 4:
            in_fb = name == "FB Memory Usage"
        elif sep and depth == 4 and name == "Product Name":
            current["name"] = value
        elif sep and in_fb and depth == 8 and name == "Total" and value.endswith(" MiB"):
            current["memory"] = value[:-4].strip()
    if not driver or not gpus or not all("name" in g and "memory" in g for g in gpus):
        return None
    return "\n".join(f"{g['name']}, {g['memory']}, {driver}" for g in gpus)


def _wants_fabric(checks: dict) -> bool:
    """Does one of the probe's checks run the GPU gate with the NVLink fabric expected?"""
    for argv in checks.values():
        inside = _archive_program(argv)
        if inside and inside[1] == "hoststate" and argv[3:4] == ["--gate"] and len(argv) == 5:
            try:
                return bool(json.loads(argv[4]).get("fabric"))
            except ValueError:
                return False
    return False


def fabric_states(text: str) -> list:
    """(State, Status) of every GPU's ``Fabric`` block in ``nvidia-smi -q`` output."""
    out, block, current = [], False, {}
    for line in text.splitlines():
        stripped = line.strip()
        if stripped == "Fabric":
            block, current = True, {}
            out.append(current)
            continue
        if block:
            key, sep, value = stripped.partition(":")
            if not sep:
                block = False
                continue
            if key.strip() in ("State", "Status"):
                current[key.strip()] = value.strip()
            elif len(line) - len(line.lstrip()) <= 4:
                block = False
    return [(b.get("State"), b.get("Status")) for b in out]


def nvidia_problems(want: dict, smi=None, db=None) -> list:
    """What keeps the host's NVIDIA stack from the plan's ``want``. With the probe's proof
    passed (:meth:`Memo.proven`: a healthy engine on every GPU the plan gives the host) NVML
    is not asked: the GPUs working and the NVLink fabric are what that engine proved; their
    count is the PCI bus's (and the type the simulated hardware's, on a sandbox host), the
    driver the loaded module's version; the rest is checked alike."""
    smi = smi or _smi
    problems, proven = [], bool(getattr(smi, "proven", None) and smi.proven())
    if proven:
        hw = hardware()
        driver = module_version("nvidia", hw["simulated"]) or ""
        if hw["count"] < want["count"]:
            problems.append(f"{hw['count']} GPUs on the PCI bus, the plan needs {want['count']}")
        if hw.get("name") and want["name"].upper() not in hw["name"].upper():
            problems.append(f"GPU type {hw['name']}, the plan is for {want['name']}")
    else:
        code, out = smi(SMI_QUERY)
        if code != 0:
            return [f"nvidia-smi failed ({code}): {out.splitlines()[0] if out else ''}"]
        rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]
        if len(rows) < want["count"]:
            problems.append(f"{len(rows)} GPUs visible, the plan needs {want['count']}")
        wrong = sorted({r[0] for r in rows if want["name"].upper() not in r[0].upper()})
        if wrong:
            problems.append(f"GPU type {', '.join(wrong)}, the plan is for {want['name']}")
        driver = rows[0][2] if rows and len(rows[0]) > 2 else ""
    major = int(driver.split(".")[0]) if driver[:3].isdigit() else 0
    if want["branch"] is not None and major != want["branch"]:  # None: any branch (a provided driver)
        problems.append(f"driver {driver} is not of branch {want['branch']}")
    if major < want["minimum"]:
        problems.append(f"driver {driver} is older than the minimum branch {want['minimum']}")
    least = want.get("minimum_version")
    if least and version_key(driver) < version_key(least):
        problems.append(f"driver {driver} is older than {least}, the oldest the engine's CUDA build runs on")
    if want.get("version") and driver != want["version"]:
        problems.append(f"driver {driver}, the plan pins {want['version']}")
    if want.get("driver_package"):  # None: a provided driver, installed by whatever means
        installed = package_versions([want["driver_package"]], db).get(want["driver_package"], "")
        loaded = module_version("nvidia", hardware()["simulated"])
        if not installed:  # seen on a real H200 whose image brought the driver (tests/fixtures/real_gpu_h200)
            problems.append(f"driver package {want['driver_package']} is not installed; the loaded module {loaded} "
                            "came another way (the image, a runfile): install the package, or keep that driver "
                            "with k2_gpu_stack: provided")
        elif installed.split(":")[-1].split("-")[0] != loaded:
            problems.append(f"loaded kernel module {loaded} differs from the installed driver {installed} (reboot)")
    if want.get("fabric") and not proven:
        code, out = smi(["-q"])
        states = fabric_states(out) if code == 0 else []
        bad = [s for s in states if s != ("Completed", "Success")]
        if not states or bad:
            problems.append(f"NVLink fabric not ready on {len(bad) if states else 'any'} GPU(s) "
                            f"({bad[0] if bad else 'no Fabric block'}): CUDA would fail with error 802; "
                            "check nvidia-fabricmanager (its version must equal the driver's)")
    return problems


def version_key(version: str) -> tuple:
    """``580.65.06`` → (580, 65, 6), for ordering driver versions (the planning tables use it too:
    :func:`k2fleet.planning.os_tables.version_key`).

    >>> version_key("580.65.06") < version_key("580.95.05"), version_key("")
    (True, (0,))
    """
    return tuple(int(re.match(r"[0-9]*", part)[0] or 0) for part in version.split("."))


def amd_problems(want: dict) -> list:
    hw = hardware()
    problems = []
    if module_version("amdgpu", hw["simulated"]) is None:
        problems.append("the amdgpu kernel module is not loaded")
    if hw["count"] < want["count"]:
        problems.append(f"{hw['count']} AMD GPUs on the PCI bus, the plan needs {want['count']}")
    return problems


def gate(want: dict, smi=None, db=None, systemd=None) -> int:
    """Compare the host with ``want`` until it matches or ``want['timeout']`` passes;
    print every mismatch of the last look (see the module doc). ``smi``, ``db`` and
    ``systemd``: the probe's memos (its one nvidia-smi answer per question, its one read of
    the package database, its one look at the units); standalone, each look asks anew."""
    deadline = time.monotonic() + float(want.get("timeout", 0))
    while True:
        problems = nvidia_problems(want, smi, db) if want["vendor"] == "nvidia" else amd_problems(want)
        services = want.get("services", [])
        states = systemd.states(services) if systemd is not None else None
        if states is None:  # standalone (each look asks anew), or units the probe did not show
            states = Systemd([unit_id(n) for n in services]).states(services)
        for unit, state in zip(services, states):
            if state != "active":
                problems.append(f"{unit} is {state or 'unknown'}")
        if not problems or time.monotonic() >= deadline:
            break
        time.sleep(1)
    for line in problems:
        print(f"GPU gate: {line}")
    return 1 if problems else 0


def main(argv: list | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--gate"]:
        return gate(json.loads(argv[1]))
    query = json.loads(argv[0]) if argv else {}
    checks = query.get("checks", {})
    proof, deadline = query.get("gpus_proven_by", []), time.monotonic() + CHECK_TIMEOUT_S  # one for every check
    smi = Memo(full_first=_wants_fabric(checks), awaits_proof=bool(proof), deadline=deadline)
    db, systemd, running = PackageDb(), Systemd(query.get("units", [])), {}
    try:
        running = start_checks(checks, smi, db, systemd)  # they run while the rest is read
    finally:
        smi.prove_by(proof, running)
    ib_dir, ib_simulated = ib_root()
    ib_devices = ib_hcas(ib_dir)
    report = {
        "disk_free": disk_free(query.get("disk_path", "/")),
        "mem_total": mem_total(),
        "shm_size": shm_size(),
        "nics": nics(),
        "ib_hcas": ib_devices,
        "ib_ports": ib_ports(ib_devices[:IB_MAX_DEVICES], ib_dir),
        "ib_simulated": ib_simulated,
        "files": {p: sha256_of(p) for p in query.get("files", [])},
        "exists": {p: os.path.exists(p) for p in query.get("exists", [])},
        "globs": {g: sorted(glob.glob(g)) for g in query.get("globs", [])},
        "units": systemd.show(),
        "packages": sorted(package_versions(query.get("packages", []), db)),  # the installed ones
        "gpus": gpus(smi),  # last: with proof checks, it waits for them
        "checks": finish_checks(running, deadline),
        "bootstrap": bootstrap_state(query, db),
    }
    sys.stdout.write(json.dumps(report, separators=(",", ":")) + "\n")
    sys.stdout.flush()
    return 0


def run() -> None:
    """The probe as a program: :func:`main` on ``sys.argv``, then exit at once."""
    code = main()
    sys.stdout.flush()
    os._exit(code)  # a check still running past its deadline is a daemon thread: do not wait for it


if __name__ == "__main__":
    run()
