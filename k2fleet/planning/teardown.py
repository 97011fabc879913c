"""What k2fleet places on a host, as one list computed from its desired state — what
``k2fleet down`` removes (pure).

:func:`placed` reads a host's :class:`~k2fleet.planning.desired.HostDesired` — the same object
the deploy's roles carry out — and names every unit, file, directory tree, nftables table,
sysctl value, container, image and group membership k2fleet puts there, and what it keeps
(the checkpoints; engine caches: :data:`ENGINE_CACHES`) unless purged. A file the deploy
writes is in the desired state, so ``down`` cannot miss it; what the roles make besides
files (the directory trees they fill, the bundle's apt source, the transfer log, repository
files) is named here, next to the constants the roles use.

:func:`record_spec` is the record the deploy keeps on each host before its first change
(:data:`~k2fleet.planning.desired.RECORD`, by the host program
:mod:`k2fleet.hostprogs.teardown`): the packages then installed, which of the directories
k2fleet may make existed, the groups and sysctl values it may change. ``down`` reads it to give
those back and to name the packages k2fleet installed (left installed: other software may
use them now).

>>> safe_tree("/etc"), safe_tree("/etc/mycorp"), safe_tree("/etc/k2fleet"), safe_tree("/opt"), safe_tree("/opt/k2fleet/venv")
(False, False, True, False, True)
"""

from __future__ import annotations

import base64
import json
import posixpath
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from k2fleet.inventory.spec import SYSTEM_DIRS, SYSTEM_TREES
from k2fleet.planning import engine_cache, firewall, privileged_ports
from k2fleet.planning.deployment import Deployment
from k2fleet.planning.desired import (HOST_ARCHIVE, HUB_ENV, RECORD, UNIT_GLOB, HostDesired)
from k2fleet.planning.host_archive import SOURCES
from k2fleet.planning.host_bootstrap import repo_paths
from k2fleet.planning.host_packages import BUNDLE_LIST, REMOTE_REPO_ROOT, REMOTE_TAR_DIR
from k2fleet.planning.preflight_checks import shown
from k2fleet.planning.processes import HostPlan
from k2fleet.planning.relay_plan import HOST_LOG, RELAY_UNIT
from k2fleet.planning.rollout import Rollout
from k2fleet.planning.engines.vllm.render import RAY_ROOT
from k2fleet.planning.units import container_name

# Trees k2fleet alone fills on a host (removed whole, kept paths inside them excepted).
STATE_TREES = ("/opt/k2fleet", posixpath.dirname(RECORD), posixpath.dirname(HOST_LOG), REMOTE_TAR_DIR, "/run/k2fleet")
# Engine compile/JIT caches on hosts (every engine's, :mod:`k2fleet.planning.engine_cache`), kept by
# ``down`` like the checkpoint; the bundle's archive of one (engine_cache.ARCHIVE_DIR) is removed.
ENGINE_CACHES: tuple[str, ...] = (engine_cache.CACHE_ROOT,)


def safe_tree(path: str) -> bool:
    """May ``down`` remove ``path`` with everything in it? A directory named for k2fleet
    (``/etc/k2fleet``, ``/opt/k2fleet``), or one outside the system's trees and shared top
    directories (``k2_venv: /opt/engines/k2``); another directory in a system tree (``k2_config_dir:
    /etc/mycorp``) is emptied of k2fleet's files only."""
    path = posixpath.normpath(path)
    if path.count("/") < 2 or path in SYSTEM_DIRS:
        return False
    return "k2fleet" in posixpath.basename(path) or not any(path == t or path.startswith(t + "/") for t in SYSTEM_TREES)


def _ancestors(path: str) -> list[str]:
    out = []
    path = posixpath.dirname(posixpath.normpath(path))
    while path not in ("/", ""):
        out.append(path)
        path = posixpath.dirname(path)
    return out


@dataclass
class Placed:
    """What k2fleet placed on one host (see the module doc)."""

    host: str
    units: list[str] = field(default_factory=list)  # stopped, disabled (with every unit file matching unit_globs)
    unit_globs: list[str] = field(default_factory=list)
    transient: list[str] = field(default_factory=list)  # transient unit patterns (the relays)
    files: list[str] = field(default_factory=list)
    trees: list[str] = field(default_factory=list)  # removed whole, ``kept`` inside them excepted
    dirs: list[str] = field(default_factory=list)  # directories k2fleet may have made: removed when empty and not in the record
    nft_tables: list[str] = field(default_factory=list)
    sysctl: list[str] = field(default_factory=list)  # given back from the record
    containers: list[str] = field(default_factory=list)
    images: list[str] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)  # groups k2fleet may create
    joins: dict[str, list[str]] = field(default_factory=dict)  # user → groups k2fleet may add it to
    kept: list[str] = field(default_factory=list)  # the checkpoints and engine caches (removed only when purged)
    packages: list[str] = field(default_factory=list)  # what k2fleet installs (named when there is no record)

    def down_spec(self, purge: bool) -> dict[str, Any]:
        """The host program's ``down`` spec (:mod:`k2fleet.hostprogs.teardown`)."""
        return {"record": RECORD, "units": self.units, "unit_globs": self.unit_globs, "transient": self.transient,
                "files": self.files, "trees": self.trees, "dirs": self.dirs, "nft_tables": self.nft_tables,
                "sysctl": self.sysctl, "containers": self.containers, "images": self.images, "groups": self.groups,
                "joins": self.joins, "packages": self.packages, "kept": [] if purge else self.kept,
                "purge": self.kept if purge else []}


def placed(dep: Deployment, hp: HostPlan, d: HostDesired) -> Placed:
    """Everything k2fleet places on host ``d.name`` (its plan ``hp``, desired state ``d``)."""
    p = Placed(host=d.name)
    p.units = sorted(d.kept_units() | {f"{s.name}.service" for s in hp.services}
                     | ({firewall.UNIT} if d.firewall else set()))
    p.unit_globs = [UNIT_GLOB]
    p.transient = [f"{RELAY_UNIT}-*.service"]
    boot = d.bootstrap
    files = set(d.all_paths()) | set(d.absent) | {BUNDLE_LIST, HOST_LOG, privileged_ports.SYSCTL_PATH,
                                                  privileged_ports.NODE_EXPORTER_DROPIN, firewall.UNIT_PATH,
                                                  firewall.rules_path(dep), HOST_ARCHIVE}
    if boot is not None:
        files |= {path for repo in boot.repos for path in repo_paths(repo)}
    p.kept = sorted({ws.path for ws in dep.weight_sets} | set(ENGINE_CACHES))
    trees = {*STATE_TREES, HUB_ENV, REMOTE_REPO_ROOT, RAY_ROOT, dep.s.venv, dep.s.config_dir}
    p.trees = sorted(t for t in trees if safe_tree(t))
    p.files = sorted(f for f in files if not any(f == t or f.startswith(t + "/") for t in p.trees))
    marks = [*p.files, *p.trees, *p.kept, dep.s.model_dir]
    p.dirs = sorted(({a for path in marks for a in _ancestors(path)} | {t for t in trees if not safe_tree(t)}
                     | {dep.s.model_dir}) - SYSTEM_DIRS - set(SYSTEM_TREES))
    p.nft_tables = [firewall.TABLE]
    p.sysctl = [privileged_ports.SYSCTL]
    p.containers = sorted(n for n in (container_name(s) for s in hp.services) if n)
    p.images = sorted({pin.ref for pin in (d.image, d.gpu_exporter) if pin is not None})
    if boot is not None:
        p.joins = {user: list(groups) for user, groups in boot.groups.items()}
        p.groups = sorted({g for groups in boot.groups.values() for g in groups})
        p.packages = sorted(set(d.packages) | {pkg.name for pkg in boot.packages})
    else:
        p.packages = sorted(d.packages)
    p.packages = sorted({name.split("=", 1)[0] for name in p.packages})
    return p


def record_spec(dep: Deployment, hp: HostPlan, d: HostDesired) -> dict[str, Any]:
    """The host program's ``record`` spec for host ``d.name`` (what the deploy keeps before its first change)."""
    p = placed(dep, hp, d)
    return {"record": RECORD, "dirs": p.dirs, "groups": p.groups, "sysctl": p.sysctl,
            "k2fleet_marks": [HOST_ARCHIVE, "/opt/k2fleet", dep.s.config_dir, *(f"/etc/systemd/system/{u}" for u in p.units)]}


@lru_cache(maxsize=1)
def _program() -> str:
    """The host program's source, compressed, as ``python3 -c`` runs it (it is sent, not
    taken from the host archive: ``record`` runs before the archive is there, ``down`` removes it)."""
    source = (SOURCES / "teardown.py").read_bytes()
    return ("import base64, zlib; exec(compile(zlib.decompress(base64.b64decode("
            f"{base64.b64encode(zlib.compress(source)).decode()!r})), 'teardown.py', 'exec'))")


def program_argv(verb: str, spec: dict[str, Any], python: str = "python3") -> list[str]:
    """argv running :mod:`k2fleet.hostprogs.teardown` ``verb`` with ``spec`` on a host (stdlib
    only: ``-I -S``).

    >>> program_argv("record", {"record": "/r"})[:4], program_argv("record", {"record": "/r"})[5:]
    (['python3', '-I', '-S', '-c'], ['record', '{"record": "/r"}'])
    """
    if verb not in ("record", "down"):
        raise ValueError(f"no teardown verb {verb!r}")
    return [python, "-I", "-S", "-c", _program(), verb, json.dumps(spec, sort_keys=True)]


def hosts_down(hosts: list[str], rollout: Rollout, named: list[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """``k2fleet down --host NAME ...``: the hosts to take down (inventory order) and, to run
    before them, the drains at the load balancer — (its host, ``lbctl drain`` argv) for each
    instance they serve behind it, so the requests in flight there finish first and no new one
    comes (after them the load balancer's health checks see the instance down). No ``named``:
    every host, no drain. Refused (ValueError, one line): a name the inventory does not have,
    part of a multi-host instance (it serves only whole), the load balancer's own host while
    others stay.

    >>> from k2fleet.planning.rollout import Balancer, Instance
    >>> lb = Balancer("a", "k2-lb", "/run/k2fleet-lb/admin.sock", "k2-replicas", 300, 120)
    >>> r = Rollout("rolling", (Instance("serve-0", ("a",), "a"), Instance("serve-1", ("b",), "b")), lb)
    >>> down, drains = hosts_down(["a", "b"], r, ["b"])
    >>> down, [(h, argv[-4:]) for h, argv in drains]
    (['b'], [('a', ['drain', 'k2-replicas/b', '--timeout', '300'])])
    >>> hosts_down(["a", "b"], r, ["a"])
    Traceback (most recent call last):
    ...
    ValueError: --host a: it runs the load balancer (k2_load_balancer) for the hosts that stay: move k2_load_balancer to another host and deploy first
    """
    if not named:
        return list(hosts), []
    for name in named:
        if name not in hosts:
            raise ValueError(f"--host {shown(name)}: not a host of this inventory (hosts: {', '.join(hosts)})")
    down = [h for h in hosts if h in named]
    if len(down) == len(hosts):
        return down, []
    lb = rollout.balancer
    if lb is not None and lb.host in down:
        raise ValueError(f"--host {lb.host}: it runs the load balancer (k2_load_balancer) for the hosts that stay: "
                         "move k2_load_balancer to another host and deploy first")
    drains = []
    for instance in rollout.instances:
        part = [h for h in instance.hosts if h in down]
        if part and len(part) < len(instance.hosts):
            raise ValueError(f"--host {part[0]}: it is part of the instance {instance.name} "
                             f"({', '.join(instance.hosts)}), which serves only whole: name all its hosts")
        if part and lb is not None and instance.server is not None:
            drains.append((lb.host, lb.argv("drain", instance.server)))
    return down, drains
