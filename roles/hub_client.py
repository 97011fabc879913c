"""Hub client role: huggingface_hub and k2fleet's downloader on the ``k2_checkpoint_fetcher`` host.

Only that one host talks to the Hub (or the mirror ``k2_hub_endpoint``); nothing
here runs on the others. The host gets no package index: the control machine's
:mod:`k2fleet.wheelhouse` (huggingface_hub at the control machine's own version and
its dependencies, as wheels) is uploaded to ``/var/cache/k2fleet/wheelhouse`` and
installed into ``/opt/k2fleet/hubenv`` with ``pip install --no-index``, next to
k2fleet's stdlib-plus-huggingface_hub downloader in ``/opt/k2fleet/lib/py``
(``python -m k2fleet.checkpoint.download``). Uploads compare checksums and the
install runs only when the venv's check fails or a wheel changed, so a no-op run
changes nothing.

.. code:: python

    from roles import hub_client
    hub_client.install()
"""

from __future__ import annotations

import os
from functools import lru_cache

from pyinfra import host
from pyinfra.api import deploy

from k2fleet import wheelhouse
from k2fleet.units import LIB_DIR
from roles.context import REPO, FleetContext, fleet
from roles.ops import command, synced_files
from roles.state import report

HUB_ENV = "/opt/k2fleet/hubenv"
WHEEL_DIR = "/var/cache/k2fleet/wheelhouse"
PY_LIB = f"{LIB_DIR}/py"
CHECK = "hub-client"
DOWNLOADER = ("k2fleet/__init__.py", "k2fleet/checkpoint/__init__.py", "k2fleet/checkpoint/verify.py",
              "k2fleet/checkpoint/manifest.py", "k2fleet/checkpoint/download.py")


def is_fetcher(ctx: FleetContext) -> bool:
    return ctx.dep.s.checkpoint_fetcher == host.name


@lru_cache(maxsize=1)
def _wheels() -> dict[str, bytes]:
    return wheelhouse.wheel_files(wheelhouse.ensure_wheelhouse())


def desired_files(ctx: FleetContext) -> dict[str, tuple[bytes, str]]:
    if not is_fetcher(ctx):
        return {}
    files = {f"{PY_LIB}/{rel}": ((REPO / rel).read_bytes(), "644") for rel in DOWNLOADER}
    files |= {f"{WHEEL_DIR}/{name}": (data, "644") for name, data in _wheels().items()}
    return files


def checks(ctx: FleetContext) -> dict[str, list[str]]:
    if not is_fetcher(ctx):
        return {}
    want = wheelhouse.hub_client_requirement().split("==", 1)[1]
    return {CHECK: [f"{HUB_ENV}/bin/python", "-c",
                    f"import sys, huggingface_hub as h; sys.exit(h.__version__ != {want!r})"]}


def download_argv(ctx: FleetContext, token_file: str | None) -> list[str]:
    """The Hub download on the fetcher host (token by file path only, never its value)."""
    s = ctx.dep.s
    argv = ["env", f"PYTHONPATH={PY_LIB}", "HF_HUB_DISABLE_TELEMETRY=1", "HF_HUB_DISABLE_PROGRESS_BARS=1"]
    if s.hub_endpoint:
        argv.append(f"HF_ENDPOINT={s.hub_endpoint}")
    if os.environ.get("HF_HUB_DISABLE_XET"):  # the operator's choice of the resumable HTTP path
        argv.append("HF_HUB_DISABLE_XET=1")
    argv += [f"{HUB_ENV}/bin/python", "-m", "k2fleet.checkpoint.download", s.model, "--revision", s.revision,
             "--dir", ctx.dep.checkpoint_path]
    return argv + (["--token-file", token_file] if token_file else [])


@deploy("k2fleet: Hub client on the checkpoint fetcher")
def install() -> None:
    ctx = fleet()
    files = desired_files(ctx)
    upload = synced_files(name="Hub client: downloader and offline wheelhouse", files=files, current=report().files)
    want = wheelhouse.hub_client_requirement()
    pip = f"{HUB_ENV}/bin/pip install --quiet --no-index --find-links {WHEEL_DIR} {want}"
    command(name=f"Hub client: venv {HUB_ENV} with {want} (no package index)",
            argv=["sh", "-c", f"python3 -m venv {HUB_ENV} && {pip}"],
            _if=lambda: is_fetcher(ctx) and (not report().passed(CHECK) or upload.did_change()))
