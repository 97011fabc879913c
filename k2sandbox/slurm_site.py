"""The sandbox's Slurm site, for ``k2fleet rehearse`` of a ``k2_role: slurm-submit`` inventory.

A real GB200 site already runs Slurm: users never ask k2fleet to install it, and
``deploys/kimi.py`` only writes ``config.yaml`` on the login host and runs the TensorRT-LLM
checkout's ``submit.py``.  So the REHEARSAL builds the site the inventory assumes, before
the unchanged deploy runs:

- real Slurm and munge from Debian's packages (bookworm: Slurm 22.05), installed on the
  sandbox hosts from an offline bundle (:mod:`k2fleet.control.deb_bundles`) over SSH: ``slurmctld`` on
  the login host (the inventory's one host), ``slurmd`` on as many compute hosts as the
  inventory's ``k2_slurm`` asks for (:func:`compute_node_count`, submit.py's arithmetic);
  one shared munge key; a ``slurm.conf`` (:func:`slurm_conf`) with
  ``proctrack/linuxproc``, ``task/none``, ``select/cons_tres`` and no cgroup, GRES or
  accounting plugins (systemd-nspawn hosts; GPUs are a CPU count per node);
- one partition, named after the inventory's ``slurm.partition`` unless that is a
  placeholder such as ``<partition>`` (then :data:`PARTITION`); a placeholder account is
  replaced by :data:`ACCOUNT` (no accounting storage: Slurm records it, enforces nothing).
  :func:`site_overlay` returns the ``k2_slurm`` the rehearsal passes with ``--data``;
- shared storage: the top directory of the inventory's ``environment`` paths (``/lustre``
  for the seed) is a symlink to the sandbox's shared mount on every host, as a Lustre
  mount would be;
- the TensorRT-LLM checkout at ``environment.trtllm_repo``: TEST DOUBLES of
  ``examples/disaggregated/slurm/benchmark/{submit.py,disaggr_torch.slurm}``
  (``files/sandbox_site/trtllm_checkout/``; kept out of ``files/doubles``, which the deploy ships
  to engine hosts) next to the engine doubles (``k2fleet_doubles`` from ``files/doubles``),
  and the synthetic checkpoint at ``environment.model_path``.
"""

from __future__ import annotations

import re
import secrets
import shlex
import shutil
import tarfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

from k2fleet.control import deb_bundles as bundle
from k2sandbox import nspawn as sandbox

CLUSTER = "k2rehearsal"
PARTITION = "rehearsal"
ACCOUNT = "rehearsal"
PLACEHOLDER = re.compile(r"^<[^>]*>$")
SLURM_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
SITE_DIR = "k2-slurm-site"  # under the sandbox's shared storage
PACKAGES = {
    "controller": ["slurmctld", "slurm-client", "munge", "python3-yaml"],
    "compute": ["slurmd", "slurm-client", "munge", "python3-yaml"],
}
DAEMON = {"controller": "slurmctld", "compute": "slurmd"}
BENCHMARK_DIR = "examples/disaggregated/slurm/benchmark"
from k2sandbox import DOUBLES as DOUBLES_ROOT, FILES
CHECKOUT_DOUBLES = FILES / "sandbox_site" / "trtllm_checkout"  # submit.py, disaggr_torch.slurm TEST DOUBLES
INSTALL_TIMEOUT_S = 600
NODES_TIMEOUT_S = 120


class SlurmSiteError(RuntimeError):
    """The sandbox's Slurm site could not be set up (one line)."""


# --------------------------------------------------------------------------
# pure: what the site must look like


def _nodes(world: int, servers: int, gpus_per_node: int) -> int:
    return -(-world * servers // gpus_per_node)


def compute_node_count(config: dict[str, Any]) -> int:
    """Nodes the job of ``config`` (the rendered config.yaml) asks Slurm for, as
    submit.py computes them: ceil(TP*PP*servers / gpus_per_node) for ctx plus gen.

    >>> compute_node_count({"hardware": {"gpus_per_node": 4, "num_ctx_servers": 4, "num_gen_servers": 1},
    ...     "worker_config": {"ctx": {"tensor_parallel_size": 4}, "gen": {"tensor_parallel_size": 32}}})
    12
    """
    hw, workers = config["hardware"], config["worker_config"]
    per = int(hw["gpus_per_node"])
    total = 0
    for side, count in (("ctx", "num_ctx_servers"), ("gen", "num_gen_servers")):
        world = int(workers[side].get("tensor_parallel_size", 1)) * int(workers[side].get("pipeline_parallel_size", 1))
        total += _nodes(world, int(hw[count]), per)
    return total


def partition_name(value: Any) -> str:
    """The sandbox partition for the inventory's ``slurm.partition``: its own name when it
    is a plain Slurm name, :data:`PARTITION` for a placeholder (``<partition>``) or none.

    >>> partition_name("<partition>"), partition_name("batch"), partition_name(None)
    ('rehearsal', 'batch', 'rehearsal')
    """
    if isinstance(value, str) and SLURM_NAME.match(value) and not PLACEHOLDER.match(value):
        return value
    return PARTITION


def site_overlay(k2_slurm: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[Any, str]]]:
    """(``k2_slurm`` with only placeholder partition/account replaced, {key: (old, new)} of
    what was replaced). Every other value stays the user's.

    >>> data, changed = site_overlay({"slurm": {"partition": "<partition>", "account": "ops", "job_time": "1:00:00"}})
    >>> data["slurm"], changed
    ({'partition': 'rehearsal', 'account': 'ops', 'job_time': '1:00:00'}, {'slurm.partition': ('<partition>', 'rehearsal')})
    """
    slurm = dict(k2_slurm.get("slurm") or {})
    changed: dict[str, tuple[Any, str]] = {}
    part = partition_name(slurm.get("partition"))
    if slurm.get("partition") != part:
        changed["slurm.partition"] = (slurm.get("partition"), part)
        slurm["partition"] = part
    account = slurm.get("account")
    if not (isinstance(account, str) and SLURM_NAME.match(account)):
        changed["slurm.account"] = (account, ACCOUNT)
        slurm["account"] = ACCOUNT
    return {**k2_slurm, "slurm": slurm}, changed


def slurm_conf(controller: tuple[str, str], nodes: Sequence[tuple[str, str]], cpus: int, partition: str) -> str:
    """``slurm.conf`` of the sandbox cluster: ``controller`` = (name, address) runs
    slurmctld, every (name, address) in ``nodes`` a slurmd with ``cpus`` CPUs (one per
    simulated GPU, so ``--ntasks-per-node=gpus_per_node`` fits), all in ``partition``.

    >>> text = slurm_conf(("k2sb-1", "10.213.0.11"), [("k2sb-2", "10.213.0.12")], 4, "rehearsal")
    >>> "SlurmctldHost=k2sb-1(10.213.0.11)" in text, "NodeName=k2sb-2 NodeAddr=10.213.0.12 CPUs=4" in text
    (True, True)
    >>> [l for l in text.splitlines() if l.startswith("PartitionName")]
    ['PartitionName=rehearsal Nodes=k2sb-2 Default=YES MaxTime=INFINITE State=UP']
    """
    lines = [
        "# Generated by k2fleet rehearse (k2sandbox/slurm_site.py): the sandbox's Slurm site.",
        f"ClusterName={CLUSTER}",
        f"SlurmctldHost={controller[0]}({controller[1]})",
        "AuthType=auth/munge",
        "CryptoType=crypto/munge",
        "SlurmUser=slurm",
        "SlurmdUser=root",
        "StateSaveLocation=/var/lib/slurm/slurmctld",
        "SlurmdSpoolDir=/var/lib/slurm/slurmd",
        "SlurmctldPidFile=/run/slurmctld.pid",
        "SlurmdPidFile=/run/slurmd.pid",
        "SlurmctldLogFile=/var/log/slurm/slurmctld.log",
        "SlurmdLogFile=/var/log/slurm/slurmd.log",
        "# systemd-nspawn hosts: no cgroup plugins",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "PropagateResourceLimits=NONE",
        "SlurmdParameters=config_overrides",
        "MpiDefault=none",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "ReturnToService=2",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=60",
        "InactiveLimit=0",
        "KillWait=10",
    ]
    for name, address in nodes:
        lines.append(f"NodeName={name} NodeAddr={address} CPUs={cpus} Boards=1 SocketsPerBoard=1 "
                     f"CoresPerSocket={cpus} ThreadsPerCore=1 RealMemory=1000 State=UNKNOWN")
    lines.append(f"PartitionName={partition} Nodes={','.join(n for n, _ in nodes)} Default=YES "
                 "MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def shared_tops(config: dict[str, Any]) -> list[str]:
    """Top directories of the job's paths (trtllm_repo, work_dir, model_path) that the
    sandbox serves from shared storage, e.g. ``['/lustre']``.

    >>> shared_tops({"environment": {"trtllm_repo": "/lustre/src/T", "work_dir": "/lustre/w", "model_path": "/lustre/m"}})
    ['/lustre']
    """
    env = config.get("environment") or {}
    tops = set()
    for key in ("trtllm_repo", "work_dir", "model_path"):
        parts = PurePosixPath(str(env.get(key) or "")).parts
        if len(parts) < 3 or parts[0] != "/":
            raise SlurmSiteError(f"environment.{key} {env.get(key)!r}: the sandbox serves it from shared "
                                 "storage and needs an absolute path two levels deep")
        tops.add("/" + parts[1])
    system = {"/bin", "/boot", "/dev", "/etc", "/lib", "/lib64", "/opt", "/proc", "/root", "/run", "/sbin",
              "/sys", "/tmp", "/usr", "/var", "/home", "/srv", "/mnt"}
    bad = sorted(tops & system)
    if bad:
        raise SlurmSiteError(f"environment paths under {', '.join(bad)}: the sandbox cannot replace a system "
                             "directory with its shared storage")
    return sorted(tops)


# --------------------------------------------------------------------------
# effects on the sandbox hosts


def _ssh(host: sandbox.SandboxHost, script: str, timeout: float = 120) -> str:
    proc = sandbox.ssh(host, script, timeout=timeout)
    if proc.returncode != 0:
        tail = " ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-3:])[:400]
        raise SlurmSiteError(f"{host.name}: {tail or f'exit {proc.returncode}'}")
    return proc.stdout


def _install_script(role: str, repo: str, site: str, tops: Sequence[str]) -> str:
    """Shell run on one host: shared-storage links, Debian packages from the bundle (no
    service started by dpkg), munge key, slurm.conf, then the daemons."""
    q = shlex.quote
    list_path = "/etc/k2fleet-site/slurm-bundle.list"
    opts = f"-o Dir::Etc::sourcelist={list_path} -o Dir::Etc::sourceparts=- -o APT::Get::List-Cleanup=0"
    links = "".join(f"[ -L {q(t)} ] || {{ [ ! -e {q(t)} ] && ln -s {q(site + '/shared' + t)} {q(t)}; }}\n"
                    for t in tops)
    return f"""set -e
# names resolve to the bridge addresses (slurmd/srun announce them), not 127.0.1.1
sed -i '/^127\\.0\\.1\\.1 /d' /etc/hosts
{links}mkdir -p /etc/k2fleet-site /etc/slurm
echo 'deb [trusted=yes] file:{repo} ./' > {list_path}
printf '#!/bin/sh\\nexit 101\\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d
trap 'rm -f /usr/sbin/policy-rc.d' EXIT
export DEBIAN_FRONTEND=noninteractive
apt-get -q update {opts} >/dev/null
apt-get -q install -y --no-install-recommends {opts} {' '.join(PACKAGES[role])} >/dev/null
rm -f /usr/sbin/policy-rc.d
install -o munge -g munge -m 0400 {q(site + '/munge.key')} /etc/munge/munge.key
install -m 0644 {q(site + '/slurm.conf')} /etc/slurm/slurm.conf
mkdir -p /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /var/log/slurm
chown slurm:slurm /var/lib/slurm/slurmctld /var/log/slurm
systemctl enable -q munge {DAEMON[role]}
systemctl restart munge
systemctl restart {DAEMON[role]}
"""


def install_checkout(shared: Path, config: dict[str, Any], checkpoint: Path) -> Path:
    """Put the TensorRT-LLM checkout double (submit.py, disaggr_torch.slurm, the engine
    doubles) at ``environment.trtllm_repo`` and the synthetic checkpoint at
    ``environment.model_path``, both on the shared storage (``shared`` is its
    control-machine path); return the benchmark directory there."""
    env = config["environment"]
    bench = shared / str(env["trtllm_repo"]).lstrip("/") / BENCHMARK_DIR
    bench.mkdir(parents=True, exist_ok=True)
    for name in ("submit.py", "disaggr_torch.slurm"):
        shutil.copy2(CHECKOUT_DOUBLES / name, bench / name)
    shutil.copytree(DOUBLES_ROOT / "k2fleet_doubles", bench / "k2fleet_doubles", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    model = shared / str(env["model_path"]).lstrip("/")
    if not model.exists():
        shutil.copytree(checkpoint, model, ignore=shutil.ignore_patterns(".k2fleet"))
    (shared / str(env["work_dir"]).lstrip("/")).mkdir(parents=True, exist_ok=True)
    return bench


def wait_nodes_idle(login: sandbox.SandboxHost, count: int, timeout: float = NODES_TIMEOUT_S) -> None:
    """Until ``sinfo`` on the login host shows ``count`` idle nodes."""
    deadline = time.monotonic() + timeout
    states = ""
    while time.monotonic() < deadline:
        proc = sandbox.ssh(login, "sinfo -h -N -o '%N %T'", timeout=20)
        states = proc.stdout.strip()
        idle = [line for line in states.splitlines() if line.split()[-1:] == ["idle"]]
        if len(idle) == count:
            return
        time.sleep(1)
    raise SlurmSiteError(f"slurm nodes not idle after {timeout:.0f}s: {' '.join(states.split())[:300]}")


def setup_site(login: sandbox.SandboxHost, computes: Sequence[sandbox.SandboxHost], config: dict[str, Any],
               checkpoint: Path, state_dir: Path = sandbox.DEFAULT_STATE_DIR) -> None:
    """Build the sandbox's Slurm site (see the module docstring) for ``config`` (the
    config.yaml k2fleet renders, with the site overlay applied)."""
    tops = shared_tops(config)
    shared = (state_dir / "shared").resolve()
    site_host = shared / SITE_DIR
    site = f"{sandbox.SHARED_MOUNT}/{SITE_DIR}"
    repo_host = site_host / "debs"
    repo_host.mkdir(parents=True, exist_ok=True)
    tar = bundle.ensure_bundle(sorted({p for pkgs in PACKAGES.values() for p in pkgs}))
    with tarfile.open(tar) as archive:
        archive.extractall(repo_host, filter="data")
    for top in tops:
        (site_host / "shared" / top.lstrip("/")).mkdir(parents=True, exist_ok=True)
    (site_host / "munge.key").write_bytes(secrets.token_bytes(1024))
    (site_host / "munge.key").chmod(0o600)
    partition = str(config["slurm"]["partition"])
    (site_host / "slurm.conf").write_text(slurm_conf(
        (login.name, login.address), [(h.name, h.address) for h in computes],
        int(config["hardware"]["gpus_per_node"]), partition))
    install_checkout(site_host / "shared", config, checkpoint)
    jobs = [("controller", login)] + [("compute", h) for h in computes]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = [pool.submit(_ssh, host, _install_script(role, f"{site}/debs", site, tops), INSTALL_TIMEOUT_S)
                   for role, host in jobs]
        for future in futures:
            future.result()
    wait_nodes_idle(login, len(computes))


# --------------------------------------------------------------------------
# after the deploy: the job's disaggregated endpoint and the topology it reports


def site_path(config: dict[str, Any], key: str, state_dir: Path = sandbox.DEFAULT_STATE_DIR) -> Path:
    """Control-machine path of the job's ``environment.<key>`` on the shared storage."""
    return (state_dir / "shared").resolve() / SITE_DIR / "shared" / str(config["environment"][key]).lstrip("/")


def server_config_path(config: dict[str, Any], state_dir: Path = sandbox.DEFAULT_STATE_DIR) -> Path | None:
    """The newest ``server_config.yaml`` the job wrote under ``environment.work_dir``."""
    found = sorted(site_path(config, "work_dir", state_dir).glob("**/server_config.yaml"),
                   key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def job_urls(server_config: dict[str, Any], addresses: dict[str, str]) -> tuple[str, list[tuple[str, str]]]:
    """(front end base URL, [(role, worker base URL)]) from the job's server config, host
    names mapped to sandbox addresses.

    >>> job_urls({"hostname": "k2sb-2", "port": 8333, "context_servers": {"urls": ["k2sb-3:8337"]},
    ...           "generation_servers": {"urls": ["k2sb-2:8336"]}}, {"k2sb-2": "10.0.0.2", "k2sb-3": "10.0.0.3"})
    ('http://10.0.0.2:8333/v1', [('ctx 0', 'http://10.0.0.3:8337/v1'), ('gen 0', 'http://10.0.0.2:8336/v1')])
    """
    def base(hostport: str) -> str:
        host, _, port = hostport.rpartition(":")
        return f"http://{addresses.get(host, host)}:{port}/v1"

    front = base(f"{server_config['hostname']}:{server_config['port']}")
    workers = [(f"{side} {i}", base(url))
               for side, key in (("ctx", "context_servers"), ("gen", "generation_servers"))
               for i, url in enumerate(server_config[key]["urls"])]
    return front, workers


def topology_mismatch(models: dict[str, Any], config: dict[str, Any]) -> str | None:
    """None if the disaggregated topology the front end reports (``/v1/models`` metadata)
    is the plan's: as many context/generation servers as ``hardware`` says, each with the
    worker config's TP, EP, world (TP*PP) and ceil(world / gpus_per_node) hosts.

    >>> cfg = {"hardware": {"gpus_per_node": 4, "num_ctx_servers": 1, "num_gen_servers": 1},
    ...        "worker_config": {"ctx": {"tensor_parallel_size": 4, "moe_expert_parallel_size": 4},
    ...                          "gen": {"tensor_parallel_size": 8, "moe_expert_parallel_size": 8}}}
    >>> w = lambda tp, hosts: {"tp_size": tp, "ep_size": tp, "world": tp, "hosts": hosts}
    >>> ok = {"data": [{"metadata": {"disaggregated": {"context_servers": [w(4, ["a"])],
    ...                                               "generation_servers": [w(8, ["b", "c"])]}}}]}
    >>> topology_mismatch(ok, cfg) is None
    True
    >>> bad = {"data": [{"metadata": {"disaggregated": {"context_servers": [w(4, ["a"])],
    ...                                                "generation_servers": [w(4, ["b"])]}}}]}
    >>> topology_mismatch(bad, cfg)
    'gen server 0: planned tp_size 8, reported 4'
    """
    try:
        topology = models["data"][0]["metadata"]["disaggregated"]
    except (KeyError, IndexError, TypeError):
        return "the front end reports no disaggregated topology in /v1/models"
    hw, per = config["hardware"], int(config["hardware"]["gpus_per_node"])
    for side, key, count in (("ctx", "context_servers", "num_ctx_servers"), ("gen", "generation_servers", "num_gen_servers")):
        servers = topology.get(key) or []
        if len(servers) != int(hw[count]):
            return f"{side} servers: planned {hw[count]}, reported {len(servers)}"
        worker = config["worker_config"][side]
        tp = int(worker.get("tensor_parallel_size", 1))
        world = tp * int(worker.get("pipeline_parallel_size", 1))
        planned = {"tp_size": tp, "ep_size": int(worker.get("moe_expert_parallel_size", tp)), "world": world,
                   "nodes": _nodes(world, 1, per)}
        for i, server in enumerate(servers):
            reported = {**{k: server.get(k) for k in ("tp_size", "ep_size", "world")},
                        "nodes": len(server.get("hosts") or [])}
            for k, value in planned.items():
                if reported[k] != value:
                    return f"{side} server {i}: planned {k} {value}, reported {reported[k]}"
    return None


def job_report(login: sandbox.SandboxHost, config: dict[str, Any], state_dir: Path = sandbox.DEFAULT_STATE_DIR,
               lines: int = 8) -> str:
    """``squeue`` on the login host and the tails of the job's logs (for a failure)."""
    queue = sandbox.ssh(login, "squeue -h -o '%i %j %T %R'", timeout=20)
    parts = [f"squeue: {queue.stdout.strip() or queue.stderr.strip() or '(empty)'}"]
    logs = sorted(site_path(config, "work_dir", state_dir).glob("**/*.log")) + \
        sorted(site_path(config, "work_dir", state_dir).glob("**/slurm-*.*"))
    for path in logs[-12:]:
        tail = path.read_text(errors="replace").strip().splitlines()[-lines:]
        if tail:
            parts.append(f"{path.name}:\n  " + "\n  ".join(tail))
    return "\n".join(parts)
