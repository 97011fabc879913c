"""Preflight role: refuse, before any change, a host that cannot run its part of the
plan (GPUs on the PCI bus, disk at ``k2_model_dir``, RAM, /dev/shm, ``k2_nic``,
``k2_ib_hcas``, fleet address) or that the bootstrap must not touch (OS release other
than ``k2_os``, Secure Boot without an enrolled key), or whose provided GPU stack cannot serve
(``k2_gpu_stack: provided``: the loaded driver against the engine's CUDA build, the fabric
manager, toolkit, Docker and kernel modules; :func:`~k2fleet.planning.host_bootstrap.provided_problems`). The driver, its module and the
NVLink fabric are checked by the bootstrap's GPU gate, after it installed them. Sandbox inventories declare simulated GPUs; production ones never can.
"""

from __future__ import annotations

from pyinfra.api import deploy

from k2fleet.planning.host_bootstrap import bootstrap_problems, provided_problems
from k2fleet.planning.deployment import Deployment
from k2fleet.planning.desired import CHECKPOINT_CHECK, HostDesired
from k2fleet.planning.host_fact import HostReport
from k2fleet.planning.preflight_checks import check_host


class PreflightError(Exception):
    """A host cannot run its part of the plan."""


@deploy("k2fleet: preflight")
def check(dep: Deployment, desired: HostDesired, fact: HostReport) -> None:
    """
    Stop the deploy, naming the host and every reason, if this host cannot run its part.

    + dep: the validated deployment (``k2fleet.deploy.fleet_run.FleetRun.dep``)
    + desired: this host's desired state (its name picks its inventory entry)
    + fact: this host's :class:`~k2fleet.deploy.facts.HostState`

    **Example:**

    .. code:: python

        preflight.check(run.dep, run.desired[host.name], fact)
    """
    entry = next(h for h in dep.fleet.hosts if h.name == desired.name)
    problems = check_host(dep, entry, fact, checkpoint_present=fact.passed(CHECKPOINT_CHECK))
    if desired.bootstrap is not None:
        problems += bootstrap_problems(desired.bootstrap, fact.boot)
        problems += provided_problems(desired.bootstrap, fact)  # k2_gpu_stack: provided
    if problems:
        raise PreflightError(f"{desired.name}: preflight failed: " + "; ".join(problems))
