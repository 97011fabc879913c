"""Bootstrap role: a bare host → GPU-ready (driver, fabric, container runtime), from the
host's :class:`~k2fleet.planning.host_bootstrap.BootstrapPlan` and the HostState fact.

In order, each step only when the fact says the host differs:

1. files: the unattended-upgrades blacklist, IMEX's nodes_config.cfg, ib_umad's
   modules-load.d entry, and the GPU gate program (``k2fleet-host.pyz hoststate --gate``);
2. NVIDIA's / Docker's repositories (``k2_package_source: apt``; the bundle carries its own);
3. packages: packages of another driver branch removed, the driver installed at its pin,
   then the fabric packages at exactly the version the driver installed (from its
   package, at execution time), then the rest; held (``apt-mark hold``);
4. the kernel module loaded (first install) — or, when the loaded module will differ
   from the installed driver, a reboot: ``if-needed`` reboots this host now, ``rolling``
   one host at a time across the fleet — under ``k2_rollout: rolling``, one instance at a
   time (its hosts together, drained at the load balancer before, health-gated and put back
   after: :func:`k2fleet.planning.host_actions.reboot_steps`); the deploy waits for it and carries on;
5. services (nvidia-persistenced, fabric manager or IMEX, Docker) enabled and started —
   restarted after a package change; the container toolkit configures Docker;
6. the GPU gate: GPU count and type, driver branch and pin, loaded module = installed
   driver, every GPU's NVLink fabric Completed (CUDA error 802 otherwise), services
   active. A host that fails stops here, named, before any engine starts.

Under ``k2_gpu_stack: provided`` the plan has no NVIDIA, AMD or Docker package, hold,
repository, module load or toolkit command, :func:`~k2fleet.planning.host_bootstrap.reboot_reason`
is None and no service is started here: steps 2–5 do nothing for the GPU stack (preflight
refused a host whose stack cannot serve) and step 6, the gate, runs as with ``install``.
"""

from __future__ import annotations

from pyinfra.api import deploy

from k2fleet.planning import host_bootstrap as b
from k2fleet.planning.host_bootstrap import BootstrapPlan, Package
from k2fleet.planning.os_tables import OS_TABLES, PACKAGE_MANAGERS
from k2fleet.deploy.operations import command, rebooted, rolling_step, start_or_explain, synced_files, unit_running
from k2fleet.planning.desired import HostDesired
from k2fleet.planning.host_fact import HostReport
from k2fleet.planning.quoting import shell_line, shell_word
from k2fleet.planning.rollout import Step

REBOOT_TIMEOUT_S = 600


class BootstrapError(Exception):
    """The bootstrap cannot proceed on a host."""


def install_line(plan: BootstrapPlan, pending: list[Package], obsolete: list[str], apt_options: str,
                 headers: list[str]) -> str:
    """One shell line: the pending driver packages at their pins (removing ``obsolete``
    ones where the manager can in the same transaction), then the packages pinned to the
    driver's version at the version its package has now (read on the host), then the rest.

    >>> from k2fleet.planning.host_bootstrap import Package, BootstrapPlan
    >>> plan = BootstrapPlan("h", "ubuntu-22.04", "k2_os", "apt", "nvidia", "x86_64", "apt", "never",
    ...                      packages=(Package("nvidia-open", "580.", hold=True),
    ...                                Package("nvidia-fabricmanager", same_as_driver=True)),
    ...                      driver_package="nvidia-open")
    >>> print(install_line(plan, list(plan.packages), [], "", []).replace(" && ", chr(10)))  # doctest: +ELLIPSIS
    DEBIAN_FRONTEND=... install 'nvidia-open=580.*'
    v=$(dpkg-query -W -f='${Version}' nvidia-open)
    v=${v#*:}
    v=${v%%-*}
    DEBIAN_FRONTEND=... install "nvidia-fabricmanager=${v}*"
    """
    manager = PACKAGE_MANAGERS[plan.manager]
    install = " ".join(manager.install_changing.format(options=apt_options).split())
    hold_tools = {n for table in OS_TABLES.values() for n in table.hold_tool}  # first: later steps hold
    driver = [p for p in pending if p.name in hold_tools or not p.same_as_driver and b.BRANCH_NAMED.match(p.name)
              or p.name == plan.driver_package]
    follow = [p for p in pending if p.same_as_driver]
    rest = [p for p in pending if p not in driver and p not in follow]
    removed = [f"{n}{manager.remove_suffix}" for n in obsolete] if manager.remove_suffix else []
    steps = []
    locked = [p.name for p in pending if p.hold and plan.manager == "dnf"]
    if locked:  # a version-locked package changes version only once its lock is gone (held again after)
        steps.append(f"{{ {shell_line([*manager.unhold, *locked])} || true; }}")
    first = plan.specs(driver) + removed
    if first:
        steps.append(f"{install} {shell_line(first)}")
    if follow:  # names from the tables: [a-z0-9-]
        pins = " ".join(manager.pinned_to_v.format(name=p.name) for p in follow)
        steps.append(f"{manager.version_of.format(name=shell_word(plan.driver_package or ''))} && {install} {pins}")
    others = plan.specs(rest) + headers
    if others:
        steps.append(f"{install} {shell_line(others)}")
    return " && ".join(steps)


@deploy("k2fleet: bootstrap")
def bring_up(plan: BootstrapPlan, fact: HostReport, files: dict, gate_argv: list[str], apt_options: str,
             reboot: str | None, tracked: list, steps: list[Step] | None = None,
             desired: HostDesired | None = None) -> None:
    """
    Bring this host to GPU-ready as its bootstrap plan says (see the module doc).

    + plan: this host's :class:`~k2fleet.planning.host_bootstrap.BootstrapPlan` (``desired.bootstrap``)
    + fact: this host's HostState (``boot``: packages, holds, loaded module; ``checks``)
    + files: the bootstrap's files (``desired.files["bootstrap"]``: path → FileSpec)
    + gate_argv: the GPU gate (``k2fleet-host.pyz hoststate --gate``) this host runs after any change
    + apt_options: apt options restricting apt to the offline bundle ("" for ``apt``)
    + reboot: why this host reboots in this run (``k2fleet.planning.host_bootstrap.reboot_reason``), or None
    + tracked: the run's changed-operation list (a reboot re-runs the health gate)
    + steps: the run's rolling reboot steps, the same on every host
      (:func:`k2fleet.planning.host_actions.reboot_steps`: ``k2_reboot: rolling`` under ``k2_rollout:
      rolling``): the hosts reboot instance by instance, each drained at the load balancer and
      health-gated; empty or None: as before (all at once, or host by host under ``rolling``)
    + desired: this host's desired state (with ``steps``: its slots, health gate, load balancer)

    **Example:**

    .. code:: python

        bootstrap.bring_up(mine.bootstrap, fact, mine.files["bootstrap"], mine.gpu_gate,
                           bundle_apt_options(), reboot_reason(mine.bootstrap, fact.boot), run.tracked)
    """
    boot = fact.boot  # preflight refused what the bootstrap must not touch (bootstrap_problems)
    # Every host plans the same operation sequence (pyinfra orders operations across hosts
    # by it); what a host does not need is skipped with _if.
    wrote = synced_files(name="bootstrap files (unattended-upgrades blacklist, fabric config, GPU gate)",
                         files=files, current=fact.files)
    pending = b.pending_packages(plan, boot)
    obsolete = b.obsolete_packages(plan, boot)
    headers = []
    if plan.kernel_headers and plan.vendor and not plan.simulated and plan.package_source == "apt":
        wanted = plan.kernel_headers.format(kernel=boot.kernel)  # DKMS builds against the running kernel
        headers = [] if wanted in boot.package_versions else [wanted]
    if plan.simulated and plan.package_source != "bundle" and plan.vendor and not plan.provided:
        raise BootstrapError(f"{plan.host}: the TEST DOUBLE driver packages travel only in the offline bundle; "
                             "set k2_package_source: bundle")
    changed = bool(pending or obsolete or headers)
    online = changed and plan.package_source == "apt"
    command(name="package repositories (NVIDIA, Docker)",
            argv=" && ".join(map(_repo_line, plan.repos)) if online and plan.repos else "true",
            _if=lambda: online and bool(plan.repos))
    command(name="update the package lists", argv=PACKAGE_MANAGERS[plan.manager].refresh, _if=lambda: online)
    installed = command(name="install the GPU stack at its pins", _if=lambda: changed,
                        argv=install_line(plan, pending, obsolete, apt_options, headers) or "true")
    tracked.append(installed)
    holds = b.missing_holds(plan, boot)
    command(name="hold the driver, fabric and kernel packages", _if=lambda: bool(holds),
            argv=shell_line([*PACKAGE_MANAGERS[plan.manager].hold, *holds]) if holds else "true")
    groups = sorted({g for gs in plan.groups.values() for g in gs})  # udev makes `render`; a host without it: here
    joins = [f"{{ getent group {g} >/dev/null || groupadd --system {g}; }}" for g in groups]
    joins += [shell_line(["usermod", "-aG", ",".join(g), u]) for u, g in plan.groups.items()]
    command(name="GPU users join the device groups", argv=" && ".join(joins) or "true",
            _if=lambda: changed and bool(joins))
    module = boot.modules.get(b.KERNEL_MODULE.get(plan.vendor or "", ""))
    load = [shell_line(list(plan.module_load))] + [shell_line(["modprobe", m]) for m in plan.modprobe]
    command(name="load the GPU kernel module", argv=" && ".join(load) if plan.module_load else "true",
            _if=lambda: reboot is None and bool(plan.module_load) and module is None)
    if steps and desired is not None:
        for k, step in enumerate(steps, 1):
            rolling_step(desired, step, f"rolling reboot {k}/{len(steps)} ({step.instance})", tracked,
                         reason=reboot or "", reboot_timeout=REBOOT_TIMEOUT_S)
    else:
        tracked.append(rebooted(name=f"reboot ({plan.reboot}): the loaded driver module changes",
                                reason=reboot or "", reboot_timeout=REBOOT_TIMEOUT_S,
                                _serial=plan.reboot == "rolling", _if=lambda: reboot is not None))
    units = [f"{u}.service" for u in plan.services]
    inactive = [u for u in units if not fact.unit_active(u)]
    active = [u for u in units if fact.unit_active(u)]
    if plan.provided:  # k2_gpu_stack: provided: read (preflight refused a stopped one), never started here
        inactive = active = []
    tracked.append(command(name="enable and start the GPU services", _if=lambda: bool(inactive),
                           argv=" && ".join(f"( {start_or_explain(u, 'enable --now')} )" for u in inactive) or "true"))
    tracked.append(command(name="restart the running GPU services whose packages changed",
                           argv=" && ".join(f"( {start_or_explain(u, 'restart')} )" for u in active) or "true",
                           _if=lambda: reboot is None and bool(active) and installed.did_change()))
    toolkit = plan.package("nvidia-container-toolkit") is not None
    configured = fact.passed(b.DOCKER_RUNTIME_CHECK) and fact.exists.get(b.CDI_SPEC, False)
    command(name="container toolkit: Docker's nvidia runtime and the CDI spec",
            argv=" && ".join(shell_line(list(c)) for c in plan.commands) or "true",
            _if=lambda: toolkit and (not configured or installed.did_change() or reboot is not None))
    settled = fact.passed(b.GPU_GATE_CHECK) and not changed and reboot is None
    command(name="GPU gate: count, type, driver, module, NVLink fabric, services",
            argv=shell_line(gate_argv) if gate_argv else "true",
            _if=lambda: bool(plan.vendor) and (not settled or wrote.did_change()))


def _repo_line(repo: b.Repo) -> str:
    """Shell line making a package repository known to apt/dnf (``k2_package_source: apt``);
    ``true`` for k2fleet's own mirror source files, which the package-sources step writes."""
    if repo.kind == "apt-keyring-deb":
        return (f"{{ test -e /usr/share/keyrings/cuda-archive-keyring.gpg || {{ curl -fsSL -o /tmp/k2-keyring.deb "
                f"{shell_word(repo.source)} && dpkg -i /tmp/k2-keyring.deb; }}; }}")
    if repo.kind == "apt":
        sources, keyring = b.repo_paths(repo)
        line = repo.source.replace("$(ARCH)", "$(dpkg --print-architecture)")
        if not line.startswith("deb "):  # a bare "URL suite component" (AMD's amdgpu repository)
            line = f"deb [signed-by={keyring}] {line}"
        return (f"{{ test -e {shell_word(keyring)} || curl -fsSL {shell_word(repo.key or '')} | gpg --dearmor -o "
                f"{shell_word(keyring)}; echo \"{line}\" > {sources}; }}")
    if repo.kind == "k2fleet-file":  # a mirror's source file and keyring: synced with the package mirrors
        return "true"
    if repo.kind == "dnf-repo":
        return f"dnf config-manager --add-repo {shell_word(repo.source)}"
    if repo.kind == "dnf-module":
        return f"dnf -y module enable {shell_word(repo.source)}"
    if repo.kind == "dnf-baseurl":
        return (f"printf '[{repo.name}]\\nname={repo.name}\\nbaseurl=%s\\ngpgkey=%s\\ngpgcheck=1\\n' "
                f"{shell_word(repo.source)} {shell_word(repo.key or '')} > {b.repo_paths(repo)[0]}")
    raise BootstrapError(f"repository {repo.name}: kind {repo.kind} is not installable with k2_package_source: apt")
