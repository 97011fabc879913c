"""Checkpoint role: the pinned checkpoint is fetched once per fleet, passed host to host,
verified file by file on every host before any engine may start (the units'
``ExecStartPre`` re-checks the verified marker) or any peer copies from it.

Sources (``k2_checkpoint_source``):

- ``hub`` (default): ``k2_model`` at the pinned ``k2_revision`` with huggingface_hub
  (endpoint ``k2_hub_endpoint`` or env ``HF_ENDPOINT``; token env ``HF_TOKEN`` or
  ``k2_hub_token_file``, read at execution time only), fetched by
  ``k2_checkpoint_fetcher``: ``auto`` (default) is a host that reaches the Hub, else the
  control machine, chosen before the deploy changes anything
  (:mod:`k2fleet.deploy.fetcher_choice`); ``control`` downloads into
  ``k2_checkpoint_cache`` on the control machine and verifies it there; a host name
  makes that host download into ``k2_model_dir`` itself (Hub client from
  :mod:`k2fleet.deploy.roles.hub_client`; the token reaches it only as a root-only file under
  ``/run/k2fleet``, deleted when the download ends) and the control machine sends
  no checkpoint bytes at all; its download feeds its relay file by file
  (``download.py --publish``) in the same operation as the receivers' fetches, so the
  fleet is ready about when the download ends; ``auto`` is resolved to one of these
  before the deploy changes anything (:mod:`k2fleet.deploy.fetcher_choice`);
- ``control:/path`` — a directory on the control machine with the files and
  ``.k2fleet/manifest.json`` (air-gapped fleets), verified there.

GGUF engines (``k2_gguf_repo``) need a second weight set, the GGUF files matching
``k2_gguf_pattern`` at ``k2_gguf_revision`` (source ``k2_gguf_source``, same grammar),
delivered, verified and gated exactly like the checkpoint (``Deployment.weight_sets``).

Fan-out (:mod:`k2fleet.control.checkpoint_copy`): one transfer leaves the control machine, to
the first host that loads weights (or the fetcher host downloads it); the others pull
from verified peers over the SSH mesh in doubling rounds. A host whose gate fails
re-receives only the files ``verify.py --json`` names. With ``k2_shared_storage`` only the first host fetches.
Every step runs at execution time and only on hosts whose gate failed in the one
HostState fact (the record's ``wanted``), so ``--dry`` and no-op runs transfer (and ask) nothing.

"""

from __future__ import annotations

import shlex
import subprocess
from io import BytesIO
from typing import Any

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import python

from k2fleet.control import checkpoint_copy
from k2fleet.planning import privileged_ports, relay_plan
from k2fleet.hostprogs.manifest import read_token
from k2fleet.planning.deployment import Deployment, WeightSet
from k2fleet.planning.desired import HUB_ENV
from k2fleet.planning.host_archive import host_argv
from k2fleet.deploy.operations import command
from k2fleet.planning.role_actions import CheckpointActions
from k2fleet.planning.units import gate_argv, pin_args
from k2fleet.planning.quoting import shell_line

TOKEN_DIR = "/run/k2fleet"
TOKEN_PATH = f"{TOKEN_DIR}/hf_token"
# the fetcher's Hub download: files at once, taken in the receivers' (name) order. Few, so that
# each file is verified (and passed on) soon after its turn and the fleet trails the download
# by about this many files at its end; one stream of the Hub's CDN or the Xet path per file.
FETCHER_WORKERS = 2


BECOME_ARGS = ("_sudo", "_sudo_user", "_use_sudo_login", "_use_sudo_password", "_preserve_sudo_env", "_su_user",
               "_use_su_login", "_preserve_su_env", "_su_shell", "_doas", "_doas_user")


def become_args(data) -> dict:
    """The host's own privilege arguments (``_sudo``...) from its data: pyinfra applies them
    to operations, not to a python.call's direct ``host.run_shell_command``/``put_file``.

    >>> become_args({"_sudo": True, "ssh_user": "ops", "_sudo_user": None})
    {'_sudo': True}
    """
    return {k: data.get(k) for k in BECOME_ARGS if data.get(k)}


def send_token(token_file: str | None, become: dict) -> None:
    """Put the Hub token (env ``HF_TOKEN`` or ``token_file``, read now) on the current
    host as ``/run/k2fleet/hf_token``, root-only (as the host's ``_sudo`` user, like its
    operations: ``become``, :func:`become_args` of its data); nothing when there is no token."""
    token = read_token(token_file)
    ok = host.run_shell_command(f"install -d -m 700 {TOKEN_DIR} && rm -f {TOKEN_PATH}", **become)[0]
    if ok and token:
        ok = (host.put_file(BytesIO(token.encode()), TOKEN_PATH, **become)
              and host.run_shell_command(f"chmod 600 {TOKEN_PATH}", **become)[0])
    if not ok:
        raise RuntimeError(f"{host.name}: could not place the Hub token in {TOKEN_DIR}")


def download_argv(dep: Deployment, xet_disabled: bool, ws: WeightSet | None = None) -> list[str]:
    """The Hub download of one weight set (default: the checkpoint) on the fetcher host
    (the token only by file, never its value); the Hub's manifest must have the digest the
    control machine pinned (``--manifest-digest``), or nothing is downloaded."""
    s = dep.s
    ws = ws or dep.weight_sets[0]
    argv = ["env", "HF_HUB_DISABLE_TELEMETRY=1", "HF_HUB_DISABLE_PROGRESS_BARS=1"]
    if s.hub_endpoint:
        argv.append(f"HF_ENDPOINT={s.hub_endpoint}")
    if xet_disabled:  # the operator's choice of the resumable HTTP path
        argv.append("HF_HUB_DISABLE_XET=1")
    argv += host_argv("download", ws.repo, "--revision", ws.revision, "--dir", ws.path, *pin_args(ws), "--publish",
                      "--max-workers", str(FETCHER_WORKERS), python=f"{HUB_ENV}/bin/python")
    return argv + (["--pattern", *ws.patterns] if ws.patterns else [])


def transfer(control: checkpoint_copy.ControlRelay, source: str | None, target: str, ssh: list[str],
             fetch_argv: list[str], tunnel_port: int, log_file: str, download: list[str] | None) -> Any:
    """This host's part of the distribution, in ONE operation on every host so the fetcher's
    Hub download and the receivers' relay fetches run at once (pipelined): ``download``
    (argv, the fetcher host): the Hub download feeding its relay file by file, over the
    deploy's own SSH to it; otherwise the relay fetch (:func:`checkpoint_copy.relay_to_host`)."""
    if download is None:
        return checkpoint_copy.relay_to_host(control=control, source=source, target=target, ssh=ssh,
                                             fetch_argv=fetch_argv, tunnel_port=tunnel_port, log_file=log_file)
    result = subprocess.run([*ssh, target, shlex.join(download)], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if result.returncode:
        raise RuntimeError(f"the Hub download on {target} failed: {(result.stdout + result.stderr).strip()[-3000:]}")
    return None


def host_download_command(dep: Deployment, xet_disabled: bool, ws: WeightSet | None = None) -> str:
    """Shell line of the fetcher's Hub download; an ``EXIT`` trap removes the token file when
    the shell exits, whether the download succeeded or failed (a shell killed by a signal leaves
    it in its root-only directory under /run, until :func:`send_token` runs again or a reboot)."""
    argv = shell_line(download_argv(dep, xet_disabled, ws))
    return (f"trap 'rm -f {TOKEN_PATH}' EXIT; if [ -f {TOKEN_PATH} ]; then set -- --token-file {TOKEN_PATH}; fi; "
            f'{argv} "$@"')


@deploy("k2fleet: checkpoint")
def ensure(dep: Deployment, actions: CheckpointActions, tracked: list, log_file: str,
           control_relay: checkpoint_copy.ControlRelay, fleet_wanted: dict[str, list[str]], side_channel: tuple[str, list[str], list[str]],
           become: dict, xet_disabled: bool = False) -> None:
    """
    Bring this host's copy of the pinned checkpoint (and of the GGUF weights, for GGUF
    engines) to verified: the root from the control machine's copy or the Hub, every host
    shard by shard through the relay, each shard verified before it is passed on.

    + dep: the validated deployment (model, revision, source, paths, fetcher, relay port)
    + actions: this host's record (``role_actions(...).checkpoint``: its place in the fan-out,
      address, the weight sets whose check it fails, whether the model_type overlay is made)
    + tracked: list the run's health gate watches; verify operations are appended
    + log_file: control-machine JSON-lines log of checkpoint transfers
    + control_relay: the run's relay of the control machine's copies (started on first use)
    + fleet_wanted: weight set check → the hosts whose copy failed it (every host's fact)
    + side_channel: (``user@address``, ssh argv, become prefix) of the control machine's own SSH
      to this host, for the relay's transfers (:func:`k2fleet.deploy.fleet_run.side_channel`)
    + become: the host's own privilege arguments (:func:`become_args` of its data), for the
      Hub token's upload to the fetcher host
    + xet_disabled: pass ``HF_HUB_DISABLE_XET=1`` to the fetcher host's download

    **Example:**

    .. code:: python

        checkpoint.ensure(run.dep, role_actions(run.dep, mine, fact).checkpoint, run.tracked,
                          log_file="/root/.local/state/k2fleet/ID/checkpoint-transfers.jsonl",
                          control_relay=run.control_relay, fleet_wanted=run.weights_wanted(inventory),
                          side_channel=side_channel(host.data, host.name), become=become_args(host.data))
    """
    for ws in dep.weight_sets:
        _ensure_weight_set(dep, ws, actions, tracked, log_file, control_relay, fleet_wanted.get(ws.check, []),
                           side_channel, become, xet_disabled)
    # model_type fallback: a config overlay over the verified files, never an edit of them.
    override = dep.s.model_type_override
    if actions.overlay:
        tracked.append(command(name=f"config overlay with model_type {override}",
                               argv=host_argv("overlay", dep.checkpoint_path, dep.serve_path, "--model-type", str(override))))


def _ensure_weight_set(dep: Deployment, ws: WeightSet, actions: CheckpointActions, tracked: list,
                       log_file: str, control_relay: checkpoint_copy.ControlRelay, wanted_hosts: list[str],
                       side_channel: tuple[str, list[str], list[str]], become: dict, xet_disabled: bool) -> None:
    """The distribution of one weight set: what only this host does is planned where it needs
    it; the check after the transfers is on every host (a step of the fleet's order: no relay
    stops before every host's transfer ended)."""
    fan = actions.fanout
    source_dir, from_hub = relay_plan.control_source(dep, ws)
    wanted = ws.check in actions.wanted
    on_host = dep.s.checkpoint_fetcher not in ("control", "auto")  # auto: resolved before the deploy (else control)
    root_download = wanted and fan.is_root and on_host  # the fetcher host downloads from the Hub itself
    distributing = bool(wanted_hosts) and not fan.shared  # some host of the fleet receives: relays run
    serving = distributing and fan.loads_weights
    receiving = wanted and not root_download and not (fan.shared and not fan.is_root)
    control_needed = fan.is_root and not on_host and bool(wanted_hosts)  # runs once, on the root
    path = ws.path
    what = f"checkpoint{ws.label}"

    # The control machine's copy (Hub download or control: dir, verified there), once per
    # fleet: the root's source, and every host's last fallback.
    if control_needed:
        python.call(
            name=f"fetch + verify the {what} on the control machine (once per fleet)",
            function=checkpoint_copy.prepare_control_copy,
            repo_id=ws.repo, revision=ws.revision, root=source_dir, hub=from_hub,
            endpoint=dep.s.hub_endpoint, token_file=dep.s.hub_token_file, log_file=log_file,
            patterns=list(ws.patterns) if ws.patterns else None,
        )
    # Or the fetcher host downloads from the Hub itself (resumable, verified, repaired).
    if root_download:
        python.call(name=f"Hub token to the fetcher host (root-only file){ws.label}", function=send_token,
                    token_file=dep.s.hub_token_file, become=become)

    # Pipelined: every host that loads weights serves what it has verified on the mesh;
    # every host whose gate failed receives shard by shard (parent, ancestors, then the
    # control machine's copy through its SSH connection), each verified before it is
    # served onward, while the fetcher host's Hub download (same operation, so at the same
    # time) feeds its relay file by file as each passes its check; then the relays stop.
    if serving:
        command(name=f"{what}: start this host's relay of its verified files (while the fleet receives)",
                argv=relay_plan.relay_serve_argv(path, actions.address, dep.s.relay_port))
    if receiving or root_download:
        control_copy = None if on_host else source_dir
        target, ssh, sudo = side_channel
        # sshd binds the tunnel as the login's user: below net.ipv4.ip_unprivileged_port_start only root may
        tport = privileged_ports.tunnel_port(actions.port_start or 1024, dep.s.relay_port, root_login=not sudo)
        tunnel = [relay_plan.relay_url("127.0.0.1", tport)] if control_copy else []
        fetch_argv = relay_plan.relay_fetch_argv(path, list(fan.relays), fan.position or 0, fan.relay_fanout, tunnel,
                                                 pin=(ws.repo, ws.revision), digest=ws.manifest_sha256) if receiving else ["true"]
        download = [*sudo, "sh", "-c", host_download_command(dep, xet_disabled, ws)] if root_download else None
        python.call(
            name=f"{what}: receive shard by shard, each verified before it is passed on "
                 "(the fetcher host: its Hub download, feeding its relay file by file)",
            function=transfer,
            control=control_relay, source=control_copy, target=target,
            ssh=ssh, fetch_argv=[*sudo, *fetch_argv], tunnel_port=tport, log_file=log_file,
            download=download,
        )
    tracked.append(command(name=f"{what}: check every file (index, headers; hashed by the relay as it arrived)",
                           argv=gate_argv(ws), run=receiving or root_download))
    if serving:
        command(name=f"{what}: stop this host's relay", argv=relay_plan.relay_stop_argv())
    if control_needed:
        python.call(name=f"{what}: stop the control machine's relay", function=control_relay.stop)

    # Shared storage: the root fetched into the shared path; the others only pass the gate.
    if fan.shared and wanted and not fan.is_root:
        command(name=f"{what} gate on shared storage", argv=gate_argv(ws))
