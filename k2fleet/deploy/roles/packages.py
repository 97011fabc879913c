"""Host packages from the network (apt) or from an offline bundle (air-gapped).

The bundle path ships the :mod:`k2fleet.control.deb_bundles` tar that the control-machine step
(:func:`k2fleet.control.artifacts.prepare_control_artifacts`) built, and serves it to apt
as a flat ``file:`` repository.  apt is always restricted to that one source,
so an air-gapped host never tries the network.

Every step is gated so that a run with nothing to do executes no command on
the hosts: the upload compares checksums, extraction and ``apt-get update`` run
only when their inputs changed (``_if=`` is evaluated at execution time) or
when something is missing, and ``apt.packages`` installs only what is absent.
"""

from __future__ import annotations

import io
from pathlib import Path

from pyinfra.api import deploy
from pyinfra.operations import apt, files, server

from k2fleet.planning.host_packages import BUNDLE_LIST, REMOTE_TAR_DIR, bundle_apt_options, bundle_repo_dir
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


def _base_name(spec: str) -> str:
    """Package name of an apt spec (``name``, ``name=version``, ``name:arch``)."""
    return spec.split("=", 1)[0].split(":", 1)[0]


def _install_from_bundle(packages: list[str], bundle: str, refresh: bool, have_repo: bool, installed: list[str]) -> None:
    """Ship, index and install the offline bundle ``bundle`` for ``packages`` (what is
    missing, and whether the bundle is extracted already, from the HostState fact)."""
    from k2fleet.control.deb_bundles import key_of  # the bundle path only (its module: tarfile, ...)

    tar = Path(bundle)
    key = key_of(tar)
    remote_tar = f"{REMOTE_TAR_DIR}/{tar.name}"
    repo_dir = bundle_repo_dir(tar.name)
    apt_options = bundle_apt_options()
    missing = [p for p in packages if _base_name(p) not in installed]

    upload = files.put(
        name=f"Upload package bundle {key}",
        src=str(tar),
        dest=remote_tar,
        mode="644",
    )
    extract = server.shell(
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
    server.shell(
        name="Update apt lists (bundle source only)",
        commands=[f"DEBIAN_FRONTEND=noninteractive apt-get -q update {apt_options}"],
        _if=lambda: extract.did_change() or source_list.did_change() or bool(missing) or refresh,
    )
    if not missing:
        return
    apt.packages(
        name="Install packages from the bundle",
        packages=packages,
        no_recommends=True,
        extra_install_args=apt_options,
    )


@deploy("k2fleet: package sources")
def package_sources(files: dict, current: dict) -> None:
    """
    Write k2fleet's source files for the declared mirrors and their keyrings
    (``desired.files["package_sources"]``, :mod:`k2fleet.planning.mirrors`) before any
    package is installed; apt/dnf read them at the next index refresh.

    + files: path → :class:`~k2fleet.planning.desired.FileSpec`
    + current: sha256 per path as the HostState fact saw it

    **Example:**

    .. code:: python

        package_sources(mine.files["package_sources"], fact.files)
    """
    synced_files(name="package sources: the declared mirrors and their keyrings", files=files, current=current)


@deploy("k2fleet: host packages")
def install_packages(packages: list[str], source: str = "bundle", installed: list[str] | None = None,
                     bundle: str | None = None, bootstrap_pending: bool = False, have_repo: bool = False) -> None:
    """
    Install Debian packages on the hosts, online or from an offline bundle.

    + packages: Debian package names (``name`` or ``name=version``)
    + source: ``"apt"`` to install from the hosts' own apt sources (network),
      ``"bundle"`` to ship the full dependency closure from the control machine
      and install it with apt restricted to that bundle (air-gapped hosts)
    + installed: packages already known to be installed (e.g. from k2fleet's
      HostState fact); when it covers ``packages`` nothing is planned at all, so a
      settled host costs no extra round trip
    + bundle: path of the bundle tar on the control machine (source ``bundle``),
      made by the control-machine step; None under ``--dry`` before it exists
    + have_repo: the HostState fact saw this bundle extracted on the host already
      (``HostDesired.bundle_repo``)
    + bootstrap_pending: the bootstrap will install packages from the bundle, so it is
      shipped and indexed even when ``packages`` are all installed

    Bundle:
        The bundle (built or reused from ``/var/cache/k2fleet/bundles`` on the
        control machine by the control-machine step) is uploaded to ``/var/cache/k2fleet/bundle-<key>.tar``,
        extracted to ``/var/lib/k2fleet/apt-bundle/<key>/`` and listed in
        ``/etc/apt/sources.list.d/k2fleet-bundle.list``. A second run with
        everything in place executes no command.

    **Example:**

    .. code:: python

        from k2fleet.deploy.roles.packages import install_packages

        install_packages(
            ["openmpi-bin", "rsync", "python3-venv", "python3-mpi4py"],
            source="bundle",
            bundle="/var/cache/k2fleet/bundles/bundle-3f1c.tar",
        )
    """
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    settled = not packages or (installed is not None and {_base_name(p) for p in packages} <= set(installed))
    if settled and not (bootstrap_pending and source == "bundle"):
        return
    if source == "apt":
        apt.packages(
            name="Install packages (apt)",
            packages=packages,
            update=True,
            no_recommends=True,
        )
        return
    if bundle is None:
        command(name="install packages from the offline bundle (built by the control-machine step)",
                argv=["true"])
        return
    _install_from_bundle([] if settled else packages, bundle, bootstrap_pending, have_repo, list(installed or []))
