"""Programs k2fleet runs ON the hosts: standard library only, no k2fleet imports.

- :mod:`k2fleet.hostprogs.hoststate` — the state probe behind the HostState fact (piped to
  ``python3 -`` by the fact, because it must run on a bare host before anything is
  shipped);
- :mod:`k2fleet.hostprogs.health` — the health probe (``/health`` + a real completion);
- :mod:`k2fleet.hostprogs.pull` — a checkpoint pull (repair or full) from a verified peer;
- the checkpoint verifier and config overlay, :mod:`k2fleet.hostprogs.verify` and
  :mod:`k2fleet.hostprogs.overlay`, which the control machine uses too.

All but the probe are shipped one way: as files of the desired state
(``k2fleet.planning.desired.HOST_PROGRAMS``) into ``/opt/k2fleet/lib`` by the engine role.
"""
