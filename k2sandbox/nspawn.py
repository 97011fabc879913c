"""Sandbox fleet: N local Debian bookworm hosts booted with systemd-nspawn.

Each sandbox host is a real Debian bookworm userland with systemd as PID 1
and sshd, booted by ``systemd-nspawn --boot`` over a writable overlay on top
of one shared, cached root filesystem.  Every host lives in its own network
namespace, joined to the bridge ``k2sb0`` (10.213.0.1/24) on the control
machine by a veth pair.  Hosts reach the control machine and each other and
have no default route, so nothing else is reachable from them.

Layout::

    /var/cache/k2fleet/sandbox-rootfs/<hash>/   shared lower root fs (cache)
    STATE/id_ed25519{,.pub}                      sandbox control key pair
    STATE/known_hosts                            host keys pinned by IP
    STATE/hosts.json                             inventory for the deploy
    STATE/hosts/k2sb-N/{upper,work,root,docker}  per-host overlay + docker dir
    STATE/run/k2sb-N.pid, STATE/logs/k2sb-N.log  nspawn pid and console log
    STATE/run/k2sb-N.supervisor, .boots          its supervisor's pid, boots so far
    STATE/shared/                                bound at /mnt/k2shared on every host

``/mnt/k2shared`` is the sandbox's shared storage: one directory of the control
machine bind-mounted into every host, so all hosts see the same files, inodes and
mtimes, as they would on an NFS or Lustre mount (``k2_shared_storage``).

Reboots: each host's ``systemd-nspawn`` runs under a small supervisor (this module run
as ``sandbox.py supervise``, see :func:`supervise`), which starts it again with the same
command when it exits with status 133 (:data:`REBOOT_EXIT_STATUS`: the container's
systemd rebooted) and exits itself on any other status, so a host whose init was killed
stays down. The overlay root, the netns with its veth and the docker dir live outside
nspawn and survive a reboot; ``/run`` (a tmpfs of the container) does not. Every boot
runs in a fresh time namespace whose CLOCK_BOOTTIME starts at 0, so ``/proc/uptime``
restarts on a reboot as on a real machine (pyinfra's ``server.reboot`` confirms a reboot
by a smaller uptime); CLOCK_MONOTONIC stays the control machine's, so systemd's monotonic
timestamps still compare across hosts.

Simulated hardware: ``up(..., hardware=simulated_hardware("h200", 8))`` writes the GPU
description the NVIDIA/AMD TEST DOUBLE packages read to every host's
``/etc/k2fleet-doubles/gpus.json`` (:data:`HARDWARE_FILE`) before it boots; ``up(...,
fabric=[spec, ...])`` lays, per host, the TEST DOUBLE ``/sys/class/infiniband`` tree of
:func:`k2sandbox.fabric_doubles.devices_of` at ``/etc/k2fleet-doubles/infiniband`` (the host
probe reads it there), so each host may have its own ports (one DOWN, say).

Inventories: ``inventories/sandbox.py`` (every host) and
``inventories/sandbox-trtllm-mpi.py`` (the first 2) take their hosts from ``hosts.json``
through :func:`sandbox_inventory_hosts`; their fleet data is :mod:`k2sandbox.inventory_data`.

One user at a time: the sandbox's names (bridge, netns, hosts) are global, so whoever
boots or uses it holds :func:`hold_sandbox_lock` (``/tmp/k2sb.lock``).

Usage: ``python -m k2sandbox.nspawn up 3 | down | status``.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from k2fleet.control.aptroot import AptRootError, apt_mirror
from k2fleet.control.cache_dirs import build_once

# Which of the machine's sandbox fleets this process drives: 0 (the default) is the one a user
# brings up; the suite runs a second one (1) beside it in its other xdist worker (tests/conftest.py).
# Each instance has its own names, subnets, lock and state directory, so two never meet; the rootfs
# cache and the other caches are shared, each built under its own lock.
INSTANCE_ENV = "K2FLEET_SANDBOX_INSTANCE"
INSTANCE = int(os.environ.get(INSTANCE_ENV, "0") or 0)
if not 0 <= INSTANCE <= 9:
    raise SystemExit(f"{INSTANCE_ENV} must be 0..9, got {INSTANCE}")
# (K2FLEET_SANDBOX_DIR names one instance's directory: set, it is that instance's whatever N is)
DEFAULT_STATE_DIR = Path(os.environ.get("K2FLEET_SANDBOX_DIR", "/var/lib/k2fleet-sandbox"
                                        + (f"-{INSTANCE}" if INSTANCE else "")))
SHARED_MOUNT = "/mnt/k2shared"  # every host's view of STATE/shared (the sandbox's shared storage)
ROOTFS_CACHE = Path(os.environ.get("K2FLEET_SANDBOX_CACHE", "/var/cache/k2fleet/sandbox-rootfs"))

SUITE = "bookworm"
HOST_OS = "debian-12"  # the k2_os of sandbox hosts (the bootstrap's package table)
VARIANT = "minbase"
# minbase + systemd, sshd, Python, iproute2, sudo, D-Bus, plus the CA bundle, openssl and rsync,
# which server images carry, and Python's distutils and lib2to3 (python3-venv's dependencies),
# kept here only for time: each cost every bare sandbox host CPU-seconds at its first deploy
# (update-ca-certificates and py3compile mostly; measured 2026-11-27 by sampling /proc over a 2-host
# rehearsal: 18 of its 28 CPU-seconds were on the hosts, 12 of them installing packages). The
# deploy still installs the rest from its bundle: python3-venv, nftables, the GPU stack, Docker.
PACKAGES: tuple[str, ...] = (
    "systemd",
    "systemd-sysv",
    "openssh-server",
    "python3",
    "iproute2",
    "sudo",
    "dbus",
    "ca-certificates",
    "openssl",
    "rsync",
    "python3-distutils",
    "python3-lib2to3",
)
# Bump when the post-debootstrap image tweaks change, to invalidate the cache.
IMAGE_REVISION = 5  # 3: upgraded to the suite's -updates pocket, no package index; 4: built under a lock, IMAGE_MARKER; 5: and -security
IMAGE_MARKER = "etc/k2sandbox-image"  # written last: the image is whole (its content: the cache key)

PREFIX = f"k2s{INSTANCE}" if INSTANCE else "k2sb"  # of every name the instance makes: hosts, netns, links
BRIDGE = f"{PREFIX}0"
SUBNET = f"10.213.{2 * INSTANCE}"
BRIDGE_ADDRESS = f"{SUBNET}.1"
PREFIX_LEN = 24
# a company-shaped sandbox's fleet subnet (k2sandbox.company_network), on the same bridge: the
# control machine holds an "unreachable" route for it while the sandbox is up, so a connection
# there fails here instead of leaving by the default route
COMPANY_SUBNET = f"10.213.{2 * INSTANCE + 1}"
FIRST_HOST_OCTET = 11
MAX_HOSTS = 200
HOST_NIC = "eth0"  # every host's one interface (its veth end, renamed inside its netns)
LOCK_PATH = f"/tmp/{PREFIX}.lock"

CONTROL_TOOLS: dict[str, str] = {
    "debootstrap": "debootstrap",
    "systemd-nspawn": "systemd-container",
    "ip": "iproute2",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
}

BOOT_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0

# systemd-nspawn's exit status when the container rebooted (its EXIT_FORCE_RESTART, which
# systemd-nspawn@.service restarts on with RestartForceExitStatus=133); verified with
# systemd 252: `systemctl reboot` in a host makes its nspawn exit 133.
REBOOT_EXIT_STATUS = 133
# A supervisor gives up after this many reboots within REBOOT_WINDOW_S (a reboot loop).
MAX_QUICK_REBOOTS = 5
REBOOT_WINDOW_S = 30.0
# Read by the NVIDIA/AMD TEST DOUBLE packages on a sandbox host (path inside the host).
HARDWARE_FILE = "/etc/k2fleet-doubles/gpus.json"

SSHD_DROPIN = """\
# k2fleet sandbox: root by key only, one pre-generated host key.
HostKey /etc/ssh/ssh_host_ed25519_key
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UseDNS no
"""


class SandboxError(RuntimeError):
    """Raised when the sandbox cannot be built, booted or torn down."""


@dataclass(frozen=True)
class SandboxHost:
    """One sandbox host as written to ``hosts.json``."""

    name: str
    address: str
    ssh_user: str
    ssh_key: str
    ssh_known_hosts_file: str


# --------------------------------------------------------------------------
# small helpers


def run(cmd: list[str], *, check: bool = True, capture: bool = True,
        env: dict[str, str] | None = None, timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` without a shell; raise SandboxError with stderr on failure."""
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=capture, text=True,
                          env=env, timeout=timeout)
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout or "").strip() if capture else ""
        raise SandboxError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{detail}")
    return proc


def host_name(index: int) -> str:
    """Name (hostname and netns name) of host ``index`` (1-based)."""
    return f"{PREFIX}-{index}"


def host_address(index: int) -> str:
    """IPv4 address of host ``index`` (1-based)."""
    return f"{SUBNET}.{FIRST_HOST_OCTET + index - 1}"


def veth_names(index: int) -> tuple[str, str]:
    """(bridge side, namespace side) veth names for host ``index``; <=15 chars."""
    return f"{PREFIX}v{index}", f"{PREFIX}c{index}"


def _paths(state_dir: Path) -> dict[str, Path]:
    """Well-known paths inside ``state_dir``."""
    return {
        "key": state_dir / "id_ed25519",
        "known_hosts": state_dir / "known_hosts",
        "hosts_json": state_dir / "hosts.json",
        "hosts": state_dir / "hosts",
        "run": state_dir / "run",
        "logs": state_dir / "logs",
        "shared": state_dir / "shared",
    }


def _require_root() -> None:
    if os.geteuid() != 0:
        raise SandboxError("the sandbox needs root (netns, bridges, systemd-nspawn)")


# --------------------------------------------------------------------------
# control machine tools


def ensure_tools() -> None:
    """Install the control machine packages the sandbox needs, if missing."""
    missing = sorted({pkg for tool, pkg in CONTROL_TOOLS.items() if shutil.which(tool) is None})
    if not missing:
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    if run(install, check=False, env=env).returncode != 0:
        run(["apt-get", "update", "-q"], env=env)
        run(install, env=env)


# --------------------------------------------------------------------------
# root filesystem cache


def rootfs_key() -> str:
    """Cache key: hash of everything that determines the root fs contents."""
    spec = {"suite": SUITE, "variant": VARIANT, "packages": sorted(PACKAGES), "rev": IMAGE_REVISION}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _mounts_under(path: Path) -> list[str]:
    """Mount points at or below ``path``, deepest first."""
    prefix = str(path.resolve())
    points = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        point = line.split()[1].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return sorted(points, key=len, reverse=True)


def _unmount_all(path: Path) -> None:
    """Unmount everything at or below ``path``; raise if something stays mounted."""
    for point in _mounts_under(path):
        run(["umount", point], check=False)
        if point in _mounts_under(path):
            run(["umount", "--lazy", point], check=False)
    left = _mounts_under(path)
    if left:
        raise SandboxError(f"still mounted under {path}: {left}")


def _namespace_inits(pid: int) -> list[int]:
    """The children of ``pid`` that are PID 1 of a PID namespace of their own (an nspawn's
    container init)."""
    kids = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            kids += children.read_text().split()
        except OSError:
            continue
    return [int(kid) for kid in kids if _is_namespace_init(kid)]


def _is_namespace_init(pid: int | str) -> bool:
    """Whether ``pid`` (as the control machine sees it) is PID 1 of a PID namespace of its own."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    nspids = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
    return len(nspids) > 1 and nspids[-1] == "1"


def _vanished_is_fine(function, path, exc_info) -> None:
    """rmtree's error handler: an entry already gone is what removing it wanted."""
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


def _safe_rmtree(path: Path) -> None:
    """Remove ``path`` after making sure nothing is mounted below it."""
    if not path.exists() and not path.is_symlink():
        return
    _unmount_all(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, onerror=_vanished_is_fine)
    else:
        path.unlink()


def _prepare_image(root: Path) -> None:
    """Make a fresh debootstrap tree host-neutral (no shared identity)."""
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    (root / "etc/machine-id").write_text("")
    dbus_id = root / "var/lib/dbus/machine-id"
    if dbus_id.exists() or dbus_id.is_symlink():
        dbus_id.unlink()
    (root / "etc/ssh/sshd_config.d").mkdir(parents=True, exist_ok=True)
    (root / "etc/ssh/sshd_config.d/k2fleet-sandbox.conf").write_text(SSHD_DROPIN)
    for deb in (root / "var/cache/apt/archives").glob("*.deb"):
        deb.unlink()


UPGRADE_LIST = "etc/apt/sources.list.d/k2sb-image-upgrade.list"


def _upgrade_image(root: Path, mirror: str, security_mirror: str) -> None:
    """Bring a fresh debootstrap tree (the suite's release pocket) to the suite's ``-updates``
    pocket from ``mirror``, the one debootstrap used, and to its ``-security`` suite from
    ``security_mirror`` (this machine's): a host kept current, as a real fleet's are. A deploy from a
    bundle resolved through the same archives then upgrades nothing it installs (it upgraded
    python3.11 on every bare host otherwise, for python3.11-venv's exact pin: ~3 CPU-seconds each,
    its stdlib byte-compiled again). A bundle through a company mirror needs that mirror's security
    archive too (``k2_os_security_mirror``, tests/test_company_network.py), as a real current host does."""
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND": "noninteractive", "LC_ALL": "C"}
    sources = root / UPGRADE_LIST
    sources.write_text(f"deb {mirror} {SUITE}-updates main\ndeb {security_mirror} {SUITE}-security main\n")
    try:
        run(["chroot", str(root), "apt-get", "-q", "update"], env=env, timeout=600)
        run(["chroot", str(root), "apt-get", "-q", "-y", "-o", "Dpkg::Options::=--force-confold", "upgrade"],
            env=env, timeout=900)
        run(["chroot", str(root), "apt-get", "clean"], env=env)
    finally:
        sources.unlink(missing_ok=True)
    # no package index, as a host whose image was cleaned (apt-get update never ran): the deploy reads
    # its bundle's index only, and every apt run after an index change rebuilt a cache of the whole
    # archive's 60k packages otherwise (0.9 CPU-seconds each on a sandbox host, measured 2026-11-27)
    for listed in (root / "var/lib/apt/lists").iterdir():
        if listed.is_file() and listed.name != "lock":
            listed.unlink()


def ensure_rootfs(cache: Path = ROOTFS_CACHE) -> Path:
    """Return the cached root fs, building it with debootstrap if missing (once: under the
    cache's lock, so two sandbox instances booting at once build it once and never replace
    the one the other's hosts run on)."""
    def make(tmp: Path) -> None:
        try:
            mirror, security_mirror = apt_mirror(SUITE), apt_mirror(f"{SUITE}-security", security=True)
        except AptRootError as exc:
            raise SandboxError(f"{exc}; the sandbox image is built from this machine's Debian archive and its "
                               "security archive, both named in its apt sources") from exc
        try:
            run(["debootstrap", f"--variant={VARIANT}", f"--include={','.join(PACKAGES)}", SUITE, str(tmp), mirror])
            _upgrade_image(tmp, mirror, security_mirror)
            _prepare_image(tmp)
        except BaseException:
            _unmount_all(tmp)  # what a failed debootstrap left mounted: the next build removes the rest
            raise
        (tmp / IMAGE_MARKER).write_text(rootfs_key() + "\n")

    return build_once(cache / rootfs_key(), IMAGE_MARKER, make)


# --------------------------------------------------------------------------
# keys and per-host files


def ensure_control_key(state_dir: Path) -> Path:
    """Create the sandbox control key pair once; return the private key path."""
    key = _paths(state_dir)["key"]
    if not key.exists():
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "k2fleet-sandbox", "-f", str(key)])
    return key


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    """Write ``text`` to ``path`` with ``mode``, creating parents."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def prepare_upper(upper: Path, index: int, count: int, pubkey: str) -> str:
    """Seed a host's overlay upper dir with its identity; return its host pubkey line."""
    name = host_name(index)
    _write(upper / "etc/hostname", f"{name}\n")
    _write(upper / "etc/machine-id", f"{uuid.uuid4().hex}\n", 0o444)
    hosts = ["127.0.0.1 localhost", f"127.0.1.1 {name}", "::1 localhost ip6-localhost ip6-loopback",
             f"{BRIDGE_ADDRESS} {PREFIX}-control"]
    hosts += [f"{host_address(i)} {host_name(i)}" for i in range(1, count + 1)]
    _write(upper / "etc/hosts", "\n".join(hosts) + "\n")
    (upper / "root").mkdir(mode=0o700, parents=True, exist_ok=True)
    (upper / "root").chmod(0o700)
    _write(upper / "root/.ssh/authorized_keys", pubkey, 0o600)
    (upper / "root/.ssh").chmod(0o700)
    hostkey = upper / "etc/ssh/ssh_host_ed25519_key"
    hostkey.parent.mkdir(parents=True, exist_ok=True)
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@{name}", "-f", str(hostkey)])
    keytype, keydata = Path(f"{hostkey}.pub").read_text().split()[:2]
    return f"{keytype} {keydata}"


def seed_host(upper: Path, index: int, count: int, pubkey: str, hardware: dict[str, object] | None,
              fabric: dict[str, object] | None) -> str:
    """Seed a new host's overlay upper dir: its identity (:func:`prepare_upper`), the simulated
    ``hardware`` and the RDMA TEST DOUBLE tree of ``fabric`` when given; its host pubkey line."""
    from k2sandbox import fabric_doubles

    hostkey = prepare_upper(upper, index, count, pubkey)
    if hardware is not None:
        write_hardware(upper, hardware)
    if fabric is not None:
        fabric_doubles.write_host_doubles(upper, fabric_doubles.devices_of(fabric))
    return hostkey


def simulated_hardware(gpu: str, count: int) -> dict[str, object]:
    """The GPU description of a host with ``count`` ``gpu`` GPUs, as the NVIDIA/AMD TEST
    DOUBLE packages read it from :data:`HARDWARE_FILE`, built from k2fleet's own tables:
    memory from :data:`k2fleet.planning.catalog.GPUS`, the name nvidia-smi / amd-smi print and the
    NVLink fabric from :mod:`k2fleet.planning.os_tables` (an NVSwitch only on an 8-GPU HGX
    board, IMEX on the NVL72 trays).

    >>> simulated_hardware("h200", 8)
    {'vendor': 'nvidia', 'name': 'NVIDIA H200', 'count': 8, 'memory_mib': 144384, 'nvswitch': True}
    >>> simulated_hardware("gb200", 4)
    {'vendor': 'nvidia', 'name': 'NVIDIA GB200', 'count': 4, 'memory_mib': 190464, 'nvswitch': False, 'imex': True}
    >>> simulated_hardware("mi300x", 8)
    {'vendor': 'amd', 'name': 'AMD Instinct MI300X', 'count': 8, 'memory_mib': 196608}
    """
    from k2fleet.planning import os_tables as tables
    from k2fleet.planning.catalog import GPUS

    kind = GPUS.get(gpu)
    if kind is None:
        raise SandboxError(f"unknown GPU type {gpu!r} (known: {', '.join(sorted(GPUS))})")
    if not 1 <= count <= kind.max_per_node:
        raise SandboxError(f"a {gpu} host has 1..{kind.max_per_node} GPUs, got {count}")
    memory_mib = int(kind.memory_gib * 1024)
    if kind.vendor == "amd":
        return {"vendor": "amd", "name": f"AMD Instinct {tables.AMD_MARKETING.get(gpu, gpu.upper())}",
                "count": count, "memory_mib": memory_mib}
    needs = tables.NVIDIA_GPUS[gpu]
    hardware: dict[str, object] = {
        "vendor": "nvidia", "name": f"NVIDIA {needs.marketing}", "count": count, "memory_mib": memory_mib,
        "nvswitch": needs.fabric in (tables.NVSWITCH, tables.NVLINK5) and count == tables.HGX_GPUS}
    if needs.fabric == tables.IMEX:
        hardware["imex"] = True
    return hardware


def parse_gpus(text: str) -> dict[str, object]:
    """``--gpus GPU[:COUNT]`` → :func:`simulated_hardware` (COUNT: the type's usual per-node count).

    >>> parse_gpus("h200")["count"], parse_gpus("gb200")["count"], parse_gpus("h200:4")["nvswitch"]
    (8, 4, False)
    """
    from k2fleet.planning.catalog import GPUS

    gpu, _, count = text.partition(":")
    if count and not count.isdigit():
        raise SandboxError(f"--gpus wants GPU[:COUNT], got {text!r}")
    default = GPUS[gpu].default_per_node if gpu in GPUS else 8
    return simulated_hardware(gpu, int(count) if count else default)


def write_hardware(upper: Path, hardware: dict[str, object]) -> None:
    """Put ``hardware`` at :data:`HARDWARE_FILE` in a host's overlay upper dir."""
    _write(upper / HARDWARE_FILE.lstrip("/"), json.dumps(hardware, indent=2) + "\n")


# --------------------------------------------------------------------------
# network


def _link_exists(name: str) -> bool:
    return run(["ip", "link", "show", "dev", name], check=False).returncode == 0


def setup_bridge() -> None:
    """Create the bridge with the control machine's sandbox address."""
    if not _link_exists(BRIDGE):
        run(["ip", "link", "add", BRIDGE, "type", "bridge"])
    run(["ip", "addr", "replace", f"{BRIDGE_ADDRESS}/{PREFIX_LEN}", "dev", BRIDGE])
    run(["ip", "link", "set", BRIDGE, "up"])


def setup_host_network(index: int) -> None:
    """Create netns + veth for a host; address it inside, with no default route."""
    ns, (outer, inner) = host_name(index), veth_names(index)
    run(["ip", "netns", "add", ns])
    run(["ip", "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns])
    run(["ip", "link", "set", outer, "master", BRIDGE, "up"])
    run(["ip", "-n", ns, "link", "set", inner, "name", HOST_NIC])
    run(["ip", "-n", ns, "addr", "add", f"{host_address(index)}/{PREFIX_LEN}", "dev", HOST_NIC])
    run(["ip", "-n", ns, "link", "set", "lo", "up"])
    run(["ip", "-n", ns, "link", "set", HOST_NIC, "up"])


_RATE = re.compile(r"^([1-9][0-9]*)(kbit|mbit|gbit)$")


def shape_argv(index: int, rate: str) -> list[list[str]]:
    """tc argv shaping host ``index``'s link to ``rate`` (``200mbit``, ``1gbit``) or ``off``,
    in both directions: the bridge-side veth's egress (traffic to the host) and, inside
    the host's netns, its NIC's egress (traffic from the host). Each is an htb root at
    the rate with two classes sharing it: packets under 128 bytes (a host's ACKs) go
    first, the rest (bulk) after. A real host's default qdisc (fq_codel, fq; this
    kernel has neither) keeps such sparse flows out of the bulk queue; in one FIFO a host
    that receives and forwards at once had its ACKs queued behind its own upload and
    received ~10% under its link rate.

    >>> shape_argv(2, "200mbit")[5][:12] == ['ip', 'netns', 'exec', host_name(2), 'tc', 'qdisc', 'replace', 'dev',
    ...                                      'eth0', 'root', 'handle', '1:']
    True
    >>> shape_argv(2, "200mbit")[1][-8:]
    ['rate', '200mbit', 'ceil', '200mbit', 'burst', '512k', 'cburst', '512k']
    >>> shape_argv(1, "off")[0] == ['tc', 'qdisc', 'del', 'dev', veth_names(1)[0], 'root']
    True
    """
    sides = [([], veth_names(index)[0]), (["ip", "netns", "exec", host_name(index)], HOST_NIC)]
    if rate == "off":
        return [[*prefix, "tc", "qdisc", "del", "dev", dev, "root"] for prefix, dev in sides]
    if not _RATE.match(rate):
        raise SandboxError(f"rate must look like 200mbit, 1gbit or off, not {rate!r}")
    out = []
    burst = ["burst", "512k", "cburst", "512k"]
    for prefix, dev in sides:
        tc = [*prefix, "tc"]
        out += [[*tc, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "20"],
                [*tc, "class", "replace", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate,
                 "ceil", rate, *burst],
                [*tc, "class", "replace", "dev", dev, "parent", "1:1", "classid", "1:10", "htb", "rate",
                 _fraction(rate, 10), "ceil", rate, "prio", "0", *burst],
                [*tc, "class", "replace", "dev", dev, "parent", "1:1", "classid", "1:20", "htb", "rate",
                 _fraction(rate, 10, 9), "ceil", rate, "prio", "1", *burst],
                [*tc, "filter", "replace", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                 "match", "u16", "0x0000", "0xff80", "at", "2", "flowid", "1:10"]]
    return out


def _fraction(rate: str, parts: int, take: int = 1) -> str:
    """``take``/``parts`` of a tc rate, in kbit.

    >>> _fraction("200mbit", 10), _fraction("1gbit", 10, 9)
    ('20000kbit', '900000kbit')
    """
    number, unit = _RATE.match(rate).groups()  # type: ignore[union-attr]
    kbit = float(number) * {"kbit": 1, "mbit": 1000, "gbit": 1000_000}[unit]
    return f"{int(kbit * take / parts)}kbit"


def shape(rate: str, state_dir: Path = DEFAULT_STATE_DIR) -> int:
    """Shape every sandbox host's link to ``rate`` (``off``: unshaped); returns how many."""
    hosts = load_hosts(state_dir)
    for i in range(1, len(hosts) + 1):
        for argv in shape_argv(i, rate):
            run(argv, check=rate != "off")
    return len(hosts)


OFFLINE_NS = f"{PREFIX}-offline"  # the control side of `k2fleet rehearse --offline`
OFFLINE_ADDRESS = f"{SUBNET}.2"


def offline_control_netns() -> list[str]:
    """A network namespace whose only link is a veth on the sandbox bridge (address
    ``OFFLINE_ADDRESS``, no default route): a command run in it reaches the sandbox hosts
    and nothing else. Made once (torn down with the sandbox); returns the argv prefix
    that runs a command inside it."""
    outer, inner = veth_names(0)
    if OFFLINE_NS not in _sandbox_netns():
        setup_bridge()
        run(["ip", "netns", "add", OFFLINE_NS])
        run(["ip", "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", OFFLINE_NS])
        run(["ip", "link", "set", outer, "master", BRIDGE, "up"])
        run(["ip", "-n", OFFLINE_NS, "addr", "add", f"{OFFLINE_ADDRESS}/{PREFIX_LEN}", "dev", inner])
        run(["ip", "-n", OFFLINE_NS, "link", "set", "lo", "up"])
        run(["ip", "-n", OFFLINE_NS, "link", "set", inner, "up"])
    return ["ip", "netns", "exec", OFFLINE_NS]


def _sandbox_netns() -> list[str]:
    out = run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(PREFIX)]


def _sandbox_links() -> list[str]:
    out = run(["ip", "-o", "link", "show"], check=False).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return [name for name in names if name.startswith(PREFIX)]


def teardown_network() -> None:
    """Delete every k2sb* netns (killing what runs in it), veth, the bridge and the company
    subnet's unreachable route."""
    for ns in _sandbox_netns():
        pids = run(["ip", "netns", "pids", ns], check=False).stdout.split()
        for pid in pids:
            _signal(int(pid), signal.SIGKILL)
        run(["ip", "netns", "delete", ns], check=False)
    for link in _sandbox_links():
        if link != BRIDGE:
            run(["ip", "link", "delete", link], check=False)
    if _link_exists(BRIDGE):
        run(["ip", "link", "delete", BRIDGE], check=False)
    run(["ip", "route", "del", "unreachable", f"{COMPANY_SUBNET}.0/{PREFIX_LEN}"], check=False)


# --------------------------------------------------------------------------
# processes


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie (reaps it if it is our child)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _is_our_nspawn(pid: int, name: str) -> bool:
    """True if ``pid`` is the systemd-nspawn we started for host ``name``."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError):
        return False
    return bool(argv) and argv[0].endswith(b"systemd-nspawn") and f"--machine={name}".encode() in argv


def _is_our_supervisor(pid: int, name: str) -> bool:
    """True if ``pid`` is the supervisor (:func:`supervise`) we started for host ``name``."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError):
        return False
    return (b"supervise" in argv and any(arg.endswith(b"/nspawn.py") for arg in argv)
            and f"--machine={name}".encode() in argv)


def _read_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def _write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one rename (readers never see half a file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


CLONE_NEWTIME = 0x80  # <linux/sched.h>; os.unshare arrives only in Python 3.12


def _fresh_boottime_namespace() -> str | None:
    """Make this process's next children start in a new time namespace whose
    CLOCK_BOOTTIME (hence ``/proc/uptime``) reads 0 now; None, or why not."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWTIME) != 0:
        return f"unshare(CLONE_NEWTIME): {os.strerror(ctypes.get_errno())}"
    # to the nanosecond: whole seconds left the new boot's uptime up to 1 s ahead of the
    # time since it began (the kernel wants nanoseconds in [0, 1e9), so -1.5 s is "-2 500000000")
    seconds, nanoseconds = divmod(-time.clock_gettime_ns(time.CLOCK_BOOTTIME), 1_000_000_000)
    try:
        Path("/proc/self/timens_offsets").write_text(f"boottime {seconds} {nanoseconds}\n")
    except OSError as exc:
        return f"/proc/self/timens_offsets: {exc}"
    return None


def supervise(run_dir: Path, name: str, command: list[str]) -> int:
    """Run host ``name``'s ``command`` (its systemd-nspawn) as systemd-nspawn@.service
    would: start it again when it exits :data:`REBOOT_EXIT_STATUS` (the container
    rebooted), return its status otherwise (a poweroff, a killed init, a failed start).
    SIGTERM/SIGINT stop it: forwarded to nspawn (a clean poweroff), never followed by a
    restart. Writes nspawn's pid to ``run_dir/NAME.pid`` and the number of boots started
    to ``run_dir/NAME.boots`` on every start. Every boot gets a fresh time namespace
    (:func:`_fresh_boottime_namespace`). Runs detached from whoever booted the sandbox."""
    stopping = False
    child: subprocess.Popen[bytes] | None = None

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        if child is not None:
            _signal(child.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    boots: list[float] = []
    status = 0
    while not stopping:
        why_not = _fresh_boottime_namespace()
        if why_not:
            print(f"k2fleet supervisor: {name}: uptime not reset for this boot ({why_not})", file=sys.stderr, flush=True)
        boots.append(time.monotonic())
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        child = proc
        _write_atomic(run_dir / f"{name}.pid", f"{proc.pid}\n")
        _write_atomic(run_dir / f"{name}.boots", f"{len(boots)}\n")
        if stopping:  # the signal came before `child` named this nspawn
            _signal(proc.pid, signal.SIGTERM)
        status = proc.wait()
        child = None
        if status != REBOOT_EXIT_STATUS or stopping:
            break
        recent = [t for t in boots if t > time.monotonic() - REBOOT_WINDOW_S]
        if len(recent) >= MAX_QUICK_REBOOTS:
            print(f"k2fleet supervisor: {name}: {len(recent)} reboots within {REBOOT_WINDOW_S:.0f}s; "
                  "leaving it down", file=sys.stderr, flush=True)
            break
        print(f"k2fleet supervisor: {name} rebooted (systemd-nspawn exit {status}); starting boot "
              f"{len(boots) + 1}", file=sys.stderr, flush=True)
    print(f"k2fleet supervisor: {name}: systemd-nspawn exited {status}"
          f"{' (stopped)' if stopping else ''}; supervisor exits", file=sys.stderr, flush=True)
    return status


def mount_root(lower: Path, hostdir: Path) -> None:
    """Mount the host's root: its writable ``upper`` over the shared ``lower``."""
    for sub in ("upper", "work", "root"):
        (hostdir / sub).mkdir(parents=True, exist_ok=True)
    options = f"lowerdir={lower},upperdir={hostdir / 'upper'},workdir={hostdir / 'work'}"
    run(["mount", "-t", "overlay", hostdir.name, "-o", options, str(hostdir / "root")])


def nspawn_command(index: int, hostdir: Path, docker: bool, shared: Path) -> list[str]:
    """The systemd-nspawn command line booting host ``index`` (``shared`` bound at SHARED_MOUNT)."""
    name = host_name(index)
    cmd = ["systemd-nspawn", "--boot", f"--machine={name}", f"--directory={hostdir / 'root'}",
           "--register=no", "--keep-unit", f"--bind={shared}:{SHARED_MOUNT}",
           f"--network-namespace-path=/run/netns/{name}", "--link-journal=no",
           "--resolv-conf=off", "--timezone=off", "--console=read-only"]
    if docker:
        cmd += ["--capability=all", f"--bind={hostdir / 'docker'}:/var/lib/docker",
                "--bind=/sys/fs/cgroup", "--system-call-filter=@keyring bpf"]
    else:  # nft in the host's own network namespace (k2fleet's firewall table); nspawn keeps it only with a private network
        cmd += ["--capability=CAP_NET_ADMIN"]
    return cmd


def start_host(index: int, lower: Path, state_dir: Path, docker: bool) -> int:
    """Start a host's nspawn under its supervisor, detached; record both pids and return
    nspawn's (``run/NAME.pid``, written by the supervisor on every boot)."""
    paths, name = _paths(state_dir), host_name(index)
    hostdir = paths["hosts"] / name
    mount_root(lower, hostdir)
    (hostdir / "docker").mkdir(parents=True, exist_ok=True)
    paths["shared"].mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    # /proc/sys/net writable, as on a real host (root sets its network namespace's sysctls:
    # k2fleet's net.ipv4.ip_unprivileged_port_start); nspawn keeps all of /proc/sys read-only otherwise
    env["SYSTEMD_NSPAWN_API_VFS_WRITABLE"] = "1" if docker else "network"
    pidfile = paths["run"] / f"{name}.pid"
    pidfile.unlink(missing_ok=True)
    # the file itself, not `-m k2sandbox.nspawn`: stdlib only, whatever the caller's sys.path
    argv = [sys.executable, "-I", str(Path(__file__).resolve()), "supervise", str(paths["run"]), name, "--",
            *nspawn_command(index, hostdir, docker, paths["shared"])]
    with open(paths["logs"] / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)
    (paths["run"] / f"{name}.supervisor").write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + 10
    while (pid := _read_pid(pidfile)) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SandboxError(f"{name}: its supervisor did not start systemd-nspawn; log tail:\n"
                               f"{_tail(paths['logs'] / f'{name}.log')}")
        time.sleep(0.02)
    return pid


def container_init(name: str) -> int:
    """A host's init as the control machine sees it: the process of its netns that is PID 1
    of its own PID namespace (what the fault drill kills, not the nspawn process)."""
    pids = run(["ip", "netns", "pids", name]).stdout.split()
    for pid in pids:
        if _is_namespace_init(pid):
            return int(pid)
    raise SandboxError(f"no init found among {name}'s netns pids {pids}")


def crash_host(index: int, state_dir: Path = DEFAULT_STATE_DIR, timeout: float = 15) -> None:
    """The fault drill: SIGKILL host ``index``'s container init and wait until its
    supervisor has given up (a killed init is not a reboot: the host stays down)."""
    name = host_name(index)
    supervisor = _read_pid(_paths(state_dir.resolve())["run"] / f"{name}.supervisor")
    os.kill(container_init(name), signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while supervisor and _alive(supervisor) and time.monotonic() < deadline:
        time.sleep(0.1)
    if supervisor and _alive(supervisor):
        raise SandboxError(f"{name}: its supervisor still runs {timeout:.0f}s after its init was killed")


def start_again(index: int, state_dir: Path = DEFAULT_STATE_DIR, docker: bool = False) -> SandboxHost:
    """Boot a crashed host ``index`` again (same root filesystem, address and keys)."""
    state_dir = state_dir.resolve()
    hostdir = _paths(state_dir)["hosts"] / host_name(index)
    run(["umount", str(hostdir / "root")], check=False)  # the crashed container's overlay, if still mounted
    start_host(index, ensure_rootfs(), state_dir, docker)
    host = load_hosts(state_dir)[index - 1]
    wait_ready([host], state_dir)
    return host


def replace_host(index: int, state_dir: Path = DEFAULT_STATE_DIR, docker: bool = False) -> SandboxHost:
    """A failed host replaced by a new machine under the same name and address: host
    ``index`` is crashed if it still runs (:func:`crash_host`), its disk (overlay upper, work
    and Docker directories) is wiped, and it boots bare with a new machine id and a new SSH
    host key (the known_hosts line for its address is replaced: what an operator does for a
    reinstalled machine), with the hardware and fabric doubles it was booted with."""
    state_dir = state_dir.resolve()
    paths, name = _paths(state_dir), host_name(index)
    entries = _host_entries(state_dir)
    if not 1 <= index <= len(entries):
        raise SandboxError(f"no sandbox host {index} (the fleet has {len(entries)})")
    supervisor = _read_pid(paths["run"] / f"{name}.supervisor")
    if supervisor and _alive(supervisor):
        crash_host(index, state_dir)
    hostdir = paths["hosts"] / name
    _unmount_all(hostdir)
    for sub in ("upper", "work", "docker"):
        _safe_rmtree(hostdir / sub)
    pubkey = Path(f"{ensure_control_key(state_dir)}.pub").read_text()
    entry = entries[index - 1]
    hostkey = seed_host(hostdir / "upper", index, len(entries), pubkey, entry.get("hardware"), entry.get("fabric"))
    address = host_address(index)
    lines = [line for line in paths["known_hosts"].read_text().splitlines() if line.split(" ", 1)[0] != address]
    _write(paths["known_hosts"], "".join(f"{line}\n" for line in lines + [f"{address} {hostkey}"]))
    start_host(index, ensure_rootfs(), state_dir, docker)
    host = load_hosts(state_dir)[index - 1]
    wait_ready([host], state_dir)
    return host


def _recorded_pids(run_dir: Path, suffix: str, ours) -> list[int]:
    """Live pids recorded in ``run_dir/k2sb-*SUFFIX`` that ``ours(pid, host)`` owns."""
    found = []
    for pidfile in sorted(run_dir.glob(f"{PREFIX}-*{suffix}")) if run_dir.is_dir() else []:
        pid = _read_pid(pidfile)
        if pid and _alive(pid) and ours(pid, pidfile.name[:-len(suffix)]):
            found.append(pid)
    return found


def stop_hosts(state_dir: Path, timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM every recorded supervisor (it stops restarting and forwards the signal)
    and nspawn (clean poweroff), SIGKILL after ``timeout``: supervisors first, so none
    starts its host again."""
    run_dir = _paths(state_dir)["run"]
    supervisors = _recorded_pids(run_dir, ".supervisor", _is_our_supervisor)
    for pid in supervisors:
        _signal(pid, signal.SIGTERM)
    pids = _recorded_pids(run_dir, ".pid", _is_our_nspawn)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in supervisors + pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in supervisors:
        if _alive(pid):
            _signal(pid, signal.SIGKILL)
    pids = sorted(set(pids) | set(_recorded_pids(run_dir, ".pid", _is_our_nspawn)))  # one started meanwhile
    inits = [init for pid in pids if _alive(pid) for init in _namespace_inits(pid)]
    for pid in inits:  # a killed nspawn leaves its container running; a PID namespace's init takes it all down
        _signal(pid, signal.SIGKILL)
    for pid in pids:
        if _alive(pid):
            _signal(pid, signal.SIGKILL)
    pids += inits
    for pid in supervisors + pids:
        for _ in range(50):
            if not _alive(pid):
                break
            time.sleep(0.1)


# --------------------------------------------------------------------------
# ssh


def ssh_command(host: SandboxHost, remote: str, connect_timeout: int = 5) -> list[str]:
    """ssh argv running ``remote`` on ``host`` with the pinned key and known_hosts."""
    return ["ssh", "-i", host.ssh_key, "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
            "-o", f"UserKnownHostsFile={host.ssh_known_hosts_file}", "-o", "StrictHostKeyChecking=yes",
            "-o", f"ConnectTimeout={connect_timeout}", "-o", "LogLevel=ERROR",
            f"{host.ssh_user}@{host.address}", remote]


def ssh(host: SandboxHost, remote: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run ``remote`` on ``host`` over ssh; never raises on a non-zero exit."""
    try:
        return run(ssh_command(host, remote), check=False, timeout=timeout)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess([], 255, "", "timeout")


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def wait_ready(hosts: list[SandboxHost], state_dir: Path, timeout: float = BOOT_TIMEOUT_S) -> None:
    """Wait until every host's systemd is running/degraded, checked over ssh."""
    pending = {h.name: h for h in hosts}
    last: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        for name, host in list(pending.items()):
            pid = _read_pid(_paths(state_dir)["run"] / f"{name}.pid")
            if pid is None or not _alive(pid):
                raise SandboxError(f"{name}: systemd-nspawn exited during boot; log tail:\n"
                                   f"{_tail(_paths(state_dir)['logs'] / f'{name}.log')}")
            proc = ssh(host, "systemctl is-system-running", timeout=15)
            last[name] = (proc.stdout.strip() or proc.stderr.strip())[-200:]
            if proc.stdout.strip() in ("running", "degraded"):
                del pending[name]
        if pending:
            time.sleep(1)
    if pending:
        detail = "\n".join(f"  {n}: last answer {last.get(n, '-')!r}; log tail:\n"
                           f"{_tail(_paths(state_dir)['logs'] / f'{n}.log', 8)}" for n in pending)
        raise SandboxError(f"sandbox hosts not ready after {timeout:.0f}s:\n{detail}")


# --------------------------------------------------------------------------
# public API


def _host_entries(state_dir: Path) -> list[dict[str, object]]:
    path = _paths(state_dir)["hosts_json"]
    return json.loads(path.read_text()) if path.exists() else []


def load_hosts(state_dir: Path = DEFAULT_STATE_DIR) -> list[SandboxHost]:
    """Hosts recorded in ``state_dir/hosts.json`` (empty if none)."""
    fields = SandboxHost.__dataclass_fields__
    return [SandboxHost(**{k: v for k, v in entry.items() if k in fields}) for entry in _host_entries(state_dir)]


def recorded_hardware(state_dir: Path = DEFAULT_STATE_DIR) -> list[dict[str, object] | None]:
    """Per recorded host, the simulated hardware it was booted with (None: none)."""
    return [entry.get("hardware") for entry in _host_entries(state_dir)]


def sandbox_inventory_hosts(count: int | None = None,
                            state_dir: Path = DEFAULT_STATE_DIR) -> list[tuple[str, dict[str, object]]]:
    """pyinfra host entries ``(name, data)`` for the first ``count`` sandbox hosts (all if
    None), from ``state_dir/hosts.json``: SSH by the pinned key and known_hosts, ``k2_nic``
    the hosts' one interface. Raises SystemExit with one line when no sandbox (or too small
    a one) is up, which pyinfra and ``k2fleet plan`` report as the inventory's error.

    >>> sandbox_inventory_hosts(state_dir=Path("/nonexistent"))
    Traceback (most recent call last):
        ...
    SystemExit: no sandbox fleet at /nonexistent: run `k2fleet sandbox up 3` first
    """
    hosts = load_hosts(state_dir)
    if not hosts:
        raise SystemExit(f"no sandbox fleet at {state_dir}: run `k2fleet sandbox up {count or 3}` first")
    if count is not None and len(hosts) < count:
        raise SystemExit(f"the sandbox fleet at {state_dir} has {len(hosts)} hosts, this inventory needs "
                         f"{count}: run `k2fleet sandbox up {count}`")
    return [
        (h.name, {"ssh_hostname": h.address, "ssh_user": h.ssh_user, "ssh_key": h.ssh_key,
                  "ssh_known_hosts_file": h.ssh_known_hosts_file, "ssh_strict_host_key_checking": "yes",
                  "k2_nic": HOST_NIC})
        for h in hosts[:count]
    ]


LOCK_FD_ENV = "K2FLEET_SANDBOX_LOCK_FD"


def hold_sandbox_lock():
    """Exclusive use of the (globally named) sandbox fleet until the returned file is
    closed (``with hold_sandbox_lock(): ...``); blocks while another process holds it.
    Not re-entrant: take it once per process. A child started by the holder with the
    lock's descriptor inherited and named in ``K2FLEET_SANDBOX_LOCK_FD``
    (:func:`lock_env`) shares the holder's lock instead of waiting for it."""
    inherited = os.environ.get(LOCK_FD_ENV, "")
    if inherited.isdigit():
        try:
            same = os.path.samestat(os.fstat(int(inherited)), os.stat(LOCK_PATH))
        except OSError:
            same = False
        if same:
            handle = os.fdopen(os.dup(int(inherited)), "w")
            fcntl.flock(handle, fcntl.LOCK_EX)  # the same open file: already ours
            return handle
    handle = open(LOCK_PATH, "w")
    fcntl.flock(handle, fcntl.LOCK_EX)
    return handle


def lock_env(handle) -> dict[str, str]:
    """Environment for a child process (started with ``pass_fds=(handle.fileno(),)``)
    that must use the sandbox under the lock ``handle`` this process holds."""
    return {LOCK_FD_ENV: str(handle.fileno())}


def recorded_fabric(state_dir: Path = DEFAULT_STATE_DIR) -> list[dict[str, object] | None]:
    """Per recorded host, the RDMA double it was booted with (a :func:`k2sandbox.fabric_doubles.host_spec`; None: none)."""
    return [entry.get("fabric") for entry in _host_entries(state_dir)]


def _is_up(state_dir: Path, n: int, hardware: dict[str, object] | None = None,
           fabric: list[dict[str, object] | None] | None = None) -> bool:
    """True if exactly ``n`` recorded hosts, booted with ``hardware`` and ``fabric``, have a live
    supervised nspawn and answer on :22."""
    if recorded_hardware(state_dir) != [hardware] * n or recorded_fabric(state_dir) != (fabric or [None] * n):
        return False
    return all(entry["running"] and entry["supervised"] and entry["ssh"] for entry in status(state_dir))


def up(n: int, state_dir: Path = DEFAULT_STATE_DIR, docker: bool = True,
       hardware: dict[str, object] | None = None,
       fabric: list[dict[str, object] | None] | None = None) -> list[SandboxHost]:
    """Bring up ``n`` sandbox hosts (no-op if exactly those are already up), each with
    ``hardware`` (:func:`simulated_hardware`) at :data:`HARDWARE_FILE` if given, and the i-th
    with the RDMA TEST DOUBLE tree of ``fabric[i]`` (:func:`k2sandbox.fabric_doubles.host_spec`;
    None: no RDMA device) if given."""
    _require_root()
    if not 1 <= n <= MAX_HOSTS:
        raise SandboxError(f"host count must be 1..{MAX_HOSTS}, got {n}")
    if fabric is not None and len(fabric) != n:
        raise SandboxError(f"fabric describes {len(fabric)} hosts, booting {n}")
    state_dir = state_dir.resolve()
    if _is_up(state_dir, n, hardware, fabric):
        return load_hosts(state_dir)
    ensure_tools()
    down(state_dir)
    lower = ensure_rootfs()
    paths = _paths(state_dir)
    for key in ("hosts", "run", "logs"):
        paths[key].mkdir(parents=True, exist_ok=True)
    state_dir.chmod(0o700)
    key = ensure_control_key(state_dir)
    pubkey = Path(f"{key}.pub").read_text()
    hosts: list[SandboxHost] = []
    known: list[str] = []
    for index in range(1, n + 1):
        hostkey = seed_host(paths["hosts"] / host_name(index) / "upper", index, n, pubkey, hardware,
                            fabric[index - 1] if fabric is not None else None)
        known.append(f"{host_address(index)} {hostkey}\n")
        hosts.append(SandboxHost(host_name(index), host_address(index), "root", str(key),
                                 str(paths["known_hosts"])))
    _write(paths["known_hosts"], "".join(known))
    setup_bridge()
    try:
        for index in range(1, n + 1):
            setup_host_network(index)
            start_host(index, lower, state_dir, docker)
        wait_ready(hosts, state_dir)
    except BaseException:
        down(state_dir)
        raise
    entries = [{**asdict(h), **({"hardware": hardware} if hardware is not None else {}),
                **({"fabric": fabric[i]} if fabric is not None and fabric[i] is not None else {})}
               for i, h in enumerate(hosts)]
    _write(paths["hosts_json"], json.dumps(entries, indent=2) + "\n")
    return hosts


KEPT_WORK = "kept-rehearsal"  # in the state dir: the work directory of a rehearsal left up (--keep)
KEPT_WORK_PREFIX = "k2rehearse-"  # such directories' names (tempfile.mkdtemp's prefix in k2sandbox.rehearse)


def keep_work(work: Path, state_dir: Path = DEFAULT_STATE_DIR) -> None:
    """Record ``work``, the directory of a rehearsal left up with its hosts (``--keep``), for
    :func:`down` to remove with them."""
    _write(state_dir.resolve() / KEPT_WORK, f"{work}\n", 0o600)


def _remove_kept_work(state_dir: Path) -> None:
    record = state_dir / KEPT_WORK
    if record.is_symlink() or not record.is_file():
        return
    work = Path(record.read_text().strip())
    if work.name.startswith(KEPT_WORK_PREFIX) and work.is_dir() and not work.is_symlink():
        remove_work(work)
    record.unlink()


def remove_work(work: Path, tries: int = 10) -> None:
    """Remove a rehearsal's work directory, again while a process that was still writing there
    (a deploy's helper ending as its hosts stop) adds entries: ``rmtree`` alone left empty
    ``k2rehearse-*`` directories in /tmp (its rmdir found a file created after its listing)."""
    for _ in range(tries):
        shutil.rmtree(work, ignore_errors=True)
        if not os.path.lexists(work):
            return
        time.sleep(0.2)


def down(state_dir: Path = DEFAULT_STATE_DIR) -> None:
    """Stop all sandbox hosts and remove everything ``up`` made (idempotent), and the work
    directory of a rehearsal kept up with them (:func:`keep_work`).

    Keeps the control key pair in ``state_dir`` and the root fs cache.
    """
    _require_root()
    state_dir = state_dir.resolve()
    stop_hosts(state_dir)
    teardown_network()
    paths = _paths(state_dir)
    if state_dir.exists():
        _unmount_all(state_dir)
    for key in ("hosts", "run", "logs", "hosts_json", "known_hosts", "shared"):
        _safe_rmtree(paths[key])
    _remove_kept_work(state_dir)


def status(state_dir: Path = DEFAULT_STATE_DIR) -> list[dict[str, object]]:
    """Per-host state: name, address, nspawn pid, whether it runs, whether its supervisor
    runs (would start it again after a reboot), boots so far (1 + reboots), whether :22
    answers."""
    state_dir = state_dir.resolve()
    run_dir = _paths(state_dir)["run"]
    result: list[dict[str, object]] = []
    for host in load_hosts(state_dir):
        pid = _read_pid(run_dir / f"{host.name}.pid")
        running = pid is not None and _alive(pid) and _is_our_nspawn(pid, host.name)
        supervisor = _read_pid(run_dir / f"{host.name}.supervisor")
        supervised = supervisor is not None and _alive(supervisor) and _is_our_supervisor(supervisor, host.name)
        result.append({"name": host.name, "address": host.address, "pid": pid, "running": running,
                       "supervised": supervised, "boots": _read_pid(run_dir / f"{host.name}.boots"),
                       "ssh": running and _port_open(host.address, 22)})
    return result


def _port_open(address: str, port: int, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    """CLI: ``up N [--gpus GPU[:COUNT]]`` / ``down`` / ``status`` [--state-dir DIR]
    (and ``supervise``, the per-host supervisor :func:`start_host` runs)."""
    parser = argparse.ArgumentParser(prog="k2fleet sandbox", description=__doc__.splitlines()[0])
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="boot N sandbox hosts")
    p_up.add_argument("n", type=int)
    p_up.add_argument("--no-docker", action="store_true", help="omit the docker-in-host nspawn flags")
    p_up.add_argument("--gpus", metavar="GPU[:COUNT]",
                      help=f"simulated GPUs in every host's {HARDWARE_FILE}, e.g. h200 or h200:8")
    sub.add_parser("down", help="stop and remove the sandbox")
    sub.add_parser("status", help="show sandbox hosts")
    p_shape = sub.add_parser("shape", help="shape every host's link (tc tbf, both directions): RATE or off")
    p_shape.add_argument("rate", help="e.g. 200mbit, 1gbit, off")
    p_sup = sub.add_parser("supervise", help="(internal) run one host's systemd-nspawn, again after a reboot")
    p_sup.add_argument("run_dir", type=Path)
    p_sup.add_argument("name")
    p_sup.add_argument("nspawn", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "supervise":
        return supervise(args.run_dir, args.name, args.nspawn[1:] if args.nspawn[:1] == ["--"] else args.nspawn)
    try:
        if args.command == "up":
            started = time.monotonic()
            hardware = parse_gpus(args.gpus) if args.gpus else None
            hosts = up(args.n, args.state_dir, docker=not args.no_docker, hardware=hardware)
            print(f"{len(hosts)} sandbox hosts up in {time.monotonic() - started:.1f}s; "
                  f"inventory: {_paths(args.state_dir.resolve())['hosts_json']}")
        elif args.command == "down":
            down(args.state_dir)
        elif args.command == "shape":
            print(f"{shape(args.rate, args.state_dir)} sandbox host links shaped: {args.rate}")
        else:
            rows = status(args.state_dir)
            for row in rows:
                print(f"{row['name']:10} {row['address']:15} pid={row['pid']} "
                      f"running={row['running']} supervised={row['supervised']} boots={row['boots']} "
                      f"ssh={row['ssh']}")
            if not rows:
                print("sandbox is down")
    except SandboxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
