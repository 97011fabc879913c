"""No local user may bind a port k2fleet serves on (pure).

An unprivileged local user who binds the API port (8000), the engine's port behind the API
front (8001) or the relay's (29700) before k2fleet's unit does — a rolling restart, a unit in
its restart delay — takes its clients' secrets (the health gate's API key, the relay secret)
unless every client checks who answers (:func:`k2fleet.hostprogs.health.check_server` does)
and the port cannot be taken at all. The kernel's ``net.ipv4.ip_unprivileged_port_start``
makes every port below it privileged (binding needs ``CAP_NET_BIND_SERVICE``; k2fleet's units
run as root): k2fleet writes :data:`SYSCTL_PATH`, its own drop-in, with the value
:func:`port_start` gives, and sets the running kernel's value when it is lower (never lowers
it: a host whose operator chose a higher one keeps it, and its check passes).

- The value is one above the highest port k2fleet names on any host of the fleet (every
  opening of :func:`k2fleet.planning.firewall.host_openings`: API, router, load balancer,
  the engine behind the front, the relay, Ray's GCS, client and worker ports, torch's store,
  DP RPC, dist-init and its ZMQ ports, the mesh sshd, the exporters), at most
  :data:`CEILING`: the kernel refuses a value above the low end of
  ``net.ipv4.ip_local_port_range`` (32768 by default), and the connections every process
  opens take their source ports there. A port at or above it (SGLang's dist-init port 50000
  and its ZMQ ports, by default) stays unprivileged: ``k2fleet plan`` names those ports.
- The sysctl is per network namespace (a container with its own network keeps 1024; k2fleet's
  containers use the host's) and, despite its name, governs IPv6 as well.
- Services that run unprivileged and bind a port below the value need the capability: Debian's
  ``prometheus-node-exporter`` (user prometheus, port 9100, ``k2_node_exporter``) gets a
  systemd drop-in, :data:`NODE_EXPORTER_DROPIN`, with ``AmbientCapabilities=CAP_NET_BIND_SERVICE``.
  Anything else on the host that binds a port below the value as an ordinary user (a
  Prometheus server on 9090, a user's notebook on 8888) needs the same, or its own port above it.
  A host where k2fleet listens on nothing (a Slurm login host: its site's ``slurmctld`` binds
  6817 as user slurm) gets no drop-in (:func:`serves`).

>>> print(sysctl_file(29701), end="")
# k2fleet: ports below 29701 need CAP_NET_BIND_SERVICE (root): no local user can take a port
# k2fleet serves on (IPv4 and IPv6). Rendered from the fleet plan; edits are overwritten.
net.ipv4.ip_unprivileged_port_start = 29701
"""

from __future__ import annotations

from k2fleet.planning.deployment import Deployment
from k2fleet.planning.metrics import NODE_EXPORTER_PORT
from k2fleet.planning.processes import HostPlan, Plan

SYSCTL = "net.ipv4.ip_unprivileged_port_start"
PROC_PATH = "/proc/sys/net/ipv4/ip_unprivileged_port_start"
SYSCTL_PATH = "/etc/sysctl.d/60-k2fleet-privileged-ports.conf"
NODE_EXPORTER_UNIT = "prometheus-node-exporter.service"
NODE_EXPORTER_DROPIN = f"/etc/systemd/system/{NODE_EXPORTER_UNIT}.d/k2fleet-bind-port.conf"
CEILING = 32768  # Linux's default net.ipv4.ip_local_port_range starts here; the value may not pass it
CHECK = "privileged-ports"  # the HostState check: the running kernel's value is at least the plan's
GROUP = "privileged_ports"  # the desired state's file group


def _own(what: str) -> bool:
    return not what.startswith(("ssh_port", "ephemeral"))


def serves(dep: Deployment, hp: HostPlan) -> bool:
    """Does k2fleet listen on some port of host ``hp``? Only such a host gets the drop-in: a
    host where k2fleet runs nothing that listens (a Slurm login host, which belongs to its site
    and whose ``slurmctld`` binds 6817 as user slurm) is left as it is."""
    from k2fleet.planning.firewall import host_openings

    return any(_own(o.what) for o in host_openings(dep, hp))


def served_ports(dep: Deployment, plan: Plan) -> list[tuple[int, int, str]]:
    """Every (first, last, what) port range k2fleet's processes listen on, on any host (not
    the ephemeral range nor SSH: they are not k2fleet's listeners)."""
    from k2fleet.planning.firewall import host_openings

    out = []
    for hp in plan.hosts.values():
        for o in host_openings(dep, hp):
            if not _own(o.what):
                continue
            out.append((o.first, o.last, f"{o.what} on {hp.name}"))
    return out


def port_start(dep: Deployment, plan: Plan) -> int:
    """The fleet's ``net.ipv4.ip_unprivileged_port_start``: one above the highest port k2fleet
    serves below :data:`CEILING` (1024, the kernel's default, when it serves none above it)."""
    below = [last for first, last, _ in served_ports(dep, plan) if last < CEILING]
    return max([1023, *below]) + 1


def unprotected(dep: Deployment, plan: Plan) -> list[str]:
    """The served ports the value cannot cover (at or above :data:`CEILING`)."""
    value = port_start(dep, plan)
    return sorted({f"{first if first == last else f'{first}-{last}'} ({what})"
                   for first, last, what in served_ports(dep, plan) if last >= value})


def tunnel_port(value: int, relay_port: int, root_login: bool) -> int:
    """The host's end of the reverse tunnel that carries the control machine's copy
    (``ssh -R 127.0.0.1:PORT:...``): sshd binds it as the SSH login's user. A root login keeps
    ``k2_relay_port`` (privileged: no other user takes it); a non-root login (``_sudo``) could
    not bind a port below ``value``, so its tunnel takes ``value``, the first unprivileged port
    (another user who holds it first makes the tunnel, and so the fetch, fail at once:
    ``ExitOnForwardFailure``; the relay's secret and pinned digest are the fetch's defence).

    >>> tunnel_port(29701, 29700, True), tunnel_port(29701, 29700, False), tunnel_port(1024, 29700, False)
    (29700, 29701, 29700)
    """
    if root_login or relay_port >= value:
        return relay_port
    return value


def sysctl_file(value: int) -> str:
    return (f"# k2fleet: ports below {value} need CAP_NET_BIND_SERVICE (root): no local user can take a port\n"
            "# k2fleet serves on (IPv4 and IPv6). Rendered from the fleet plan; edits are overwritten.\n"
            f"{SYSCTL} = {value}\n")


def node_exporter_dropin(value: int) -> str:
    return ("# k2fleet: prometheus-node-exporter runs as user prometheus and binds port "
            f"{NODE_EXPORTER_PORT}, below\n# {SYSCTL} = {value} ({SYSCTL_PATH}): "
            "the capability to bind it, nothing more.\n"
            "[Service]\nAmbientCapabilities=CAP_NET_BIND_SERVICE\n")


def files(dep: Deployment, value: int, node_exporter: bool) -> dict[str, str]:
    """Path → content of the drop-ins one host holds (``node_exporter``: it runs the node exporter)."""
    out = {SYSCTL_PATH: sysctl_file(value)}
    if node_exporter and NODE_EXPORTER_PORT < value:
        out[NODE_EXPORTER_DROPIN] = node_exporter_dropin(value)
    return out


def check_argv(value: int) -> list[str]:
    """Exit 0 when the running kernel's value is at least ``value`` (``cat``: dash's ``read``
    takes a byte at a time, and a sysctl file answers a read past offset 0 with nothing)."""
    return ["/bin/sh", "-c", f'v=$(cat {PROC_PATH}) && [ "$v" -ge {value} ]']


def apply_argv(value: int) -> str:
    """Raise the running kernel's value to ``value`` (the drop-in holds it across reboots);
    fails in one line when the kernel refuses it."""
    return (f"echo {value} > {PROC_PATH} 2>/dev/null || {{ echo \"{SYSCTL} = {value} refused by the kernel "
            f"(is net.ipv4.ip_local_port_range's low end below {value}? $(cat /proc/sys/net/ipv4/ip_local_port_range))\" >&2; "
            "exit 1; }")


def format_section(dep: Deployment, plan: Plan) -> str:
    """``k2fleet plan``'s line on the privileged ports."""
    value = port_start(dep, plan)
    out = [f"\n== privileged ports: {SYSCTL} = {value} ({SYSCTL_PATH}, every host k2fleet serves on): "
           f"only root binds a port below {value}; the running kernel's value is raised to it, never lowered"]
    if dep.s.metrics and dep.s.node_exporter and NODE_EXPORTER_PORT < value:
        out.append(f"  {NODE_EXPORTER_UNIT} (user prometheus, port {NODE_EXPORTER_PORT}): "
                   f"CAP_NET_BIND_SERVICE by the drop-in {NODE_EXPORTER_DROPIN}")
    left = unprotected(dep, plan)
    if left:
        out.append(f"  not covered (at or above {CEILING}, the kernel's ephemeral range): " + "; ".join(left))
    return "\n".join(out) + "\n"
