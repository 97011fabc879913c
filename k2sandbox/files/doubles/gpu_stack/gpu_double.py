#!/usr/bin/python3
"""k2fleet TEST DOUBLE of the GPU driver stack's programs (no GPU, no kernel module).

Shipped inside the sandbox's stand-in packages (built by ``k2sandbox.driver_doubles``)
as ``/usr/lib/k2fleet-doubles/<package>/gpu_double.py`` and run through small shell
wrappers (``/usr/bin/nvidia-smi`` -> ``gpu_double.py nvidia-smi ...``). Python 3
standard library only.

Simulated state (nothing else is read or written):

- ``/etc/k2fleet-doubles/gpus.json``: the host's simulated hardware, written by the
  sandbox when it boots a host, e.g. ``{"vendor": "nvidia", "name": "NVIDIA H200",
  "count": 8, "memory_mib": 143771, "nvswitch": true}``. Missing: a host without GPUs.
- ``/run/k2fleet-doubles/nvidia/module-version``: the "loaded kernel module". Written
  by ``load-module`` (the stand-in for ``modprobe nvidia`` at boot) only when no module
  is loaded; a loaded module is never replaced, so only a reboot (``/run`` cleared)
  brings a newly installed driver into effect, as on a real host.
- ``/usr/lib/k2fleet-doubles/nvidia/installed-version``: the installed user-space
  driver (NVML) version, shipped by the ``nvidia-open`` double.
- ``/run/k2fleet-doubles/nvidia/fabric-state``: written by the fabric manager double
  while it runs (at the loaded module's version), read by ``nvidia-smi -q``.
- ``/run/k2fleet-doubles/amdgpu/module-version``: the "loaded" amdgpu module.

Commands (first argument): nvidia-smi, load-module, nvidia-persistenced,
nv-fabricmanager, nvidia-imex, nvidia-ctk, amdgpu-load-module.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

# Paths are strings, not pathlib's: nvidia-smi runs at every deploy's host probe, and pathlib
# (with urllib.parse, ipaddress) is ~2 ms of its start-up; the rare commands that write files
# (load-module, the daemons, nvidia-ctk) import it where they need it.
_join = os.path.join
HARDWARE = os.environ.get("K2FLEET_DOUBLE_HARDWARE", "/etc/k2fleet-doubles/gpus.json")
STATE = os.environ.get("K2FLEET_DOUBLE_STATE", "/run/k2fleet-doubles")
LIB = os.environ.get("K2FLEET_DOUBLE_LIB", "/usr/lib/k2fleet-doubles")
NV_MODULE = _join(STATE, "nvidia", "module-version")
FABRIC_STATE = _join(STATE, "nvidia", "fabric-state")
NV_INSTALLED = _join(LIB, "nvidia", "installed-version")
AMD_MODULE = _join(STATE, "amdgpu", "module-version")
AMD_INSTALLED = _join(LIB, "amdgpu", "installed-version")
IMEX_NODES = os.environ.get("K2FLEET_DOUBLE_IMEX_NODES", "/etc/nvidia-imex/nodes_config.cfg")
DOCKER_DAEMON_JSON = "/etc/docker/daemon.json"
RUNTIME_PATH = "/usr/bin/nvidia-container-runtime"
# CUDA version the driver branch reports in nvidia-smi's header ([cuda-rn])
CUDA_OF_BRANCH = {"580": "13.0", "590": "13.1"}

SMI_NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                 "Make sure that the latest NVIDIA driver is installed and running.")
EXIT_NO_DRIVER = 9  # NVML_ERROR_DRIVER_NOT_LOADED
EXIT_MISMATCH = 18  # NVML_ERROR_LIB_RM_VERSION_MISMATCH


def read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None


def hardware(vendor: str) -> dict | None:
    """The simulated hardware of ``vendor`` (None: no such GPUs on this host)."""
    try:
        with open(HARDWARE) as f:
            hw = json.loads(f.read())
    except (FileNotFoundError, ValueError):
        return None
    if hw.get("vendor") != vendor or int(hw.get("count", 0)) < 1:
        return None
    return hw


def write_atomic(path: str, text: str) -> None:
    from pathlib import Path
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- modules


def load_module(module: str, installed: str, vendor: str, name: str) -> int:
    """The stand-in for ``modprobe <name>`` at boot: a loaded module stays (modprobe is a
    no-op then); otherwise the installed version is "loaded" if the GPUs exist."""
    if os.path.exists(module):
        return 0
    version = read_text(installed)
    if version is None:
        print(f"modprobe: FATAL: Module {name} not found in directory /lib/modules/{os.uname().release}",
              file=sys.stderr)
        return 1
    if hardware(vendor) is None:
        print(f"modprobe: ERROR: could not insert '{name}': No such device", file=sys.stderr)
        return 1
    write_atomic(module, version + "\n")
    return 0


# --------------------------------------------------------------------------- nvidia-smi


def _gpu_fields(hw: dict, version: str, index: int) -> dict[str, tuple[str, str]]:
    """field -> (value with units, value without units)."""
    mem = str(int(hw.get("memory_mib", 0)))
    uuid = f"GPU-00000000-0000-4000-8000-{index:012d}"
    values = {
        "index": (str(index), str(index)),
        "name": (hw["name"], hw["name"]),
        "memory.total": (f"{mem} MiB", mem),
        "memory.used": ("0 MiB", "0"),
        "memory.free": (f"{mem} MiB", mem),
        "driver_version": (version, version),
        "count": (str(hw["count"]), str(hw["count"])),
        "uuid": (uuid, uuid),
        "pci.bus_id": (_bus_id(index), _bus_id(index)),
    }
    values["gpu_name"], values["gpu_uuid"] = values["name"], values["uuid"]
    return values


_HEADERS = {"memory.total": "memory.total [MiB]", "memory.used": "memory.used [MiB]",
            "memory.free": "memory.free [MiB]"}


def _bus_id(index: int) -> str:
    return f"00000000:{0x18 + 0x10 * index:02X}:00.0"


def _smi_state() -> tuple[dict | None, str | None, int]:
    """(hardware, loaded version, exit code if nvidia-smi must fail)."""
    hw = hardware("nvidia")
    loaded = read_text(NV_MODULE)
    if hw is None or loaded is None:
        print(SMI_NO_DRIVER)
        return None, None, EXIT_NO_DRIVER
    library = read_text(NV_INSTALLED)
    if library is None:
        print("nvidia-smi: error while loading shared libraries: libnvidia-ml.so.1: cannot open shared object file",
              file=sys.stderr)
        return None, None, 127
    if library != loaded:
        print("Failed to initialize NVML: Driver/library version mismatch")
        print(f"NVML library version: {'.'.join(library.split('.')[:2])}")
        return None, None, EXIT_MISMATCH
    return hw, loaded, 0


def _kv(indent: int, key: str, value: str) -> str:
    # the key padded to column 55, as a real nvidia-smi 580 prints it (tests/fixtures/real_gpu_h200)
    return f"{' ' * indent}{key}".ljust(55) + f": {value}"


def _fabric(hw: dict) -> tuple[str, str]:
    if not hw.get("nvswitch"):
        return "N/A", "N/A"
    if read_text(FABRIC_STATE) == "Completed":
        return "Completed", "Success"
    return "In Progress", "N/A"


def smi_query(hw: dict, version: str, indices: list[int]) -> str:
    """``nvidia-smi -q``: the header and, per GPU, the fields k2fleet reads."""
    lines = ["", "==============NVSMI LOG==============", "",
             _kv(0, "Timestamp", time.strftime("%a %b %d %H:%M:%S %Y")),
             _kv(0, "Driver Version", version),
             _kv(0, "CUDA Version", CUDA_OF_BRANCH.get(version.split(".")[0], "13.0")), "",
             _kv(0, "Attached GPUs", str(hw["count"]))]
    state, status = _fabric(hw)
    for i in indices:
        f = _gpu_fields(hw, version, i)
        lines += [f"GPU {_bus_id(i)}",
                  _kv(4, "Product Name", hw["name"]),
                  _kv(4, "Product Brand", "NVIDIA"),
                  _kv(4, "Persistence Mode", "Enabled"),
                  _kv(4, "GPU UUID", f["uuid"][0]),
                  _kv(4, "Minor Number", str(i)),
                  "    Fabric",
                  _kv(8, "State", state),
                  _kv(8, "Status", status),
                  _kv(8, "CliqueId", "N/A"),
                  _kv(8, "ClusterUUID", "N/A"),
                  "        Health",
                  _kv(12, "Bandwidth", "Full" if state == "Completed" else "N/A"),
                  "    FB Memory Usage",
                  _kv(8, "Total", f"{hw['memory_mib']} MiB"),
                  _kv(8, "Used", "0 MiB"),
                  _kv(8, "Free", f"{hw['memory_mib']} MiB"), ""]
    return "\n".join(lines)


def nvidia_smi(argv: list[str]) -> int:
    query = fmt = None
    full = False
    ids: str | None = None
    args = iter(argv)
    for arg in args:
        if arg.startswith("--query-gpu="):
            query = arg.split("=", 1)[1]
        elif arg.startswith("--format="):
            fmt = arg.split("=", 1)[1]
        elif arg in ("-q", "--query"):
            full = True
        elif arg in ("-i", "--id"):
            ids = next(args, "")
        elif arg.startswith("--id="):
            ids = arg.split("=", 1)[1]
        elif arg in ("-h", "--help"):
            print("NVIDIA System Management Interface -- k2fleet TEST DOUBLE (no GPU)")
            return 0
        else:
            print('Invalid combination of input arguments. Please run "nvidia-smi -h" for help.\n')
            return 2
    hw, version, code = _smi_state()
    if code:
        return code
    assert hw is not None and version is not None
    count = int(hw["count"])
    indices = list(range(count))
    if ids is not None:
        try:
            indices = [int(x) for x in ids.split(",")]
        except ValueError:
            indices = [-1]
        if not all(0 <= i < count for i in indices):
            print("No devices were found")
            return 6
    if query is not None:
        if fmt is None or not fmt.split(",")[0] == "csv":
            print('"--format=" switch is missing. Please run "nvidia-smi -h" for help.')
            return 2
        opts = set(fmt.split(",")[1:])
        names = [n.strip() for n in query.split(",") if n.strip()]
        known = _gpu_fields(hw, version, 0)
        for n in names:
            if n not in known:
                print(f'Field "{n}" is not a valid field to query.\n')
                return 2
        unit = 1 if "nounits" in opts else 0
        if "noheader" not in opts:
            print(", ".join(_HEADERS.get(n, n) if not unit else n for n in names))
        for i in indices:
            f = _gpu_fields(hw, version, i)
            print(", ".join(f[n][unit] for n in names))
        return 0
    if full:
        print(smi_query(hw, version, indices))
        return 0
    print(f"| NVIDIA-SMI {version}   Driver Version: {version}   CUDA Version: "
          f"{CUDA_OF_BRANCH.get(version.split('.')[0], '13.0')} |  (k2fleet TEST DOUBLE)")
    for i in indices:
        print(f"|   {i}  {hw['name']}  {hw['memory_mib']}MiB |")
    return 0


# --------------------------------------------------------------------------- daemons


def _daemonize(pidfile: str, on_start: str | None = None, state: str = "") -> int:
    """Type=forking: the parent writes the state file and the child's PID, exits 0; the
    child runs until SIGTERM and then removes the state file."""
    from pathlib import Path
    on_start = None if on_start is None else Path(on_start)
    if on_start is not None:
        write_atomic(on_start, state + "\n")

    def stop(_signo: int, _frame: object) -> None:
        if on_start is not None:
            on_start.unlink(missing_ok=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        write_atomic(pidfile, f"{pid}\n")
        return 0
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    while True:
        signal.pause()


def _module_matches(own: str, program: str) -> str | None:
    """None if the loaded module's version is ``own``, else the error line."""
    loaded = read_text(NV_MODULE)
    if loaded is None or hardware("nvidia") is None:
        return (f"{program}: failed to open the NVIDIA driver: no NVIDIA kernel module is loaded "
                "(modprobe nvidia; the NVIDIA device files /dev/nvidia* do not exist)")
    if loaded != own:
        return f"{program}: Driver/library version mismatch: kernel module {loaded}, {program} {own}"
    return None


def persistenced(argv: list[str]) -> int:
    own = read_text(NV_INSTALLED) or "unknown"
    error = _module_matches(own, "nvidia-persistenced")
    if error:
        print(error, file=sys.stderr)
        print("nvidia-persistenced failed to initialize. Check syslog for more details.", file=sys.stderr)
        return 1
    print(f"nvidia-persistenced {own} (k2fleet TEST DOUBLE) started; persistence mode enabled on all devices")
    return _daemonize("/run/nvidia-persistenced/nvidia-persistenced.pid")


def _own_version(package: str) -> str:
    """The version a daemon double's package shipped: ``LIB/<package>/version``, or before
    branch 580 the branch-named package's (``nvidia-fabricmanager-570``)."""
    named = sorted(d for d in (os.listdir(LIB) if os.path.isdir(LIB) else ()) if d.startswith(package + "-"))
    for name in [package, *named]:
        text = read_text(_join(LIB, name, "version"))
        if text:
            return text
    return "unknown"


def fabricmanager(argv: list[str]) -> int:
    own = _own_version("nvidia-fabricmanager")
    loaded = read_text(NV_MODULE)
    hw = hardware("nvidia")
    if loaded is None or hw is None:
        print("fabric manager failed to open the NVIDIA driver: no NVIDIA kernel module is loaded", file=sys.stderr)
        return 1
    if loaded != own:
        print(f"fabric manager NVIDIA GPU driver interface version {own} don't match with driver version "
              f"{loaded}. Please update with matching NVIDIA driver package.", file=sys.stderr)
        return 1
    if not hw.get("nvswitch"):
        print("request to query NVSwitch device information from NVSwitch driver failed with error:"
              "WARNING Nothing to do [NV_WARN_NOTHING_TO_DO]", file=sys.stderr)
        return 1
    print(f"Fabric Manager version {own} (k2fleet TEST DOUBLE) is running; "
          f"{hw['count']} GPUs, fabric state Completed")
    return _daemonize(_join(STATE, "nvidia", "nv-fabricmanager.pid"), FABRIC_STATE, "Completed")


def imex(argv: list[str]) -> int:
    own = _own_version("nvidia-imex")
    error = _module_matches(own, "nvidia-imex")
    if error:
        print(error, file=sys.stderr)
        return 1
    nodes = [line.strip() for line in (read_text(IMEX_NODES) or "").splitlines()
             if line.strip() and not line.strip().startswith("#")]
    if not nodes:
        from pathlib import Path
        print(f"IMEX nodes config file {Path(IMEX_NODES)} is missing or lists no node: cannot start the IMEX domain",
              file=sys.stderr)
        return 1
    print(f"IMEX {own} (k2fleet TEST DOUBLE) running; domain of {len(nodes)} nodes: {', '.join(nodes)}")
    return _daemonize(_join(STATE, "nvidia", "nvidia-imex.pid"), _join(STATE, "nvidia", "imex-nodes"), "\n".join(nodes))


# --------------------------------------------------------------------------- nvidia-ctk


def _option(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
    return None


def runtime_configure(argv: list[str]) -> int:
    runtime = _option(argv, "--runtime") or "docker"
    if runtime != "docker":
        print(f'level=error msg="unsupported runtime: {runtime} (k2fleet TEST DOUBLE supports docker)"',
              file=sys.stderr)
        return 1
    from pathlib import Path
    path = Path(_option(argv, "--config") or DOCKER_DAEMON_JSON)
    old = path.read_bytes() if path.exists() else b""
    try:
        config = json.loads(old) if old.strip() else {}
    except ValueError as exc:
        print(f'level=error msg="unable to load config: {path}: {exc}"', file=sys.stderr)
        return 1
    config.setdefault("runtimes", {})["nvidia"] = {"args": [], "path": RUNTIME_PATH}
    new = (json.dumps(config, indent=4, sort_keys=True) + "\n").encode()
    if new != old:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_bytes(new)
        os.replace(tmp, path)
    print(f'level=info msg="Wrote updated config to {path}"')
    print('level=info msg="It is recommended that docker daemon be restarted."')
    return 0


def cdi_spec(hw: dict) -> str:
    """A CDI spec (YAML, cdiVersion 0.5.0) naming nvidia.com/gpu=0..N-1 and ``all``; the
    edits only set environment variables (no device node exists to pass through)."""
    count = int(hw["count"])
    lines = ["---", "cdiVersion: 0.5.0", "kind: nvidia.com/gpu", "devices:"]
    for name, visible in [*((str(i), str(i)) for i in range(count)),
                          ("all", ",".join(str(i) for i in range(count)))]:
        lines += [f'- name: "{name}"', "  containerEdits:", "    env:",
                  f"    - K2FLEET_DOUBLE_VISIBLE_GPUS={visible}"]
    lines += ["containerEdits:", "  env:", "  - K2FLEET_DOUBLE_GPU_STACK=test-double"]
    return "\n".join(lines) + "\n"


def cdi_generate(argv: list[str]) -> int:
    hw = hardware("nvidia")
    if hw is None or read_text(NV_MODULE) is None:
        print('level=error msg="failed to generate CDI spec: failed to initialize NVML: '
              'ERROR_LIBRARY_NOT_FOUND"', file=sys.stderr)
        return 1
    spec = cdi_spec(hw)
    output = _option(argv, "--output")
    if not output:
        sys.stdout.write(spec)
        return 0
    write_atomic(output, spec)
    print('level=info msg="Generated CDI spec with version 0.5.0"')
    return 0


def nvidia_ctk(argv: list[str]) -> int:
    if argv[:2] == ["runtime", "configure"]:
        return runtime_configure(argv[2:])
    if argv[:2] == ["cdi", "generate"]:
        return cdi_generate(argv[2:])
    if argv[:1] in (["--version"], ["-v"]):
        print("NVIDIA Container Toolkit CLI version (k2fleet TEST DOUBLE)")
        return 0
    print(f"nvidia-ctk (k2fleet TEST DOUBLE): unsupported command: {' '.join(argv)}", file=sys.stderr)
    return 1


COMMANDS = {
    "nvidia-smi": nvidia_smi,
    "load-module": lambda argv: load_module(NV_MODULE, NV_INSTALLED, "nvidia", "nvidia"),
    "amdgpu-load-module": lambda argv: load_module(AMD_MODULE, AMD_INSTALLED, "amd", "amdgpu"),
    "nvidia-persistenced": persistenced,
    "nv-fabricmanager": fabricmanager,
    "nvidia-imex": imex,
    "nvidia-ctk": nvidia_ctk,
}


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `nvidia-smi ... | head` ends quietly, as the real one
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: gpu_double.py {{{','.join(COMMANDS)}}} ARGS...", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
