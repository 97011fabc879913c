"""The desired state: everything each host must hold, computed from the plan.

:func:`desired_state` turns a validated :class:`~k2fleet.planning.deployment.Deployment`, its
:class:`~k2fleet.planning.processes.Plan` and a read-only view of the control machine's artifacts
(:class:`ControlArtifacts`: mesh keys, Hub-client wheels) into one
:class:`HostDesired` per host: files (path, mode, content, sha256) grouped by the role
that writes them, systemd units, Debian packages, read-only checks the HostState fact
runs, paths whose existence matters, and the host's place in the checkpoint distribution.
``k2fleet plan --json`` prints it; the deploy's roles only carry it out.

Computing it connects to nothing and writes nothing, but it is not a function of its
arguments alone: it reads files on the control machine — k2fleet's host-program sources and
this interpreter's bytecode cache of them (``__pycache__``, for the host archive:
:func:`k2fleet.planning.host_archive.archive_bytes`) and the image archives
:class:`ControlArtifacts` names. A control artifact that does not exist yet (first run under ``--dry``) is a file with unknown content (``sha256`` None),
made by :func:`k2fleet.control.artifacts.prepare_control_artifacts`.

>>> FileSpec(b"hi\\n", "644").sha256[:12]
'98ea6e4f216f'
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

from k2fleet.planning.host_archive import ARCHIVE as HOST_ARCHIVE, archive_bytes, host_argv
from k2fleet.planning.engine_side import HOST_ARCH, engine_side_requirements as venv_side_requirements, host_python, requirement_version
from k2fleet.planning import api_front, engine_cache, engines, load_balancer, mesh_config
from k2fleet.planning.rollout import INSTANCE_ROLES, Balancer, Instance, Rollout
from k2fleet.planning import host_bootstrap as bootstrap
from k2fleet.planning.host_bootstrap import BootstrapPlan, bootstrap_plan
from k2fleet.planning.os_tables import OS_TABLES
from k2fleet.planning import mirrors, relay_plan
from k2fleet.planning import firewall as fleet_firewall
from k2fleet.planning import instance_watch, privileged_ports
from k2fleet.planning import gpu_exporter
from k2fleet.planning.reach_plan import ReachCheck, reach_checks
from k2fleet.planning.kept_revisions import Kept, kept_dirs
from k2fleet.hostprogs import swarm
from k2fleet.planning.deployment import CHECKPOINT_CHECK, Deployment, WeightSet
from k2fleet.planning.engines.vllm.render import RAY_TOKEN
from k2fleet.planning.host_packages import bundle_repo_dir, required_packages
from k2fleet.planning.processes import HostPlan, Plan, Service
from k2fleet.planning.units import (pin_args, api_key_paths, container_name, env_file, env_path, holds_api_key, image_pin_argv,
                           sends_api_key, unit_file, unit_name, unit_path)
from k2fleet.planning.quoting import env_file_line, shell_line, shell_word
from k2fleet.planning.render.common import DOCKER

DOUBLES_DIR = "/opt/k2fleet/doubles"
GPU_STACK_DOUBLES = "gpu_stack"  # the doubles' gpu_stack/: inside the TEST DOUBLE driver packages, not shipped
HUB_ENV = "/opt/k2fleet/hubenv"
WHEEL_DIR = "/var/cache/k2fleet/wheelhouse"
ENGINE_WHEEL_DIR = "/var/cache/k2fleet/engine-wheelhouse"
UNIT_GLOB = "/etc/systemd/system/k2-*.service"
# dpkg's journal of a run that did not finish (a reboot or a crash mid-install): while it holds
# files, apt refuses every install ("dpkg was interrupted, you must manually run 'dpkg
# --configure -a'": apt-pkg/deb/debsystem.cc checks this directory); empty or absent otherwise
DPKG_JOURNAL_GLOB = "/var/lib/dpkg/updates/*"
RECORD = "/var/lib/k2fleet/before.json"  # the host before k2fleet's first change (k2fleet.planning.teardown)
MESH_UNIT_PATH = f"/etc/systemd/system/{mesh_config.UNIT}"
HEALTH_CHECK = "healthy"
HUB_CLIENT_CHECK = "hub-client"
IMAGE_CHECK = "image-pinned"
IMAGE_DIR = "/var/cache/k2fleet/images"  # where hosts keep the image archive they docker-load
# Sandbox ROCm hosts: /dev/kfd and /dev/dri/renderD128 as TEST DOUBLE device nodes (the
# null device's numbers), made by systemd-tmpfiles at every boot, so `--device` is real.
DEVICE_DOUBLES_CONF = "/etc/tmpfiles.d/k2fleet-device-doubles.conf"
DEVICE_DOUBLES = {"rocm": ("/dev/kfd", "/dev/dri/renderD128")}
ENGINE_SIDE_CHECK = "engine-side"


@dataclass(frozen=True)
class FileSpec:
    """One file a host must hold. ``content`` None: a control artifact not made yet."""

    content: bytes | None
    mode: str
    origin: str = "plan"
    secret: bool = False  # a user's secret (the API key): the plan shows "(secret)", not its digest or size

    @cached_property
    def sha256(self) -> str | None:
        """The content's digest, computed once (every host's settled-state check asks for it)."""
        return None if self.content is None else hashlib.sha256(self.content).hexdigest()

    def to_json(self) -> dict[str, Any]:
        if self.secret:
            return {"mode": self.mode, "sha256": "(secret)", "bytes": None, "origin": self.origin}
        return {"mode": self.mode, "sha256": self.sha256,
                "bytes": None if self.content is None else len(self.content), "origin": self.origin}


@dataclass(frozen=True)
class EngineDoubles:
    """``k2_engine_doubles``: the engine TEST DOUBLES the control step got from the
    stand-in provider (:mod:`k2fleet.control.stand_ins`): the requirement that installs
    their wheel, and their sources (path under the doubles' root → bytes)."""

    requirement: str
    files: dict[str, bytes] = field(default_factory=dict)


ENGINE_DOUBLES_UNREAD = "k2fleet-engine-doubles"  # the requirement's stand-in before the control step read it


@dataclass(frozen=True)
class ControlArtifacts:
    """What the control machine generated for this deployment (read-only view).

    ``mesh_clients``: mesh head (:func:`~k2fleet.planning.mesh_config.mesh_links`) → its
    (private, public) client key; ``mesh_hosts``: mesh member → (private, public) mesh host key; ``hub_requirement``: the Hub client the
    fetcher host gets (``huggingface_hub==VERSION``; None: no fetcher host); ``wheels``:
    its wheel name → bytes (None: not built); ``bundles``: package set
    (:func:`package_set`) → offline bundle tar path; ``engine_wheels``: engine-side
    requirement set (:func:`engine_side_requirements`, as a tuple) → wheel name → bytes
    for the hosts' interpreter (absent: not built).
    """

    mesh_clients: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)
    mesh_hosts: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)
    hub_requirement: str | None = None
    wheels: dict[str, bytes] | None = None
    bundles: dict[tuple[str, ...], str] = field(default_factory=dict)
    images: dict[str, tuple[str, str]] = field(default_factory=dict)  # image ref → (archive path, image ID)
    engine_wheels: dict[tuple[str, ...], dict[str, bytes]] = field(default_factory=dict)
    engine_doubles: EngineDoubles | None = None  # k2_engine_doubles: the stand-ins (None: not read)
    relay_secret: bytes | None = None  # the deployment's relay secret (None: not made yet, e.g. --dry)
    ray_token: bytes | None = None  # the deployment's Ray authentication token (None: not made yet)
    api_key: bytes | None = None  # k2_api_key_file's key, read on the control machine (None: no key file)
    tls: tuple[bytes, bytes] | None = None  # k2_tls_*: (certificate chain + key as one PEM, the CA's PEM); None: no TLS
    keyrings: dict[str, bytes] = field(default_factory=dict)  # mirror keyring control path → its bytes (absent: not read)
    engine_cache: tuple[str, str] | None = None  # k2_bundle's engine cache archive: (control path, the lock's sha256)

    def bundle_for(self, packages: list[str]) -> str | None:
        """The bundle tar made for ``packages`` (None: none made, e.g. under ``--dry``)."""
        return self.bundles.get(package_set(packages))


def package_set(packages: list[str]) -> tuple[str, ...]:
    """The key of one host's package list: sorted, without repeats.

    >>> package_set(["rsync", "openmpi-bin", "rsync"])
    ('openmpi-bin', 'rsync')
    """
    return tuple(sorted(set(packages)))


@dataclass(frozen=True)
class FanoutPlace:
    """This host's place in the checkpoint's distribution (:mod:`k2fleet.hostprogs.relay`): the
    root receives from the control machine's copy (or the Hub); the others shard by shard
    from peers, by the per-shard plan over ``relays``."""

    loads_weights: bool
    is_root: bool
    shared: bool
    position: int | None = None  # index in ``relays`` (None: loads no weights)
    relays: tuple[str, ...] = ()  # relay URL of every host that loads weights, fan-out order (root first)
    relay_fanout: int = 1  # 1: a chain; k: k fixed trees, shard j down tree j mod k (:func:`k2fleet.hostprogs.swarm.fanout_for`)


@dataclass(frozen=True)
class ImagePin:
    """The container image a host runs: ``ref`` pinned to ``image_id`` (None: the
    archive is not built yet, ``--dry``), shipped as the archive at ``archive`` (sandbox
    doubles) or pulled from the registry (None: ``k2_image_id``)."""

    ref: str
    image_id: str | None
    archive: str | None


@dataclass
class HostDesired:
    """Everything one host must hold; see the module doc."""

    name: str
    address: str
    files: dict[str, dict[str, FileSpec]] = field(default_factory=dict)  # role → path → spec
    service_files: dict[str, dict[str, FileSpec]] = field(default_factory=dict)  # service → path → spec
    units: list[str] = field(default_factory=list)
    slots: list[tuple[int, str]] = field(default_factory=list)  # fleet-wide (stage, service): one op sequence
    own_slots: list[tuple[int, str]] = field(default_factory=list)  # this host's (stage, service)
    packages: list[str] = field(default_factory=list)
    bundle_request: list[str] = field(default_factory=list)  # the offline bundle's packages (host + bootstrap)
    gpu_gate: list[str] | None = None  # the bootstrap's GPU gate (k2fleet-host.pyz hoststate --gate)
    mesh_yields_to: list[str] = field(default_factory=list)  # units that take the mesh port while they run
    mesh_between_deploys: bool = False  # the mesh sshd runs between deploys (k2_mesh_after_deploy: keep)
    bundle_repo: str | None = None  # where this host's offline bundle is extracted (reported by the fact, not a goal)
    absent: list[str] = field(default_factory=list)  # paths that must not exist (keys this host no longer holds)
    checks: dict[str, list[str]] = field(default_factory=dict)
    exists: list[str] = field(default_factory=list)
    fanout: FanoutPlace | None = None
    health_argv: list[str] | None = None
    venv_install: list[str] | None = None
    python: str = "python3"  # the interpreter venvs are made with (the OS table's)
    engine_side_install: list[str] | None = None
    engine_cache_unpack: list[str] | None = None  # the bundle's engine cache into an absent or empty cache dir (last word)
    engine_entry: str = ""
    bootstrap: BootstrapPlan | None = None  # driver, fabric, container runtime (k2fleet.planning.host_bootstrap)
    image: ImagePin | None = None
    gpu_exporter: ImagePin | None = None  # k2_gpu_exporter: dcgm-exporter's image (None: not on this host)
    device_doubles: tuple[str, ...] = ()
    firewall: fleet_firewall.HostFirewall | None = None  # k2fleet's nftables table (None: none on this host)
    api_key_services: list[str] = field(default_factory=list)  # services that read the API key (restart with it)
    rollout: Rollout = field(default_factory=Rollout)  # the fleet's instances, k2_rollout, its load balancer
    reach: ReachCheck | None = None  # the peers' rendezvous ports checked before the engines start
    gpus_proven_by: list[str] = field(default_factory=list)  # checks whose pass proves every GPU here works
    port_start: int = 0  # net.ipv4.ip_unprivileged_port_start the host holds at least (k2fleet.planning.privileged_ports)
    kept: list[Kept] = field(default_factory=list)  # old revisions and engine venvs kept (k2_keep_revisions)

    def all_paths(self) -> list[str]:
        paths = {p for files in self.files.values() for p in files}
        paths |= {p for files in self.service_files.values() for p in files}
        return sorted(paths)

    def kept_units(self) -> set[str]:
        """Names of the units k2fleet keeps on this host: the ones it runs and the ones whose
        unit file is in the desired state (e.g. the mesh sshd under ``k2_mesh_after_deploy:
        stop``); any other ``k2-*.service`` there is stale."""
        return set(self.units) | {p.rsplit("/", 1)[1] for files in self.files.values() for p in files
                                  if p.startswith("/etc/systemd/system/") and p.endswith(".service")}

    def fact_query(self, disk_path: str, full_gpu_look: bool = False) -> dict[str, Any]:
        """The HostState query for this host: one round trip answers every decision.
        ``gpus_proven_by`` (unless ``full_gpu_look``, as ``k2fleet status`` asks): when these
        checks pass, the probe does not ask NVML (nvidia-smi, rocm-smi) — see
        :func:`gpus_proven_by`."""
        boot = self.bootstrap
        units = self.units + [f"{s}.service" for s in (boot.services if boot else ())]
        query = {"disk_path": disk_path, "files": self.all_paths(), "units": units, "checks": self.checks,
                 "exists": self.exists + self.absent + ([self.bundle_repo] if self.bundle_repo else [])
                 + list(boot.reads if boot else ()),  # k2_gpu_stack: provided reads the toolkit, Docker, ib_umad
                 "globs": [UNIT_GLOB, DPKG_JOURNAL_GLOB], "packages": self.packages,
                 "package_versions": bootstrap.fact_patterns(boot) if boot else []}
        if self.gpus_proven_by and not full_gpu_look:
            query["gpus_proven_by"] = list(self.gpus_proven_by)
        return query

    def to_json(self) -> dict[str, Any]:
        fan = self.fanout
        return {
            "files": {p: spec.to_json() for files in (*self.files.values(), *self.service_files.values())
                      for p, spec in sorted(files.items())},
            "units": self.units,
            "packages": self.packages,
            "checks": self.checks,
            "checkpoint": None if fan is None or not fan.loads_weights else {
                "from": _source_label(fan), "position": fan.position,
                "relay": None if fan.shared else fan.relays[fan.position], "relay_fanout": fan.relay_fanout},
            "bootstrap": None if self.bootstrap is None else self.bootstrap.to_json(),
            "firewall": None if self.firewall is None else self.firewall.to_json(),
            "venv_install": self.venv_install,
            "reach": None if self.reach is None else self.reach.to_json(),
        }


def _source_label(fan: FanoutPlace) -> str:
    if fan.is_root:
        return "control-or-hub"
    if fan.shared:
        return "shared-storage"
    return "peer"


# --------------------------------------------------------------------------- per role


def gpus_proven_by(dep: Deployment, hp: HostPlan) -> list[str]:
    """The checks whose pass proves that every GPU the plan gives ``hp``'s host works, so that
    the fact need not ask NVML (``nvidia-smi -q``: hundreds of milliseconds on eight real GPUs,
    on every host of every re-run): the host's health check (``/health`` 200 and a real
    completion, the planned topology where the engine reports it) when its one service is a
    GPU engine instance that lies on this host alone and whose every completion runs on all
    its GPUs: one tensor × pipeline parallel group, no data-parallel replicas beside it (a
    completion reaches one replica). The gate refuses instances smaller than a node, so that
    instance holds all the host's planned GPUs. Then the GPU gate's NVML half (the GPUs
    answering, their NVLink fabric) is what the serving engine proved; its other half (GPU
    count on the PCI bus, driver branch from the loaded module, module = installed driver,
    fabric services active) is still checked (:mod:`k2fleet.hostprogs.hoststate`). Empty (ask
    NVML): no health check, a host without GPUs (a router), an instance over several hosts,
    data-parallel replicas in one instance, or more than one service.

    >>> from k2fleet.planning.processes import Health, Service
    >>> class Pool: nodes_per_instance, tp, pp, instance_gpus = 1, 8, 1, 8
    >>> class Dep: pools = {"serve": Pool()}
    >>> one = HostPlan("n1", "10.0.0.1", "serve", [Service("k2-vllm", ["vllm"], health=Health(8000))])
    >>> gpus_proven_by(Dep(), one)
    ['healthy']
    >>> Pool.tp = 1  # eight data-parallel replicas of one GPU each: one completion proves one
    >>> gpus_proven_by(Dep(), one)
    []
    >>> Pool.tp, Pool.nodes_per_instance = 8, 2
    >>> gpus_proven_by(Dep(), one)
    []
    """
    pool = dep.pools.get(hp.role)
    if pool is None or hp.role in ("router", "slurm-submit") or pool.instance_gpus <= 0 \
            or pool.nodes_per_instance != 1 or pool.tp * pool.pp != pool.instance_gpus \
            or len(hp.services) != 1 or not hp.services[0].health:
        return []
    return [HEALTH_CHECK]


def loads_weights(hp: HostPlan) -> bool:
    """Every GPU host loads weights (mpirun ranks too, with no service of their own)."""
    return hp.role not in ("router", "slurm-submit") or any(s.needs_checkpoint for s in hp.services)


def _key(pair: tuple[bytes, bytes] | None, index: int, mode: str, origin: str) -> FileSpec:
    return FileSpec(None if pair is None else pair[index], mode, origin)


def mesh_files(dep: Deployment, plan: Plan, art: ControlArtifacts) -> dict[str, dict[str, FileSpec]]:
    """Every host's SSH mesh files: none off the mesh (:func:`~k2fleet.planning.mesh_config.mesh_members`);
    on it, the sshd (accepting only the heads that log into this host, from their
    addresses), every member's pinned host key, and on a head its own client key."""
    members = mesh_config.mesh_members(plan)
    out: dict[str, dict[str, FileSpec]] = {h.name: {} for h in dep.fleet.hosts}
    if not members:
        return out
    d = mesh_config.mesh_dir(dep)
    address = {h.name: h.address for h in dep.fleet.hosts}
    shared = {
        f"{d}/ssh_config": FileSpec(mesh_config.ssh_config(dep).encode(), "644"),
        MESH_UNIT_PATH: FileSpec(mesh_config.unit_file(dep).encode(), "644"),
    }
    if all(name in art.mesh_hosts for name in members):
        publics = {n: art.mesh_hosts[n][1].decode() for n in members}
        shared[f"{d}/known_hosts"] = FileSpec(mesh_config.known_hosts(dep, publics).encode(), "644")
    else:
        shared[f"{d}/known_hosts"] = FileSpec(None, "644", "mesh-keys")
    links = mesh_config.mesh_links(plan)
    for h in dep.fleet.hosts:
        if h.name not in members:
            continue
        heads = mesh_config.logins_into(plan, h.name)
        if all(head in art.mesh_clients for head in heads):
            keys = "".join(mesh_config.authorized_keys(dep, art.mesh_clients[head][1].decode(), [address[head]])
                           for head in heads)
            authorized = FileSpec(keys.encode(), "644")
        else:
            authorized = FileSpec(None, "644", "mesh-keys")
        allow = mesh_config.allow_users(dep, [address[head] for head in heads])
        files = {
            **shared,
            f"{d}/authorized_keys": authorized,
            f"{d}/sshd_config": FileSpec(mesh_config.sshd_config(dep, h, allow).encode(), "644"),
            f"{d}/ssh_host_ed25519_key": _key(art.mesh_hosts.get(h.name), 0, "600", "mesh-keys"),
            f"{d}/ssh_host_ed25519_key.pub": _key(art.mesh_hosts.get(h.name), 1, "644", "mesh-keys"),
        }
        if h.name in links:
            files[f"{d}/id_ed25519"] = _key(art.mesh_clients.get(h.name), 0, "600", "mesh-keys")
            files[f"{d}/id_ed25519.pub"] = _key(art.mesh_clients.get(h.name), 1, "644", "mesh-keys")
        out[h.name] = files
    return out


def host_arch(dep: Deployment) -> str:
    """CPU architecture of the fleet's hosts (for engine-side wheels)."""
    return HOST_ARCH.get(dep.gpu.name if dep.gpu else "", "x86_64")


def engine_side_requirements(dep: Deployment, hp: HostPlan) -> list[str]:
    """What this host's engine venv needs beside the engine for the services it runs."""
    return venv_side_requirements(dep.engine, dep.venv, [svc.argv for svc in hp.services])


def engine_pin(dep: Deployment, doubles: EngineDoubles | None) -> str:
    """The requirement that installs the engine into ``k2_venv``: its release, or with
    engine test doubles the doubles' wheel (``doubles``, from the control step)."""
    if dep.s.engine_doubles:
        return doubles.requirement if doubles else ENGINE_DOUBLES_UNREAD
    return f"{dep.engine_impl.package}=={dep.version}"


def engine_requirements(dep: Deployment, hp: HostPlan, bundled: bool, doubles: EngineDoubles | None) -> list[str]:
    """What this host installs into ``k2_venv`` from wheels the control machine ships:
    the engine-side requirements and, when the deploy takes everything from a bundle
    (``k2_bundle``, or ``bundled`` while one is built), the engine itself (sorted)."""
    side = engine_side_requirements(dep, hp)
    if (bundled or dep.engine_cpu_build) and dep.runtime == "venv":
        return sorted({*side, engine_pin(dep, doubles)})
    return side


def engine_files(dep: Deployment, doubles: EngineDoubles | None, real_venv: bool = False,
                 from_wheel: bool = False) -> dict[str, FileSpec]:
    """k2fleet's host programs, and (sandbox only) the engine test doubles + wrappers.

    ``real_venv``: the host's ``k2_venv`` is a real venv (it holds engine-side wheels):
    the doubles run with its python, which is left alone; otherwise ``k2_venv/bin/python``
    is a wrapper running the system python with the doubles on its path. ``from_wheel``:
    the doubles come as a wheel installed into the venv (a bundle), so only KTransformers'
    rule files are shipped beside it."""
    files = host_archive_files()
    if not dep.s.engine_doubles:
        return files
    venv = dep.venv
    if doubles is None:  # not read yet (the control step reads them)
        files[f"{DOUBLES_DIR}/"] = FileSpec(None, "644", "engine-doubles")
        return files
    sources = sorted(doubles.files.items())
    for rel, data in sources:  # KTransformers: the legacy server's rule files, where a source install keeps them
        path = dep.engine_impl.double_file(venv, rel)
        if path is not None:
            files[path] = FileSpec(data, "644", "engine-doubles")
    if from_wheel:
        return files
    for rel, data in sources:
        if not rel.startswith(f"{GPU_STACK_DOUBLES}/"):
            mode = "755" if rel.startswith("bin/") else "644"
            files[f"{DOUBLES_DIR}/{rel}"] = FileSpec(data, mode, "engine-doubles")
    interpreter = f"{venv}/bin/python3 " if real_venv else ""
    for name in ("vllm", "trtllm-serve", "trtllm-llmapi-launch"):
        wrapper = (f'#!/bin/sh\n# k2fleet engine TEST DOUBLE wrapper (sandbox only)\n'
                   f'exec {interpreter}{DOUBLES_DIR}/bin/{name} "$@"\n')
        files[f"{venv}/bin/{name}"] = FileSpec(wrapper.encode(), "755", "k2fleet")
    if not real_venv:
        python = (f"#!/bin/sh\n# k2fleet engine TEST DOUBLE python (sandbox only)\n"
                  f'PYTHONPATH={DOUBLES_DIR} exec /usr/bin/python3 "$@"\n')
        files[f"{venv}/bin/python"] = FileSpec(python.encode(), "755", "k2fleet")
    return files


def engine_side_files(requirements: list[str], art: ControlArtifacts) -> dict[str, FileSpec]:
    """The engine-side wheels this host installs into its engine venv (none: no requirements)."""
    if not requirements:
        return {}
    wheels = art.engine_wheels.get(tuple(requirements))
    if wheels is None:
        return {f"{ENGINE_WHEEL_DIR}/": FileSpec(None, "644", "wheelhouse")}
    return {f"{ENGINE_WHEEL_DIR}/{name}": FileSpec(data, "644", "wheelhouse") for name, data in wheels.items()}


def engine_side_check(dep: Deployment, requirements: list[str], python: str) -> list[str]:
    """Read-only check: ``k2_venv``'s python is ``python`` (the host OS's, which its wheels
    are for: :func:`host_python`) and holds every distribution of
    ``requirements`` at its pinned version; prints what differs."""
    pins = dict(requirement_version(r) for r in requirements)
    code = ("import sys\n"
            "from importlib.metadata import version, PackageNotFoundError as Missing\n"
            "def have(name):\n    try:\n        return version(name)\n    except Missing:\n        return \"missing\"\n"
            f"want = {json.dumps(pins, sort_keys=True)}\n"
            "bad = [\"%s %s (fleet: %s)\" % (n, have(n), v) for n, v in sorted(want.items())\n"
            "       if have(n) != v and have(n).split(\"+\")[0] != v]  # a local label (+cpu...) matches, as in pip\n"
            "py = \"%d.%d\" % sys.version_info[:2]\n"
            f"bad += [] if py == {json.dumps(python)} else "
            f"[\"python %s (fleet: {python})\" % py]\n"
            "print(\"; \".join(bad) or \"python %s, %s\" % (py, want))\n"
            "sys.exit(1 if bad else 0)\n")
    return [f"{dep.venv}/bin/python", "-c", code]


# pip's --no-compile: pip byte-compiles every module it installs (vLLM's CPU build: ~20k files),
# the engine imports a fraction of them and writes their bytecode itself on its first start (its
# unit runs as root, the venv writable). Measured on this 2-core machine, vllm 0.33.0 (CPU build)
# from its wheelhouse: the install 141.9 s -> 63.8 s; the first import of vLLM's API server
# 18.9 s -> 31.9 s (its modules compiled then), later imports as before: ~65 s sooner to ready.
PIP_INSTALL = ("install", "--no-compile")


def engine_side_install_argv(dep: Deployment, requirements: list[str], python: str, interpreter: str) -> list[str]:
    """Make ``k2_venv`` (``INTERPRETER -m venv``, the OS table's), install the engine-side wheels with no
    package index, then run :func:`engine_side_check` (a host whose Python or pins differ
    from the fleet's fails here, naming what differs)."""
    venv = dep.venv
    pip = shell_line([f"{venv}/bin/pip", *PIP_INSTALL, "--quiet", "--no-index", "--find-links", ENGINE_WHEEL_DIR,
                      *requirements])
    check = shell_line(engine_side_check(dep, requirements, python))
    return ["sh", "-c", f"{shell_word(interpreter)} -m venv {shell_word(venv)} && {pip} && "
                        f"{{ {check} || {{ echo \"$(hostname): engine venv {venv} differs from the fleet\" >&2; exit 1; }}; }}"]


def hub_client_files(dep: Deployment, host_name: str, art: ControlArtifacts) -> dict[str, FileSpec]:
    if dep.s.checkpoint_fetcher != host_name:
        return {}
    files: dict[str, FileSpec] = {}  # the downloader itself is in the host archive (the engine stage's)
    if art.wheels is None:
        files[f"{WHEEL_DIR}/"] = FileSpec(None, "644", "wheelhouse")
    else:
        files |= {f"{WHEEL_DIR}/{name}": FileSpec(data, "644", "wheelhouse") for name, data in art.wheels.items()}
    return files


def needs_double_image(dep: Deployment) -> bool:
    """The sandbox's container scenarios run the engine test doubles in an image the
    control-machine step builds (:mod:`k2sandbox.double_image`) and tags as ``k2_image``."""
    return dep.runtime == "container" and dep.s.engine_doubles and dep.image is not None


def image_files(dep: Deployment, hp: HostPlan, art: ControlArtifacts) -> tuple[ImagePin | None, dict[str, FileSpec]]:
    """A container host's image pin and the archive it loads (sandbox doubles, or a
    ``k2_bundle``'s saved image; otherwise a real fleet pulls ``k2_image`` and checks it
    is ``k2_image_id``)."""
    if dep.image is None or not any(container_name(s) for s in hp.services):
        return None, {}
    if not needs_double_image(dep) and dep.s.bundle is None:
        return (ImagePin(dep.image, dep.s.image_id, None) if dep.s.image_id else None), {}
    made = art.images.get(dep.image)  # the double image, or (k2_bundle) the archive in the bundle
    if made is None:
        name = "double-image.tar.gz"
        return ImagePin(dep.image, None, f"{IMAGE_DIR}/{name}"), {f"{IMAGE_DIR}/{name}": FileSpec(None, "644", "image")}
    path = Path(made[0])
    remote = f"{IMAGE_DIR}/{path.name}"
    return ImagePin(dep.image, made[1], remote), {remote: FileSpec(path.read_bytes(), "644", "image")}


def gpu_exporter_files(dep: Deployment, address: str, art: ControlArtifacts) -> tuple[ImagePin, dict[str, FileSpec]]:
    """``k2_gpu_exporter`` on the GPU host at fleet ``address``: dcgm-exporter's image pin, its unit and (the sandbox's
    TEST DOUBLE image, or a ``k2_bundle``'s saved image) the archive the host loads; otherwise a
    real fleet pulls ``k2_gpu_exporter_image`` and checks it is ``k2_gpu_exporter_image_id``
    (:mod:`k2fleet.planning.gpu_exporter`)."""
    ref = dep.s.gpu_exporter_image
    if not dep.s.simulated_gpus and dep.s.bundle is None:
        image_id = dep.s.gpu_exporter_image_id
        unit = gpu_exporter.unit_file(dep, address, image_id).encode()
        return ImagePin(ref, image_id, None), {gpu_exporter.UNIT_PATH: FileSpec(unit, "644")}
    made = art.images.get(ref)  # the TEST DOUBLE image, or (k2_bundle) the archive in the bundle
    if made is None:  # not built yet (--dry): the unit names its image ID, so it waits too
        return ImagePin(ref, None, gpu_exporter.ARCHIVE), {gpu_exporter.ARCHIVE: FileSpec(None, "644", "image"),
                                                           gpu_exporter.UNIT_PATH: FileSpec(None, "644", "image")}
    path = Path(made[0])
    remote = f"{IMAGE_DIR}/{path.name}"
    unit = gpu_exporter.unit_file(dep, address, made[1]).encode()
    return ImagePin(ref, made[1], remote), {remote: FileSpec(path.read_bytes(), "644", "image"),
                                            gpu_exporter.UNIT_PATH: FileSpec(unit, "644")}


def device_double_files(dep: Deployment) -> tuple[tuple[str, ...], dict[str, FileSpec]]:
    """(device nodes, tmpfiles.d config) standing in for a simulated platform's devices."""
    nodes = DEVICE_DOUBLES.get(dep.platform, ()) if dep.s.simulated_gpus and dep.runtime == "container" else ()
    if not nodes:
        return (), {}
    lines = ["# k2fleet: TEST DOUBLE device nodes for simulated GPUs (sandbox only): the null",
             "# device's numbers under the names the engine container is given with --device."]
    lines += sorted({f"d {node.rsplit('/', 1)[0]} 0755 root root -" for node in nodes if node.count("/") > 2})
    lines += [f"c {node} 0666 root root - 1:3" for node in nodes]
    return nodes, {DEVICE_DOUBLES_CONF: FileSpec(("\n".join(lines) + "\n").encode(), "644", "k2fleet")}


def api_key_files(dep: Deployment, hp: HostPlan, art: ControlArtifacts) -> dict[str, FileSpec]:
    """``k2_api_key_file`` on a host that serves the API: the key alone (the health gate
    reads it) and what reads it there: under vLLM the env file its units read
    (``VLLM_API_KEY=...``), under the other engines the API front's pattern file (``Bearer
    KEY``, :mod:`k2fleet.planning.api_front`); all 0600 and created with that mode before a
    byte lands; shown in the plan as ``(secret)``."""
    if dep.s.api_key_file is None or not any(holds_api_key(dep, svc) for svc in hp.services):
        return {}
    key_path, env_path_ = api_key_paths(dep)
    key = None if art.api_key is None else art.api_key.decode()
    if api_front.checks_key(dep):
        reader, content = api_front.keys_path(dep), None if key is None else api_front.keys_file(key)
    else:
        reader = env_path_
        content = None if key is None else (env_file_line(str(dep.engine_impl.api_key_env), key) + "\n").encode()
    return {key_path: FileSpec(None if key is None else (key + "\n").encode(), "600", "api-key", secret=True),
            reader: FileSpec(content, "600", "api-key", secret=True)}


def tls_files(dep: Deployment, svc: Service, art: ControlArtifacts) -> dict[str, FileSpec]:
    """``k2_tls_*`` for a service that serves HTTPS (the API front, the load balancer): the
    certificate chain and key as one PEM, and the CA its health gate (and the load balancer's
    calls to the replicas) verify against; both root-only 0600, created with that mode before
    a byte lands (:func:`k2fleet.deploy.operations.synced_files`); the PEM shown as ``(secret)``.
    A change restarts the front (reloads the load balancer: :func:`fleet_rollout`)."""
    if not api_front.tls(dep) or svc.name not in (api_front.FRONT, load_balancer.LB):
        return {}
    pem, ca = art.tls if art.tls else (None, None)
    return {api_front.pem_path(dep): FileSpec(pem, "600", "tls", secret=True),
            api_front.ca_path(dep): FileSpec(ca, "600", "tls")}


def service_files(dep: Deployment, svc: Service, pin: ImagePin | None = None) -> dict[str, FileSpec]:
    unit = None if pin is not None and pin.image_id is None else unit_file(dep, svc, pin.image_id if pin else None)
    files = {
        unit_path(svc): FileSpec(None if unit is None else unit.encode(), "644", "plan" if unit else "image"),
        env_path(dep, svc): FileSpec(env_file(svc).encode(), "600"),
    }
    for path, content in svc.files.items():
        files[path] = FileSpec(content.encode(), "644")
    return files


def expected_world(dep: Deployment, svc: Service, host: str) -> dict[str, Any] | None:
    """The topology the health gate checks (sandbox: the engine test doubles report it):
    the planned parallel sizes and, for vLLM and SGLang rendezvous (not Ray), the
    addresses of the other hosts of ``host``'s instance, as the head saw them join.
    KTransformers ≥ 0.4 serves through sglang-kt; the legacy server reports none."""
    pool = dep.pools.get(svc.role)
    server = dep.engine_impl.server(dep.version)  # what each engine's test double reports (Engine.world_keys)
    world = server.world(pool) if dep.s.engine_doubles and pool is not None and pool.tp else None
    if world is None:
        return None
    if pool.settings.multinode_backend == "ray" and pool.nodes_per_instance > 1:
        # the Ray cluster the engine joined: every node of the instance with all its GPUs
        world |= {"ray_nodes": pool.nodes_per_instance, "ray_gpus": pool.nodes_per_instance * dep.gpus_per_node}
    elif server.reports_members():
        nodes = next((n for n in pool.instances if n[0].name == host), None)
        if nodes is not None:
            world["members"] = sorted({h.address for h in nodes[1:]} - {nodes[0].address})
    return world


def pd_servers(plan: Plan) -> dict[str, list[str]]:
    """Base URLs of the PD prefill and decode servers (rank 0 of each instance)."""
    pools: dict[str, list[str]] = {}
    for host, svc in plan.services():
        if svc.role in ("prefill", "decode") and svc.health:
            pools.setdefault(svc.role, []).append(f"http://{host.address}:{svc.health.port}")
    return pools


# the request counter each engine's /metrics moves with every completed request (its own:
# ``Engine.request_counter``, with its source), which the deploy's health gate reads before and
# after its completion. A service whose /metrics lacks it (another release, a router) is not held to it.
REQUEST_COUNTERS: dict[str, str] = {name: e.request_counter for name, e in engines.ENGINES.items() if e.request_counter}


# The fact's quick look at a serving endpoint (/health and a short completion), in seconds: a
# GPU engine answers in well under one. An engine's CPU build (k2_engine_cpu_build, sandbox only)
# took longer than 5 s on a loaded 2-core machine (2026-11-28: two hosts' real vLLM, TP2 over gloo,
# beside two other sandbox fleets): the settled re-run then saw it unhealthy and ran the gate again.
QUICK_HEALTH_TIMEOUT_S = 5
QUICK_HEALTH_TIMEOUT_CPU_BUILD_S = 30  # (an engine that is down costs the fact this long: not 60)


def quick_health_timeout(dep: Deployment) -> int:
    """Seconds the fact's quick health check may take (:data:`QUICK_HEALTH_TIMEOUT_S`, or
    :data:`QUICK_HEALTH_TIMEOUT_CPU_BUILD_S` for an engine's CPU build)."""
    return QUICK_HEALTH_TIMEOUT_CPU_BUILD_S if dep.engine_cpu_build else QUICK_HEALTH_TIMEOUT_S


def health_argv(dep: Deployment, hp: HostPlan, timeout: int, pd: dict[str, list[str]] | None = None,
                metrics: bool = True) -> list[str] | None:
    """The health gate of this host's first chat-serving service: its readiness route
    (``/health`` unless the plan's Health names another) 200 + a completion (+ on engine
    test doubles, the parallel sizes and members they report equal the plan's, and a
    router's completion reached both PD pools: ``pd``, from :func:`pd_servers`; with
    ``metrics``, a serving engine's request counter moved with the completion:
    :data:`REQUEST_COUNTERS`)."""
    for svc in hp.services:
        if svc.health and svc.health.chat:
            where = f"[{svc.health.host}]" if ":" in svc.health.host else svc.health.host  # an IPv6 literal in a URL
            https = api_front.tls(dep) and api_front.fronts(svc)  # PD servers: the router's plain backends
            argv = [*host_argv("health"), "--base", f"{'https' if https else 'http'}://{where}:{svc.health.port}",
                    "--model", dep.api_model_name, "--unit", unit_name(svc), "--timeout", str(timeout)]
            if https:  # the front's certificate verified against the CA, for the address clients call
                argv += ["--ca-file", api_front.ca_path(dep), "--tls-name", hp.address]
            if sends_api_key(dep, svc):  # the path of the key, never the key (through the API front too)
                argv += ["--api-key-file", api_key_paths(dep)[0]]
            if svc.health.path != "/health":
                argv += ["--ready-path", svc.health.path]
            world = expected_world(dep, svc, hp.name)
            argv += ["--expect-world", json.dumps(world, sort_keys=True)] if world else []
            if dep.s.engine_doubles and svc.role == "router" and pd and len(pd) == 2:
                argv += ["--expect-pd", json.dumps(pd, sort_keys=True)]
            if metrics and svc.role == "serve" and dep.engine_impl.request_counter:
                argv += ["--expect-counter", dep.engine_impl.request_counter]
            held = instance_watch.rendezvous(dep, hp, svc)  # a head: its ranks that never joined, named on failure
            if held:
                argv += ["--rendezvous-port", str(held[0]), *(w for m in held[1] for w in ("--member", m))]
            return argv
    return None


def marker_check_argv(ws: WeightSet) -> list[str]:
    """Read-only check of one weight set for the HostState fact: its manifest is of the
    pinned repository and revision, the verified marker matches it and no file's stat
    changed (never writes or removes the marker); its digest is the control machine's pin
    once it has one (:attr:`WeightSet.manifest_sha256`)."""
    return host_argv("verify", "--marker-only", "--repo", ws.repo, "--revision", ws.revision, *pin_args(ws), ws.path)


def hub_client_check(requirement: str) -> list[str]:
    want = requirement.split("==", 1)[1]
    return [f"{HUB_ENV}/bin/python", "-c", f"import sys, huggingface_hub as h; sys.exit(h.__version__ != {want!r})"]


def venv_install_argv(dep: Deployment, interpreter: str) -> list[str]:
    """``INTERPRETER -m venv`` (the OS table's) + pip install of the pinned engine (offline wheelhouse
    first, then the package index: ``k2_pypi_index``, else pip's own configuration); no byte-compiling
    at install (:data:`PIP_INSTALL`)."""
    venv = dep.venv
    pip = shell_line([f"{venv}/bin/pip", *PIP_INSTALL, engine_pin(dep, None)])
    wheelhouse = shell_word(f"{venv}/wheelhouse")
    index = shell_line(["pip", "install", *mirrors.pip_index_args(dep.s)])[len("pip install"):]
    return ["sh", "-c", f"{shell_word(interpreter)} -m venv {shell_word(venv)} && {pip} --no-index --find-links {wheelhouse} "
                        f"|| {pip}{index}"]


def package_source_files(dep: Deployment, plan: BootstrapPlan, art: ControlArtifacts) -> dict[str, FileSpec]:
    """k2fleet's source files for the mirrors (``k2_os_mirror`` with ``k2_os_security_mirror``, ``k2_nvidia_repo``,
    ``k2_container_toolkit_repo``, ``k2_docker_repo``) and their keyrings (``k2_package_source:
    apt``; a bundle carries its own packages): written before any package is installed
    (:mod:`k2fleet.planning.mirrors`)."""
    if dep.s.package_source != "apt":
        return {}
    nvidia = plan.vendor == "nvidia" and not plan.simulated
    container = "docker" in plan.services  # the bootstrap installs Docker (and with NVIDIA GPUs the toolkit)
    files = {p: FileSpec(text.encode(), "644")
             for p, text in mirrors.mirror_files(dep.s, plan.os, plan.arch, nvidia, container).items()}
    docker_repo = any(r.name == "docker-ce" for r in plan.repos)
    for path, (key, control) in mirrors.keyring_files(dep.s, plan.manager, nvidia, container, docker_repo).items():
        files[path] = FileSpec(art.keyrings.get(control), "644", f"{key} {control}")
    return files


# --------------------------------------------------------------------------- bootstrap


def runs_containers(hp: HostPlan) -> bool:
    return any(s.argv and s.argv[0] == DOCKER for s in hp.services)


def host_bootstrap(dep: Deployment, hp: HostPlan, entry: Any) -> BootstrapPlan:
    """The host's bootstrap plan; Docker (and with NVIDIA GPUs the container toolkit) where it
    runs containers: the engine's, or dcgm-exporter's under ``k2_gpu_exporter``."""
    return bootstrap_plan(dep, entry, docker=runs_containers(hp) or gpu_exporter.runs_on(dep, hp.role))


def bootstrap_files(plan: BootstrapPlan) -> dict[str, FileSpec]:
    """The bootstrap's config files and, for its GPU gate, the host archive (``hoststate --gate``)."""
    files = {path: FileSpec(text.encode(), "644") for path, text in plan.files.items()}
    if plan.vendor:
        files |= host_archive_files()
    return files


def host_archive_files() -> dict[str, FileSpec]:
    """The one archive of k2fleet's host programs (:mod:`k2fleet.planning.host_archive`)."""
    return {HOST_ARCHIVE: _host_archive_spec()}


@lru_cache(maxsize=1)
def _host_archive_spec() -> FileSpec:
    """The archive's file, one object per process like its bytes (:func:`~k2fleet.planning.host_archive.archive_bytes`):
    every host's desired state holds it (twice on a GPU host), so its sha256 (~0.2 ms for its
    ~370 KB) is computed once, not once per host and group."""
    return FileSpec(archive_bytes(), "644", "k2fleet")


def bundle_request(dep: Deployment, fleet_plan: Plan, hp: HostPlan, plan: BootstrapPlan) -> list[str]:
    """What the host's offline bundle holds: its packages and its bootstrap's, pinned."""
    return _bundle_request(required_packages(dep, hp, on_mesh(fleet_plan, hp.name)), plan)


def _bundle_request(packages: list[str], plan: BootstrapPlan) -> list[str]:
    return sorted(set(packages) | set(plan.specs()))


def on_mesh(plan: Plan, name: str) -> bool:
    """Does host ``name`` take part in the SSH mesh (it needs sshd)?"""
    return name in mesh_config.mesh_members(plan)


@dataclass(frozen=True, eq=False)
class FleetParts:
    """What more than one step asks of every host — its bootstrap plan, firewall, packages,
    offline bundle request —, each computed once for ``dep`` and ``plan``, when first asked.
    A run makes one and passes it to :func:`k2fleet.control.artifacts.prepare_control_artifacts`
    and :func:`desired_state` (each makes its own when given none, and refuses one made for
    another deployment or plan): without it every host's packages were computed three times,
    its bootstrap plan four times and its firewall four times."""

    dep: Deployment
    plan: Plan

    def of(self, dep: Deployment, plan: Plan) -> "FleetParts":
        """This, when it was made for ``dep`` and ``plan`` (the same objects); ValueError otherwise."""
        if self.dep is not dep or self.plan is not plan:
            raise ValueError("FleetParts of another deployment or plan")
        return self

    @cached_property
    def mesh_members(self) -> frozenset[str]:
        return frozenset(mesh_config.mesh_members(self.plan))

    @cached_property
    def bootstraps(self) -> dict[str, BootstrapPlan]:
        """Host → :func:`host_bootstrap`."""
        return {h.name: host_bootstrap(self.dep, self.plan.hosts[h.name], h) for h in self.dep.fleet.hosts}

    @cached_property
    def firewalls(self) -> dict[str, fleet_firewall.HostFirewall | None]:
        """Host → :func:`k2fleet.planning.firewall.host_firewall`."""
        return {name: fleet_firewall.host_firewall(self.dep, hp) for name, hp in self.plan.hosts.items()}

    @cached_property
    def packages(self) -> dict[str, list[str]]:
        """Host → :func:`~k2fleet.planning.host_packages.required_packages`."""
        return {name: required_packages(self.dep, hp, name in self.mesh_members,
                                        firewalled=self.firewalls[name] is not None)
                for name, hp in self.plan.hosts.items()}

    @cached_property
    def bundle_requests(self) -> dict[str, list[str]]:
        """Host → :func:`bundle_request`."""
        return {name: _bundle_request(self.packages[name], self.bootstraps[name]) for name in self.plan.hosts}


# --------------------------------------------------------------------------- the whole fleet


def fanout_plan(dep: Deployment, plan: Plan) -> relay_plan.FanoutPlan:
    names = [h.name for h in dep.fleet.hosts if loads_weights(plan.hosts[h.name])]
    fetcher = dep.s.checkpoint_fetcher
    return relay_plan.plan_fanout(names, shared_storage=dep.s.shared_storage, root=None if fetcher in ("control", "auto") else fetcher)


def fleet_rollout(dep: Deployment, plan: Plan) -> Rollout:
    """The fleet's engine instances in inventory order (``ROLE-INDEX``, hosts head first, the
    ``serve`` ones' server names at the load balancer), ``k2_rollout`` and the load balancer
    (:mod:`k2fleet.planning.rollout`)."""
    servers = {s.name for s in load_balancer.servers(dep, plan)} if load_balancer.balanced(dep) else set()
    instances = []
    for role in INSTANCE_ROLES:
        pool = dep.pools.get(role)
        for i, hosts in enumerate(pool.instances if pool else []):
            names = tuple(h.name for h in hosts)
            server = next((n for n in names if n in servers), None) if role == "serve" else None
            instances.append(Instance(f"{role}-{i}", names, server))
    balancer = None
    reloads: dict[str, tuple[str, ...]] = {}
    if load_balancer.balanced(dep):
        balancer = Balancer(host=str(dep.s.load_balancer), unit=load_balancer.UNIT, socket=load_balancer.SOCKET,
                            backend=load_balancer.BACKEND, drain_timeout=dep.s.drain_timeout,
                            ready_timeout=load_balancer.READY_TIMEOUT_S)
        reloads[load_balancer.LB] = (load_balancer.config_path(dep),)  # new backends: a reload, streams go on
        if api_front.tls(dep):  # a new certificate or CA: a reload too (HAProxy reads them again)
            reloads[load_balancer.LB] += (api_front.pem_path(dep), api_front.ca_path(dep))
    return Rollout(mode=dep.s.rollout, instances=tuple(instances), balancer=balancer, reloads=reloads)


def desired_state(dep: Deployment, plan: Plan, art: ControlArtifacts,
                  parts: FleetParts | None = None) -> dict[str, HostDesired]:
    """One :class:`HostDesired` per host, in inventory order; ``parts``: the run's
    :class:`FleetParts` of ``dep`` and ``plan`` (default: made here). Connects to nothing and
    writes nothing; reads the host archive's sources and their ``__pycache__`` bytecode
    (:func:`~k2fleet.planning.host_archive.archive_bytes`, once per process) and the image
    archives ``art.images`` names."""
    parts = parts.of(dep, plan) if parts else FleetParts(dep, plan)
    slots = sorted({(svc.stage, svc.name) for _, svc in plan.services()})
    fan = fanout_plan(dep, plan)
    address = {h.name: h.address for h in dep.fleet.hosts}
    relays = tuple(relay_plan.relay_url(address[name], dep.s.relay_port) for name in fan.order)
    bundled = dep.s.bundle is not None
    engine = {real: engine_files(dep, art.engine_doubles, real, from_wheel=bundled and dep.runtime == "venv")
              | {relay_plan.RELAY_SECRET: FileSpec(art.relay_secret, "600", "relay-secret")}
              for real in (False, True)}
    meshes = mesh_files(dep, plan, art)
    pd = pd_servers(plan)
    rollout = fleet_rollout(dep, plan)
    reach = reach_checks(plan)
    port_start = privileged_ports.port_start(dep, plan)
    port_files = {p: FileSpec(c.encode(), "644") for p, c in
                  privileged_ports.files(dep, port_start, node_exporter=dep.s.metrics and dep.s.node_exporter).items()}
    cache_spec = None  # k2_bundle with a warmed engine cache: one archive for every host that runs the engine
    if art.engine_cache is not None:
        cache_spec = FileSpec(Path(art.engine_cache[0]).read_bytes(), "600", "engine-cache")
    out: dict[str, HostDesired] = {}
    for h in dep.fleet.hosts:
        hp = plan.hosts[h.name]
        d = HostDesired(name=h.name, address=h.address, slots=slots, bootstrap=parts.bootstraps[h.name],
                        rollout=rollout)
        d.files["bootstrap"] = bootstrap_files(d.bootstrap)
        d.files["package_sources"] = package_source_files(dep, d.bootstrap, art)
        d.files["mesh"] = meshes[h.name]
        d.absent = mesh_config.keys_not_held(dep, d.files["mesh"])
        engine_side = engine_requirements(dep, hp, bundled, art.engine_doubles)
        python = host_python(d.bootstrap.os)
        d.python = OS_TABLES[d.bootstrap.os].python
        d.files["engine"] = dict(engine[bool(engine_side)])
        d.files["engine_side"] = engine_side_files(engine_side, art)
        d.files["hub_client"] = hub_client_files(dep, h.name, art)
        d.files["host"] = {p: FileSpec(c.encode(), "644") for p, c in hp.files.items()}
        if any(svc.env.get("RAY_AUTH_TOKEN_PATH") for svc in hp.services):  # Ray with token authentication
            d.files["host"][RAY_TOKEN] = FileSpec(art.ray_token, "600", "ray-token")
        d.image, d.files["image"] = image_files(dep, hp, art)
        d.device_doubles, devices = device_double_files(dep)
        d.files["engine"].update(devices)
        d.service_files = {svc.name: service_files(dep, svc, d.image if container_name(svc) else None)
                           | tls_files(dep, svc, art) for svc in hp.services}
        d.files["api_key"] = api_key_files(dep, hp, art)
        d.reach = reach.get(h.name)
        if (d.reach or (rollout.balancer and rollout.balancer.host == h.name)) and HOST_ARCHIVE not in d.all_paths():
            d.files["host"] |= host_archive_files()  # lbctl (the load balancer) and reach run from the host archive
        d.api_key_services = [svc.name for svc in hp.services if holds_api_key(dep, svc)]
        d.own_slots = sorted((svc.stage, svc.name) for svc in hp.services)
        d.mesh_between_deploys = h.name in parts.mesh_members and dep.s.mesh_after_deploy == "keep"
        d.units = [mesh_config.UNIT] * d.mesh_between_deploys + [unit_name(s) for s in hp.services]
        d.mesh_yields_to = [unit_name(s) for s in hp.services if mesh_config.UNIT in s.conflicts]
        d.packages = list(parts.packages[h.name])
        d.bundle_request = list(parts.bundle_requests[h.name])
        if dep.s.package_source == "bundle" and (tar := art.bundle_for(d.bundle_request)):
            d.bundle_repo = bundle_repo_dir(tar)
        d.checks = {ws.check: marker_check_argv(ws) for ws in dep.weight_sets}
        d.checks.update(bootstrap.fact_checks(d.bootstrap))
        if d.bootstrap.vendor:
            d.gpu_gate = bootstrap.gate_argv(d.bootstrap)
            if bootstrap.CDI_SPEC in " ".join(" ".join(c) for c in d.bootstrap.commands):
                d.exists.append(bootstrap.CDI_SPEC)
        d.health_argv = health_argv(dep, hp, dep.s.health_timeout, pd)
        quick = health_argv(dep, hp, quick_health_timeout(dep), pd, metrics=False)  # the fact's quick look: no /metrics reads
        if quick:
            d.checks[HEALTH_CHECK] = quick
            d.gpus_proven_by = gpus_proven_by(dep, hp)
        if d.image is not None and d.image.image_id:
            d.checks[IMAGE_CHECK] = image_pin_argv(d.image.ref, d.image.image_id)
        if dep.s.checkpoint_fetcher == h.name and art.hub_requirement:
            d.checks[HUB_CLIENT_CHECK] = hub_client_check(art.hub_requirement)
        if engine_side:
            d.checks[ENGINE_SIDE_CHECK] = engine_side_check(dep, engine_side, python)
            d.engine_side_install = engine_side_install_argv(dep, engine_side, python, d.python)
        d.engine_entry = f"{dep.venv}/bin/{dep.engine_impl.entry}"
        d.exists = [*d.exists, d.engine_entry, *d.device_doubles, RECORD]  # RECORD: kept before the first change
        cache_dir = engine_cache.cache_dir(dep.engine)
        if cache_spec is not None and art.engine_cache and any(engine_cache.cache_dir_of(s.env) == cache_dir
                                                               for s in hp.services):
            d.files["engine_cache"] = {engine_cache.archive_path(dep.engine): cache_spec}
            d.engine_cache_unpack = engine_cache.unpack_argv(dep.engine, art.engine_cache[1])
            d.exists.append(cache_dir)
        if dep.s.model_type_override:
            d.exists.append(f"{dep.serve_path}/config.json")
        if dep.runtime == "venv" and not dep.s.simulated_gpus and not bundled:
            d.venv_install = venv_install_argv(dep, d.python)
        d.firewall = parts.firewalls[h.name]
        if privileged_ports.serves(dep, hp):  # no local user binds a port k2fleet serves on
            d.files[privileged_ports.GROUP] = dict(port_files)
            d.checks[privileged_ports.CHECK] = privileged_ports.check_argv(port_start)
            d.port_start = port_start
        if gpu_exporter.runs_on(dep, hp.role):  # dcgm-exporter: its unit and image (the gpu_exporter role)
            d.gpu_exporter, d.files["gpu_exporter"] = gpu_exporter_files(dep, h.address, art)
            d.units.append(gpu_exporter.UNIT)
            if d.gpu_exporter.image_id:
                d.checks[gpu_exporter.CHECK] = image_pin_argv(d.gpu_exporter.ref, d.gpu_exporter.image_id)
        if d.firewall is not None:  # the rules, their unit, and the check that the kernel holds them
            d.files["firewall"] = {fleet_firewall.rules_path(dep): FileSpec(d.firewall.rules().encode(), "644"),
                                   fleet_firewall.UNIT_PATH: FileSpec(fleet_firewall.unit_file(dep, d.firewall).encode(), "644")}
            d.units.append(fleet_firewall.UNIT)
            d.checks[fleet_firewall.CHECK] = fleet_firewall.check_argv(d.firewall)
        d.fanout = FanoutPlace(loads_weights=loads_weights(hp), is_root=h.name == fan.root, shared=fan.shared,
                               position=fan.order.index(h.name) if h.name in fan.order else None,
                               relays=relays, relay_fanout=swarm.fanout_for(len(relays)))
        d.kept = kept_dirs(dep, d.fanout.loads_weights, fetches=d.fanout.is_root or not d.fanout.shared)
        d.checks.update({k.check: k.argv(check=True) for k in d.kept})
        out[h.name] = d
    return out
