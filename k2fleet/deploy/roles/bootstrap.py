"""Bootstrap role: a bare host → GPU-ready (driver, fabric, container runtime), from the
host's bootstrap record (:class:`~k2fleet.planning.role_actions.BootstrapActions`: its
:class:`~k2fleet.planning.host_bootstrap.BootstrapPlan` and what the HostState fact shows differs).

In order, each step only when the record says the host differs (a plain ``if``: a host
that needs none of it gets no operation):

1. files: the unattended-upgrades blacklist, IMEX's nodes_config.cfg, ib_umad's
   modules-load.d entry, and the GPU gate program (``k2fleet-host.pyz hoststate --gate``);
2. NVIDIA's / Docker's repositories (``k2_package_source: apt``; the bundle carries its own);
3. packages: packages of another driver branch removed, the driver installed at its pin,
   then the fabric packages at exactly the version the driver installed (from its
   package, at execution time), then the rest and the running kernel's headers (DKMS);
   held (``apt-mark hold``);
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
from k2fleet.deploy.operations import command, rebooted, rolling_step, start_or_explain, synced_files
from k2fleet.planning.desired import HostDesired
from k2fleet.planning.quoting import shell_line, shell_word
from k2fleet.planning.role_actions import BootstrapActions
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
def bring_up(actions: BootstrapActions, tracked: list, steps: list[Step] | None = None,
             desired: HostDesired | None = None) -> None:
    """
    Bring this host to GPU-ready as its bootstrap record says (see the module doc).

    + actions: this host's bootstrap record (``role_actions(...).bootstrap``): its
      :class:`~k2fleet.planning.host_bootstrap.BootstrapPlan`, the files to write, the packages
      pending, obsolete and held, the kernel headers missing, the reboot's reason, the GPU
      services to start or restart, whether the toolkit configures Docker and the gate runs
    + tracked: the run's changed-operation list (a reboot re-runs the health gate)
    + steps: the run's rolling reboot steps, the same on every host
      (:func:`k2fleet.planning.host_actions.reboot_steps`: ``k2_reboot: rolling`` under ``k2_rollout:
      rolling``): the hosts reboot instance by instance, each drained at the load balancer and
      health-gated; empty or None: as before (all at once, or host by host under ``rolling``)
    + desired: this host's desired state (with ``steps``: its slots, health gate, load balancer)

    **Example:**

    .. code:: python

        bootstrap.bring_up(role_actions(run.dep, mine, fact).bootstrap, run.tracked)
    """
    a = actions
    plan = a.plan
    manager = PACKAGE_MANAGERS[plan.manager]
    if a.files:
        synced_files(name="bootstrap files (unattended-upgrades blacklist, fabric config, GPU gate)", files=a.files)
    if a.refused:
        raise BootstrapError(a.refused)
    if a.online and plan.repos:
        command(name="package repositories (NVIDIA, Docker)", argv=" && ".join(map(_repo_line, plan.repos)))
    if a.online:
        command(name="update the package lists", argv=manager.refresh)
    if a.installs:
        tracked.append(command(name="install the GPU stack at its pins",
                               argv=install_line(plan, list(a.pending), list(a.obsolete), a.apt_options,
                                                 list(a.headers))))
    if a.holds:
        command(name="hold the driver, fabric and kernel packages", argv=[*manager.hold, *a.holds])
    groups = sorted({g for gs in plan.groups.values() for g in gs})  # udev makes `render`; a host without it: here
    joins = [f"{{ getent group {g} >/dev/null || groupadd --system {g}; }}" for g in groups]
    joins += [shell_line(["usermod", "-aG", ",".join(g), u]) for u, g in plan.groups.items()]
    if a.installs and joins:
        command(name="GPU users join the device groups", argv=" && ".join(joins))
    if a.load_module:
        load = [shell_line(list(plan.module_load))] + [shell_line(["modprobe", m]) for m in plan.modprobe]
        command(name="load the GPU kernel module", argv=" && ".join(load))
    if steps and desired is not None:  # every host plans them (a fleet-ordered change), each reboots its own
        for k, step in enumerate(steps, 1):
            rolling_step(desired, step, f"rolling reboot {k}/{len(steps)} ({step.instance})", tracked,
                         reason=a.reboot or "", reboot_timeout=REBOOT_TIMEOUT_S)
    elif a.reboot is not None:  # under ``rolling`` pyinfra runs it host by host (_serial)
        tracked.append(rebooted(name=f"reboot ({plan.reboot}): the loaded driver module changes",
                                reason=a.reboot, reboot_timeout=REBOOT_TIMEOUT_S, _serial=plan.reboot == "rolling"))
    if a.start:
        tracked.append(command(name="enable and start the GPU services",
                               argv=" && ".join(f"( {start_or_explain(u, 'enable --now')} )" for u in a.start)))
    if a.restart:
        tracked.append(command(name="restart the running GPU services whose packages changed",
                               argv=" && ".join(f"( {start_or_explain(u, 'restart')} )" for u in a.restart)))
    if a.toolkit:
        command(name="container toolkit: Docker's nvidia runtime and the CDI spec",
                argv=" && ".join(shell_line(list(c)) for c in plan.commands) or "true")
    if a.gate:
        command(name="GPU gate: count, type, driver, module, NVLink fabric, services",
                argv=shell_line(list(a.gate_argv)) if a.gate_argv else "true")


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
