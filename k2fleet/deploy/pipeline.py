"""The Kimi-K2 pipeline: every role, in order, for one host.

Not a role itself (a plain function, so each role's operations keep their own names):
the one place that composes them (no role imports another).
``deploys/kimi.py`` gathers the host's fact and calls :func:`deploy_kimi`; the offline
role tests call it with a fact they construct.
"""

from __future__ import annotations

from pyinfra import host

from k2fleet.planning import host_bootstrap as boot
from k2fleet.planning.desired import HostDesired
from k2fleet.planning.host_packages import bundle_apt_options
from k2fleet.planning.host_fact import HostReport
from k2fleet.deploy.fleet_run import FleetRun, side_channel
from k2fleet.deploy.roles import (bootstrap, checkpoint, engine, firewall, gpu_exporter, health_gate, hub_client,
                                  kept_revisions, mesh, packages, preflight, privileged_ports, reach, record, services)
from k2fleet.planning.firewall import rules_path
from k2fleet.planning.rollout import Step
from k2fleet.planning.teardown import program_argv, record_spec


class RebootRefused(Exception):
    """``k2_reboot: never`` and the bootstrap needs to reboot hosts."""


def deploy_kimi(run: FleetRun, desired: HostDesired, fact: HostReport, reboots: dict[str, str],
                weights_wanted: dict[str, list[str]], unsettled: dict[str, str] | None = None,
                reboot_steps: list[Step] | None = None, restart_steps: list[Step] | None = None,
                starting: bool = False) -> None:
    """Carry out one host's desired state: preflight → the record of the host before k2fleet → packages → bootstrap → firewall → privileged ports → SSH mesh →
    engine → GPU exporter → Hub client → checkpoint → reachability → services → health gate → kept revisions (→ the mesh stopped, under
    ``k2_mesh_after_deploy: stop``).

    + run: the run's :class:`~k2fleet.deploy.fleet_run.FleetRun` (deployment, artifacts, tracked operations)
    + desired: this host's desired state (``run.desired[host.name]``)
    + fact: this host's :class:`~k2fleet.deploy.facts.HostState`
    + reboots: host → why the bootstrap reboots it in this run (every host's, from
      :meth:`~k2fleet.deploy.fleet_run.FleetRun.reboots`); under ``k2_reboot: never`` any entry stops
      the deploy before its first change; any reboot restarts the services in stage order
    + weights_wanted: weight set check → hosts whose copy fails it (every host's, from
      :meth:`~k2fleet.deploy.fleet_run.FleetRun.weights_wanted`): while any does, the fleet's relays run
    + unsettled: host → what differs from its desired state (every host's, from
      :meth:`~k2fleet.deploy.fleet_run.FleetRun.unsettled`); empty: the fleet is settled, the host is
      checked (preflight, no operation) and nothing else is planned. None: not computed (plan every role)
    + reboot_steps: the bootstrap's instance-by-instance reboots (every host's, from
      :meth:`~k2fleet.deploy.fleet_run.FleetRun.reboot_steps`; ``k2_reboot: rolling`` under ``k2_rollout:
      rolling``); with them, the services are not all restarted after the reboots (each step restarted
      and health-gated its instance). None or empty: reboots as before
    + restart_steps: the restarts of running units (every host's, from
      :meth:`~k2fleet.deploy.fleet_run.FleetRun.restart_steps`): instance by instance under ``k2_rollout:
      rolling``. None: every restart at once
    + starting: serving units start somewhere in the fleet in this run (from
      :meth:`~k2fleet.deploy.fleet_run.FleetRun.starting`): the peers' rendezvous ports are
      checked first (the reach role)

    **Example:**

    .. code:: python

        run = fleet_run(state, inventory)
        mine = run.desired[host.name]
        deploy_kimi(run, run.desired[host.name], run.fact_of(host), reboots=run.reboots(inventory),
                    weights_wanted=run.weights_wanted(inventory), unsettled=run.unsettled(inventory),
                    reboot_steps=run.reboot_steps(inventory), restart_steps=run.restart_steps(inventory),
                    starting=run.starting(inventory))
    """
    dep = run.dep
    if reboots and dep.s.reboot == "never":
        raise RebootRefused("k2_reboot is never and these hosts need a reboot for their driver: " + "; ".join(
            f"{name} ({why})" for name, why in sorted(reboots.items())) + "; nothing was changed. Set k2_reboot: "
            "rolling (or if-needed), or reboot them yourself after the install")
    plan = desired.bootstrap
    pending = bool(plan and (boot.pending_packages(plan, fact.boot) or boot.obsolete_packages(plan, fact.boot)))
    preflight.check(dep, desired, fact)
    if unsettled == {}:  # every host holds its desired state: no operation anywhere
        return
    record.keep(program_argv("record", record_spec(dep, run.plan.hosts[desired.name], desired)), fact)
    packages.package_sources(desired.files.get("package_sources", {}), fact.files)
    packages.install_packages(desired.packages, dep.s.package_source, installed=list(fact.packages),
                              bundle=run.artifacts.bundle_for(desired.bundle_request), bootstrap_pending=pending,
                              have_repo=bool(desired.bundle_repo and fact.exists.get(desired.bundle_repo)))
    if plan is not None:
        bootstrap.bring_up(plan, fact, desired.files.get("bootstrap", {}), desired.gpu_gate or [],
                           bundle_apt_options() if dep.s.package_source == "bundle" else "",
                           reboots.get(desired.name), run.tracked, steps=reboot_steps, desired=desired)
    firewall.configure(desired, fact, run.tracked, rules_path=rules_path(dep))
    privileged_ports.configure(desired, fact, run.tracked)
    mesh.configure(desired, fact, run.tracked)
    engine.install(desired, fact, run.tracked)
    gpu_exporter.run(desired, fact, run.tracked)
    hub_client.install(desired, fact, requirement=run.artifacts.hub_requirement)
    checkpoint.ensure(dep, desired, fact, run.tracked, log_file=str(run.state_dir / "checkpoint-transfers.jsonl"),
                      control_relay=run.control_relay, fleet_wanted=weights_wanted,
                      side_channel=side_channel(host.data, host.name), xet_disabled=run.xet_disabled)
    reach.check(desired, starting=starting, probes=run.reach_probes)
    services.start(desired, fact, run.tracked, restart_all=bool(reboots) and not reboot_steps, steps=restart_steps)
    health_gate.gate(desired, fact, changed=run.fleet_changed)
    kept_revisions.prune(desired, fact)
    mesh.rest(desired, fact)
