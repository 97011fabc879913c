"""Record role: the host as it was before k2fleet's first change, kept once on the host
(:data:`~k2fleet.planning.desired.RECORD`, root-only), so that ``k2fleet down`` gives back what
the deploy changed and names the packages it installed (:mod:`k2fleet.planning.teardown`).
Runs before the package role; a host that holds the record gets no operation.
"""

from __future__ import annotations

from pyinfra.api import deploy

from k2fleet.deploy.operations import command


@deploy("k2fleet: record of the host before k2fleet")
def keep(argv: list[str] | None) -> None:
    """
    Write the record when the HostState fact did not see it (the host program keeps an existing one too).

    + argv: :func:`k2fleet.planning.teardown.program_argv` ``record`` with this host's
      :func:`~k2fleet.planning.teardown.record_spec` when the record is missing
      (``role_actions(...).record``); None: the host holds it, no operation

    **Example:**

    .. code:: python

        record.keep(role_actions(dep, mine, fact, record_argv=program_argv("record", spec)).record)
    """
    if argv is not None:
        command(name="keep a record of the host before k2fleet's first change (for k2fleet down)", argv=argv)
