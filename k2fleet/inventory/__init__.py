"""The inventory's grammar and the gate in front of pyinfra (runs on the control machine,
before any host is contacted): :mod:`.spec` (every ``k2_*`` key, its type, default and
meaning), :mod:`.loader` (an inventory file and pyinfra's ``--data`` → per-host data) and
:mod:`.gate` (one line naming the key and the fix, exit 2). Imports nothing else of k2fleet
but planning's pure validation."""
