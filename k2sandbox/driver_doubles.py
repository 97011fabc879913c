"""The sandbox's stand-in for NVIDIA's (and AMD's) driver repository: TEST DOUBLE .debs.

Sandbox hosts have no GPU, so the bootstrap installs the driver stack through the same
apt path from a local flat repository of named TEST DOUBLE packages that the control
machine builds here (``dpkg-deb`` + ``dpkg-scanpackages``, no network). Every program in
them is ``files/doubles/gpu_stack/gpu_double.py`` (stdlib Python 3) behind a shell
wrapper, reading the simulated hardware from :data:`HARDWARE_FILE`.

:func:`ensure_double_repo` returns ``CACHE/repo-<key>/`` holding ``*.deb``, ``Packages``
and an unsigned ``Release``: usable on a host as ``deb [trusted=yes] file:DIR ./``. The
key hashes every package's control data and file contents, and the bytes are
reproducible (fixed mtimes, root owner, sorted members, gzip), so two builds give the
same sha256 for every file.

Packages (Debian revision -1, amd64 unless noted), for each ``V`` in
:data:`DRIVER_VERSIONS`:

- ``nvidia-open`` ``V-1``: ``nvidia-smi``, the module "loader" and its boot unit
  :data:`MODULE_UNIT`, ``nvidia-persistenced`` and its unit;
- ``nvidia-open-<branch>`` (branches below 590): meta, ``Depends: nvidia-open (= V-1)``.
  apt does not go back to an older ``nvidia-open`` for it: with 590 in the repository,
  ``apt-get install nvidia-open-580`` alone fails ("Depends: nvidia-open (= 580.95.05-1)
  but 590.44.01-1 is to be installed"); name ``nvidia-open=V*`` too, or install the
  branch's pinning package first, as on NVIDIA's repository;
- ``nvidia-driver-pinning-<branch>`` (every branch, arch all; NVIDIA publishes them for
  580 too, and from 590 they are the way to select a branch): an apt preferences file
  pinning the driver family to ``<branch>.*``; they conflict with each other;
- ``nvidia-fabricmanager``, ``nvidia-imex`` ``V-1`` with their units; ``libnvidia-nscq``,
  ``libnvsdm`` ``V-1`` (markers); before branch 580 named after the branch
  (``nvidia-fabricmanager-570``), as in NVIDIA's repository;

and once: ``nvlsm`` (marker), ``nvidia-container-toolkit`` (``nvidia-ctk``,
``nvidia-container-runtime`` = runc), ``amdgpu-dkms`` (arch all; its module loader and
boot unit). ``infiniband-diags`` is Debian's own package and is not doubled.

>>> sorted({p.name for p in double_packages()})[:4]
['amdgpu-dkms', 'libnvidia-nscq', 'libnvidia-nscq-570', 'libnvsdm']
>>> [p.depends for p in double_packages() if p.name == "nvidia-open-580"]
['nvidia-open (= 580.95.05-1)']
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from k2fleet.hostprogs import locks
from k2fleet.control import deb_bundles as bundle
from k2fleet.planning.os_tables import UNVERSIONED_FABRIC_SINCE
from k2sandbox import DOUBLES

DOUBLE_PROGRAM = DOUBLES / "gpu_stack" / "gpu_double.py"
DEFAULT_CACHE_DIR = Path("/var/cache/k2fleet/nvidia-doubles")

DRIVER_VERSIONS: dict[int, str] = {570: "570.195.03", 580: "580.95.05", 590: "590.44.01"}
REVISION = "1"
ARCH = "amd64"  # the sandbox's arch (GB200/GB300 hosts are arm64 in reality)
PINNING_SINCE = 590  # from this branch: nvidia-driver-pinning-<branch> + unversioned nvidia-open
NVLSM_VERSION = "2025.06.5-1"
CTK_VERSION = "1.18.0-1"
# plausible amdgpu-dkms version (ROCm 6.4's numbering; not read from AMD's repository)
AMDGPU_VERSION = "1:6.12.12.60400-2187269.22.04"
# every file's mtime and the Release date: 2026-01-01T00:00:00Z
SOURCE_DATE_EPOCH = 1767225600
MAINTAINER = "k2fleet test doubles <k2fleet-doubles@localhost>"

# on-host paths (the double programs read/write these; see gpu_double.py)
HARDWARE_FILE = "/etc/k2fleet-doubles/gpus.json"
LIB_DIR = "/usr/lib/k2fleet-doubles"
STATE_DIR = "/run/k2fleet-doubles"
NVIDIA_LOADED_VERSION = f"{STATE_DIR}/nvidia/module-version"
NVIDIA_INSTALLED_VERSION = f"{LIB_DIR}/nvidia/installed-version"
NVIDIA_LOAD_MODULE = f"{LIB_DIR}/nvidia/load-module"
FABRIC_STATE = f"{STATE_DIR}/nvidia/fabric-state"
AMDGPU_LOADED_VERSION = f"{STATE_DIR}/amdgpu/module-version"
AMDGPU_LOAD_MODULE = f"{LIB_DIR}/amdgpu/load-module"
MODULE_UNIT = "k2fleet-double-nvidia-module.service"
AMDGPU_MODULE_UNIT = "k2fleet-double-amdgpu-module.service"
UNIT_DIR = "/lib/systemd/system"
# the driver family a pinning package pins (the names this repository carries)
PINNED_FAMILY = ("nvidia-open", "nvidia-fabricmanager", "libnvidia-nscq", "libnvsdm", "nvidia-imex")


class DoubleRepoError(RuntimeError):
    """Raised when the double repository cannot be built."""


@dataclass(frozen=True)
class DoubleFile:
    """One file of a package: its text and mode."""

    text: str
    mode: int = 0o644


@dataclass(frozen=True)
class DoublePackage:
    """One TEST DOUBLE package: control fields, files (absolute path -> file) and
    maintainer scripts (``postinst``/``prerm`` -> sh text)."""

    name: str
    version: str
    summary: str
    arch: str = ARCH
    depends: str = ""
    provides: str = ""
    conflicts: str = ""
    files: dict[str, DoubleFile] = field(default_factory=dict)
    scripts: dict[str, str] = field(default_factory=dict)
    conffiles: tuple[str, ...] = ()

    @property
    def filename(self) -> str:
        """Pool-style ``name_version_arch.deb`` (epoch dropped, as :mod:`k2fleet.control.deb_bundles`)."""
        return f"{self.name}_{self.version.split(':', 1)[-1]}_{self.arch}.deb"

    def control(self) -> str:
        size = sum(-(-len(f.text.encode()) // 1024) for f in self.files.values()) or 1
        lines = [f"Package: {self.name}", f"Version: {self.version}", f"Architecture: {self.arch}",
                 f"Maintainer: {MAINTAINER}", f"Installed-Size: {size}"]
        for key, value in (("Depends", self.depends), ("Provides", self.provides), ("Conflicts", self.conflicts)):
            if value:
                lines.append(f"{key}: {value}")
        lines += ["Section: misc", "Priority: optional",
                  f"Description: TEST DOUBLE of {self.summary} (k2fleet sandbox, no GPU)",
                  " A k2fleet test double: it stands in for the real package on sandbox hosts",
                  " that have no GPU. Its programs simulate the hardware described in",
                  f" {HARDWARE_FILE} and touch no device or kernel module."]
        return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- contents


PYCACHE = "/var/cache/k2fleet-doubles/pycache"  # the doubles' bytecode, outside the packages' own files


def _wrapper(program_dir: str, command: str, what: str) -> DoubleFile:
    """``/usr/bin/PROGRAM``: runs ``gpu_double.py COMMAND ARGS`` imported as a module, so its
    bytecode is cached (under :data:`PYCACHE`) instead of compiled at every call — the
    host's fact asks nvidia-smi twice per deploy, and the double should cost about what a
    real nvidia-smi does, not a Python compile. ``-I -S``: the program is standard-library
    only, so no site-packages (their ``.pth`` files) and no PYTHON* variables of the caller:
    ~2 ms less of every call (the probe's nvidia-smi)."""
    run = f'import sys; sys.path.insert(0, "{program_dir}"); from gpu_double import main; sys.exit(main(sys.argv[1:]))'
    return DoubleFile("#!/bin/sh\n"
                      f"# k2fleet TEST DOUBLE of {what} (no GPU): see {program_dir}/gpu_double.py\n"
                      f"exec /usr/bin/python3 -I -S -X pycache_prefix={PYCACHE} -c '{run}' {command} \"$@\"\n", 0o755)


def _program(program_dir: str) -> dict[str, DoubleFile]:
    return {f"{program_dir}/gpu_double.py": DoubleFile(DOUBLE_PROGRAM.read_text(), 0o755)}


def _unit(description: str, service: str, install: bool = True, unit: str = "") -> DoubleFile:
    text = f"# k2fleet TEST DOUBLE unit\n[Unit]\nDescription={description} (k2fleet TEST DOUBLE)\n{unit}"
    text += f"\n[Service]\n{service}"
    if install:
        text += "\n[Install]\nWantedBy=multi-user.target\n"
    return DoubleFile(text)


def _scripts(enable: tuple[str, ...] = (), stop: tuple[str, ...] = ()) -> dict[str, str]:
    """postinst: reload systemd, enable ``enable`` (not started: the module "loads" at
    boot); prerm on removal: stop ``stop``, disable ``enable``."""
    head = "#!/bin/sh\n# k2fleet TEST DOUBLE package script\nset -e\n"
    post = head + 'if [ "$1" = configure ]; then\n'
    post += "    if [ -d /run/systemd/system ]; then systemctl daemon-reload; fi\n"
    post += "".join(f"    systemctl --quiet enable {u}\n" for u in enable) + "fi\n"
    pre = head + 'if [ "$1" = remove ]; then\n'
    pre += "".join(f"    if [ -d /run/systemd/system ]; then systemctl stop {u} || true; fi\n" for u in stop)
    pre += "".join(f"    systemctl --quiet disable {u}\n" for u in enable) + "    :\nfi\n"
    return {"postinst": post, "prerm": pre}


def _module_unit(what: str, loader: str, before: str) -> DoubleFile:
    return _unit(f"Load the {what} kernel module at boot (stands in for udev/modprobe)",
                 f"Type=oneshot\nRemainAfterExit=yes\nExecStart={loader}\n",
                 unit=f"Before={before}\n" if before else "")


def nvidia_driver(version: str) -> DoublePackage:
    """``nvidia-open`` at ``version``: THE driver double."""
    lib = f"{LIB_DIR}/nvidia"
    files = {
        "/usr/bin/nvidia-smi": _wrapper(lib, "nvidia-smi", "nvidia-smi"),
        "/usr/bin/nvidia-persistenced": _wrapper(lib, "nvidia-persistenced", "nvidia-persistenced"),
        NVIDIA_INSTALLED_VERSION: DoubleFile(version + "\n"),
        NVIDIA_LOAD_MODULE: _wrapper(lib, "load-module", "modprobe nvidia"),
        **_program(lib),
        f"{UNIT_DIR}/{MODULE_UNIT}": _module_unit(
            "NVIDIA", NVIDIA_LOAD_MODULE,
            "nvidia-persistenced.service nvidia-fabricmanager.service nvidia-imex.service"),
        f"{UNIT_DIR}/nvidia-persistenced.service": _unit(
            "NVIDIA Persistence Daemon",
            "Type=forking\nExecStart=/usr/bin/nvidia-persistenced --verbose\n"
            "PIDFile=/run/nvidia-persistenced/nvidia-persistenced.pid\n"
            "ExecStopPost=/bin/rm -rf /run/nvidia-persistenced\n",
            unit=f"After={MODULE_UNIT}\n"),
    }
    return DoublePackage("nvidia-open", f"{version}-{REVISION}", "NVIDIA's nvidia-open driver (open kernel modules)",
                         depends="python3", files=files,
                         scripts=_scripts(enable=(MODULE_UNIT,), stop=("nvidia-persistenced.service",)))


def _marker(name: str, version: str, summary: str, arch: str = ARCH) -> DoublePackage:
    text = f"k2fleet TEST DOUBLE of {name} {version}: no library inside\n"
    return DoublePackage(name, version, summary, arch=arch, files={f"{LIB_DIR}/{name}/version": DoubleFile(text)})


def _daemon(name: str, version: str, program: str, unit: str, service: str, summary: str) -> DoublePackage:
    lib = f"{LIB_DIR}/{name}"
    files = {f"/usr/bin/{program}": _wrapper(lib, program, program), f"{lib}/version": DoubleFile(version + "\n"),
             **_program(lib), f"{UNIT_DIR}/{unit}": _unit(summary, service, unit=f"After={MODULE_UNIT}\n")}
    return DoublePackage(name, f"{version}-{REVISION}", summary, depends="python3", files=files,
                         scripts=_scripts(stop=(unit,)))


def pinning_preferences(branch: int) -> str:
    """The apt preferences file of ``nvidia-driver-pinning-<branch>`` (written for the
    double; NVIDIA's own file was not read)."""
    return (f"Explanation: k2fleet TEST DOUBLE of nvidia-driver-pinning-{branch}: the driver family "
            f"tracks branch {branch}\n"
            f"Package: {' '.join(PINNED_FAMILY)}\nPin: version {branch}.*\nPin-Priority: 1000\n")


def branch_packages(branch: int, version: str) -> list[DoublePackage]:
    """The packages of one driver release ``version`` of ``branch``."""
    full = f"{version}-{REVISION}"
    pkgs = [nvidia_driver(version)]
    if branch < PINNING_SINCE:
        pkgs.append(DoublePackage(f"nvidia-open-{branch}", full, f"NVIDIA's nvidia-open-{branch} meta package",
                                  depends=f"nvidia-open (= {full})"))
    path = f"/etc/apt/preferences.d/nvidia-driver-pinning-{branch}"
    pkgs.append(DoublePackage(f"nvidia-driver-pinning-{branch}", f"{branch}-{REVISION}",
                              f"NVIDIA's nvidia-driver-pinning-{branch} (apt pin to branch {branch})",
                              arch="all", provides="nvidia-driver-pinning", conflicts="nvidia-driver-pinning",
                              files={path: DoubleFile(pinning_preferences(branch))}, conffiles=(path,)))
    def named(base: str) -> str:
        return base if branch >= UNVERSIONED_FABRIC_SINCE else f"{base}-{branch}"

    pkgs.append(_daemon(named("nvidia-fabricmanager"), version, "nv-fabricmanager", "nvidia-fabricmanager.service",
                        "Type=forking\nExecStart=/usr/bin/nv-fabricmanager -c /usr/share/nvidia/nvswitch/fabricmanager.cfg\n"
                        f"PIDFile={STATE_DIR}/nvidia/nv-fabricmanager.pid\nExecStopPost=/bin/rm -f {FABRIC_STATE}\n",
                        "NVIDIA fabric manager service"))
    pkgs.append(_daemon(named("nvidia-imex"), version, "nvidia-imex", "nvidia-imex.service",
                        "Type=forking\nExecStart=/usr/bin/nvidia-imex -c /etc/nvidia-imex/config.cfg\n"
                        f"PIDFile={STATE_DIR}/nvidia/nvidia-imex.pid\n"
                        f"ExecStopPost=/bin/rm -f {STATE_DIR}/nvidia/imex-nodes\n",
                        "NVIDIA IMEX service"))
    pkgs.append(_marker(named("libnvidia-nscq"), full, "NVIDIA's NSCQ library (NVSwitch configuration and query)"))
    pkgs.append(_marker(named("libnvsdm"), full, "NVIDIA's NVSDM library (NVSwitch device monitoring)"))
    return pkgs


def container_toolkit() -> DoublePackage:
    lib = f"{LIB_DIR}/nvidia-container-toolkit"
    runtime = DoubleFile("#!/bin/sh\n# k2fleet TEST DOUBLE of nvidia-container-runtime: runs runc itself "
                         "(no GPU hook to add)\nexec runc \"$@\"\n", 0o755)
    return DoublePackage("nvidia-container-toolkit", CTK_VERSION, "NVIDIA's container toolkit (nvidia-ctk)",
                         depends="python3",
                         files={"/usr/bin/nvidia-ctk": _wrapper(lib, "nvidia-ctk", "nvidia-ctk"),
                                "/usr/bin/nvidia-container-runtime": runtime, **_program(lib)})


def amdgpu_dkms() -> DoublePackage:
    lib = f"{LIB_DIR}/amdgpu"
    files = {f"{lib}/installed-version": DoubleFile(AMDGPU_VERSION.split(":", 1)[-1] + "\n"),
             AMDGPU_LOAD_MODULE: _wrapper(lib, "amdgpu-load-module", "modprobe amdgpu"), **_program(lib),
             f"{UNIT_DIR}/{AMDGPU_MODULE_UNIT}": _module_unit("amdgpu", AMDGPU_LOAD_MODULE, "")}
    return DoublePackage("amdgpu-dkms", AMDGPU_VERSION, "AMD's amdgpu-dkms kernel driver", arch="all",
                         depends="python3", files=files, scripts=_scripts(enable=(AMDGPU_MODULE_UNIT,)))


def double_packages() -> list[DoublePackage]:
    """Every package of the double repository (pure), sorted by file name."""
    pkgs = [p for branch, version in sorted(DRIVER_VERSIONS.items()) for p in branch_packages(branch, version)]
    pkgs += [_marker("nvlsm", NVLSM_VERSION, "NVIDIA's NVLink subnet manager"), container_toolkit(), amdgpu_dkms()]
    return sorted(pkgs, key=lambda p: p.filename)


def repo_key(packages: list[DoublePackage]) -> str:
    """Content key: every control file, script and file (path, mode, text)."""
    payload = [[p.filename, p.control(), sorted(p.scripts.items()), list(p.conffiles),
                sorted((path, f.mode, f.text) for path, f in p.files.items())] for p in packages]
    payload.append(["epoch", SOURCE_DATE_EPOCH])
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- building


def _write(path: Path, text: str, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def stage(pkg: DoublePackage, root: Path) -> None:
    """The package's tree under ``root`` (DEBIAN/ included) with fixed modes and mtimes."""
    for path, f in pkg.files.items():
        _write(root / path.lstrip("/"), f.text, f.mode)
    _write(root / "DEBIAN" / "control", pkg.control(), 0o644)
    for name, text in pkg.scripts.items():
        _write(root / "DEBIAN" / name, text, 0o755)
    if pkg.conffiles:
        _write(root / "DEBIAN" / "conffiles", "".join(c + "\n" for c in pkg.conffiles), 0o644)
    for path in [root, *root.rglob("*")]:
        if path.is_dir():
            path.chmod(0o755)
        os.utime(path, (SOURCE_DATE_EPOCH, SOURCE_DATE_EPOCH), follow_symlinks=False)


def build_deb(pkg: DoublePackage, work: Path, out: Path) -> Path:
    """``dpkg-deb --build`` of the staged package into ``out/<filename>`` (root-owned,
    gzip, SOURCE_DATE_EPOCH: reproducible bytes)."""
    root = work / pkg.filename.removesuffix(".deb")
    stage(pkg, root)
    deb = out / pkg.filename
    env = dict(os.environ, SOURCE_DATE_EPOCH=str(SOURCE_DATE_EPOCH), LC_ALL="C")
    proc = subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "-z9", "--build", str(root), str(deb)],
                          env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise DoubleRepoError(f"dpkg-deb --build {pkg.filename} failed: {proc.stderr.strip()}")
    return deb


def build_repo(packages: list[DoublePackage], repo: Path) -> None:
    """Every package's .deb, ``Packages`` and an unsigned ``Release`` in ``repo``."""
    bundle.ensure_tools()
    with tempfile.TemporaryDirectory(prefix="k2fleet-doubles-stage-") as tmp:
        for pkg in packages:
            build_deb(pkg, Path(tmp), repo)
    bundle.write_index(repo, date=SOURCE_DATE_EPOCH)
    for path in repo.iterdir():
        path.chmod(0o644)
        os.utime(path, (SOURCE_DATE_EPOCH, SOURCE_DATE_EPOCH))
    repo.chmod(0o755)


def ensure_double_repo(cache_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    """The double repository's directory ``cache_dir/repo-<key>``, built once per content
    key (atomically, one builder at a time).

    Example::

        repo = ensure_double_repo()
        # on a host, after copying it to /opt/k2fleet/double-repo:
        #   deb [trusted=yes] file:/opt/k2fleet/double-repo ./
    """
    packages = double_packages()
    repo = cache_dir / f"repo-{repo_key(packages)}"
    if (repo / bundle.RELEASE_NAME).is_file():
        return repo
    cache_dir.mkdir(parents=True, exist_ok=True)
    with locks.exclusive(cache_dir / ".lock"):
        if not (repo / bundle.RELEASE_NAME).is_file():
            tmp = Path(tempfile.mkdtemp(prefix=f".{repo.name}-", dir=cache_dir))
            try:
                build_repo(packages, tmp)
                os.replace(tmp, repo)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return repo


def gpus_json(vendor: str, name: str, count: int, memory_mib: int, nvswitch: bool | None = None) -> str:
    """The text of :data:`HARDWARE_FILE` for a simulated host.

    >>> gpus_json("nvidia", "NVIDIA H200", 8, 143771, True)
    '{"vendor": "nvidia", "name": "NVIDIA H200", "count": 8, "memory_mib": 143771, "nvswitch": true}\\n'
    """
    hw: dict[str, object] = {"vendor": vendor, "name": name, "count": count, "memory_mib": memory_mib}
    if nvswitch is not None:
        hw["nvswitch"] = nvswitch
    return json.dumps(hw) + "\n"


if __name__ == "__main__":  # `python -m k2sandbox.driver_doubles` prints the repository's path
    print(ensure_double_repo())
