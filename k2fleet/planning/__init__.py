"""Pure planning: a validated inventory → what every host must hold and run.

No module here connects to a host, runs a process or writes a file:
:mod:`.deployment` resolves the inventory (catalog, parallel sizes, ports, runtime);
:mod:`.planner` and :mod:`.render` turn it into each host's processes
(:mod:`.processes`); :mod:`.desired` computes each host's desired state (files, units,
packages, checks, checkpoint) from that plan and the control machine's artifacts;
:mod:`.os_tables` and :mod:`.host_bootstrap` hold the per-OS and per-GPU tables with
their sources.
"""
