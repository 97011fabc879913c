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

from k2fleet.planning.role_actions import PreflightActions


class PreflightError(Exception):
    """A host cannot run its part of the plan."""


@deploy("k2fleet: preflight")
def check(actions: PreflightActions) -> None:
    """
    Stop the deploy, naming the host and every reason, if this host cannot run its part.

    + actions: this host's preflight record (``role_actions(...).preflight``: the problems
      :func:`~k2fleet.planning.preflight_checks.check_host`, ``bootstrap_problems`` and
      ``provided_problems`` found in its HostState fact)

    **Example:**

    .. code:: python

        preflight.check(role_actions(run.dep, run.desired[host.name], fact).preflight)
    """
    if actions.problems:
        raise PreflightError(f"{actions.host}: preflight failed: " + "; ".join(actions.problems))
