"""The authenticating API front: HAProxy before an engine that cannot take the key safely (pure).

``k2_api_key_file`` with an engine that takes its API key only in argv, logs it at start or
has no key option (SGLang and its PD router, TRT-LLM's ``trtllm-serve``, KTransformers;
each engine's ``api_key_fronted`` says why, :mod:`k2fleet.planning.engines`) is carried out by a
front: on every host that serves the OpenAI API (a serving instance's HTTP server, or the
SGLang PD router) :func:`add_fronts` moves the engine's listener to ``127.0.0.1`` on
``k2_api_backend_port`` and plans ``k2-api-front.service``, k2fleet's own unit running the
OS package's HAProxy (``haproxy -Ws -f /etc/k2fleet/api-front.cfg``, not the package's own
``haproxy.service``) where the endpoint was: the host's bind address and ``k2_port``
(``k2_router_port`` for the router). vLLM keeps its native ``VLLM_API_KEY`` path.

HAProxy answers 401 (``{"error": "Unauthorized"}``, as vLLM does) to every request whose
``Authorization`` header is not exactly ``Bearer KEY``, except ``GET``/``HEAD`` of
``/health`` and ``/metrics`` (open in vLLM too; trtllm-serve's ``/prometheus/metrics`` too:
:func:`open_paths`). It passes only the routes the deployment serves: the OpenAI routes under
``/v1/`` and those open paths; any other path (the engines' admin routes: SGLang's
``/update_weights_from_disk``, ``/flush_cache``, ...; a path with a dot segment or an encoded
separator) is answered 404, with the key too. ``Upgrade`` (and ``CONNECT``) is answered 400 and a
101 from the engine is never passed on: HAProxy would tunnel the connection's later bytes
unchecked (exploit tests in tests/test_api_front.py, on the real HAProxy). The key is matched against a pattern file
(``/etc/k2fleet/api-front.keys``: the one line ``Bearer KEY``, root-only 0600, written like
the other key files) and so is in no config text, argv or log; HAProxy logs no request
(no ``log`` line). Timeouts suit LLM streaming: a response may run (and its first token
wait) for up to :data:`TIMEOUTS` ``server``; connecting to the engine and receiving a
client's request headers are bounded.

With ``k2_tls_cert_file`` (and its key and CA, :mod:`k2fleet.inventory.spec`) every engine's
endpoint is fronted, vLLM's too, whether or not a key is set: the front terminates TLS
(``bind ... ssl crt``) with the certificate and key as one root-only PEM
(:func:`pem_path`, 0600, created with that mode like the key files, read by HAProxy alone:
the engine, which runs the checkpoint's code under ``--trust-remote-code``, never holds the
private key), and the clients verify it against the CA (:func:`ca_path` on hosts). The
front checks the key only where the engine cannot (:func:`checks_key`): under vLLM, vLLM
still checks ``VLLM_API_KEY`` itself behind a TLS-only front.

>>> print(keys_file("sk-123").decode(), end="")
Bearer sk-123
>>> bind_line("10.0.0.1", 8000, "/etc/k2fleet/tls/server.pem")
'bind 10.0.0.1:8000 ssl crt /etc/k2fleet/tls/server.pem ssl-min-ver TLSv1.2 alpn http/1.1'
>>> bind_line("::", 8000, None)
'bind [::]:8000'
"""

from __future__ import annotations

from k2fleet.planning.deployment import Deployment
from k2fleet.planning.processes import HostPlan, Plan, Service
from k2fleet.planning.quoting import systemd_exec, systemd_value

FRONT = "k2-api-front"
UNIT = f"{FRONT}.service"
HAPROXY = "/usr/sbin/haproxy"  # Debian, Ubuntu and RHEL's haproxy package (k2fleet.planning.os_tables)
BACKEND_KEY = "k2_api_backend_port"
LOOPBACK = "127.0.0.1"
OPEN_PATHS = ("/health", "/metrics")  # what vLLM leaves open too (GET/HEAD only)
MAXCONN = 4096
UNAUTHORIZED = '{"error": "Unauthorized"}'
NOT_FOUND = '{"error": "Not Found"}'
NO_UPGRADE = '{"error": "Upgrade is not served"}'
API_PREFIX = "/v1/"  # the OpenAI routes: chat/completions, completions, models, embeddings, ...
# a path holding any of these is refused (404): a dot segment or an encoded separator could reach
# another route once the engine decodes or normalizes it (HAProxy's ``path`` is not normalized)
ODD_PATH = ("/.", "%2e", "%2f", "%5c", "%00")
# HAProxy 2.6 timeouts. ``server`` is the engine's inactivity: a streamed (SSE) answer resets
# it with every chunk, but a long prompt may wait minutes in the engine's queue before its
# first byte (and a non-streamed answer sends nothing until it is done), so an hour.
# ``client`` is armed only while the client must send or read (not while it waits for the
# engine: tested with the real HAProxy, tests/test_api_front.py): a client that stops
# reading a stream is dropped after 5 minutes. The request's headers, the connection to the
# engine, an idle keep-alive and HAProxy's own queue are bounded tightly.
TIMEOUTS = {
    "http-request": "30s",
    "connect": "5s",
    "client": "5m",
    "server": "1h",
    "http-keep-alive": "60s",
    "queue": "30s",
    "client-fin": "30s",
    "server-fin": "30s",
}


def tls(dep: Deployment) -> bool:
    """Do the endpoints (the fronts, the load balancer) serve HTTPS (``k2_tls_cert_file``)?"""
    return dep.s.tls_cert_file is not None


def checks_key(dep: Deployment) -> bool:
    """Does the front check ``k2_api_key_file``'s key (an engine that cannot take it itself)?"""
    return dep.s.api_key_file is not None and dep.engine_impl.api_key_env is None


def fronted(dep: Deployment) -> bool:
    """Does this deployment put the API front before its endpoints (a key the engine cannot
    take, or TLS: :func:`tls`)?"""
    return checks_key(dep) or tls(dep)


def tls_dir(dep: Deployment) -> str:
    return f"{dep.s.config_dir}/tls"


def pem_path(dep: Deployment) -> str:
    """The certificate chain and its private key as one PEM (HAProxy's ``crt``): root-only 0600."""
    return f"{tls_dir(dep)}/server.pem"


def ca_path(dep: Deployment) -> str:
    """``k2_tls_ca_file`` on hosts: what the health gate and the load balancer verify against."""
    return f"{tls_dir(dep)}/ca.pem"


def scheme(dep: Deployment) -> str:
    """``https`` under :func:`tls`, else ``http``: how every client URL of the endpoints starts."""
    return "https" if tls(dep) else "http"


def bind_line(bind_host: str, port: int, pem: str | None) -> str:
    """HAProxy's ``bind`` of an endpoint: TLS with ``pem`` (certificate chain + key) when given
    (TLS 1.2 at least; HTTP/1.1 offered by ALPN), plain HTTP otherwise."""
    assert pem is None or ("\n" not in pem and " " not in pem)
    ssl = f" ssl crt {pem} ssl-min-ver TLSv1.2 alpn http/1.1" if pem else ""
    return f"bind {address(bind_host, port)}{ssl}"


def config_path(dep: Deployment) -> str:
    return f"{dep.s.config_dir}/api-front.cfg"


def keys_path(dep: Deployment) -> str:
    """The pattern file HAProxy matches ``Authorization`` against (0600, root)."""
    return f"{dep.s.config_dir}/api-front.keys"


def keys_file(key: str) -> bytes:
    """The pattern file's content: the header value a client must send, one line."""
    return f"Bearer {key}\n".encode()


def address(host: str, port: int) -> str:
    """``host:port`` as HAProxy (and a URL) writes it: an IPv6 literal in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def config(bind_host: str, port: int, backend_port: int, keys: str | None, engine: str = "the engine",
           pem: str | None = None, open_paths: tuple[str, ...] = OPEN_PATHS) -> str:
    """HAProxy's config: listen on ``bind_host:port`` (HTTPS with ``pem``: :func:`bind_line`),
    forward authenticated requests to the routes the deployment serves (``/v1/...``) and
    ``open_paths`` (GET/HEAD without the key too) to ``127.0.0.1:backend_port``; 401 without the
    key, 404 for any other route, 400 for an ``Upgrade`` or ``CONNECT``, and a 101 from the engine
    never passed on (no tunnel). ``keys``: the pattern file's path (the key is never in this text);
    None: the engine checks the key itself, or there is none (a TLS-only front: routes and
    upgrades are still refused)."""
    assert keys is None or ("\n" not in keys and " " not in keys)
    assert all(p.startswith("/") and " " not in p for p in open_paths)
    timeouts = "".join(f"    timeout {name} {value}\n" for name, value in TIMEOUTS.items())
    open_paths_ = " ".join(open_paths)
    return (
        "# Rendered by k2fleet from the fleet plan; edits are overwritten.\n"
        + (f"# The API front of {engine}: Authorization: Bearer KEY, matched against the root-only\n"
           f"# pattern file {keys} (the key is not in this file). No log line: no request is logged.\n"
           if keys else f"# The TLS front of {engine} (it checks any key itself). No log line: no request is logged.\n")
        + (f"# HTTPS: certificate and key in the root-only {pem}.\n" if pem else "")
        +
        "global\n"
        f"    maxconn {MAXCONN}\n"
        "\n"
        "defaults\n"
        "    mode http\n"
        "    option http-server-close\n"
        "    option forwardfor\n"
        f"{timeouts}"
        "\n"
        "frontend k2-api\n"
        f"    {bind_line(bind_host, port, pem)}\n"
        f"    maxconn {MAXCONN}\n"
        f"    acl open_path path {open_paths_}\n"
        "    acl open_method method GET HEAD\n"
        + (f"    acl has_key req.hdr(authorization) -m str -f {keys}\n" if keys else "")
        + f"    acl served_path path_beg {API_PREFIX}\n"
        f"    acl served_path path {open_paths_}\n"
        f"    acl odd_path path_sub -i {' '.join(ODD_PATH)}\n"
        "    acl upgrade req.hdr(upgrade) -m found\n"
        "    acl upgrade method CONNECT\n"
        + (f"    http-request return status 401 content-type application/json string '{UNAUTHORIZED}' "
           "hdr WWW-Authenticate Bearer unless has_key || open_path open_method\n" if keys else "")
        + f"    http-request return status 404 content-type application/json string '{NOT_FOUND}' "
        "if !served_path || odd_path\n"
        f"    http-request return status 400 content-type application/json string '{NO_UPGRADE}' if upgrade\n"
        "    http-response deny deny_status 502 if { status 101 }\n"
        "    default_backend engine\n"
        "\n"
        "backend engine\n"
        f"    server engine {address(LOOPBACK, backend_port)}\n"
    )


def unit_file(dep: Deployment, svc: Service, env_file: str, path: str | None = None,
              runtime_dir: str | None = None) -> str:
    """``k2-api-front.service`` (and the load balancer's ``k2-lb.service``, with its config
    ``path`` and a root-only ``runtime_dir`` under /run for its admin socket): HAProxy in
    master-worker mode under systemd (``-Ws``, ``Type=notify``, as the package's own unit),
    its config checked before start and reload (``systemctl reload``: new workers, streams in
    flight finish on the old ones)."""
    path = path or config_path(dep)
    check = [HAPROXY, "-c", "-q", "-f", path]
    return "\n".join([
        "# Rendered by k2fleet from the fleet plan; edits are overwritten.",
        "[Unit]",
        f"Description={systemd_value(f'k2fleet: {svc.description or svc.name}')}",
        "After=network-online.target",
        "Wants=network-online.target",
        "",
        "[Service]",
        "Type=notify",
        f"EnvironmentFile={systemd_value(env_file, path=True)}",
        f"ExecStartPre={systemd_exec(check)}",
        f"ExecStart={systemd_exec(svc.argv)}",
        f"ExecReload={systemd_exec(check)}",
        "ExecReload=/bin/kill -USR2 $MAINPID",
        *([f"RuntimeDirectory={runtime_dir}", "RuntimeDirectoryMode=0700"] if runtime_dir else []),
        "KillMode=mixed",
        "SuccessExitStatus=143",
        "Restart=on-failure",
        "RestartSec=5",
        f"LimitNOFILE={MAXCONN * 4}",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ])


def open_paths(dep: Deployment) -> tuple[str, ...]:
    """The paths the front serves without the key (GET/HEAD): :data:`OPEN_PATHS` and the
    engine's Prometheus route where it is another (trtllm-serve's ``/prometheus/metrics``,
    :data:`k2fleet.planning.metrics.ENGINE_METRICS`), which the scrapers call without a key."""
    from k2fleet.planning.metrics import ENGINE_METRICS

    path = ENGINE_METRICS[dep.engine].path if dep.engine in ENGINE_METRICS else None
    return OPEN_PATHS + ((path,) if path and path not in OPEN_PATHS else ())


def fronts(svc: Service) -> bool:
    """Is ``svc`` an endpoint clients call (a chat-serving instance's HTTP server or the PD
    router)? PD prefill/decode servers are the router's backends, closed to the fleet."""
    return svc.health is not None and svc.health.chat and svc.role not in ("prefill", "decode")


def has_front(hp: HostPlan) -> bool:
    return any(svc.name == FRONT for svc in hp.services)


def _value_after(argv: list[str], flag: str) -> int:
    at = [i for i, word in enumerate(argv[:-1]) if word == flag]
    assert len(at) == 1, f"{flag} once in {argv}"
    return at[0] + 1


def add_fronts(dep: Deployment, plan: Plan) -> None:
    """Under :func:`fronted`: each endpoint's engine listens on ``127.0.0.1:k2_api_backend_port``
    and a front service takes its address and port. The engine's Health keeps the API port:
    the health gate calls through the front (with the key)."""
    if not fronted(dep):
        return
    backend = dep.s.api_backend_port
    for host in plan.hosts.values():
        for svc in [s for s in host.services if fronts(s)]:
            assert svc.health is not None
            key = "k2_router_port" if "k2_router_port" in svc.ports else "k2_port"
            port = svc.ports.pop(key)
            h, p = _value_after(svc.argv, "--host"), _value_after(svc.argv, "--port")
            assert svc.argv[p] == str(port), (svc.argv, port)
            bind = svc.argv[h]
            svc.argv[h], svc.argv[p] = LOOPBACK, str(backend)
            svc.ports[BACKEND_KEY] = backend
            what = f"{svc.name} on {address(LOOPBACK, backend)}"
            keys = keys_path(dep) if checks_key(dep) else None
            pem = pem_path(dep) if tls(dep) else None
            checks = ([f"Authorization: Bearer, key in {keys}"] if keys else []) + \
                     ([f"HTTPS, certificate and key in {pem}"] if pem else [])
            host.services.append(Service(
                name=FRONT,
                argv=[HAPROXY, "-Ws", "-f", config_path(dep)],
                files={config_path(dep): config(bind, port, backend, keys, svc.name, pem, open_paths(dep))},
                ports={key: port},
                stage=svc.stage,
                role=svc.role,
                needs_checkpoint=False,
                description=f"HAProxy API front on {address(bind, port)} ({'; '.join(checks)}) for {what}",
            ))
