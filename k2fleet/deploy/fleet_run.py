"""One pyinfra run of the k2fleet deploy: the validated plan, the control-machine
artifacts and every host's desired state, computed once and kept on pyinfra's own
``State`` (no module globals).

``deploys/kimi.py`` calls :func:`fleet_run` for each host it plans; the first call
takes the plan the gate in ``config.py`` validated (or validates the inventory itself
when run without that gate), runs the one control-machine step (:func:`k2fleet.control.artifacts.prepare_control_artifacts`,
skipped under ``--dry``, where only existing artifacts are read) and computes the
desired state (:func:`k2fleet.planning.desired.desired_state`). Later calls return the same
object. pyinfra loads the deploy file for its hosts in concurrent greenlets, and the
control step yields while its downloads run: the first call holds a lock (a cooperative
one under pyinfra's gevent) so the others wait for its result instead of starting the
step again (a second, blocking ``flock`` on a cache would freeze the whole process).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from k2fleet.control import ControlError, failure_line
from k2fleet.control.artifacts import prepare_control_artifacts, read_control_artifacts, relay_secret_path, state_dir
from k2fleet.planning.host_actions import host_actions, reboot_steps, restart_steps
from k2fleet.planning.host_bootstrap import reboot_reason
from k2fleet.planning.rollout import Step
from k2fleet.control.checkpoint_copy import ControlRelay, manifest_pins
from k2fleet.deploy.facts import HostState
from k2fleet.planning.host_fact import HostReport
from k2fleet.planning.deployment import Deployment
from k2fleet.planning.desired import ControlArtifacts, FleetParts, HostDesired, desired_state
from k2fleet.deploy.failure_lines import record_failures
from k2fleet.deploy.gate import check_hosts, refusal_line
from k2fleet.inventory.loader import host_data
from k2fleet.planning.processes import Plan
from k2fleet.inventory.spec import SpecError
from k2fleet.planning import api_front
from k2fleet.planning.quoting import curl_line
from pyinfra.api.state import StateStage

STATE_ATTRIBUTE = "k2fleet_run"


@dataclass
class FleetRun:
    """Per-run state of the deploy (see module doc)."""

    dep: Deployment
    plan: Plan
    artifacts: ControlArtifacts
    desired: dict[str, HostDesired]
    dry: bool
    state_dir: Path
    tracked: list[Any] = field(default_factory=list)  # ops whose change re-runs the health gate
    reach_probes: dict[str, Any] = field(default_factory=dict)  # host → its reachability probe op (the fleet barrier)
    facts: dict[str, HostReport] = field(default_factory=dict)  # HostState per host, gathered once
    fact_locks: dict[str, threading.Lock] = field(default_factory=dict)
    control_relay: ControlRelay = field(default_factory=ControlRelay)  # the control copy, served to the fleet
    xet_disabled: bool = False  # HF_HUB_DISABLE_XET on the control machine: its Hub downloads skip hf-xet
    views: dict[str, Any] = field(default_factory=dict)  # fleet-wide views of every host's fact, made once
    view_locks: dict[str, threading.Lock] = field(default_factory=dict)

    def _fleet_view(self, name: str, compute: Any) -> Any:
        """``compute()`` once per run (each host's deploy asks for the same fleet-wide view;
        without this, N hosts would each recompute it over N facts)."""
        with self.view_locks.setdefault(name, threading.Lock()):
            if name not in self.views:
                self.views[name] = compute()
        return self.views[name]

    def fleet_changed(self) -> bool:
        """Did any tracked operation on any host change something (execution time)?"""
        return any(op.is_complete() and op.did_change() for op in self.tracked)

    def fact_of(self, host: Any) -> HostReport:
        """``host``'s HostState, gathered once per run (any host's deploy may ask)."""
        with self.fact_locks.setdefault(host.name, threading.Lock()):
            if host.name not in self.facts:
                query = self.desired[host.name].fact_query(self.dep.s.model_dir)
                self.facts[host.name] = host.get_fact(HostState, query=query)
        return self.facts[host.name]

    def weights_wanted(self, inventory: Any) -> dict[str, list[str]]:
        """Weight set check → the hosts that load weights and fail it (every host's fact)."""
        return self._fleet_view("weights_wanted", lambda: self._weights_wanted(inventory))

    def _weights_wanted(self, inventory: Any) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for h in inventory:
            fan = self.desired[h.name].fanout
            for ws in self.dep.weight_sets:
                if fan and fan.loads_weights and not self.fact_of(h).passed(ws.check):
                    out.setdefault(ws.check, []).append(h.name)
        return out

    def unsettled(self, inventory: Any) -> dict[str, str]:
        """Host → what differs from its desired state (:func:`~k2fleet.planning.host_actions.host_actions`
        over every host's fact); empty: the whole fleet is settled and the deploy plans nothing."""
        return self._fleet_view("unsettled", lambda: self._unsettled(inventory))

    def _unsettled(self, inventory: Any) -> dict[str, str]:
        out = {}
        for h in inventory:
            actions = host_actions(self.desired[h.name], self.fact_of(h))
            if not actions.settled:
                out[h.name] = actions.describe()
        return out

    def starting(self, inventory: Any) -> bool:
        """Does a serving unit start or restart somewhere in the fleet in this run (one of a
        host's own units is not active — a bring-up or a recovery — or running ones restart:
        :meth:`restart_steps`; planning time, every host's fact)?"""
        return self._fleet_view("starting", lambda: bool(self.restart_steps(inventory)) or any(
            not self.fact_of(h).unit_active(f"{name}.service") for h in inventory
            for _, name in self.desired[h.name].own_slots))

    def reboot_steps(self, inventory: Any) -> list[Step]:
        """The bootstrap's rolling reboots, instance by instance (``k2_reboot: rolling`` under
        ``k2_rollout: rolling``; :func:`~k2fleet.planning.host_actions.reboot_steps`); empty otherwise."""
        return self._fleet_view("reboot_steps", lambda: reboot_steps(
            self.desired, {h.name: self.fact_of(h) for h in inventory}, self.reboots(inventory)))

    def restart_all(self, inventory: Any) -> bool:
        """Restart every running unit in stage order after the bootstrap: hosts rebooted at once
        or host by host (units came back at boot in no order); not after instance-by-instance
        reboots, whose steps restarted and health-gated each instance."""
        return bool(self.reboots(inventory)) and not self.reboot_steps(inventory)

    def restart_steps(self, inventory: Any) -> list[Step]:
        """This run's restarts of running units, as steps (:func:`~k2fleet.planning.host_actions.restart_steps`)."""
        return self._fleet_view("restart_steps", lambda: restart_steps(
            self.desired, {h.name: self.fact_of(h) for h in inventory}, self.restart_all(inventory)))

    def reboots(self, inventory: Any) -> dict[str, str]:
        """Host → why it reboots in this run's bootstrap (planning time; every host's fact)."""
        return self._fleet_view("reboots", lambda: self._reboots(inventory))

    def _reboots(self, inventory: Any) -> dict[str, str]:
        out = {}
        for h in inventory:
            boot = self.desired[h.name].bootstrap
            reason = reboot_reason(boot, self.fact_of(h).boot) if boot else None
            if reason:
                out[h.name] = reason
        return out


def refuse_without_gate(exc: SpecError) -> NoReturn:
    """The refusal when pyinfra ran without k2fleet's gate (another cwd, no ``--config``, and
    k2fleet's ``pyinfra.connectors`` entry point not registered: :mod:`k2fleet.deploy.pyinfra_entry`):
    the same one line, naming how to get the gate, printed once; the process ends at once
    (exit 2) so no other host's deploy adds a traceback. pyinfra has connected already, but
    no operation has run: nothing was changed."""
    sys.stderr.write(f"{refusal_line(exc)} (pyinfra ran without k2fleet's gate, so it connected first: run it from "
                     "the k2fleet checkout, pass --config /path/to/k2fleet/config.py, or install k2fleet (pip install -e .) "
                     "so pyinfra loads its gate's entry point)\n")
    sys.stderr.flush()
    os._exit(2)


def side_channel(data: Any, name: str) -> tuple[str, list[str], list[str]]:
    """(``user@address``, ssh argv, become prefix) of the control machine's own SSH to a
    host, with the inventory's connection settings pyinfra also uses (user, port, key,
    known_hosts, ``ssh_config_file`` — a ProxyJump there is honoured, and its ``User`` and ``Port``
    for the host win over ``ssh_user``/``ssh_port`` as they do in pyinfra's connection —, strict host key
    checking); the become prefix (``sudo -n -H [-u USER] --``) when the host's data sets
    ``_sudo``, for commands that must run as root (the relay's transfers ride on it).

    >>> side_channel({"ssh_user": "ops", "ssh_port": 2222, "_sudo": True, "ssh_config_file": "/c"}, "n1")
    ('ops@n1', ['ssh', '-o', 'BatchMode=yes', '-p', '2222', '-F', '/c'], ['sudo', '-n', '-H', '--'])
    """
    user, port = data.get("ssh_user") or "root", data.get("ssh_port") or 22
    target = data.get("ssh_hostname") or name
    if data.get("ssh_config_file"):  # as pyinfra connects: the file's User and Port for the host win
        looked = _ssh_config_lookup(str(data.get("ssh_config_file")), str(target))
        user, port = looked.get("user") or user, looked.get("port") or port
    ssh = ["ssh", "-o", "BatchMode=yes", "-p", str(port)]
    if data.get("ssh_config_file"):
        ssh += ["-F", str(data.get("ssh_config_file"))]
    if data.get("ssh_key"):
        ssh += ["-i", str(data.get("ssh_key")), "-o", "IdentitiesOnly=yes"]
    if data.get("ssh_known_hosts_file"):
        ssh += ["-o", f"UserKnownHostsFile={data.get('ssh_known_hosts_file')}", "-o", "StrictHostKeyChecking=yes"]
    elif data.get("ssh_strict_host_key_checking"):
        ssh += ["-o", f"StrictHostKeyChecking={data.get('ssh_strict_host_key_checking')}"]
    become: list[str] = []
    if data.get("_sudo"):
        become = ["sudo", "-n", "-H", *(["-u", str(data.get("_sudo_user"))] if data.get("_sudo_user") else []), "--"]
    return f"{user}@{target}", ssh, become


def _ssh_config_lookup(path: str, target: str) -> dict[str, Any]:
    """``target``'s settings in the ssh_config ``path``, read as pyinfra's SSH connector reads
    it (its own parser; ``{}`` when the file cannot be read, as pyinfra then connects without it)."""
    try:
        from pyinfra.connectors.sshuserclient.client import get_ssh_config

        config = get_ssh_config(os.path.expanduser(path))
        return dict(config.lookup(target)) if config is not None else {}
    except Exception:  # noqa: BLE001 - pyinfra's parser failing: ssh reads the file itself
        return {}


def fleet_run(state: Any, inventory: Any, dry: bool | None = None) -> FleetRun:
    """The run's :class:`FleetRun`, made on first use and kept on ``state``."""
    with vars(state).setdefault(f"{STATE_ATTRIBUTE}_lock", threading.Lock()):
        return getattr(state, STATE_ATTRIBUTE, None) or _make_fleet_run(state, inventory, dry)


def _make_fleet_run(state: Any, inventory: Any, dry: bool | None) -> FleetRun:
    checked = getattr(state, "k2fleet_checked", None)  # the gate's (config.py) validated plan
    if checked is None:  # not under the CLI's gate (pyinfra run outside the checkout): validate here
        try:
            checked = check_hosts("inventory", host_data(inventory))
        except SpecError as exc:
            refuse_without_gate(exc)
    dep, plan = checked
    if dep.s.checkpoint_fetcher == "auto":  # who talks to the Hub: asked of the hosts before anything changes
        from k2fleet.deploy.fetcher_choice import resolve

        try:
            dep, plan, _ = resolve(inventory, dep, plan)
        except SpecError as exc:  # the inventory with the chosen fetcher is refused: one line, nothing changed
            sys.stderr.write(f"{refusal_line(exc)}\n")
            sys.stderr.flush()
            os._exit(2)
    if dry is None:  # under the CLI, the gate (config.py) recorded --dry on the state
        dry = bool(getattr(state, "k2fleet_dry", False))
    try:
        # the manifest digest every host must accept, held before any host receives a byte
        dep = dep.pinned(manifest_pins(dep, fetch=not dry))
        parts = FleetParts(dep, plan)  # each host's bootstrap, firewall, packages: computed once for both steps
        artifacts = read_control_artifacts(dep, plan, parts) if dry else prepare_control_artifacts(dep, plan, parts)
    except ControlError as exc:  # one line naming what and the fix, no traceback
        sys.stderr.write(f"k2fleet: {exc}\n")
        sys.stderr.flush()
        raise SystemExit(1) from None
    except Exception as exc:  # noqa: BLE001 - a download, a build, a full disk: one line, no traceback
        sys.stderr.write(f"k2fleet: the control machine's step failed: {failure_line(exc)}\n")
        sys.stderr.flush()
        raise SystemExit(1) from None
    run = FleetRun(dep=dep, plan=plan, artifacts=artifacts, dry=dry, state_dir=state_dir(dep),
                   desired=desired_state(dep, plan, artifacts, parts), xet_disabled=bool(os.environ.get("HF_HUB_DISABLE_XET")),
                   control_relay=ControlRelay(relay_secret_path(dep)))
    setattr(state, STATE_ATTRIBUTE, run)
    if not dry:
        atexit.register(say_endpoints, state, dep, plan)
        record_failures(state)  # each failed host: one line at exit, naming the operation and the cause
    return run


def endpoint_lines(dep: Deployment, plan: Plan) -> list[str]:
    """Where the fleet serves and a line to try it (:meth:`Plan.endpoint`: the load balancer's,
    the router's or the first health-checked service's endpoint; with ``k2_api_key_file`` the key is read from that file
    when the line runs)."""
    main = plan.endpoint()
    if main is None:
        return []
    base = f"{api_front.scheme(dep)}://{api_front.address(*main)}/v1"
    return [f"k2fleet: serving {dep.api_model_name} at {base}" + ("" if api_front.tls(dep) else " (plain HTTP)"),
            f"k2fleet: try: {curl_line(base, dep.api_model_name, dep.s.api_key_file, dep.s.tls_ca_file)}"]


def say_endpoints(state: Any, dep: Deployment, plan: Plan) -> None:
    """At the end of a deploy whose operations ran on every host without a failure (pyinfra
    reached its disconnect stage, no failed host): :func:`endpoint_lines` on stderr, after
    pyinfra's own summary."""
    if getattr(state, "current_stage", 0) < StateStage.Disconnect or getattr(state, "failed_hosts", None):
        return
    sys.stderr.write("".join(line + "\n" for line in endpoint_lines(dep, plan)))
    sys.stderr.flush()
