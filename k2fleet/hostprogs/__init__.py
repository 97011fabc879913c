"""Programs k2fleet runs ON the hosts: standard library only (the Hub downloader and the Ray
gate also import what their venv holds: huggingface_hub, ray), importing one another as
``k2fleet.hostprogs.NAME`` and nothing else of k2fleet.

- :mod:`.hoststate` — the state probe behind the HostState fact (started from the archive
  when the host's copy has the pinned sha256; otherwise the fact's command carries its
  source, compressed, because it must run on a bare host before anything is shipped) and
  the bootstrap's GPU gate (``--gate``); it asks the system's own tools (``systemctl``,
  ``dpkg-query``/``rpm``, ``ip``, ``nvidia-smi``), each once per probe;
- :mod:`.health` — the health gate (``/health`` + a real completion);
- :mod:`.relay` (+ :mod:`.swarm`) — the checkpoint relay, serving and receiving peer to peer;
- :mod:`.verify` and :mod:`.overlay` — the checkpoint verifier and config overlay, which
  the control machine uses too;
- :mod:`.revisions` — the checkpoint revisions and engine venvs a host keeps (``k2_keep_revisions``);
- :mod:`.image_pin`, :mod:`.raygate`, :mod:`.groupwatch` (a multi-host instance fails as one), :mod:`.download` (+ :mod:`.manifest`, :mod:`.locks`).

All are shipped one way: as one reproducible archive of their sources,
``/opt/k2fleet/lib/k2fleet-host.pyz`` (:mod:`k2fleet.planning.host_archive`), a file of the
desired state, and run as ``python3 k2fleet-host.pyz PROGRAM ARGS...``.
"""
