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

from k2fleet.planning.desired import HUB_ENV, WHEEL_DIR
from k2fleet.deploy.operations import command, synced_files
from k2fleet.planning.quoting import shell_line, shell_word
from k2fleet.planning.role_actions import HubClientActions


@deploy("k2fleet: Hub client on the checkpoint fetcher")
def install(actions: HubClientActions, requirement: str | None) -> None:
    """
    Upload the downloader and the wheels, then make the Hub-client venv if needed.

    + actions: this host's record (``role_actions(...).hub_client``: the files of group
      ``hub_client`` to write, empty unless this host is ``k2_checkpoint_fetcher``; whether the
      venv is made: its check failed or a wheel changed)
    + requirement: ``huggingface_hub==VERSION`` to install (None: no fetcher host)

    **Example:**

    .. code:: python

        hub_client.install(role_actions(run.dep, mine, fact).hub_client, "huggingface_hub==2.4.0")
    """
    if actions.files:
        synced_files(name="Hub client: downloader and offline wheelhouse", files=actions.files)
    if actions.install:
        pip = shell_line([f"{HUB_ENV}/bin/pip", "install", "--no-compile", "--quiet", "--no-index", "--find-links",
                          WHEEL_DIR, requirement or "huggingface_hub"])
        command(name=f"Hub client: venv {HUB_ENV} with {requirement or 'huggingface_hub'} (no package index)",
                argv=["sh", "-c", f"{shell_word(actions.python)} -m venv {HUB_ENV} && {pip}"])
