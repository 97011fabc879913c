"""Record role: the host as it was before k2fleet's first change, kept once on the host
(:data:`~k2fleet.planning.desired.RECORD`, root-only), so that ``k2fleet down`` gives back what
the deploy changed and names the packages it installed (:mod:`k2fleet.planning.teardown`).
Runs before the package role; a host that holds the record gets no operation.
"""

from __future__ import annotations

from pyinfra.api import deploy

from k2fleet.deploy.operations import command
from k2fleet.planning.desired import RECORD
from k2fleet.planning.host_fact import HostReport


@deploy("k2fleet: record of the host before k2fleet")
def keep(argv: list[str], fact: HostReport) -> None:
    """
    Write the record unless the HostState fact saw it (the host program keeps an existing one too).

    + argv: :func:`k2fleet.planning.teardown.program_argv` ``record`` with this host's
      :func:`~k2fleet.planning.teardown.record_spec`
    + fact: this host's HostState (whether the record exists)

    **Example:**

    .. code:: python

        record.keep(program_argv("record", record_spec(dep, plan.hosts[host.name], mine)), fact)
    """
    command(name="keep a record of the host before k2fleet's first change (for k2fleet down)", argv=argv,
            _if=lambda: not fact.exists.get(RECORD))
