"""The checkpoint's distribution, planned (pure): who receives from whom, the relays'
URLs and argv, and where the control machine keeps its copy.

:mod:`k2fleet.control.checkpoint_copy` runs what this plans; the relay itself is the host
program :mod:`k2fleet.hostprogs.relay`.

Example:
    >>> plan_fanout(["a", "b", "c"]).order
    ('a', 'b', 'c')
"""

from __future__ import annotations

import posixpath
import shlex
from dataclasses import dataclass, field

from k2fleet.planning.deployment import Deployment, WeightSet
from k2fleet.planning.host_archive import host_argv

CONTROL = None  # a host's parent when it receives from the control machine
RELAY_UNIT = "k2-relay"
RELAY_SECRET = "/etc/k2fleet/relay/secret"  # the deployment's relay secret on every host (root-only, mode 600)
RELAY_MAX_SECONDS = 6 * 3600  # the hard cap of a relay unit's life
RELAY_IDLE_EXIT_S = 600  # a relay nobody asked for 10 minutes (its deploy failed or ended) stops by itself
HOST_LOG = "/var/log/k2fleet/checkpoint-transfers.jsonl"


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class FanoutPlan:
    """Who receives the checkpoint from whom, in which round.

    ``order``: hosts that load weights, fleet order (``order[0]`` is the root);
    ``parents``: host → source host (None: the control machine);
    ``rounds``: round → hosts active in it (round 0 is the root alone);
    ``shared``: shared storage — only the root fetches, the others only pass the gate.
    """

    order: tuple[str, ...]
    parents: dict[str, str | None] = field(default_factory=dict)
    rounds: tuple[tuple[str, ...], ...] = ()
    shared: bool = False

    @property
    def root(self) -> str | None:
        return self.order[0] if self.order else None

    def round_of(self, host: str) -> int | None:
        """The round in which ``host`` receives (None: never, e.g. shared storage non-root)."""
        return next((r for r, hosts in enumerate(self.rounds) if host in hosts), None)

    def control_transfers(self) -> int:
        """How many transfers leave the control machine (1 for any non-empty fleet)."""
        return sum(1 for h in self.order if self.parents.get(h, "") is CONTROL and self.round_of(h) is not None)


def plan_fanout(hosts: list[str], shared_storage: bool = False, root: str | None = None) -> FanoutPlan:
    """The doubling fan-out over ``hosts`` (fleet order, only hosts that load weights),
    rooted at ``root`` (default: the first host) — the one host that gets the checkpoint
    from outside the fleet (from the control machine, or from the Hub itself).

    Example:
        >>> p = plan_fanout(["h1", "h2", "h3", "h4", "h5"])
        >>> p.rounds
        (('h1',), ('h2',), ('h3', 'h4'), ('h5',))
        >>> p.parents["h5"], p.parents["h4"]
        ('h1', 'h2')
        >>> plan_fanout(["h1", "h2"], shared_storage=True).rounds
        (('h1',),)
        >>> plan_fanout(["h1", "h2", "h3"], root="h2").parents
        {'h2': None, 'h1': 'h2', 'h3': 'h2'}
    """
    order = tuple(dict.fromkeys(hosts))
    if root is not None:
        if root not in order:
            raise ValueError(f"fan-out root {root} is not among the hosts that load weights")
        order = (root,) + tuple(h for h in order if h != root)
    if not order:
        return FanoutPlan(order=(), shared=shared_storage)
    if shared_storage:
        return FanoutPlan(order=order, parents={order[0]: CONTROL}, rounds=((order[0],),), shared=True)
    parents: dict[str, str | None] = {order[0]: CONTROL}
    rounds: list[tuple[str, ...]] = [(order[0],)]
    have = 1
    while have < len(order):
        batch = order[have : 2 * have]
        for k, h in enumerate(batch):
            parents[h] = order[k]
        rounds.append(batch)
        have += len(batch)
    return FanoutPlan(order=order, parents=parents, rounds=tuple(rounds), shared=False)


def relay_url(address: str, port: int) -> str:
    """A host's relay (``[v6]`` bracketed).

    >>> relay_url("10.0.0.2", 29700), relay_url("fd00::2", 29700)
    ('http://10.0.0.2:29700', 'http://[fd00::2]:29700')
    """
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


def relay_serve_argv(path: str, address: str, port: int) -> list[str]:
    """argv (run on a host) starting its relay as a transient systemd unit that serves the
    verified files of ``path`` on ``address:port`` (the private mesh) while the fleet
    distributes; earlier ones are stopped first. Each start gets a unit of its own
    (``k2-relay-<ns>``): a stopped transient unit can stay loaded where systemd cannot
    read its cgroup back (the sandbox's hybrid hierarchy), and its name would be taken.

    >>> relay_serve_argv("/m/k2", "10.0.0.2", 29700)[2].split(" && ")[1]
    'systemd-run --unit=k2-relay-$(date +%s%N) --collect --quiet --property=RuntimeMaxSec=21600 /usr/bin/python3 /opt/k2fleet/lib/k2fleet-host.pyz relay serve /m/k2 --bind 10.0.0.2 --port 29700 --secret-file /etc/k2fleet/relay/secret --idle-exit 600'
    """
    start = ["--collect", "--quiet", f"--property=RuntimeMaxSec={RELAY_MAX_SECONDS}", *host_argv("relay"),
             "serve", path, "--bind", address, "--port", str(port), "--secret-file", RELAY_SECRET,
             "--idle-exit", str(RELAY_IDLE_EXIT_S)]
    return ["sh", "-c", f"{shlex.join(relay_stop_argv())} 2>/dev/null; mkdir -p {shlex.quote(path)} && "
            f"systemd-run --unit={RELAY_UNIT}-$(date +%s%N) " + shlex.join(start)]


def relay_stop_argv() -> list[str]:
    """argv stopping every relay unit of this host (:func:`relay_serve_argv`'s)."""
    return ["systemctl", "stop", f"{RELAY_UNIT}-*.service"]


def relay_fetch_argv(path: str, fleet: list[str], position: int, fanout_k: int, sources: list[str],
                     log_file: str = HOST_LOG, pin: tuple[str, str] | None = None,
                     secret_file: str | None = RELAY_SECRET, digest: str | None = None,
                     pieces_digest: str | None = None) -> list[str]:
    """argv (run on a host) receiving ``path`` shard by shard through the relay: from its
    place ``position`` in the fleet order ``fleet`` (relay URLs), falling back to the
    parent's ancestors and last to ``sources``. ``pin``: (repository, revision) and
    ``digest``: the manifest digest the control machine pinned
    (:func:`k2fleet.control.checkpoint_copy.manifest_pins`) — a manifest of another is
    refused by the receiving relay, whichever peer serves it. ``pieces_digest``: the pin of
    the control copy's pieces (``relay pieces``): each host passes a file on piece by piece
    as its pieces verify, not only once whole.

    >>> relay_fetch_argv("/m/k2", ["http://a:1", "http://b:1"], 1, 1, [])[4:10]
    ['--fleet', 'http://a:1,http://b:1', '--position', '1', '--fanout', '1']
    >>> relay_fetch_argv("/m/k2", ["http://a:1"], 0, 1, [], pin=("m/k", "0" * 40), digest="d" * 64)[-11:-4]
    ['--repo', 'm/k', '--revision', '0000000000000000000000000000000000000000', '--manifest-digest', 'dddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddd', '--secret-file']
    """
    argv = [*host_argv("relay"), "fetch", "--fleet", ",".join(fleet), "--position", str(position),
            "--fanout", str(fanout_k)]
    if pin is not None:
        argv += ["--repo", pin[0], "--revision", pin[1]]
    if digest is not None:
        argv += ["--manifest-digest", digest]
    if pieces_digest is not None:
        argv += ["--pieces-digest", pieces_digest]
    if secret_file is not None:
        argv += ["--secret-file", secret_file]
    argv += ["--log", log_file]
    for url in sources:
        argv += ["--source", url]
    return argv + [path]


def control_source(dep: Deployment, ws: WeightSet | None = None) -> tuple[str, bool]:
    """(control-machine directory, fetched from the Hub?) of one weight set (default: the
    checkpoint): the Hub's pinned copy in ``k2_checkpoint_cache``, or the ``control:`` directory."""
    ws = ws or dep.weight_sets[0]
    if ws.source == "hub":
        return control_dir(dep.s.checkpoint_cache, ws.repo, ws.revision), True
    return ws.source.removeprefix("control:"), False


def control_dir(cache: str, repo_id: str, revision: str) -> str:
    """Control-machine cache directory of one pinned checkpoint: ``CACHE/<org>--<name>/<revision>``.

    Example:
        >>> control_dir("/var/cache/k2fleet/checkpoints", "moonshotai/Kimi-K2-Thinking", "a" * 40)[-12:]
        'aaaaaaaaaaaa'
    """
    return posixpath.join(cache, repo_id.replace("/", "--"), revision)
