"""``k2fleet status``'s one contact with the fleet: every host's HostState fact, gathered
concurrently through pyinfra's API, read-only.

The inventory is loaded by pyinfra exactly as ``pyinfra INVENTORY deploys/kimi.py`` loads
it (host data, group data, ``--data``), so each host is reached with the same connector
and connection data (``ssh_user``, ``ssh_port``, ``ssh_key``, ``ssh_known_hosts_file``,
``ssh_config_file``, ``_sudo``...), and the fact is the deploy's own
(:class:`~k2fleet.deploy.facts.HostState` with :meth:`~k2fleet.planning.desired.HostDesired.fact_query`):
one round trip per host that changes nothing.
"""

from __future__ import annotations

from typing import Any

from k2fleet.deploy.facts import HostState
from k2fleet.inventory.loader import _import_pyinfra_cli_inventory, parse_data_overrides
from k2fleet.planning.host_fact import HostReport


def pyinfra_state(inventory: str, data: list[str] | tuple[str, ...]) -> Any:
    """A pyinfra ``State`` holding ``inventory`` loaded as ``pyinfra INVENTORY deploys/kimi.py``
    loads it (host data, group data, ``--data``); no host is connected yet. pyinfra's CLI
    patches the socket module for its greenlets: so is it here, when not yet."""
    from gevent import monkey

    if not monkey.is_module_patched("socket"):  # as pyinfra_cli does: parallel SSH in greenlets
        monkey.patch_all()
    from pyinfra.api import Config, State
    from pyinfra.context import ctx_state

    make_inventory_from_files = _import_pyinfra_cli_inventory().make_inventory_from_files
    state = State()
    with ctx_state.use(state):
        loaded = make_inventory_from_files(inventory, parse_data_overrides(data) or None)
    state.init(loaded, Config())
    return state


def gather_facts(inventory: str, data: list[str] | tuple[str, ...],
                 queries: dict[str, dict[str, Any]]) -> dict[str, HostReport | str]:
    """Host name → its HostState (``queries[name]`` is its fact query), or why it could not
    be gathered (one line: not connected, the probe failed). Hosts are reached in parallel
    (pyinfra's gevent pool; the socket module is patched as pyinfra's CLI patches it)."""
    from gevent import monkey

    if not monkey.is_module_patched("socket"):  # as pyinfra_cli does: parallel SSH in greenlets
        monkey.patch_all()
    import gevent
    from pyinfra.context import ctx_host, ctx_state

    state = pyinfra_state(inventory, data)

    def one(host: Any) -> HostReport | str:
        with ctx_state.use(state), ctx_host.use(host):
            try:
                if not host.connected:
                    host.connect(reason="k2fleet status", raise_exceptions=True)
                    state.activate_host(host)
                report = host.get_fact(HostState, query=queries[host.name])
            except Exception as exc:  # noqa: BLE001 - any failure of one host is that host's status
                return " ".join(f"{type(exc).__name__}: {exc}".split()) or type(exc).__name__
            return report if isinstance(report, HostReport) else "the HostState probe gave no report"

    hosts = [h for h in state.inventory if h.name in queries]
    greenlets = {h.name: state.pool.spawn(one, h) for h in hosts}
    gevent.joinall(list(greenlets.values()))
    out = {name: g.value if g.successful() else f"{type(g.exception).__name__}: {g.exception}"
           for name, g in greenlets.items()}
    disconnect_all(hosts)
    return out


def disconnect_all(hosts: Any) -> None:
    """Close every connected host's connection (the results are in: a failing disconnect
    changes nothing)."""
    for h in hosts:
        if h.connected:
            try:
                h.disconnect()
            except Exception:  # noqa: BLE001 - see the docstring
                pass
