"""Host packages from the network (apt) or from an offline bundle (air-gapped).

The bundle path ships the :mod:`k2fleet.control.deb_bundles` tar that the control-machine step
(:func:`k2fleet.control.artifacts.prepare_control_artifacts`) built, and serves it to apt
as a flat ``file:`` repository.  apt is always restricted to that one source,
so an air-gapped host never tries the network.

Nothing is planned when the record says no package is missing (and the bootstrap installs
none from the bundle); otherwise pyinfra's own operations: ``files.put`` compares the bundle
with the host's copy, extraction and ``apt-get update`` run only when their inputs changed
(``_if=``: the upload's outcome, at execution time) or something is missing, and
``apt.packages`` installs only what is absent.
"""

from __future__ import annotations

import io
from pathlib import Path

from pyinfra.api import deploy
from pyinfra.operations import apt, files, server

from k2fleet.planning.host_packages import BUNDLE_LIST, REMOTE_TAR_DIR, bundle_apt_options, bundle_repo_dir
from k2fleet.planning.role_actions import PackagesActions
from k2fleet.deploy.operations import command, synced_files

SOURCES = ("apt", "bundle")
def bundle_source_line(repo_dir: str) -> str:
    """The one-line apt source for an extracted bundle in ``repo_dir``."""
    return f"deb [trusted=yes] file:{repo_dir} ./\n"


def extract_command(tar: str, repo_dir: str) -> str:
    """Shell command unpacking ``tar`` into ``repo_dir``: into ``repo_dir.tmp`` first, then the old
    directory is removed and the new one moved into place (a failed unpack leaves the old one;
    not atomic: between the ``rm`` and the ``mv`` there is no ``repo_dir``)."""
    tmp = f"{repo_dir}.tmp"
    return (f"rm -rf {tmp} && mkdir -p {tmp} && tar -xf {tar} -C {tmp} && "
            f"rm -rf {repo_dir} && mv {tmp} {repo_dir}")


def _install_from_bundle(actions: PackagesActions, bundle: str) -> None:
    """Ship, index and install the offline bundle ``bundle`` (what is missing, and whether the
    bundle is extracted already, from the record)."""
    from k2fleet.control.deb_bundles import key_of  # the bundle path only (its module: tarfile, ...)

    tar = Path(bundle)
    key = key_of(tar)
    remote_tar = f"{REMOTE_TAR_DIR}/{tar.name}"
    repo_dir = bundle_repo_dir(tar.name)
    apt_options = bundle_apt_options()
    upload = files.put(
        name=f"Upload package bundle {key}",
        src=str(tar),
        dest=remote_tar,
        mode="644",
    )
    have_repo = actions.have_repo
    extract = server.shell(  # pyinfra's files.put compared the tar with the host's: only then, or when never extracted
        name=f"Extract package bundle {key}",
        commands=[extract_command(remote_tar, repo_dir)],
        _if=lambda: upload.did_change() or not have_repo,
    )
    source_list = files.put(
        name="Point apt at the package bundle",
        src=io.StringIO(bundle_source_line(repo_dir)),
        dest=BUNDLE_LIST,
        mode="644",
    )
    index = bool(actions.missing) or actions.refresh
    server.shell(
        name="Update apt lists (bundle source only)",
        commands=[f"DEBIAN_FRONTEND=noninteractive apt-get -q update {apt_options}"],
        _if=lambda: index or extract.did_change() or source_list.did_change(),
    )
    if actions.missing:
        apt.packages(
            name="Install packages from the bundle",
            packages=list(actions.install),
            no_recommends=True,
            extra_install_args=apt_options,
        )


@deploy("k2fleet: package sources")
def package_sources(files: dict) -> None:
    """
    Write k2fleet's source files for the declared mirrors and their keyrings
    (``desired.files["package_sources"]``, :mod:`k2fleet.planning.mirrors`) before any
    package is installed; apt/dnf read them at the next index refresh.

    + files: path → :class:`~k2fleet.planning.desired.FileSpec`, those whose digest the
      HostState fact did not see (``role_actions(...).packages.sources``)

    **Example:**

    .. code:: python

        package_sources(actions.packages.sources)
    """
    if files:
        synced_files(name="package sources: the declared mirrors and their keyrings", files=files)


@deploy("k2fleet: host packages")
def install(actions: PackagesActions, bundle: str | None = None) -> None:
    """
    Install the host's Debian packages, online or from an offline bundle.

    + actions: this host's packages record (``role_actions(...).packages``): an install dpkg
      did not finish (finished first, ``dpkg --configure -a``), the packages, those missing,
      the source (``apt``: the hosts' own apt sources; ``bundle``: the full
      dependency closure shipped from the control machine, apt restricted to it), whether the
      bundle is shipped (packages missing, or the bootstrap installs from it) and extracted
      already; nothing is planned when no package is missing and the bootstrap needs none
    + bundle: path of the bundle tar on the control machine (source ``bundle``),
      made by the control-machine step; None under ``--dry`` before it exists

    Bundle:
        The bundle (built or reused from ``/var/cache/k2fleet/bundles`` on the
        control machine by the control-machine step) is uploaded to ``/var/cache/k2fleet/bundle-<key>.tar``,
        extracted to ``/var/lib/k2fleet/apt-bundle/<key>/`` and listed in
        ``/etc/apt/sources.list.d/k2fleet-bundle.list``. A second run with
        everything in place executes no command.

    **Example:**

    .. code:: python

        from k2fleet.deploy.roles.packages import install

        install(role_actions(dep, desired, fact).packages,
                bundle="/var/cache/k2fleet/bundles/bundle-3f1c.tar")
    """
    if actions.source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {actions.source!r}")
    if actions.finish_dpkg:  # apt refuses every install until dpkg has finished the interrupted one
        command(name="finish the install a reboot or crash interrupted (dpkg --configure -a)",
                argv="DEBIAN_FRONTEND=noninteractive dpkg --force-confold --configure -a")
    if actions.source == "apt":
        if actions.missing:
            apt.packages(name="Install packages (apt)", packages=list(actions.install), update=True,
                         no_recommends=True)
        return
    if not actions.ship_bundle:
        return
    if bundle is None:
        command(name="install packages from the offline bundle (built by the control-machine step)",
                argv=["true"])
        return
    _install_from_bundle(actions, bundle)
