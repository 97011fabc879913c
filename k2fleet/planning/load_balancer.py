"""The replicas' load balancer: HAProxy before the ``serve`` instances (pure).

With ``k2_load_balancer: HOST``, :func:`add_load_balancer` plans ``k2-lb.service`` on that
inventory host: k2fleet's own unit running the OS package's HAProxy (the same package and
binary as the API front, :mod:`k2fleet.planning.api_front`; ``haproxy -Ws -f
/etc/k2fleet/lb.cfg``, ``Type=notify``, the config checked by ``haproxy -c`` before start and
reload). Why HAProxy: it health-checks each replica on the engine's own readiness route
(``option httpchk``: a replica that stops answering it 200 gets no new request), and its
runtime API drains one replica without a reload (``set server BACKEND/SERVER state drain``:
no new request, the ones in flight finish; ``show stat`` counts them) — what a rolling change
needs (:mod:`k2fleet.planning.rollout`, :mod:`k2fleet.hostprogs.lbctl`).

The config (:func:`config`) listens on what the user means: the LB host's bind address
(``0.0.0.0`` under ``k2_bind_address: all``, its fleet address under ``fleet``), written
explicitly, and ``k2_load_balancer_port``. Its one backend lists, per ``serve`` instance, the
instance's API endpoint (its head's fleet address and ``k2_port``: the engine, or the API front
that took that port under ``k2_api_key_file``). HAProxy forwards every request header, the
client's ``Authorization`` included, so the key is checked where it always is (the engine or
the front); the health checks call the engine's unauthenticated readiness route (``/health``,
open in vLLM and in the front). No key and no secret is in the config; the admin socket is
``/run/k2fleet-lb/admin.sock``, mode 0600 in a 0700 runtime directory (root only), and no
request is logged (no ``log`` line).

With ``k2_tls_cert_file`` the load balancer serves HTTPS with the fleet's certificate (the
root-only PEM of :func:`k2fleet.planning.api_front.pem_path`) and calls the replicas (their TLS
fronts) over HTTPS, health checks included, verifying each one's certificate against
``k2_tls_ca_file`` (:func:`k2fleet.planning.api_front.ca_path`): the chain only, as HAProxy 2.6
matches a server's name against DNS names and the replicas are called by IP.

>>> cfg = config("0.0.0.0", 8080, [Server("n0", "10.0.0.1", 8000), Server("n1", "10.0.0.2", 8000)], "/health")
>>> [line.strip() for line in cfg.splitlines() if line.strip().startswith(("bind", "server", "option httpchk"))]
['bind 0.0.0.0:8080', 'option httpchk GET /health', 'server n0 10.0.0.1:8000', 'server n1 10.0.0.2:8000']
"""

from __future__ import annotations

from dataclasses import dataclass

from k2fleet.planning import api_front
from k2fleet.planning.deployment import Deployment
from k2fleet.planning.processes import Plan, Service

LB = "k2-lb"
UNIT = f"{LB}.service"
PORT_KEY = "k2_load_balancer_port"
BACKEND = "k2-replicas"
RUNTIME_DIR = "k2fleet-lb"  # systemd's RuntimeDirectory=: /run/k2fleet-lb, 0700 root
SOCKET = f"/run/{RUNTIME_DIR}/admin.sock"
# A replica is checked every 2 s while up; once a check fails, or while it is down, every 0.5 s
# (HAProxy's fastinter, downinter): it is out after 2 failed checks (within 2.5 s when its port
# refuses; a check that gets no answer waits its timeout, inter's 2 s), and back after 2 good
# ones (~1 s after its restart answers, not 4 s: a rolling change waits for that once per replica)
CHECK = {"inter": "2s", "fastinter": "500ms", "downinter": "500ms", "fall": 2, "rise": 2}
READY_TIMEOUT_S = 120  # lbctl ready: how long the health checks may take to see a restarted replica UP


@dataclass(frozen=True)
class Server:
    """One replica at the load balancer: its HAProxy server name (the instance head's host
    name), and the address and port of its API endpoint."""

    name: str
    address: str
    port: int


def balanced(dep: Deployment) -> bool:
    """Does this deployment put a load balancer before its replicas?"""
    return dep.s.load_balancer is not None


def config_path(dep: Deployment) -> str:
    return f"{dep.s.config_dir}/lb.cfg"


def servers(dep: Deployment, plan: Plan) -> list[Server]:
    """Every ``serve`` instance's endpoint, in inventory order: the first host of the instance
    with a chat-serving service, at its fleet address and that service's API port."""
    pool = dep.pools.get("serve")
    out: list[Server] = []
    for instance in pool.instances if pool else []:
        for h in instance:
            endpoint = next((s for s in plan.hosts[h.name].services if s.health and s.health.chat), None)
            if endpoint is not None and endpoint.health is not None:
                out.append(Server(h.name, h.address, endpoint.health.port))
                break
    return out


def health_path(plan: Plan) -> str:
    """The engines' readiness route (the same on every replica of one engine)."""
    return next((s.health.path for _, s in plan.services() if s.health and s.health.chat), "/health")


def config(bind_host: str, port: int, replicas: list[Server], path: str, socket: str = SOCKET,
           pem: str | None = None, ca: str | None = None) -> str:
    """HAProxy's config: listen on ``bind_host:port`` (HTTPS with ``pem``), send each request to
    the replica with the fewest requests in flight (``leastconn``: LLM requests last seconds to
    minutes) among those whose readiness route ``path`` answers 200 (over TLS verified against
    ``ca`` when given); the runtime API on ``socket``."""
    assert all(c not in path for c in " \n#") and "\n" not in socket and " " not in socket
    assert ca is None or ("\n" not in ca and " " not in ca)
    upstream = f" ssl verify required ca-file {ca} alpn http/1.1" if ca else ""
    timeouts = "".join(f"    timeout {name} {value}\n" for name, value in api_front.TIMEOUTS.items())
    check = " ".join(f"{k} {v}" for k, v in CHECK.items())
    lines = "".join(f"    server {s.name} {api_front.address(s.address, s.port)}\n" for s in replicas)
    return (
        "# Rendered by k2fleet from the fleet plan; edits are overwritten.\n"
        "# The load balancer of the serve replicas: health checks on the engines' readiness route; a\n"
        "# rolling change drains one replica at a time through the root-only admin socket. No secret here:\n"
        "# the client's Authorization header is forwarded as it came. No log line: no request is logged.\n"
        "global\n"
        f"    maxconn {api_front.MAXCONN}\n"
        f"    stats socket {socket} mode 600 level admin\n"
        "\n"
        "defaults\n"
        "    mode http\n"
        "    option http-server-close\n"
        "    option forwardfor\n"
        "    option redispatch\n"
        "    retries 2\n"
        f"{timeouts}"
        "\n"
        "frontend k2-lb\n"
        f"    {api_front.bind_line(bind_host, port, pem)}\n"
        f"    maxconn {api_front.MAXCONN}\n"
        f"    default_backend {BACKEND}\n"
        "\n"
        f"backend {BACKEND}\n"
        "    balance leastconn\n"
        f"    option httpchk GET {path}\n"
        "    http-check expect status 200\n"
        f"    default-server check {check}{upstream}\n"
        f"{lines}"
    )


def add_load_balancer(dep: Deployment, plan: Plan) -> None:
    """Under :func:`balanced`: the LB service on ``k2_load_balancer``'s host, started after
    every serving stage (its health checks then find the replicas up)."""
    if not balanced(dep):
        return
    host = plan.hosts[str(dep.s.load_balancer)]
    bind = host.address if dep.s.bind_address == "fleet" else "0.0.0.0"
    port = dep.s.load_balancer_port
    replicas = servers(dep, plan)
    host.services.append(Service(
        name=LB,
        argv=[api_front.HAPROXY, "-Ws", "-f", config_path(dep)],
        files={config_path(dep): config(bind, port, replicas, health_path(plan), SOCKET,
                                        *((api_front.pem_path(dep), api_front.ca_path(dep)) if api_front.tls(dep)
                                          else (None, None)))},
        ports={PORT_KEY: port},
        stage=max(plan.stages(), default=-1) + 1,
        role=host.role,
        needs_checkpoint=False,
        # no replica named here: a host added or removed changes only the config, which reloads
        description=f"HAProxy load balancer on {api_front.address(bind, port)}"
                    f"{' (HTTPS)' if api_front.tls(dep) else ''} before the serve replicas ({config_path(dep)})",
    ))


def server_ref(name: str) -> str:
    """``BACKEND/SERVER`` of one replica, as the runtime API names it."""
    return f"{BACKEND}/{name}"
