"""The Kimi-K2 pipeline: every role, in order, for one host.

Not a role itself (a plain function, so each role's operations keep their own names):
the one place that composes them (no role imports another). It makes the host's role
records once (:func:`k2fleet.planning.role_actions.role_actions`: plan → diff) and hands
each role its own (apply).
``deploys/kimi.py`` gathers the host's fact and calls :func:`deploy_kimi`; the offline
role tests call it with a fact they construct.
"""

from __future__ import annotations

from pyinfra import host

from k2fleet.planning.desired import HostDesired
from k2fleet.planning.host_fact import HostReport
from k2fleet.planning.role_actions import role_actions
from k2fleet.deploy.fleet_run import FleetRun, side_channel
from k2fleet.deploy.roles import (bootstrap, checkpoint, engine, firewall, gpu_exporter, health_gate, hub_client,
                                  kept_revisions, mesh, packages, preflight, privileged_ports, reach, record, services)
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
    actions = role_actions(dep, desired, fact, restart_all=bool(reboots) and not reboot_steps,
                           record_argv=program_argv("record", record_spec(dep, run.plan.hosts[desired.name], desired)))
    preflight.check(actions.preflight)
    if unsettled == {}:  # every host holds its desired state: no operation anywhere
        return
    record.keep(list(actions.record) if actions.record is not None else None)
    packages.package_sources(actions.packages.sources)
    packages.install(actions.packages, bundle=run.artifacts.bundle_for(desired.bundle_request))
    if actions.bootstrap is not None:
        bootstrap.bring_up(actions.bootstrap, run.tracked, steps=reboot_steps, desired=desired)
    firewall.configure(actions.firewall, run.tracked)
    privileged_ports.configure(actions.ports, run.tracked)
    mesh.configure(actions.mesh, run.tracked)
    engine.install(actions.engine, run.tracked)
    gpu_exporter.run(actions.exporter, run.tracked)
    hub_client.install(actions.hub_client, requirement=run.artifacts.hub_requirement)
    if actions.checkpoint is not None:
        checkpoint.ensure(dep, actions.checkpoint, run.tracked, log_file=str(run.state_dir / "checkpoint-transfers.jsonl"),
                          control_relay=run.control_relay, fleet_wanted=weights_wanted,
                          side_channel=side_channel(host.data, host.name), become=checkpoint.become_args(host.data),
                          xet_disabled=run.xet_disabled)
    reach.check(actions.reach, starting=starting, probes=run.reach_probes, host_name=desired.name)
    services.start(actions.services, desired, run.tracked, steps=restart_steps)
    health_gate.gate(actions.health, changed=run.fleet_changed)
    kept_revisions.prune(actions.kept_revisions)
    mesh.rest(actions.mesh)
