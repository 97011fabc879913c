"""Fleet reachability before the engines start, planned (pure): which ports each host's
peers must be able to open, and the host program's argv that checks it (issue #22).

A multi-host engine meets at ports on one host (vLLM's ``--data-parallel-rpc-port`` and
``--master-port``, SGLang's ``--dist-init-addr``, Ray's GCS, the PD bootstrap port, a PD
backend's API for its router). When a firewall or security group between the hosts drops
one of them, the engines load the model and then hang. So before the first start, each host
holds its rendezvous ports on its fleet address (``k2fleet-host.pyz reach listen``, a
transient unit) and every other serving host opens each of them (``reach probe``), failing
with one line naming the host, the port and the fix. Run by the ``reach`` role when serving
units are about to start somewhere in the fleet (a settled fleet gets no operation).

>>> ports_of(Service("k2-vllm", [], ports={"k2_port": 8000, "k2_dp_rpc_port": 13345}))
[13345]
>>> ports_of(Service("k2-sglang-decode", [], ports={"k2_port": 8000, "k2_dist_init_port": 5757}, role="decode"))
[5757, 8000]
>>> target("10.0.0.1", 13345), target("fd00::1", 13345)
('10.0.0.1:13345', '[fd00::1]:13345')
"""

from __future__ import annotations

from dataclasses import dataclass

from k2fleet.planning.firewall import API_KEYS, BACKEND_KEY
from k2fleet.planning.host_archive import host_argv
from k2fleet.planning.processes import Plan, Service
from k2fleet.planning.quoting import shell_line

LISTEN_UNIT = "k2-reach"
LISTEN_SECONDS = 180  # the listener's life (it is stopped as soon as the probes are done)
PROBE_TIMEOUT_S = 30  # how long a host keeps trying a peer's port that refuses (a dropped one: 3 attempts)
ROUTED_ROLES = ("prefill", "decode")  # backends whose API the fleet's router opens


def ports_of(svc: Service) -> list[int]:
    """The ports of ``svc`` that other fleet hosts open: every planned port but the API
    (the clients'; a PD backend's API is its router's, so it counts) and the loopback
    backend behind the API front."""
    return sorted({port for key, port in svc.ports.items()
                   if key != BACKEND_KEY and (key not in API_KEYS or svc.role in ROUTED_ROLES)})


def target(address: str, port: int) -> str:
    """``ADDRESS:PORT`` as ``reach probe --targets`` takes it (an IPv6 address in brackets)."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


@dataclass(frozen=True)
class ReachCheck:
    """One host's part: ``listen`` (its rendezvous ports held by a transient unit; None: it
    has none), ``probe`` (every peer's ports opened from here; None: no peer has any),
    ``stop`` (the shell line stopping the listener, if it still runs)."""

    listen: list[str] | None
    probe: list[str] | None
    stop: str

    @property
    def start(self) -> str | None:
        """The shell line starting the listener: a leftover one (a failed run's, within its
        life) is stopped first, so the unit's name is free and the ports are this run's."""
        return None if self.listen is None else f"{self.stop}; {shell_line(self.listen)}"

    def to_json(self) -> dict[str, list[str] | None]:
        return {"listen": self.listen, "probe": self.probe}


def reach_checks(plan: Plan) -> dict[str, ReachCheck]:
    """Host → its :class:`ReachCheck`, for a fleet of several serving hosts (else none)."""
    serving = {name: hp for name, hp in plan.hosts.items() if hp.services}
    if len(serving) < 2:
        return {}
    ports = {name: sorted({p for svc in hp.services for p in ports_of(svc)}) for name, hp in serving.items()}
    out = {}
    stop = f"systemctl stop {LISTEN_UNIT}.service 2>/dev/null || true"  # gone already: it exits when it is done
    for name, hp in serving.items():
        listen = None
        if ports[name]:
            listen = ["systemd-run", f"--unit={LISTEN_UNIT}", "--collect", "--quiet",
                      f"--property=RuntimeMaxSec={LISTEN_SECONDS + 30}",
                      *host_argv("reach", "listen", "--bind", hp.address, "--ports", ",".join(map(str, ports[name])),
                                 "--seconds", str(LISTEN_SECONDS))]
        targets = [target(peer.address, p) for other, peer in serving.items() if other != name for p in ports[other]]
        probe = host_argv("reach", "probe", "--host", name, "--targets", ",".join(targets),
                          "--timeout", str(PROBE_TIMEOUT_S)) if targets else None
        if listen or probe:
            out[name] = ReachCheck(listen, probe, stop)
    return out
