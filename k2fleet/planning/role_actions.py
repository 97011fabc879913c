"""Plan → diff → apply: what each deploy role does on one host, decided from (its desired
state, its HostState fact) alone (pure).

:func:`role_actions` turns a host's :class:`~k2fleet.planning.desired.HostDesired` and the one
fact (:class:`~k2fleet.planning.host_fact.HostReport`) into one frozen record per role
(:class:`RoleActions`). A role (``k2fleet.deploy.roles``) takes its record and nothing of
the fact: what the record says is known before the run is a plain ``if`` in the role, so a
host that needs nothing from a role gets no operation of it and ``pyinfra --dry`` lists
only real changes. The roles keep ``_if=`` for what only the run itself decides (another
host's outcome: the fleet changed, a peer's probe failed).

The records name the files to write as the subset of the desired files whose digest the
fact did not see (:func:`differing`); a record that is empty everywhere is a role with nothing
to do. :func:`k2fleet.planning.host_actions.host_actions` summarises the same differences per
host (settled or not); the bootstrap's packages are decided once, here and there, by the same
functions of :mod:`k2fleet.planning.host_bootstrap` (kernel headers included).

>>> from k2fleet.planning.desired import FileSpec
>>> list(differing({"/a": FileSpec(b"a", "644"), "/b": FileSpec(b"b", "600")}, {"/a": FileSpec(b"a", "644").sha256}))
['/b']
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from k2fleet.planning import firewall as plan_firewall
from k2fleet.planning import gpu_exporter as plan_exporter
from k2fleet.planning import host_bootstrap as b
from k2fleet.planning import privileged_ports as plan_ports
from k2fleet.planning.deployment import Deployment
from k2fleet.planning.desired import (CHECKPOINT_CHECK, DPKG_JOURNAL_GLOB, ENGINE_SIDE_CHECK, HEALTH_CHECK,
                                      HUB_CLIENT_CHECK, IMAGE_CHECK, RECORD, UNIT_GLOB, FanoutPlace, FileSpec, HostDesired,
                                      ImagePin)
from k2fleet.planning.host_bootstrap import BootstrapPlan, Package
from k2fleet.planning.host_fact import HostReport
from k2fleet.planning.host_packages import bundle_apt_options
from k2fleet.planning.mesh_config import UNIT as MESH_UNIT
from k2fleet.planning.preflight_checks import check_host
from k2fleet.planning.quoting import shell_line
from k2fleet.planning.reach_plan import ReachCheck
from k2fleet.planning.units import image_pin_argv

Files = Mapping[str, FileSpec]


def differing(files: Files, seen: Mapping[str, str | None]) -> dict[str, FileSpec]:
    """The files of ``files`` whose sha256 the fact did not see at their path (missing, other
    content, or a control artifact not made yet: no content, under ``--dry``)."""
    return {path: spec for path, spec in files.items() if spec.content is None or seen.get(path) != spec.sha256}


def image_load_line(pin: ImagePin) -> str:
    """``docker load`` (the archive) or ``docker pull``, then the pin checked once more; ``true``
    without an image ID (``--dry`` before the archive exists)."""
    if not pin.image_id:
        return "true"
    get = ["docker", "load", "--input", pin.archive] if pin.archive else ["docker", "pull", pin.ref]
    return f"{shell_line(get)} && {shell_line(image_pin_argv(pin.ref, pin.image_id))}"


@dataclass(frozen=True)
class PreflightActions:
    host: str
    problems: tuple[str, ...] = ()  # why this host cannot run its part (empty: go ahead)


@dataclass(frozen=True)
class PackagesActions:
    sources: Files = field(default_factory=dict)  # the mirrors' source files and keyrings to write
    source: str = "bundle"  # k2_package_source: apt | bundle
    install: tuple[str, ...] = ()  # the host packages (every one, as apt takes them) when some are missing
    missing: tuple[str, ...] = ()  # those not installed
    ship_bundle: bool = False  # the offline bundle is shipped and indexed (packages missing, or the bootstrap's)
    refresh: bool = False  # the bootstrap installs from the bundle: its index is read again
    have_repo: bool = False  # the fact saw this bundle extracted already
    finish_dpkg: bool = False  # dpkg's journal holds an interrupted install: `dpkg --configure -a` before any apt run


@dataclass(frozen=True)
class BootstrapActions:
    plan: BootstrapPlan
    files: Files = field(default_factory=dict)  # unattended-upgrades blacklist, fabric config, GPU gate
    pending: tuple[Package, ...] = ()  # planned packages not installed at their pins
    obsolete: tuple[str, ...] = ()  # packages of another driver branch, removed
    headers: tuple[str, ...] = ()  # the running kernel's headers (DKMS builds against them), not installed
    holds: tuple[str, ...] = ()  # packages to hold (not held, or changed by this run)
    reboot: str | None = None  # why the host reboots in this run
    load_module: bool = False  # first install: the GPU module is loaded without a reboot
    start: tuple[str, ...] = ()  # GPU services not active: enabled and started
    restart: tuple[str, ...] = ()  # active GPU services, restarted because their packages change
    toolkit: bool = False  # the container toolkit configures Docker (not configured, or packages change, or a reboot)
    gate: bool = False  # the GPU gate runs (it did not pass, or anything here changes)
    gate_argv: tuple[str, ...] = ()
    apt_options: str = ""  # apt restricted to the offline bundle ("" online)
    refused: str | None = None  # the bootstrap cannot proceed (TEST DOUBLE packages without the bundle)

    @property
    def installs(self) -> bool:
        """Packages change (install, remove, kernel headers)."""
        return bool(self.pending or self.obsolete or self.headers)

    @property
    def online(self) -> bool:
        """Packages change from the network (``k2_package_source: apt``): repositories, index refresh."""
        return self.installs and self.plan.package_source == "apt"


@dataclass(frozen=True)
class FirewallActions:
    files: Files = field(default_factory=dict)  # rules and unit to write
    planned: bool = False  # k2_firewall is on for this host
    remove: bool = False  # off, and a table k2fleet loaded before is there: removed with its unit and file
    rules_path: str = ""
    start: bool = False  # the unit is not active (or not enabled)
    reload: bool = False  # active, and its rules changed or the kernel no longer holds them


@dataclass(frozen=True)
class PortsActions:
    files: Files = field(default_factory=dict)  # sysctl drop-in (and the node exporter's systemd drop-in)
    planned: bool = False
    dropin: bool = False  # the node exporter's drop-in changes: systemd reloads
    raise_to: int | None = None  # the running kernel's value is below the plan's: raised to this


@dataclass(frozen=True)
class MeshActions:
    remove: tuple[str, ...] = ()  # keys this host holds and must no longer
    files: Files = field(default_factory=dict)
    planned: bool = False  # the host is on the mesh
    start: bool = False  # the mesh sshd is not running (and no unit that takes its port does)
    restart: bool = False  # it runs and its files change
    stop_after: bool = False  # k2_mesh_after_deploy: stop


@dataclass(frozen=True)
class EngineActions:
    files: Files = field(default_factory=dict)  # host programs and engine files
    create_devices: bool = False  # TEST DOUBLE device nodes missing (or their config changes)
    image_files: Files = field(default_factory=dict)  # the image archive
    load_image: str | None = None  # shell line: the pinned image is not there
    venv: str = ""
    venv_install: tuple[str, ...] | None = None  # the engine's entry point is missing
    side_files: Files = field(default_factory=dict)  # engine-side wheelhouse
    side_install: tuple[str, ...] | None = None  # engine-side wheels not as pinned (or a wheel changes)
    cache_files: Files = field(default_factory=dict)  # the bundle's engine cache archive
    cache_unpack: tuple[str, ...] | None = None  # its cache dir is missing, or the archive changes


@dataclass(frozen=True)
class ExporterActions:
    planned: bool = False
    files: Files = field(default_factory=dict)
    load_image: str | None = None
    start: bool = False
    restart: bool = False  # running, and its unit or image archive changes


@dataclass(frozen=True)
class HubClientActions:
    files: Files = field(default_factory=dict)  # downloader and offline wheelhouse
    python: str = "python3"
    install: bool = False  # the venv's check fails or a wheel changes


@dataclass(frozen=True)
class CheckpointActions:
    fanout: FanoutPlace
    address: str
    port_start: int = 0
    wanted: tuple[str, ...] = ()  # weight set checks this host loads weights for and fails
    overlay: bool = False  # the model_type overlay is (re)made


@dataclass(frozen=True)
class ServicesActions:
    stale: tuple[str, ...] = ()  # unit files of k2fleet units the plan no longer has
    host_files: Files = field(default_factory=dict)
    key_files: Files = field(default_factory=dict)
    unit_files: Mapping[str, Files] = field(default_factory=dict)  # service → its files to write (changed only)
    start: frozenset[tuple[int, str]] = frozenset()  # own slots not active (or not enabled)
    running: frozenset[tuple[int, str]] = frozenset()  # own slots whose unit is active
    changed: frozenset[tuple[int, str]] = frozenset()  # running own slots whose files (or the API key) change
    reload: frozenset[str] = frozenset()  # running reloading services whose config changes (reloaded unless restarted)

    @property
    def stale_units(self) -> tuple[str, ...]:
        return tuple(p.rsplit("/", 1)[1] for p in self.stale)


@dataclass(frozen=True)
class HealthActions:
    argv: tuple[str, ...] | None = None  # None: no endpoint on this host
    healthy: bool = False  # the fact's quick check passed


@dataclass(frozen=True)
class RoleActions:
    """Every role's record for one host (see the module doc)."""

    preflight: PreflightActions
    record: tuple[str, ...] | None  # the record of the host before k2fleet is missing: its program's argv
    packages: PackagesActions
    bootstrap: BootstrapActions | None
    firewall: FirewallActions
    ports: PortsActions
    mesh: MeshActions
    engine: EngineActions
    exporter: ExporterActions
    hub_client: HubClientActions
    checkpoint: CheckpointActions | None
    reach: ReachCheck | None
    services: ServicesActions
    health: HealthActions
    # (what, argv) per directory of revisions whose fact check failed (k2_keep_revisions): run
    # after the health gate passed on what is pinned
    kept_revisions: tuple[tuple[str, tuple[str, ...]], ...] = ()


def bootstrap_actions(dep: Deployment, desired: HostDesired, fact: HostReport) -> BootstrapActions | None:
    plan = desired.bootstrap
    if plan is None:
        return None
    boot = fact.boot
    pending = tuple(b.pending_packages(plan, boot))
    obsolete = tuple(b.obsolete_packages(plan, boot))
    headers = tuple(b.missing_headers(plan, boot))
    reboot = b.reboot_reason(plan, boot)
    installs = bool(pending or obsolete or headers)
    units = [f"{u}.service" for u in plan.services]
    provided = bool(plan.provided)  # k2_gpu_stack: provided: read (preflight refused a stopped one), never started here
    start = () if provided else tuple(u for u in units if not fact.unit_active(u))
    restart = () if provided or reboot is not None or not installs else tuple(u for u in units if fact.unit_active(u))
    configured = fact.passed(b.DOCKER_RUNTIME_CHECK) and fact.exists.get(b.CDI_SPEC, False)
    toolkit = plan.package("nvidia-container-toolkit") is not None and (not configured or installs or reboot is not None)
    files = differing(desired.files.get("bootstrap", {}), fact.files)
    settled = fact.passed(b.GPU_GATE_CHECK) and not installs and reboot is None
    module = boot.modules.get(b.KERNEL_MODULE.get(plan.vendor or "", ""))
    refused = None
    if plan.simulated and plan.package_source != "bundle" and plan.vendor and not plan.provided:
        refused = (f"{plan.host}: the TEST DOUBLE driver packages travel only in the offline bundle; "
                   "set k2_package_source: bundle")
    return BootstrapActions(
        plan=plan, files=files, pending=pending, obsolete=obsolete, headers=headers,
        holds=tuple(b.missing_holds(plan, boot)), reboot=reboot,
        load_module=reboot is None and bool(plan.module_load) and module is None,
        start=start, restart=restart, toolkit=toolkit,
        gate=bool(plan.vendor) and (not settled or bool(files)), gate_argv=tuple(desired.gpu_gate or ()),
        apt_options=bundle_apt_options() if dep.s.package_source == "bundle" else "", refused=refused)


def services_actions(desired: HostDesired, fact: HostReport, restart_all: bool = False) -> ServicesActions:
    planned = desired.kept_units() | {plan_firewall.UNIT}  # the firewall role removes its own unit
    stale = tuple(sorted(p for p in fact.globs.get(UNIT_GLOB, []) if p.rsplit("/", 1)[1] not in planned))
    key_files = differing(desired.files.get("api_key", {}), fact.files)
    names = dict.fromkeys(name for _, name in desired.slots)
    unit_files = {name: differing(desired.service_files.get(name, {}), fact.files) for name in names}
    reloads = desired.rollout.reloads
    running = frozenset(s for s in desired.own_slots if fact.unit_active(f"{s[1]}.service"))
    start = frozenset(s for s in desired.own_slots
                      if not (fact.unit_active(f"{s[1]}.service") and fact.unit_enabled(f"{s[1]}.service")))
    changed = set()
    for stage, name in running:
        files = desired.service_files.get(name, {})
        if name in reloads:  # restarts only when a file other than its config changed
            others = {p: f for p, f in files.items() if p not in reloads[name]}
            if restart_all or differing(others, fact.files):
                changed.add((stage, name))
        elif restart_all or unit_files.get(name) or (name in desired.api_key_services and key_files):
            changed.add((stage, name))
    reload = frozenset(name for name in reloads if any(n == name for _, n in running)
                       and differing({p: f for p, f in desired.service_files.get(name, {}).items()
                                      if p in reloads[name]}, fact.files))
    return ServicesActions(stale=stale, host_files=differing(desired.files.get("host", {}), fact.files),
                           key_files=key_files, unit_files=unit_files, start=start, running=running,
                           changed=frozenset(changed), reload=reload)


def role_actions(dep: Deployment, desired: HostDesired, fact: HostReport, restart_all: bool = False,
                 record_argv: list[str] | None = None) -> RoleActions:
    """Every role's record for this host (see the module doc). ``restart_all``: hosts of the
    fleet reboot at once or host by host in this run, so every running unit restarts in stage
    order (:meth:`k2fleet.deploy.fleet_run.FleetRun.restart_all`); ``record_argv``: the program
    that keeps the record of the host before k2fleet (:func:`k2fleet.planning.teardown.program_argv`),
    run when the fact did not see the record."""
    seen = fact.files
    entry = next(h for h in dep.fleet.hosts if h.name == desired.name)
    problems = check_host(dep, entry, fact, checkpoint_present=fact.passed(CHECKPOINT_CHECK))
    if desired.bootstrap is not None:
        problems += b.bootstrap_problems(desired.bootstrap, fact.boot)
        problems += b.provided_problems(desired.bootstrap, fact)  # k2_gpu_stack: provided
    boot = bootstrap_actions(dep, desired, fact)

    base = lambda p: p.split("=", 1)[0].split(":", 1)[0]  # noqa: E731 (a package name of an apt spec)
    missing = tuple(p for p in desired.packages if base(p) not in fact.packages)
    source = dep.s.package_source
    refresh = bool(boot and (boot.pending or boot.obsolete)) and source == "bundle"
    packages = PackagesActions(
        sources=differing(desired.files.get("package_sources", {}), seen), source=source,
        install=tuple(desired.packages) if missing else (), missing=missing,
        ship_bundle=source == "bundle" and bool(missing or refresh), refresh=refresh,
        have_repo=bool(desired.bundle_repo and fact.exists.get(desired.bundle_repo)),
        finish_dpkg=bool(fact.globs.get(DPKG_JOURNAL_GLOB)))

    fw_files = desired.files.get("firewall", {})
    fw_unit = plan_firewall.UNIT
    fw_active = fact.unit_active(fw_unit)
    fw_written = differing(fw_files, seen)
    firewall = FirewallActions(
        files=fw_written, planned=bool(fw_files), rules_path=plan_firewall.rules_path(dep),
        remove=not fw_files and any(p.rsplit("/", 1)[1] == fw_unit for p in fact.globs.get(UNIT_GLOB, [])),
        start=bool(fw_files) and not (fw_active and fact.unit_enabled(fw_unit)),
        reload=bool(fw_files) and fw_active and bool(fw_written or not fact.passed(plan_firewall.CHECK)))

    port_files = desired.files.get(plan_ports.GROUP, {})
    port_written = differing(port_files, seen)
    ports = PortsActions(files=port_written, planned=bool(port_files),
                         dropin=plan_ports.NODE_EXPORTER_DROPIN in port_written,
                         raise_to=desired.port_start if port_files and not fact.passed(plan_ports.CHECK) else None)

    mesh_files = desired.files.get("mesh", {})
    mesh_written = differing(mesh_files, seen)
    was_active = fact.unit_active(MESH_UNIT)
    yielded = any(fact.unit_active(u) for u in desired.mesh_yields_to)
    mesh = MeshActions(remove=tuple(p for p in desired.absent if fact.exists.get(p)), files=mesh_written,
                       planned=bool(mesh_files),
                       start=bool(mesh_files) and not ((was_active and fact.unit_enabled(MESH_UNIT)) or yielded),
                       restart=bool(mesh_files) and was_active and bool(mesh_written),
                       stop_after=bool(mesh_files) and not desired.mesh_between_deploys)

    programs = differing(desired.files.get("engine", {}), seen)
    side = desired.files.get("engine_side", {})
    side_written = differing(side, seen)
    devices = desired.device_doubles
    pin = desired.image
    unpack = desired.engine_cache_unpack
    cache_written = differing(desired.files.get("engine_cache", {}), seen)
    engine = EngineActions(
        files=programs,
        create_devices=bool(devices) and (bool(programs) or not all(fact.exists.get(d) for d in devices)),
        image_files=differing(desired.files.get("image", {}), seen),
        load_image=image_load_line(pin) if pin is not None and not fact.passed(IMAGE_CHECK) else None,
        venv=desired.engine_entry.rsplit("/bin/", 1)[0],
        venv_install=tuple(desired.venv_install) if desired.venv_install is not None
        and not fact.exists.get(desired.engine_entry) else None,
        side_files=side_written,
        side_install=tuple(desired.engine_side_install or ["true"]) if side
        and (not fact.passed(ENGINE_SIDE_CHECK) or side_written) else None,
        cache_files=cache_written,
        cache_unpack=tuple(unpack) if unpack is not None and (not fact.exists.get(unpack[-1]) or cache_written)
        else None)

    ex_files = desired.files.get("gpu_exporter", {})
    ex_pin = desired.gpu_exporter
    ex_planned = bool(ex_files) and ex_pin is not None
    ex_written = differing(ex_files, seen)
    ex_active = fact.unit_active(plan_exporter.UNIT)
    exporter = ExporterActions(
        planned=ex_planned, files=ex_written if ex_planned else {},
        load_image=image_load_line(ex_pin) if ex_planned and ex_pin and ex_pin.image_id
        and not fact.passed(plan_exporter.CHECK) else None,
        start=ex_planned and not (ex_active and fact.unit_enabled(plan_exporter.UNIT)),
        restart=ex_planned and ex_active and bool(ex_written))

    hub_files = desired.files.get("hub_client", {})
    hub_written = differing(hub_files, seen)
    hub = HubClientActions(files=hub_written, python=desired.python,
                           install=bool(hub_files) and (not fact.passed(HUB_CLIENT_CHECK) or bool(hub_written)))

    fan = desired.fanout
    checkpoint = None
    if fan is not None:
        wanted = tuple(ws.check for ws in dep.weight_sets if fan.loads_weights and not fact.passed(ws.check))
        override = dep.s.model_type_override
        overlay_missing = bool(override) and not fact.exists.get(f"{dep.serve_path}/config.json", False)
        refetched = fan.loads_weights and not fact.passed(CHECKPOINT_CHECK)
        checkpoint = CheckpointActions(fanout=fan, address=desired.address, port_start=desired.port_start,
                                       wanted=wanted, overlay=bool(override) and fan.loads_weights
                                       and (refetched or overlay_missing))

    return RoleActions(
        preflight=PreflightActions(desired.name, tuple(problems)),
        record=tuple(record_argv) if record_argv is not None and not fact.exists.get(RECORD) else None,
        packages=packages, bootstrap=boot, firewall=firewall, ports=ports,
        mesh=mesh, engine=engine, exporter=exporter, hub_client=hub, checkpoint=checkpoint, reach=desired.reach,
        services=services_actions(desired, fact, restart_all),
        health=HealthActions(tuple(desired.health_argv) if desired.health_argv is not None else None,
                             fact.passed(HEALTH_CHECK)),
        kept_revisions=tuple((f"keep {k.keep} {k.kind} revision(s) in {k.root} (the pinned one first), remove older ones",
                              tuple(k.argv())) for k in desired.kept if not fact.passed(k.check)))

