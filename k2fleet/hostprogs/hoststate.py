"""Host-side state probe: one round trip returns everything the deploy decides on.

This file is run ON THE HOST by the :class:`k2fleet.deploy.facts.HostState` fact: from the
host archive when the host's copy is the pinned one, else from its source carried in the
fact's command (a bare host), so it is standard-library only and imports nothing from
k2fleet. Input: one JSON document (argv[1]) naming what to look at; output: one JSON
document with hardware facts (GPUs, driver, disk, RAM, /dev/shm, NICs, RDMA devices and their
ports: :func:`ib_ports`) and the
state of the files, units, packages and health endpoints the deploy manages, plus what
the bootstrap decides on (OS release, kernel, Secure Boot, the GPUs on the PCI bus, the
loaded kernel module's version, installed package versions and holds).

NVML is asked once per probe (one ``nvidia-smi -q`` on NVLink hosts) unless the query's
``gpus_proven_by`` checks pass: a host whose engine answers its health check on all its GPUs
is not asked again at every re-run (see :func:`gpus`, :func:`nvidia_problems`).

``--gate JSON`` runs the same probe after the bootstrap and compares it with the
expectations in JSON (GPU count and type, driver branch — any when ``branch`` is null —,
the oldest driver version, loaded module = installed driver when a ``driver_package`` is
named, NVLink fabric state, services); it prints one line per mismatch and exits 1
(0: every expectation holds). Still read-only.

Simulated GPUs (the sandbox, TEST DOUBLES): a host whose ``/etc/k2fleet-doubles/gpus.json``
exists (written by the sandbox when it boots the host) reports that hardware instead of
the PCI bus, and the loaded module's version from the NVIDIA/AMD double packages'
``/run/k2fleet-doubles/*/module-version`` (``/run`` is emptied at every boot, like a
loaded module).
"""

from __future__ import annotations

import _thread
import os
import sys
import time

# The probe runs on every host at every deploy: it imports neither json, subprocess, threading,
# socket nor fnmatch (with re, enum, signal and collections, ~8 ms of a probe that now takes
# ~22 ms). Its own small equivalents follow (JSON through the C accelerator ``_json``, children
# through ``os.posix_spawnp``, threads through ``_thread``), each falling back to the module.


class Timeout(Exception):
    """A child process or a check did not finish in time."""


def json_loads(text):
    """``json_loads(text)`` through ``_json``'s C scanner (the ``json`` package itself
    imports re and enum); ``json.loads`` when the interpreter lacks it.

    >>> json_loads(' {"a": [1, 2.5, true, null, "\\u00e9"], "b": {}} '), json_loads(b"[]")
    ({'a': [1, 2.5, True, None, 'é'], 'b': {}}, [])
    >>> for bad in ('{"a": 1} x', '{"a": }', ''):
    ...     try:
    ...         json_loads(bad)
    ...     except ValueError:
    ...         pass
    ...     else:
    ...         print("accepted", bad)
    """
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8")
    try:
        from _json import make_scanner
        scan = make_scanner(_JsonContext)
    except (ImportError, TypeError):
        import json
        return json.loads(text)
    start = _json_space(text, 0)
    try:
        value, end = scan(text, start)
    except StopIteration as exc:
        raise ValueError(f"no JSON value at {exc.value}") from None
    if _json_space(text, end) != len(text):
        raise ValueError(f"extra data after the JSON value at {end}")
    return value


class _JsonContext:
    """What ``_json.make_scanner`` reads from ``json.JSONDecoder`` (its defaults)."""

    strict, object_hook, object_pairs_hook = True, None, None
    parse_float, parse_int = float, int
    parse_constant = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}.__getitem__


def _json_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\n\r":
        at += 1
    return at


def json_dumps(value, sort_keys: bool = False) -> str:
    """``json.dumps(value, separators=(",", ":"), sort_keys=sort_keys)`` through ``_json``'s C
    encoder (the same bytes).

    >>> v = {"b": [1, 2.5, True, None, "é\\n"], "a": {"d": 1, "c": 2}}
    >>> [json_dumps(v, k) == __import__("json").dumps(v, separators=(",", ":"), sort_keys=k) for k in (False, True)]
    [True, True]
    """
    try:
        from _json import encode_basestring_ascii, make_encoder
        encode = make_encoder({}, _json_refuse, encode_basestring_ascii, None, ":", ",", sort_keys, False, True)
        return "".join(encode(value, 0))
    except (ImportError, TypeError):
        import json
        return json.dumps(value, separators=(",", ":"), sort_keys=sort_keys)


def _json_refuse(value):
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


class Child:
    """A child process started with ``os.posix_spawnp`` (what ``subprocess.Popen`` does
    without the module's import): stdin from /dev/null, stdout and stderr to pipes
    (``capture``) or /dev/null. ``wait(timeout)`` → exit code (raises :class:`Timeout`),
    ``kill()``; ``communicate(timeout)`` → (stdout, stderr) bytes. Raises OSError when
    ``argv[0]`` cannot be started."""

    def __init__(self, argv: list, capture: bool = False):
        self.code, self.pipes = None, ()
        null = os.open(os.devnull, os.O_RDWR)
        ends = [os.pipe(), os.pipe()] if capture else []
        try:
            out, err = (ends[0][1], ends[1][1]) if capture else (null, null)
            self.pid = os.posix_spawnp(argv[0], list(argv), os.environ, file_actions=[
                (os.POSIX_SPAWN_DUP2, null, 0), (os.POSIX_SPAWN_DUP2, out, 1), (os.POSIX_SPAWN_DUP2, err, 2)],
                setsigdef=(13, 25))  # SIGPIPE, SIGXFSZ back to their defaults, as subprocess does
        except BaseException:
            for r, w in ends:
                os.close(r)
                os.close(w)
            raise
        finally:
            os.close(null)
        for _, w in ends:
            os.close(w)
        self.pipes = tuple(r for r, _ in ends)

    def communicate(self, timeout: float) -> tuple:
        """Read stdout and stderr to their end, then wait; :class:`Timeout` (the child
        killed) past ``timeout`` seconds in all."""
        import select
        deadline, chunks = time.monotonic() + timeout, {fd: [] for fd in self.pipes}
        poller = select.poll()
        for fd in self.pipes:
            poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        try:
            open_fds = set(self.pipes)
            while open_fds:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.kill()
                    raise Timeout(f"{timeout} s")
                for fd, _ in poller.poll(left * 1000):
                    data = os.read(fd, 65536)
                    if data:
                        chunks[fd].append(data)
                    else:
                        poller.unregister(fd)
                        open_fds.discard(fd)
        finally:
            for fd in self.pipes:
                os.close(fd)
            self.pipes = ()
        self.wait(max(0.0, deadline - time.monotonic()) + 1)
        return tuple(b"".join(chunks[fd]) for fd in chunks)

    def wait(self, timeout: float | None = None) -> int:
        if self.code is not None:
            return self.code
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.0002
        while True:
            pid, status = os.waitpid(self.pid, os.WNOHANG if deadline is not None else 0)
            if pid:
                self.code = os.waitstatus_to_exitcode(status)
                return self.code
            if time.monotonic() >= deadline:
                raise Timeout(f"{timeout} s")
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.02)

    def kill(self) -> None:
        if self.code is None:
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass


def run_child(argv: list, timeout: float) -> tuple:
    """(exit code, stdout text, stderr text) of ``argv`` (``subprocess.run(argv,
    capture_output=True, text=True, timeout=timeout)``). Raises OSError, :class:`Timeout`.

    >>> run_child(["sh", "-c", "echo out; echo err >&2; exit 3"], 10)
    (3, 'out\\n', 'err\\n')
    """
    child = Child(argv, capture=True)
    try:
        out, err = child.communicate(timeout)
    except Timeout:
        child.kill()  # e.g. it closed its pipes but did not exit
        child.wait()
        raise
    return child.code, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")


def matches(name: str, pattern: str) -> bool:
    """``fnmatch.fnmatchcase(name, pattern)`` without importing fnmatch and re when the
    pattern's only wildcard is ``*`` (the probe's: ``k2-*.service``, ``nvidia-*``).

    >>> [matches(n, p) for n, p in [("k2-vllm.service", "k2-*.service"), ("k2-.service", "k2-*.service"),
    ...  ("nvidia-open", "nvidia-*"), ("libnvidia", "nvidia-*"), ("a", "a"), ("ab", "a"), ("abcb", "a*b*b"), ("ab", "a[b]")]]
    [True, True, True, False, True, False, True, True]
    """
    if "?" in pattern or "[" in pattern:
        import fnmatch
        return fnmatch.fnmatchcase(name, pattern)
    parts = pattern.split("*")
    if len(parts) == 1:
        return name == pattern
    if not name.startswith(parts[0]) or len(name) < len(parts[0]) + len(parts[-1]) or not name.endswith(parts[-1]):
        return False
    at, end = len(parts[0]), len(name) - len(parts[-1])
    for middle in parts[1:-1]:
        found = name.find(middle, at, end)
        if found < 0:
            return False
        at = found + len(middle)
    return True


def on_path(name: str) -> bool:
    """Is ``name`` an executable file on PATH (or, with a ``/``, that file)? ``shutil.which``'s
    yes or no without importing shutil (~3 ms of the probe's start-up).

    >>> on_path("sh"), on_path("/bin/sh"), on_path("no-such-command-k2fleet"), on_path("/")
    (True, True, False, False)
    """
    paths = [name] if "/" in name else [os.path.join(d, name) for d in os.get_exec_path()]
    return any(os.path.isfile(p) and os.access(p, os.X_OK) for p in paths)


def glob_list(pattern: str) -> list:
    """``glob.glob(pattern)``, same names in the same order, without importing glob when only
    the last component has wildcards (the probe's patterns: ``/etc/systemd/system/k2-*.service``,
    the PCI devices): that directory's names (hidden ones only for a pattern starting with
    ``.``) that ``fnmatch`` matches, as glob lists them. Anything else goes to glob itself.

    >>> glob_list("/proc/self/sta*") == __import__("glob").glob("/proc/self/sta*")
    True
    >>> glob_list("/no-such-dir-k2fleet/*"), glob_list("/proc/self/stat") == __import__("glob").glob("/proc/self/stat")
    ([], True)
    """
    head, tail = os.path.split(pattern)
    if not head or head == pattern or _magic(head) or not _magic(tail):
        import glob
        return glob.glob(pattern)
    try:
        with os.scandir(head) as entries:
            names = [entry.name for entry in entries]
    except OSError:
        return []
    if tail[0] != ".":
        names = [n for n in names if n[0] != "."]
    return [os.path.join(head, n) for n in names if matches(n, tail)]


def _magic(text: str) -> bool:
    """Has ``text`` a glob wildcard (glob's ``has_magic``)?"""
    return "*" in text or "?" in text or "[" in text


_SHA256 = []  # the builtin sha256 constructor, once found
LARGE_FILE = 1 << 20  # from this size on, hashlib's OpenSSL sha256 (~5x faster) is worth its import


def new_sha256(size: int = 0):
    """A fresh sha256 object for ``size`` bytes. hashlib's loads OpenSSL (``_hashlib``, ~2 ms
    of every probe) and the probe hashes small files: below :data:`LARGE_FILE` it is the
    interpreter's builtin module's (``_sha2`` on 3.12+, ``_sha256`` on 3.9-3.11) when it has
    one; the digest is the same.

    >>> new_sha256().hexdigest() == new_sha256(LARGE_FILE).hexdigest() == __import__("hashlib").sha256().hexdigest()
    True
    """
    if size < LARGE_FILE:
        if not _SHA256:
            try:
                from _sha2 import sha256
            except ImportError:
                try:
                    from _sha256 import sha256
                except ImportError:
                    from hashlib import sha256
            _SHA256.append(sha256)
        return _SHA256[0]()
    import hashlib
    return hashlib.sha256()


def _run(argv: list[str]) -> str | None:
    if not on_path(argv[0]):
        return None
    try:
        return run_child(argv, 20)[1]
    except (OSError, Timeout):
        return None


SMI_QUERY = ["--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"]


def gpus(smi=None) -> dict:
    """The GPUs as NVML sees them (nvidia-smi; rocm-smi for AMD): vendor, names, memory,
    driver. When the probe's proof checks passed (:meth:`Memo.proven`), NVML is not asked:
    the vendor comes from the PCI bus, the driver is the loaded kernel module's version, no
    names or memory, and ``proven_by`` names the checks."""
    if smi is not None and getattr(smi, "proven", None) and smi.proven():
        hw = hardware()
        module = {"nvidia": "nvidia", "amd": "amdgpu"}.get(hw["vendor"] or "")
        return {"vendor": hw["vendor"], "names": [], "memory_mib": [],
                "driver": module_version(module, hw["simulated"]) if module else None, "proven_by": smi.proof}
    code, out = (smi or _smi)(SMI_QUERY)
    if code == 0 and out:
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
            data = json_loads(out)
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
            sim = json_loads(text)
        except ValueError:
            sim = {}
        return {"vendor": sim.get("vendor"), "count": int(sim.get("count", 0)), "name": sim.get("name"),
                "simulated": True}
    found: dict = {}
    for dev in glob_list("/sys/bus/pci/devices/*"):
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


def os_release() -> dict:
    out = {}
    for line in (_read("/etc/os-release") or "").splitlines():
        key, _, value = line.partition("=")
        if key in ("ID", "VERSION_ID"):
            out[key.lower()] = value.strip('"')
    return out


def secure_boot() -> bool | None:
    """UEFI Secure Boot on (True), off (False), or no UEFI variables (None)."""
    for path in glob_list("/sys/firmware/efi/efivars/SecureBoot-*"):
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        return bool(data[4:5] == b"\x01")
    return None


DPKG_DIR = "/var/lib/dpkg"
DPKG_WANT = {"unknown": "u", "install": "i", "hold": "h", "deinstall": "r", "purge": "p"}
DPKG_STATUS = {"not-installed": "n", "config-files": "c", "half-installed": "H", "unpacked": "U",
               "half-configured": "F", "triggers-awaited": "W", "triggers-pending": "t", "installed": "i"}


def dpkg_status_rows(text: str) -> list | None:
    """``dpkg-query -W -f '${db:Status-Abbrev}\\t${Package}\\t${Version}\\n'``'s rows read from
    dpkg's status file itself (deb-status(5): one stanza per package, ``Status: WANT FLAG
    STATUS``); packages not installed are left out, as ``-W`` without a pattern does. None
    when a stanza is not understood (then ask dpkg-query).

    >>> dpkg_status_rows("Package: a\\nStatus: hold ok installed\\nVersion: 1-2\\n\\n"
    ...                  "Package: b\\nStatus: purge ok not-installed\\n\\nPackage: c\\nStatus: deinstall ok config-files\\nVersion: 3\\n")
    [['hi ', 'a', '1-2'], ['rc ', 'c', '3']]
    >>> dpkg_status_rows("Package: a\\nStatus: install ok sideways\\n") is None
    True
    """
    rows = []
    for stanza in text.split("\n\n"):
        stanza = stanza.strip("\n")
        if not stanza:
            continue
        fields = {}
        for name in ("Package", "Status", "Version"):
            at = 0 if stanza.startswith(name + ": ") else stanza.find("\n" + name + ": ") + 1
            if at or stanza.startswith(name + ": "):
                end = stanza.find("\n", at)
                fields[name] = stanza[at + len(name) + 2:end if end >= 0 else len(stanza)].strip()
        want, flag, status = (fields.get("Status", "").split() + ["", "", ""])[:3]
        if not fields.get("Package") or want not in DPKG_WANT or flag not in ("ok", "reinstreq") \
                or status not in DPKG_STATUS:
            return None
        if status != "not-installed":
            rows.append([DPKG_WANT[want] + DPKG_STATUS[status] + ("R" if flag == "reinstreq" else " "),
                         fields["Package"], fields.get("Version", "")])
    return rows


class Dpkg:
    """dpkg's database, read once per probe (one read for every question: the report's
    package versions, the holds and the GPU gate's installed driver). Each row: (status
    abbreviation, package, version); ``rows()`` is None without dpkg. Read from the status
    file itself (:func:`dpkg_status_rows`: no ``dpkg-query`` process) unless dpkg's journal
    (``updates/``) holds entries not yet merged into it, or the file is not understood."""

    def __init__(self, root: str = DPKG_DIR):
        self.root, self.lock, self.seen = root, _thread.allocate_lock(), None

    def rows(self):
        with self.lock:
            if self.seen is None:
                self.seen = self._from_status_file()
                if self.seen is None:
                    out = _run(["dpkg-query", "-W", "-f", "${db:Status-Abbrev}\t${Package}\t${Version}\n"])
                    self.seen = None if out is None else [r for r in (line.split("\t") for line in out.splitlines())
                                                           if len(r) == 3]
            return self.seen

    def _from_status_file(self):
        try:
            if any(name[:1].isdigit() for name in os.listdir(os.path.join(self.root, "updates"))):
                return None  # an interrupted dpkg run: its journal is not merged yet
            with open(os.path.join(self.root, "status"), encoding="utf-8", errors="replace") as f:
                return dpkg_status_rows(f.read())
        except OSError:
            return None


def package_versions(patterns: list, dpkg=None) -> dict:
    """Installed version of every installed package matching ``patterns`` (dpkg globs).

    >>> class Db: rows = lambda self: [["ii ", "nvidia-open", "580.95.05-1"], ["rc ", "nvidia-old", "1"],
    ...                                 ["hi ", "nvidia-fabricmanager", "580.95.05-1"], ["ii ", "rsync", "3"]]
    >>> package_versions(["nvidia-*"], Db())
    {'nvidia-open': '580.95.05-1', 'nvidia-fabricmanager': '580.95.05-1'}
    """
    if not patterns:
        return {}
    rows = (dpkg or Dpkg()).rows() or []
    return {r[1]: r[2] for r in rows if r[0][1:2] == "i" and any(matches(r[1], p) for p in patterns)}


def holds(dpkg=None) -> list:
    """Packages on hold (dpkg's selection ``hold``, what ``apt-mark showhold`` lists)."""
    return sorted(r[1] for r in (dpkg or Dpkg()).rows() or [] if r[0][:1] == "h")


def reboot_required() -> list:
    """Packages that asked for a reboot (Debian/Ubuntu's /run/reboot-required.pkgs)."""
    if not os.path.exists("/run/reboot-required"):
        return []
    return sorted(set((_read("/run/reboot-required.pkgs") or "").split())) or ["(unnamed)"]


def bootstrap_state(query: dict, dpkg=None) -> dict:
    hw = hardware()
    dpkg = dpkg or Dpkg()
    return {
        "os": os_release(),
        "kernel": os.uname().release,
        "secure_boot": secure_boot(),
        "hardware": hw,
        "modules": {m: module_version(m, hw["simulated"]) for m in ("nvidia", "amdgpu")},
        "nouveau": os.path.isdir("/sys/module/nouveau"),
        "package_versions": package_versions(query.get("package_versions", []), dpkg),
        "holds": holds(dpkg),
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
    """Interface name → its addresses (``ip -j addr``'s ``ifname`` → ``addr_info[].local``),
    read over netlink (:func:`netlink_addresses`: no ``ip`` process); from ``ip`` when netlink
    cannot answer."""
    try:
        return netlink_addresses()
    except (OSError, ValueError, AttributeError):
        pass
    out = {}
    addrs = _run(["ip", "-j", "addr"])
    if addrs:
        for link in json_loads(addrs):
            out[link["ifname"]] = [a["local"] for a in link.get("addr_info", [])]
    return out


NETLINK_DEADLINE_S = 5
NETLINK_MAX_BYTES = 16 << 20  # an address dump larger than this is refused (then ``ip`` answers)


def netlink_addresses() -> dict:
    """Every interface (``if_nameindex`` order) → its IPv4/IPv6 addresses, from one
    RTM_GETADDR dump of the kernel's routing netlink socket: an address's ``IFA_LOCAL``, else
    its ``IFA_ADDRESS`` (what ``ip`` shows as ``local``). Raises OSError or ValueError."""
    import _socket
    order = sys.byteorder
    sock = _socket.socket(16, _socket.SOCK_RAW, 0)  # AF_NETLINK, NETLINK_ROUTE
    try:
        sock.settimeout(NETLINK_DEADLINE_S)
        sock.bind((0, 0))
        # nlmsghdr (len, RTM_GETADDR 22, NLM_F_REQUEST | NLM_F_DUMP, seq 1, pid 0) + ifaddrmsg (any family)
        sock.send((24).to_bytes(4, order) + (22).to_bytes(2, order) + (0x301).to_bytes(2, order)
                  + (1).to_bytes(4, order) + bytes(4) + bytes(8))
        out = {name: [] for _, name in _socket.if_nameindex()}  # the kernel's order, as ip lists them
        deadline, seen = time.monotonic() + NETLINK_DEADLINE_S, 0
        while True:
            data = sock.recv(1 << 16)
            seen += len(data)
            if not data or seen > NETLINK_MAX_BYTES or time.monotonic() > deadline:
                raise ValueError("netlink: no complete address dump")
            for kind, payload in netlink_messages(data):
                if kind == 3:  # NLMSG_DONE
                    return out
                if kind == 2:  # NLMSG_ERROR
                    raise OSError("netlink: the kernel refused the address dump")
                if kind == 20 and len(payload) >= 8:  # RTM_NEWADDR: ifaddrmsg, then its attributes
                    family, index = payload[0], int.from_bytes(payload[4:8], order)
                    found = netlink_attributes(payload[8:])
                    raw = found.get(2) or found.get(1)  # IFA_LOCAL, else IFA_ADDRESS
                    if family in (_socket.AF_INET, _socket.AF_INET6) and raw:
                        out.setdefault(_socket.if_indextoname(index), []).append(_socket.inet_ntop(family, raw))
    finally:
        sock.close()


def netlink_messages(data: bytes):
    """(type, payload) of each netlink message in one ``recv`` (``nlmsghdr``: length, type,
    flags, seq, pid; messages 4-aligned). Raises ValueError for a length out of bounds.

    >>> list(netlink_messages((20).to_bytes(4, sys.byteorder) + (2).to_bytes(2, sys.byteorder) + bytes(14)))
    [(2, b'\\x00\\x00\\x00\\x00')]
    >>> list(netlink_messages((99).to_bytes(4, sys.byteorder) + bytes(12)))
    Traceback (most recent call last):
    ValueError: netlink: a message past the answer's end
    """
    at, order = 0, sys.byteorder
    while at + 16 <= len(data):
        length, kind = int.from_bytes(data[at:at + 4], order), int.from_bytes(data[at + 4:at + 6], order)
        if length < 16 or at + length > len(data):
            raise ValueError("netlink: a message past the answer's end")
        yield kind, data[at + 16:at + length]
        at += (length + 3) & ~3


def netlink_attributes(data: bytes) -> dict:
    """Type → value of each attribute (``nlattr``/``rtattr``: length, type, value; 4-aligned)
    in ``data``. Raises ValueError for a length out of bounds.

    >>> netlink_attributes((6).to_bytes(2, sys.byteorder) + (3).to_bytes(2, sys.byteorder) + b"ab" + bytes(2))
    {3: b'ab'}
    >>> netlink_attributes((60).to_bytes(2, sys.byteorder) + (3).to_bytes(2, sys.byteorder) + b"ab")
    Traceback (most recent call last):
    ValueError: netlink: an attribute past its message's end
    """
    found, at, order = {}, 0, sys.byteorder
    while at + 4 <= len(data):
        length, kind = int.from_bytes(data[at:at + 2], order), int.from_bytes(data[at + 2:at + 4], order)
        if length < 4 or at + length > len(data):
            raise ValueError("netlink: an attribute past its message's end")
        found[kind & 0x3FFF] = data[at + 4:at + length]  # without NLA_F_NESTED / NLA_F_NET_BYTEORDER
        at += (length + 3) & ~3
    return found


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


def ib_hcas(root: str | None = None) -> list:
    return _listdir(root if root is not None else ib_root()[0])


def ib_port(path: str) -> dict:
    """One port of an RDMA device (``<root>/<dev>/ports/<n>``), as ``ibstat``/``ibv_devinfo`` see
    it: ``state`` ("4: ACTIVE"), ``phys_state`` ("5: LinkUp"), ``link_layer`` (InfiniBand or
    Ethernet), ``rate`` ("400 Gb/sec (4X NDR)"); on an Ethernet (RoCE) port also ``gids``:
    index → [GID, type ("RoCE v2", "IB/RoCE v1"), netdev] of every non-zero GID (an IB port's
    GID table is not read: the gate needs none there). Read-only; a file that cannot be read is
    left out."""
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


def ib_ports(devices: list, root: str | None = None) -> dict:
    """Device → port number → :func:`ib_port`, for each of ``devices`` present under ``root``
    (default :func:`ib_root`): what the preflight's fabric gate decides on
    (:func:`k2fleet.planning.preflight_checks.check_fabric`)."""
    root = root if root is not None else ib_root()[0]
    found = {}
    for dev in devices:
        if "/" in dev or dev in (".", "..") or not os.path.isdir(f"{root}/{dev}"):
            continue
        found[dev] = {n: ib_port(f"{root}/{dev}/ports/{n}") for n in _listdir(f"{root}/{dev}/ports") if n.isdigit()}
    return found


def sha256_of(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            h = new_sha256(os.fstat(f.fileno()).st_size)
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()
    except OSError:
        return None


UNIT_PROPERTIES = ("Id", "LoadState", "ActiveState", "UnitFileState")


def units(names: list) -> dict:
    """Unit id → its :data:`UNIT_PROPERTIES` (``systemctl show NAMES -p ...``), asked of systemd
    over its private D-Bus socket (:func:`units_over_dbus`: no systemctl process, and PID 1
    answers four properties rather than all of them); from systemctl when that socket cannot
    answer (not root, no systemd, an answer not understood)."""
    if not names:
        return {}
    try:
        return {seen["Id"]: seen for seen in units_over_dbus(names).values() if seen.get("Id")}
    except (OSError, ValueError):
        pass
    out = _run(["systemctl", "show", *names, "-p", ",".join(UNIT_PROPERTIES)]) or ""
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


SYSTEMD_PRIVATE_BUS = "/run/systemd/private"  # PID 1's own D-Bus socket (root only), what systemctl uses as root
DBUS_MAX_ANSWER = 1 << 20


def bus_label(name: str) -> str:
    """systemd's object path label of a unit name (``bus_label_escape``): every byte but a
    letter, or a digit not first, as ``_XX``.

    >>> bus_label("k2-vllm.service"), bus_label("1x@a.service")
    ('k2_2dvllm_2eservice', '_31x_40a_2eservice')
    """
    out = []
    for i, byte in enumerate(name.encode()):
        c = chr(byte)
        out.append(c if c.isascii() and (c.isalpha() or (c.isdigit() and i)) else f"_{byte:02x}")
    return "".join(out) or "_"


def _dbus_string(buf: bytearray, text: str, signature: str = "s") -> None:
    data = text.encode()
    if signature == "g":
        buf.append(len(data))
    else:
        buf.extend(bytes(-len(buf) % 4))
        buf.extend(len(data).to_bytes(4, "little"))
    buf.extend(data + b"\0")


def dbus_get(serial: int, path: str, interface: str, prop: str) -> bytes:
    """One little-endian D-Bus METHOD_CALL of ``org.freedesktop.DBus.Properties.Get(interface,
    prop)`` on ``path`` (header fields PATH, INTERFACE, MEMBER, SIGNATURE; no DESTINATION: the
    private socket is peer to peer)."""
    fields = bytearray()
    for code, signature, value in ((1, "o", path), (2, "s", "org.freedesktop.DBus.Properties"), (3, "s", "Get"),
                                   (8, "g", "ss")):
        fields.extend(bytes(-len(fields) % 8))
        fields.extend(bytes([code, 1]) + signature.encode() + b"\0")
        _dbus_string(fields, value, signature)
    body = bytearray()
    for arg in (interface, prop):
        _dbus_string(body, arg)
    head = bytearray(b"l\x01\x00\x01") + len(body).to_bytes(4, "little") + serial.to_bytes(4, "little") \
        + len(fields).to_bytes(4, "little") + fields
    head.extend(bytes(-len(head) % 8))
    return bytes(head + body)


def _dbus_read_string(data: bytes, at: int, signature: str) -> tuple:
    if signature == "g":
        if at >= len(data) or at + 1 + data[at] >= len(data):
            raise ValueError("D-Bus: a signature past the message's end")
        size = data[at]
        return data[at + 1:at + 1 + size].decode(), at + 2 + size
    at += -at % 4
    size = int.from_bytes(data[at:at + 4], "little")
    if at + 4 + size >= len(data):
        raise ValueError("D-Bus: a string past the message's end")
    return data[at + 4:at + 4 + size].decode(), at + 5 + size


def units_over_dbus(names: list, timeout: float = 5.0, socket_path: str = SYSTEMD_PRIVATE_BUS) -> dict:
    """Each of ``names`` → its :data:`UNIT_PROPERTIES`, asked of systemd on its private
    socket: EXTERNAL authentication as this user, then one ``Properties.Get`` per unit and
    property, all sent at once, the answers matched by serial. Raises OSError (no socket, not
    root, a timeout) or ValueError (anything not understood: big-endian, an error reply, a
    non-string answer, more than :data:`DBUS_MAX_ANSWER` bytes or ``timeout`` seconds in all)."""
    import _socket
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(socket_path)
        sock.sendall(b"\0AUTH EXTERNAL " + str(os.geteuid()).encode().hex().encode() + b"\r\n")
        line = b""
        while not line.endswith(b"\r\n"):
            chunk = sock.recv(512)
            if not chunk or len(line) > 512:
                raise ValueError("D-Bus: no answer to AUTH")
            line += chunk
        if not line.startswith(b"OK "):
            raise ValueError("D-Bus: authentication refused")
        calls, out = {}, bytearray(b"BEGIN\r\n")
        for name in names:
            for prop in UNIT_PROPERTIES:
                calls[len(calls) + 1] = (name, prop)
                out += dbus_get(len(calls), "/org/freedesktop/systemd1/unit/" + bus_label(name),
                                "org.freedesktop.systemd1.Unit", prop)
        sock.sendall(bytes(out))
        result, data, total, deadline = {name: {} for name in names}, b"", 0, time.monotonic() + timeout
        while calls:
            while True:  # one whole message in data
                if len(data) >= 16:
                    if data[:1] != b"l":
                        raise ValueError("D-Bus: not a little-endian message")
                    body_size, fields_size = int.from_bytes(data[4:8], "little"), int.from_bytes(data[12:16], "little")
                    start = 16 + fields_size + (-(16 + fields_size) % 8)
                    if len(data) >= start + body_size:
                        break
                sock.settimeout(max(0.01, deadline - time.monotonic()))  # in all, not per recv
                chunk = sock.recv(65536)
                total += len(chunk)
                if not chunk or total > DBUS_MAX_ANSWER or time.monotonic() > deadline:
                    raise ValueError("D-Bus: no whole answer")
                data += chunk
            kind, at, reply, signature = data[1], 16, None, ""
            while at < 16 + fields_size:
                at += -at % 8
                if at >= 16 + fields_size:
                    break
                code = data[at]
                value_type, at = _dbus_read_string(data, at + 1, "g")
                if value_type == "u":
                    at += -at % 4
                    value, at = int.from_bytes(data[at:at + 4], "little"), at + 4
                elif value_type in ("s", "o", "g"):
                    value, at = _dbus_read_string(data, at, value_type)
                else:
                    raise ValueError(f"D-Bus: a header field of type {value_type!r}")
                if code == 5:
                    reply = value
                elif code == 8:
                    signature = value
            body, data = data[start:start + body_size], data[start + body_size:]
            if reply not in calls:
                continue  # a signal or anything else not asked for
            name, prop = calls.pop(reply)
            if kind != 2 or signature != "v" or body[:3] != b"\x01s\x00":
                raise ValueError(f"D-Bus: no string {prop} of {name}")
            result[name][prop] = _dbus_read_string(body, 3, "s")[0]
        return result
    finally:
        sock.close()


def unit_id(name: str) -> str:
    """systemd's id of ``name``: ``X`` is ``X.service``."""
    return name if "." in name else name + ".service"


class Systemd:
    """The probe's units as :func:`units` saw them (systemd's bus, else ``systemctl show``),
    asked once (the report and the GPU gate check both read it).

    >>> sd = Systemd(["k2-vllm.service", "nvidia-fabricmanager.service"])
    >>> sd.seen = {"nvidia-fabricmanager.service": {"ActiveState": "failed"}}
    >>> sd.states(["nvidia-fabricmanager", "k2-vllm.service"]), sd.states(["nvidia-persistenced"])
    (['failed', 'unknown'], None)
    """

    def __init__(self, names: list):
        self.names, self.lock, self.seen = list(names), _thread.allocate_lock(), None

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


def packages(names: list, dpkg=None) -> list:
    """The installed ones of ``names``."""
    return sorted(package_versions(names, dpkg))


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


class _Check:
    """One check run in a thread of this process: ``code`` is its exit code once done. The
    GPU gate (``hoststate --gate``) is this module's own :func:`gate`, sharing the probe's
    nvidia-smi answers (``smi``), its one read of dpkg's database (``dpkg``) and its one look
    at the units (``systemd``)."""

    def __init__(self, archive: str, program: str, args: list, smi=None, dpkg=None, systemd=None):
        if archive not in sys.path:
            sys.path.insert(0, archive)  # the archive's own modules, never the host's
        self.code, self.smi, self.dpkg, self.systemd = None, smi, dpkg, systemd
        self.done = _thread.allocate_lock()  # held until the check has its code
        self.done.acquire()
        _thread.start_new_thread(self._run, (program, args))  # dies with the probe (os._exit), like a daemon

    def _run(self, program: str, args: list) -> None:
        code = 1  # a check that breaks has failed
        try:
            if program == "hoststate" and args[:1] == ["--gate"] and len(args) == 2:
                code = gate(json_loads(args[1]), self.smi, self.dpkg, self.systemd)
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
            self.done.release()

    def wait(self, timeout: float):
        if not self.done.acquire(timeout=max(0.0, timeout)):
            raise Timeout(f"{timeout} s")
        self.done.release()
        return self.code

    def kill(self) -> None:  # a thread cannot be killed: it is a daemon and dies with the probe
        pass


def start_checks(named: dict, smi=None, dpkg=None, systemd=None) -> dict:
    """Start every named argv at once (when its program exists): name → running check or
    None. The archive's read-only programs run as threads of this process (their output
    discarded: stdout and stderr point at /dev/null until :func:`finish_checks`), other
    argv as processes. They run while the rest of the report is gathered."""
    started = {}
    quiet = None
    for name, argv in named.items():
        inside = _archive_program(argv)
        if inside:
            if quiet is None:
                quiet = open(os.devnull, "w")
                sys.stdout, sys.stderr = quiet, quiet
            started[name] = _Check(inside[0], inside[1], argv[3:], smi, dpkg, systemd)
            continue
        if not os.path.exists(argv[1] if argv[0].endswith("python3") and len(argv) > 1 else argv[0]):
            started[name] = None
            continue
        answered = _nft_list_chain(argv)
        if answered is not None:
            started[name] = answered
            continue
        try:
            started[name] = Child(argv)
        except OSError:
            started[name] = None
    return started


class _Answered:
    """A check the probe answered itself: its exit code, at once."""

    def __init__(self, code: int):
        self.code = code

    def wait(self, timeout: float) -> int:
        return self.code

    def kill(self) -> None:
        pass


NFT_FAMILIES = {"ip": 2, "ip6": 10, "inet": 1, "arp": 3, "bridge": 7, "netdev": 5}  # NFPROTO_*


def _nft_list_chain(argv: list):
    """``nft list chain FAMILY TABLE CHAIN`` (the firewall's check) answered over netlink,
    as :class:`_Answered` (0: the chain exists, 1: it does not), without starting nft; None
    for any other argv, or when netlink cannot answer (then nft runs)."""
    if len(argv) != 6 or not argv[0].endswith("/nft") or argv[1:3] != ["list", "chain"] \
            or argv[3] not in NFT_FAMILIES:
        return None
    try:
        found = nft_chain_exists(NFT_FAMILIES[argv[3]], argv[4], argv[5])
    except (OSError, ValueError):
        return None
    return _Answered(0 if found else 1)


def nft_chain_exists(family: int, table: str, chain: str) -> bool:
    """Does nftables hold ``chain`` in ``table`` of ``family`` (an NFPROTO_* number)? One
    NFT_MSG_GETCHAIN over the kernel's netfilter netlink socket (what ``nft list chain``
    asks). Raises OSError (e.g. no CAP_NET_ADMIN) or ValueError (an answer not understood)."""
    import _socket
    order = sys.byteorder

    def attribute(kind: int, text: str) -> bytes:
        data = text.encode() + b"\0"
        return (4 + len(data)).to_bytes(2, order) + kind.to_bytes(2, order) + data + bytes(-len(data) % 4)

    # nfgenmsg (family, NFNETLINK_V0, res_id 0), then NFTA_CHAIN_TABLE (1) and NFTA_CHAIN_NAME (3)
    body = bytes([family, 0, 0, 0]) + attribute(1, table) + attribute(3, chain)
    # nlmsghdr: (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETCHAIN, NLM_F_REQUEST | NLM_F_ACK, seq 1
    message = (16 + len(body)).to_bytes(4, order) + (0x0A04).to_bytes(2, order) + (5).to_bytes(2, order) \
        + (1).to_bytes(4, order) + bytes(4) + body
    sock = _socket.socket(16, _socket.SOCK_RAW, 12)  # AF_NETLINK, NETLINK_NETFILTER
    try:
        sock.settimeout(NETLINK_DEADLINE_S)
        sock.bind((0, 0))
        sock.send(message)
        found = False
        for _ in range(8):  # the chain (NFT_MSG_NEWCHAIN), then the ack; or an error alone
            for kind, payload in netlink_messages(sock.recv(1 << 16)):
                if kind == 0x0A03:  # NFT_MSG_NEWCHAIN
                    found = True
                elif kind == 2:  # NLMSG_ERROR: its error number, then the request; 0 is the ack
                    if len(payload) < 4:
                        raise ValueError("netlink: an error message without its number")
                    error = int.from_bytes(payload[:4], order, signed=True)
                    if error == 0:
                        return found
                    if error == -2:  # ENOENT: no such table or chain
                        return False
                    raise OSError(-error, "netlink: nftables refused the question")
        raise ValueError("netlink: no answer from nftables")
    finally:
        sock.close()


def finish_checks(started: dict, deadline: float | None = None) -> dict:
    """Each started check's exit code (None: not run, or past ``deadline``: the probe's, else
    :data:`CHECK_TIMEOUT_S` from now); the probe's own stdout and stderr are back when it returns."""
    deadline = time.monotonic() + CHECK_TIMEOUT_S if deadline is None else deadline
    result = {}
    for name, proc in started.items():
        if proc is None:
            result[name] = None
            continue
        try:
            result[name] = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except Timeout:
            proc.kill()
            if isinstance(proc, Child):
                proc.wait()
            result[name] = None
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    return result


def _smi(args: list) -> tuple:
    """(exit code, output) of nvidia-smi (127: not installed)."""
    if not on_path("nvidia-smi"):
        return 127, "nvidia-smi: not installed"
    try:
        code, out, err = run_child(["nvidia-smi", *args], 60)
    except (OSError, Timeout) as exc:
        return 1, str(exc) or "nvidia-smi: no answer in 60 s"
    return code, (out if code == 0 else out + err).strip()


class Memo:
    """``_smi`` remembered for one probe: the report and the GPU gate check ask nvidia-smi
    the same questions once (one lock per question: different ones run at once). With
    ``full_first`` (the probe will read ``nvidia-smi -q`` anyway: the gate checks the NVLink
    fabric), the CSV question is answered from that one ``-q`` (:func:`csv_from_full`): one
    nvidia-smi, so one NVML start, per probe; it is asked itself only when ``-q`` cannot
    answer it."""

    def __init__(self, smi=None, full_first: bool = False, awaits_proof: bool = False, deadline: float | None = None):
        self.smi, self.lock, self.locks, self.seen = smi or _smi, _thread.allocate_lock(), {}, {}
        self.full_first, self.verdict_lock = full_first, _thread.allocate_lock()
        self.deadline = time.monotonic() + CHECK_TIMEOUT_S if deadline is None else deadline  # the probe's, for its checks
        self.proof, self.started, self.verdict = [], {}, None  # see proven()
        self.unproven, self.awaiting = _thread.allocate_lock(), awaits_proof  # held until prove_by()
        if awaits_proof:
            self.unproven.acquire()

    def prove_by(self, names: list, started: dict) -> None:
        """Let the checks ``names`` (of the probe's ``started`` ones, every one started by
        now) stand in for NVML. Until this is called, :meth:`proven` waits (a check started
        before the proof, e.g. the GPU gate, must not decide without it)."""
        self.proof, self.started = [n for n in names if n in started], started
        if self.awaiting:
            self.awaiting = False
            self.unproven.release()

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
        if not self.unproven.acquire(timeout=max(0.0, self.deadline - time.monotonic())):
            return False
        self.unproven.release()
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
            mine = self.locks.setdefault(key, _thread.allocate_lock())
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
    except Timeout:
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
                return bool(json_loads(argv[4]).get("fabric"))
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


def nvidia_problems(want: dict, smi=None, dpkg=None) -> list:
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
        installed = package_versions([want["driver_package"]], dpkg).get(want["driver_package"], "")
        loaded = module_version("nvidia", hardware()["simulated"])
        if installed.split(":")[-1].split("-")[0] != loaded:
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
    out = []
    for part in version.split("."):
        digits = ""
        for c in part:
            if not c.isdigit():
                break
            digits += c
        out.append(int(digits or 0))
    return tuple(out)


def amd_problems(want: dict) -> list:
    hw = hardware()
    problems = []
    if module_version("amdgpu", hw["simulated"]) is None:
        problems.append("the amdgpu kernel module is not loaded")
    if hw["count"] < want["count"]:
        problems.append(f"{hw['count']} AMD GPUs on the PCI bus, the plan needs {want['count']}")
    return problems


def gate(want: dict, smi=None, dpkg=None, systemd=None) -> int:
    """Compare the host with ``want`` until it matches or ``want['timeout']`` passes;
    print every mismatch of the last look (see the module doc). ``smi``, ``dpkg`` and
    ``systemd``: the probe's memos (its one nvidia-smi answer per question, its one read of
    dpkg's database, its one look at the units); standalone, each look asks anew."""
    deadline = time.monotonic() + float(want.get("timeout", 0))
    while True:
        problems = nvidia_problems(want, smi, dpkg) if want["vendor"] == "nvidia" else amd_problems(want)
        services = want.get("services", [])
        states = systemd.states(services) if systemd is not None else None
        if states is None:  # standalone (each look asks anew), or units the probe did not show
            states = Systemd([unit_id(n) for n in services]).states(services)
        for unit, state in zip(services, states):
            if state != "active":
                problems.append(f"{unit} is {state or 'unknown'}")
        if not problems or time.monotonic() >= deadline:
            break
        time.sleep(2)
    for line in problems:
        print(f"GPU gate: {line}")
    return 1 if problems else 0


def main(argv: list | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--gate"]:
        return gate(json_loads(argv[1]))
    query = json_loads(argv[0]) if argv else {}
    checks = query.get("checks", {})
    proof, deadline = query.get("gpus_proven_by", []), time.monotonic() + CHECK_TIMEOUT_S  # one for every check
    smi = Memo(full_first=_wants_fabric(checks), awaits_proof=bool(proof), deadline=deadline)
    dpkg, systemd, running = Dpkg(), Systemd(query.get("units", [])), {}
    try:
        running = start_checks(checks, smi, dpkg, systemd)  # they run while the rest is read
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
        "globs": {g: sorted(glob_list(g)) for g in query.get("globs", [])},
        "units": systemd.show(),
        "packages": packages(query.get("packages", []), dpkg),
        "gpus": gpus(smi),  # last: with proof checks, it waits for them
        "checks": finish_checks(running, deadline),
        "bootstrap": bootstrap_state(query, dpkg),
    }
    sys.stdout.write(json_dumps(report) + "\n")
    sys.stdout.flush()
    return 0


def run() -> None:
    """The probe as a program: :func:`main` on ``sys.argv``, then exit at once."""
    code = main()
    sys.stdout.flush()
    os._exit(code)  # a check still running past its deadline is a daemon thread: do not wait for it


if __name__ == "__main__":
    run()
