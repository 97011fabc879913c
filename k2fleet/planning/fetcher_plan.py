"""Who talks to the Hub (``k2_checkpoint_fetcher: auto``), planned (pure): what each host is
asked before the deploy changes anything, and how the answers choose the fetcher.

``auto`` is resolved by the deploy (:mod:`k2fleet.deploy.fetcher_choice`) before anything
changes: every host that loads weights, in inventory order, is asked over the deploy's own
connection to open a TCP connection to the Hub endpoint (``k2_hub_endpoint``, default
huggingface.co:443) within :data:`REACH_TIMEOUT_S`; the first that does fetches (it downloads
and feeds the others file by file, pipelined), the control machine only when none does. The
control machine without asking anyone when nothing is to be downloaded by a host: a
``control:`` source, ``k2_bundle`` (an air-gapped bundle carries the checkpoint), an endpoint
on a loopback address (the control machine's own), or ``k2_egress: mirrors-only`` without
``k2_hub_endpoint`` (the firewall would not let a host reach huggingface.co's CDN).

>>> hub_target("https://hub.corp.example:8443/x"), hub_target(None), hub_target("http://[fd00::1]")
(('hub.corp.example', 8443), ('huggingface.co', 443), ('fd00::1', 80))
>>> choose(["a", "b", "c"], {"a": False, "b": True, "c": True})
'b'
>>> choose(["a"], {"a": False})
'control'
"""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlsplit

AUTO, CONTROL = "auto", "control"
DEFAULT_ENDPOINT = "https://huggingface.co"
REACH_TIMEOUT_S = 3.0


def hub_target(endpoint: str | None) -> tuple[str, int]:
    """(host, port) a fetcher host opens: ``k2_hub_endpoint``'s, default huggingface.co:443."""
    parts = urlsplit(endpoint or DEFAULT_ENDPOINT)
    return (parts.hostname or "").lower(), parts.port or (443 if parts.scheme == "https" else 80)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def static_choice(dep: Any) -> str | None:
    """What ``auto`` is without asking any host (``control`` and why), or None: the hosts
    must be asked. For a concrete ``k2_checkpoint_fetcher`` its value."""
    s = dep.s
    if s.checkpoint_fetcher != AUTO:
        return s.checkpoint_fetcher
    return CONTROL if static_reason(dep) else None


def static_reason(dep: Any) -> str | None:
    """Why ``auto`` is the control machine without asking a host (None: the hosts are asked)."""
    s = dep.s
    if any(ws.source != "hub" for ws in dep.weight_sets):
        return "the weights come from the control machine (a `control:` source or k2_bundle)"
    if s.bundle:
        return "k2_bundle carries the checkpoint"
    if _loopback(hub_target(s.hub_endpoint)[0]):
        return f"k2_hub_endpoint {s.hub_endpoint} is the control machine's own loopback"
    if s.egress == "mirrors-only" and not s.hub_endpoint:
        return "k2_egress: mirrors-only without k2_hub_endpoint (no host may reach huggingface.co's CDN)"
    return None


def reach_argv(endpoint: str | None, timeout: float = REACH_TIMEOUT_S) -> list[str]:
    """argv a host runs (read-only) to say whether it opens the Hub endpoint: prints ``1`` or ``0``.

    >>> reach_argv("http://10.0.0.1:8080")[:3]
    ['python3', '-I', '-c']
    """
    host, port = hub_target(endpoint)
    code = ("import socket,sys\ntry:\n socket.create_connection((sys.argv[1],int(sys.argv[2])),float(sys.argv[3])).close()"
            "\n print(1)\nexcept Exception:\n print(0)")
    return ["python3", "-I", "-c", code, host, str(port), str(timeout)]


def choose(candidates: list[str], reached: dict[str, bool]) -> str:
    """The first of ``candidates`` (hosts that load weights, inventory order) that reached
    the Hub; ``control`` when none did."""
    return next((h for h in candidates if reached.get(h)), CONTROL)


def describe(dep: Any, candidates: list[str]) -> str:
    """``k2fleet plan``'s line on who talks to the Hub."""
    s = dep.s
    if s.checkpoint_fetcher == CONTROL:
        return ("checkpoint fetcher: control (k2_checkpoint_fetcher: control): the control machine downloads, then sends "
                "the fleet one copy over the deploy's own SSH")
    if s.checkpoint_fetcher != AUTO:
        return (f"checkpoint fetcher: {s.checkpoint_fetcher} (k2_checkpoint_fetcher): it downloads from the Hub and feeds "
                "the others file by file as it verifies each")
    why = static_reason(dep)
    if why:
        return f"checkpoint fetcher: auto → control: {why}"
    host, port = hub_target(s.hub_endpoint)
    return (f"checkpoint fetcher: auto → decided before the deploy changes anything: the first of "
            f"{', '.join(candidates) or '(no host loads weights)'} that opens {host}:{port} (asked over the deploy's own "
            "connection) downloads and feeds the others file by file; the control machine only if none does "
            "(this plan shows the control machine's path)")
