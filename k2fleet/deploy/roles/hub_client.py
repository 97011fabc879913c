"""Hub client role: huggingface_hub and k2fleet's downloader on the ``k2_checkpoint_fetcher`` host.

Only that one host talks to the Hub (or the mirror ``k2_hub_endpoint``); nothing
here runs on the others. The host gets no package index: the control machine's
wheelhouse (:mod:`k2fleet.control.wheelhouse`, made by the control-machine step) is uploaded
to ``/var/cache/k2fleet/wheelhouse`` and installed into ``/opt/k2fleet/hubenv`` with
``pip install --no-index``; k2fleet's downloader runs from the host archive with that venv's python.
Uploads compare checksums and the install runs only when the venv's check fails or a
wheel changed, so a no-op run changes nothing.
"""

from __future__ import annotations


from pyinfra.api import deploy

from k2fleet.planning.desired import HUB_CLIENT_CHECK, HUB_ENV, WHEEL_DIR, HostDesired
from k2fleet.deploy.operations import command, synced_files
from k2fleet.planning.host_fact import HostReport
from k2fleet.planning.quoting import shell_line, shell_word


@deploy("k2fleet: Hub client on the checkpoint fetcher")
def install(desired: HostDesired, fact: HostReport, requirement: str | None) -> None:
    """
    Upload the downloader and the wheels, then make the Hub-client venv if needed.

    + desired: this host's desired state (files of group ``hub_client``: empty unless
      this host is ``k2_checkpoint_fetcher``)
    + fact: this host's HostState (digests, the ``hub-client`` check)
    + requirement: ``huggingface_hub==VERSION`` to install (None: no fetcher host)

    **Example:**

    .. code:: python

        hub_client.install(run.desired[host.name], fact, "huggingface_hub==2.4.0")
    """
    files = desired.files.get("hub_client", {})
    upload = synced_files(name="Hub client: downloader and offline wheelhouse", files=files, current=fact.files)
    pip = shell_line([f"{HUB_ENV}/bin/pip", "install", "--quiet", "--no-index", "--find-links", WHEEL_DIR,
                      requirement or "huggingface_hub"])
    command(name=f"Hub client: venv {HUB_ENV} with {requirement or 'huggingface_hub'} (no package index)",
            argv=["sh", "-c", f"{shell_word(desired.python)} -m venv {HUB_ENV} && {pip}"],
            _if=lambda: bool(files) and (not fact.passed(HUB_CLIENT_CHECK) or upload.did_change()))
