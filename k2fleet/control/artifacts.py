"""Control-machine effects, in one explicit step: :func:`prepare_control_artifacts`.

A deployment needs a few things made on the control machine before any host can be
told what to hold: the mesh key pairs (a client key per mesh head — mpirun's host —, a host
key per mesh member, so known_hosts is pinned before a host is contacted; none without a mesh), the Hub-client wheelhouse
for a ``k2_checkpoint_fetcher`` host, the engine-side wheelhouses (e.g. Ray for the
hosts of vLLM's Ray backend), the offline .deb bundles for
``k2_package_source: bundle`` and, for a sandbox container scenario, the engine TEST
DOUBLE image archive (from the stand-ins, :mod:`k2fleet.control.stand_ins`) — or, with ``k2_bundle: DIR``, all of these
but the mesh keys from that air-gapped bundle alone (:mod:`k2fleet.control.airgap`). :func:`read_control_artifacts` only reads what exists
(``k2fleet plan`` and ``pyinfra --dry`` use it and change nothing);
:func:`prepare_control_artifacts` makes what is missing and is called once per real
run by ``deploys/kimi.py``. The checkpoint cache (a Hub download on the control
machine) is filled later, by the checkpoint role's first operation, and only when a
host's checkpoint gate fails — a settled fleet never asks the Hub.

Generated state lives under ``$K2FLEET_STATE_DIR/<deployment id>`` (default
``~/.local/state/k2fleet``; both this user's and writable by no one else, checked before
anything is read from them: :func:`owned_state_dir`; the id is the inventory file's:
:func:`deployment_id`), caches under ``/var/cache/k2fleet``.

>>> deployment_id("inventory", "m/x", ["10.0.0.2", "10.0.0.1"]) == deployment_id("inventory", "m/x", ["10.0.0.1", "10.0.0.2"])
True
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
import subprocess
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from k2fleet.planning.engine_side import host_python
from k2fleet.control import ControlError
from k2fleet.control.stand_ins import engine_doubles_for, stand_ins
from k2fleet.planning.deployment import Deployment
from k2fleet.planning import gpu_exporter, mesh_config
from k2fleet.planning.desired import ControlArtifacts, FleetParts, engine_requirements, host_arch, needs_double_image, package_set
from k2fleet.planning.processes import Plan

if TYPE_CHECKING:
    from k2fleet.control.aptroot import AptRoot

# What a settled run does not need is imported where it is used: the wheelhouses (a Hub
# client or engine-side wheels), the offline bundles and their private apt root
# (``k2_package_source: bundle``) and the air-gapped bundle (``k2_bundle``, with urllib,
# tarfile, the lock file): ~5 ms of imports on the deploy's path before its first fact.


def deployment_id(inventory: str, model: str, addresses: list[str]) -> str:
    """Stable id of a deployment: its inventory file's real path, so that a host added,
    removed or replaced, a new revision or engine version keep the deployment (its relay
    secret, Ray token and mesh keys stay, and the hosts that stay are not handed new ones).
    An inventory that is no file (pyinfra's API, an inline host list): its model and the
    fleet's addresses."""
    if os.path.isfile(inventory):
        key = ["inventory", os.path.realpath(inventory)]
    else:
        key = [model, *sorted(addresses)]
    return hashlib.sha256("|".join(key).encode()).hexdigest()[:12]


def dep_id(dep: Deployment) -> str:
    """:func:`deployment_id` of ``dep`` (its ``fleet.source``: the inventory as named on the command line)."""
    return deployment_id(dep.fleet.source, dep.s.model, [h.address for h in dep.fleet.hosts])


def state_dir(dep: Deployment) -> Path:
    """Control-machine directory of this deployment's generated state (not created here)."""
    base = Path(os.environ.get("K2FLEET_STATE_DIR", Path.home() / ".local/state/k2fleet"))
    return base / dep_id(dep)


def owned_state_dir(dep: Deployment, create: bool) -> Path | None:
    """:func:`state_dir`, checked as the control cache is
    (:func:`k2fleet.control.checkpoint_copy.owned_cache`): it and the directory above it
    (``$K2FLEET_STATE_DIR``) are this user's, real directories, writable by no one else, so
    no other local user can have planted the relay secret, the Ray token or the mesh keys
    read from there. ``create``: make what is missing (0700); otherwise None when it does not
    exist yet. Raises ControlError naming the directory and the fix."""
    path = state_dir(dep)
    for directory in (path.parent, path):
        if not os.path.lexists(directory):
            if not create:
                return None
            directory.mkdir(mode=0o700, parents=True)
        st = directory.lstat()
        if not stat.S_ISDIR(st.st_mode):
            raise ControlError(f"the control state directory {directory} is not a directory of its own (a symlink?): "
                               "remove it, or set K2FLEET_STATE_DIR to a directory of yours (chmod 700)")
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise ControlError(f"the control state directory {directory} is owned by uid {st.st_uid} with mode "
                               f"{st.st_mode & 0o777:o}: another user could have planted the relay secret, Ray token "
                               "or mesh keys there; make it yours and 0700 (chown; chmod 700; remove files you did "
                               "not make) or set K2FLEET_STATE_DIR to such a directory")
    return path


def _mesh_paths(dep: Deployment, plan: Plan) -> tuple[dict[str, Path], dict[str, Path]]:
    """(head → its client key, member → its host key) on the control machine, for the mesh's
    heads and members only (:mod:`k2fleet.planning.mesh_config`)."""
    base = state_dir(dep) / "mesh"
    return ({name: base / "clients" / name / "id_ed25519" for name in mesh_config.mesh_links(plan)},
            {name: base / "hosts" / name / "ssh_host_ed25519_key" for name in mesh_config.mesh_members(plan)})


def _read_pair(path: Path) -> tuple[bytes, bytes] | None:
    public = path.with_name(path.name + ".pub")
    if path.is_file() and public.is_file():
        return path.read_bytes(), public.read_bytes()
    return None


def _package_sets(parts: FleetParts) -> set[tuple[str, ...]]:
    """Each host's offline bundle request: its packages and its bootstrap's."""
    return {package_set(request) for request in parts.bundle_requests.values()}


def _bundle_sources(dep: Deployment, parts: FleetParts) -> AptRoot | None:
    """Where the offline bundles' packages come from: the control machine's own apt
    (None) for Debian packages alone; with GPU packages on simulated GPUs, a private apt
    configuration with the sandbox's Debian release and the TEST DOUBLE repository
    standing in for NVIDIA's / AMD's (:mod:`k2sandbox.driver_doubles`)."""
    from k2fleet.control import aptroot

    gpu_stack = any(boot.vendor and not boot.provided for boot in parts.bootstraps.values())  # provided: none to bundle
    if not gpu_stack:
        return None
    if not dep.s.simulated_gpus:
        raise ControlError("k2_package_source: bundle for real GPU hosts takes NVIDIA's / AMD's packages for the "
                           "fleet's OS from an air-gapped bundle: make it with `k2fleet bundle INVENTORY --out DIR` "
                           "and set k2_bundle: DIR (or use k2_package_source: apt with the hosts' repositories)")
    provider = stand_ins()
    return aptroot.AptRoot([*aptroot.debian_sources(provider.suite), f"deb [trusted=yes] file:{provider.driver_repo()} ./"])


def _hub_requirement(dep: Deployment) -> str | None:
    if dep.s.checkpoint_fetcher in ("control", "auto"):  # auto: resolved before this step runs (control when unresolved)
        return None
    from k2fleet.control import wheelhouse

    return wheelhouse.hub_client_requirement()


def _engine_side_sets(dep: Deployment, parts: FleetParts) -> dict[tuple[str, ...], str]:
    """Engine-side requirement sets → the Python of the hosts that install them."""
    sets = {}
    for h in dep.fleet.hosts:
        reqs = engine_requirements(dep, parts.plan.hosts[h.name], False, None)
        if reqs:
            sets[tuple(reqs)] = host_python(parts.bootstraps[h.name].os)
    return sets


def _engine_wheelhouse(dep: Deployment, requirements: tuple[str, ...], python: str, build: bool) -> Path | None:
    if dep.engine_cpu_build:  # simulated GPUs, the real engine: its CPU build from the stand-ins
        return stand_ins().engine_cpu_wheelhouse(list(requirements), python, build=build)
    from k2fleet.control import wheelhouse

    where = dict(pythons=(python,), archs=(host_arch(dep),))
    if build:
        return wheelhouse.ensure_wheelhouse(list(requirements), index=dep.s.pypi_index, **where)
    return wheelhouse.cached_wheelhouse(list(requirements), **where)


def _engine_wheels(dep: Deployment, parts: FleetParts, build: bool) -> dict[tuple[str, ...], dict[str, bytes]]:
    """Engine-side wheel sets (requirements → wheel name → bytes): built, or those cached."""
    found = {reqs: _engine_wheelhouse(dep, reqs, python, build) for reqs, python in _engine_side_sets(dep, parts).items()}
    if not found:
        return {}
    from k2fleet.control import wheelhouse

    return {reqs: wheelhouse.wheel_files(path) for reqs, path in found.items() if path is not None}


def _double_images(dep: Deployment, plan: Plan, build: bool) -> dict[str, tuple[str, str]]:
    """The engine TEST DOUBLE image archive of a sandbox container scenario (ref → (path,
    image ID)) and, under ``k2_gpu_exporter``, dcgm-exporter's: built, or the cached ones; empty
    when none is needed (or, read only, made)."""
    out: dict[str, tuple[str, str]] = {}
    if needs_double_image(dep):
        assert dep.image is not None
        made = stand_ins().image(dep.image, plan, build=build)
        if made:
            out[dep.image] = (str(made[0]), made[1])
    if needs_gpu_exporter_double(dep, plan):  # k2_gpu_exporter on simulated GPUs: dcgm-exporter's TEST DOUBLE
        made = stand_ins().gpu_exporter_image(dep.s.gpu_exporter_image, build=build)
        if made:
            out[dep.s.gpu_exporter_image] = (str(made[0]), made[1])
    return out


def needs_gpu_exporter_double(dep: Deployment, plan: Plan) -> bool:
    """``k2_gpu_exporter`` on simulated GPUs (the sandbox) on some host: the exporter's TEST DOUBLE image."""
    return dep.s.simulated_gpus and any(gpu_exporter.runs_on(dep, hp.role) for hp in plan.hosts.values())


def relay_secret_path(dep: Deployment) -> Path:
    """The deployment's relay secret on the control machine (its own relay reads it too)."""
    return state_dir(dep) / "relay.secret"


def ray_token_path(dep: Deployment) -> Path:
    """The deployment's Ray authentication token on the control machine (hosts that run
    Ray get it as a root-only file: :data:`k2fleet.planning.engines.vllm.render.RAY_TOKEN`)."""
    return state_dir(dep) / "ray.token"


def read_api_key(dep: Deployment) -> bytes | None:
    """``k2_api_key_file``'s key (its one line, without the newline), or None without one.
    The gate checked the file (this user's, 0600, one line of visible ASCII) before."""
    if dep.s.api_key_file is None:
        return None
    return Path(dep.s.api_key_file).read_bytes().strip()


def read_tls(dep: Deployment) -> tuple[bytes, bytes] | None:
    """``k2_tls_cert_file`` + ``k2_tls_key_file`` as the one PEM HAProxy serves (certificate
    chain, then the key) and ``k2_tls_ca_file``'s bytes; None without TLS. The gate checked
    the files (the key the deploying user's and 0600, the certificate matching it and
    verifying against the CA: :func:`k2fleet.deploy.gate.check_tls_files`)."""
    if dep.s.tls_cert_file is None or dep.s.tls_key_file is None or dep.s.tls_ca_file is None:
        return None
    cert, key = Path(dep.s.tls_cert_file).read_bytes(), Path(dep.s.tls_key_file).read_bytes()
    pem = cert.rstrip(b"\n") + b"\n" + key.rstrip(b"\n") + b"\n"
    return pem, Path(dep.s.tls_ca_file).read_bytes()


def read_keyrings(dep: Deployment) -> dict[str, bytes]:
    """The mirrors' keyrings (``k2_os_mirror_keyring``, ``k2_nvidia_repo_keyring``,
    ``k2_container_toolkit_repo_keyring``, ``k2_docker_repo_keyring``): control path → bytes (the
    gate checked them: regular files, OpenPGP key material, at most 1 MiB)."""
    s = dep.s
    paths = [p for p in (s.os_mirror_keyring, s.nvidia_repo_keyring, s.container_toolkit_repo_keyring,
                         s.docker_repo_keyring) if p]
    return {p: Path(p).read_bytes() for p in paths}


def _read_secret(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _make_secret(path: Path) -> bytes:
    """The secret at ``path``, made once: created with its final mode (0600, never readable
    by others for a moment) and exclusively (first writer wins, so concurrent runs agree)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return path.read_bytes()
    with os.fdopen(fd, "wb") as fh:
        fh.write((secrets.token_hex(32) + "\n").encode())
    return path.read_bytes()


def _from_bundle(dep: Deployment, plan: Plan, clients: dict[str, tuple[bytes, bytes]],
                 hosts: dict[str, tuple[bytes, bytes]], relay_secret: bytes | None,
                 ray_token: bytes | None) -> ControlArtifacts:
    """``k2_bundle``: packages, wheels, images and the engine cache archive (when the bundle
    carries one for this engine) from the bundle alone, each sha256-checked against its lock as
    it is read (:func:`k2fleet.control.airgap.read_bundle`); nothing is fetched."""
    assert dep.s.bundle is not None
    from k2fleet.control import airgap

    try:
        found = airgap.read_bundle(dep, plan, dep.s.bundle)
    except airgap.AirgapError as exc:
        raise ControlError(f"k2_bundle: {exc}") from None
    return ControlArtifacts(mesh_clients=clients, mesh_hosts=hosts, hub_requirement=_hub_requirement(dep),
                            wheels=found.hub_wheels, bundles=found.debs, images=found.images,
                            engine_wheels=found.engine_wheels, engine_doubles=engine_doubles_for(dep),
                            relay_secret=relay_secret, api_key=read_api_key(dep), tls=read_tls(dep), ray_token=ray_token,
                            keyrings=read_keyrings(dep), engine_cache=found.engine_cache)


def read_control_artifacts(dep: Deployment, plan: Plan, parts: FleetParts | None = None) -> ControlArtifacts:
    """What exists already (read only; missing pieces stay None/absent); ``parts``: the
    run's :class:`~k2fleet.planning.desired.FleetParts` (default: made here)."""
    owned_state_dir(dep, create=False)  # read nothing another local user could have planted
    client_paths, host_paths = _mesh_paths(dep, plan)
    clients = {name: pair for name, path in client_paths.items() if (pair := _read_pair(path)) is not None}
    hosts = {name: pair for name, path in host_paths.items() if (pair := _read_pair(path)) is not None}
    relay_secret = _read_secret(relay_secret_path(dep))
    ray_token = _read_secret(ray_token_path(dep))
    if dep.s.bundle is not None:
        return _from_bundle(dep, plan, clients, hosts, relay_secret, ray_token)
    requirement = _hub_requirement(dep)
    wheels = None
    if requirement:
        from k2fleet.control import wheelhouse

        cached = wheelhouse.cached_wheelhouse([requirement])
        wheels = wheelhouse.wheel_files(cached) if cached else None
    return ControlArtifacts(mesh_clients=clients, mesh_hosts=hosts, hub_requirement=requirement, wheels=wheels,
                            images=_double_images(dep, plan, build=False),
                            engine_wheels=_engine_wheels(dep, parts.of(dep, plan) if parts else FleetParts(dep, plan),
                                                         build=False),
                            engine_doubles=engine_doubles_for(dep),
                            relay_secret=relay_secret, api_key=read_api_key(dep), tls=read_tls(dep), ray_token=ray_token,
                            keyrings=read_keyrings(dep))


def _keypair(path: Path, comment: str) -> tuple[bytes, bytes]:
    """The key pair at ``path``, generated once (a fresh pair is linked into place only
    if none exists: first writer wins, so concurrent runs agree)."""
    public = path.with_name(path.name + ".pub")
    if not public.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(tmp)], check=True)
        try:
            os.link(tmp, path)
            os.link(tmp.with_name(tmp.name + ".pub"), public)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
            tmp.with_name(tmp.name + ".pub").unlink()
    return path.read_bytes(), public.read_bytes()


def prepare_control_artifacts(dep: Deployment, plan: Plan, parts: FleetParts | None = None) -> ControlArtifacts:
    """THE control-machine step: make the mesh keys, the Hub-client wheelhouse, the
    engine-side wheelhouses, package bundles and (sandbox container scenarios) the engine
    TEST DOUBLE image archive this deployment needs (each only once; cached), then return them.
    ``parts``: the run's :class:`~k2fleet.planning.desired.FleetParts` (default: made here)."""
    parts = parts.of(dep, plan) if parts else FleetParts(dep, plan)
    client_paths, host_paths = _mesh_paths(dep, plan)
    owned_state_dir(dep, create=True)
    clients = {name: _keypair(path, f"k2fleet-mesh-{dep_id(dep)}-{name}") for name, path in client_paths.items()}
    hosts = {name: _keypair(path, name) for name, path in host_paths.items()}
    relay_secret = _make_secret(relay_secret_path(dep))
    ray_token = _make_secret(ray_token_path(dep))
    if dep.s.bundle is not None:
        return _from_bundle(dep, plan, clients, hosts, relay_secret, ray_token)
    requirement = _hub_requirement(dep)
    wheels = None
    if requirement:
        from k2fleet.control import wheelhouse

        wheels = wheelhouse.wheel_files(wheelhouse.ensure_wheelhouse([requirement], index=dep.s.pypi_index))
    bundles = {}
    if dep.s.package_source == "bundle":
        from k2fleet.control import deb_bundles

        sources = _bundle_sources(dep, parts)
        bundles = {names: str(deb_bundles.ensure_bundle(list(names), apt_root=sources))
                   for names in _package_sets(parts) if names}
    return ControlArtifacts(mesh_clients=clients, mesh_hosts=hosts, hub_requirement=requirement, wheels=wheels,
                            bundles=bundles, images=_double_images(dep, plan, build=True),
                            engine_wheels=_engine_wheels(dep, parts, build=True), engine_doubles=engine_doubles_for(dep),
                            relay_secret=relay_secret, api_key=read_api_key(dep), tls=read_tls(dep), ray_token=ray_token,
                            keyrings=read_keyrings(dep))
