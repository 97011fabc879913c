"""Mirrors as keys: the hosts' package sources and pip index, rendered from the inventory (pure).

- ``k2_os_mirror`` (+ ``k2_os_mirror_keyring``): the distribution's mirror as k2fleet's own
  source file, apt deb822 ``/etc/apt/sources.list.d/k2fleet-os.sources`` (suites and components
  from :data:`~k2fleet.planning.os_tables.MIRROR_LAYOUTS`) or dnf ``/etc/yum.repos.d/k2fleet-os.repo``,
  signed by the uploaded keyring or the distribution's own archive key; on Debian,
  ``k2_os_security_mirror`` adds a second stanza there for the separate security archive;
- ``k2_nvidia_repo`` (+ ``k2_nvidia_repo_keyring``): NVIDIA's CUDA repository at the mirror,
  ``<base>/<os>/<arch>/``, as ``k2fleet-nvidia.sources`` / ``k2fleet-nvidia.repo`` instead of
  NVIDIA's ``cuda-keyring`` package (which would point apt at NVIDIA's own URL);
- ``k2_container_toolkit_repo`` (+ ``_keyring``): the NVIDIA Container Toolkit's repository at the
  mirror (hosts that run containers on NVIDIA GPUs), ``<base>/stable/deb/<amd64|arm64>/`` (flat) as
  ``k2fleet-container-toolkit.sources`` or ``<base>/stable/rpm/<arch>/`` as
  ``k2fleet-container-toolkit.repo`` (metadata signed, packages not: ``repo_gpgcheck=1``,
  ``gpgcheck=0``, as NVIDIA's own ``.repo`` file), instead of the line naming ``nvidia.github.io``;
- ``k2_docker_repo`` (+ ``_keyring``): Docker CE's RHEL repository at the mirror
  (``<base>/$releasever/$basearch/stable``) as ``k2fleet-docker.repo``, instead of Docker's
  ``docker-ce.repo`` (RHEL-family hosts that run containers; Ubuntu and Debian take ``docker.io``
  from the distribution);
- ``k2_pypi_index``: ``--index-url`` of the hosts' venv installs and of the control machine's
  ``pip download`` (:mod:`k2fleet.control.wheelhouse`).

:mod:`k2fleet.planning.fetches` lists every place a host's plan fetches from (``k2fleet plan``,
``k2_egress: mirrors-only``).

Keyrings are files on the control machine; their bytes are read by the control step
(:mod:`k2fleet.control.artifacts`), the host paths are decided here.

>>> print(apt_sources("https://m.example/ubuntu", ("jammy", "jammy-updates"), "main universe", "/k.gpg"), end="")
# k2fleet: rendered from the inventory; edits are overwritten.
Types: deb
URIs: https://m.example/ubuntu
Suites: jammy jammy-updates
Components: main universe
Signed-By: /k.gpg
"""

from __future__ import annotations

from urllib.parse import urlsplit

from k2fleet.inventory.spec import HostSettings
from k2fleet.planning import os_tables as t

HEADER = "# k2fleet: rendered from the inventory; edits are overwritten.\n"
APT_SOURCES = "/etc/apt/sources.list.d/k2fleet-{name}.sources"
APT_KEYRING = "/etc/apt/keyrings/k2fleet-{name}{suffix}"
DNF_REPO = "/etc/yum.repos.d/k2fleet-{name}.repo"
DNF_KEY = "/etc/pki/rpm-gpg/RPM-GPG-KEY-k2fleet-{name}"
OS, NVIDIA, CTK, DOCKER = "os", "nvidia", "container-toolkit", "docker"
KEYRING_KEYS = {OS: "k2_os_mirror_keyring", NVIDIA: "k2_nvidia_repo_keyring",
                CTK: "k2_container_toolkit_repo_keyring", DOCKER: "k2_docker_repo_keyring"}
# the bootstrap's repository (host_bootstrap.Repo.name) each vendor mirror replaces → its settings field
REPO_MIRRORS = {"cuda": (NVIDIA, "nvidia_repo"), "nvidia-container-toolkit": (CTK, "container_toolkit_repo"),
                "docker-ce": (DOCKER, "docker_repo")}
DEFAULT_PYPI_HOST = "pypi.org"  # and files.pythonhosted.org, where PyPI serves the files
PYPI_FILES_HOST = "files.pythonhosted.org"
HUB_HOST = "huggingface.co"


def keyring_path(manager: str, name: str, control_path: str) -> str:
    """Where the keyring of mirror ``name`` (``os``/``nvidia``) lands on a host: apt takes
    binary ``.gpg`` or armored ``.asc`` by the suffix (the control file's), dnf an armored key.

    >>> keyring_path("apt", "os", "/srv/keys/corp.asc"), keyring_path("apt", "nvidia", "/srv/k/cuda.gpg")
    ('/etc/apt/keyrings/k2fleet-os.asc', '/etc/apt/keyrings/k2fleet-nvidia.gpg')
    >>> keyring_path("dnf", "os", "/srv/keys/corp.asc")
    '/etc/pki/rpm-gpg/RPM-GPG-KEY-k2fleet-os'
    """
    if manager == "dnf":
        return DNF_KEY.format(name=name)
    return APT_KEYRING.format(name=name, suffix=".asc" if control_path.endswith((".asc", ".pub")) else ".gpg")


def apt_sources(uri: str, suites: tuple[str, ...], components: str, signed_by: str) -> str:
    """A source file of one deb822 stanza (sources.list(5)); a flat repository has suite ``/`` and no components."""
    return HEADER + apt_stanza(uri, suites, components, signed_by)


def apt_stanza(uri: str, suites: tuple[str, ...], components: str, signed_by: str) -> str:
    """One deb822 stanza; stanzas of one file are separated by an empty line."""
    lines = ["Types: deb", f"URIs: {uri}", f"Suites: {' '.join(suites)}"]
    if components:
        lines.append(f"Components: {components}")
    lines.append(f"Signed-By: {signed_by}")
    return "\n".join(lines) + "\n"


def os_archives(mirror: str, security_mirror: str | None, layout: t.MirrorLayout) -> list[tuple[str, tuple[str, ...]]]:
    """(base URL, suites) of each archive of the distribution at its mirrors: ``k2_os_mirror``'s
    suites, and on Debian the separate security archive's at ``k2_os_security_mirror``; read by the
    hosts' source file and by ``k2fleet bundle`` (:mod:`k2fleet.control.airgap`).

    >>> os_archives("https://m/debian/", "https://m/debian-security", t.MIRROR_LAYOUTS["debian-12"])
    [('https://m/debian', ('bookworm', 'bookworm-updates')), ('https://m/debian-security', ('bookworm-security',))]
    """
    archives = [(mirror.rstrip("/"), layout.suites)]
    if security_mirror:
        archives.append((security_mirror.rstrip("/"), layout.security_suites))
    return archives


def security_archive_note(s: HostSettings, host_oses: set[str]) -> str | None:
    """The plan's note when Debian hosts read ``k2_os_mirror`` without ``k2_os_security_mirror``: k2fleet
    cannot see which security updates a host already took, so it cannot tell whether apt will find
    packages as new as those it holds (``k2fleet bundle`` resolves against the same archives).

    >>> s = HostSettings(model="m/x", revision="0" * 40, engine="vllm", gpu="h200", os_mirror="https://m/debian")
    >>> security_archive_note(s, {"debian-12"})[:58]
    'k2_os_mirror without k2_os_security_mirror: debian-12 host'
    >>> security_archive_note(s, {"ubuntu-22.04"}) is None
    True
    """
    debian = sorted(o for o in host_oses if t.MIRROR_LAYOUTS[o].security_suites)
    if not s.os_mirror or s.os_security_mirror or not debian:
        return None
    return (f"k2_os_mirror without k2_os_security_mirror: {', '.join(debian)} hosts and `k2fleet bundle` read no "
            "security archive, so a host that took Debian's security updates can hold packages newer than the "
            "mirror's, and apt cannot install those pinned to them (python3-venv); set k2_os_security_mirror "
            "to your mirror of https://security.debian.org/debian-security")


def dnf_repo(repos: list[tuple[str, str, str]], gpgkey: str, signed: str = "packages") -> str:
    """A dnf ``.repo`` file: (id, name, baseurl) sections, each gpg-checked with ``gpgkey``:
    its packages' signatures (``signed="packages"``) or its metadata's (``"metadata"``: the
    container toolkit's repository signs ``repomd.xml``, not its packages)."""
    checks = "gpgcheck=1\nrepo_gpgcheck=0\n" if signed == "packages" else "gpgcheck=0\nrepo_gpgcheck=1\n"
    out = HEADER
    for rid, name, url in repos:
        out += f"[{rid}]\nname={name}\nbaseurl={url}\nenabled=1\n{checks}gpgkey=file://{gpgkey}\n\n"
    return out.rstrip("\n") + "\n"


def nvidia_repo_url(s: HostSettings, table: t.OsTable, arch: str) -> str:
    """NVIDIA's CUDA repository for one OS and arch: at ``k2_nvidia_repo``, else NVIDIA's own.

    >>> from k2fleet.inventory.spec import HostSettings
    >>> s = HostSettings(model="m/x", revision="0" * 40, engine="vllm", gpu="h200",
    ...                  nvidia_repo="https://m.example/cuda/")
    >>> nvidia_repo_url(s, t.UBUNTU_2204, "x86_64")
    'https://m.example/cuda/ubuntu2204/x86_64/'
    """
    base = (s.nvidia_repo or t.NVIDIA_REPO_BASE).rstrip("/")
    return f"{base}/{table.cuda_repo}/{arch}/"


def ctk_repo_url(s: HostSettings, table: t.OsTable, arch: str) -> str:
    """The container toolkit's repository for one OS family and arch: at
    ``k2_container_toolkit_repo``, else NVIDIA's own.

    >>> from k2fleet.inventory.spec import HostSettings
    >>> s = HostSettings(model="m/x", revision="0" * 40, engine="vllm", gpu="h200",
    ...                  container_toolkit_repo="https://m.example/libnvidia-container")
    >>> ctk_repo_url(s, t.UBUNTU_2404, "sbsa"), ctk_repo_url(s, t.RHEL_9, "x86_64")
    ('https://m.example/libnvidia-container/stable/deb/arm64/', 'https://m.example/libnvidia-container/stable/rpm/x86_64/')
    """
    base = (s.container_toolkit_repo or t.CTK_REPO_BASE).rstrip("/")
    if table.manager == "dnf":
        return f"{base}/stable/rpm/{t.DNF_ARCH[arch]}/"
    return f"{base}/stable/deb/{t.DEB_ARCH[arch]}/"


def docker_repo_url(s: HostSettings) -> str:
    """Docker CE's RHEL repository (dnf expands ``$releasever`` and ``$basearch``): at
    ``k2_docker_repo``, else Docker's own.

    >>> from k2fleet.inventory.spec import HostSettings
    >>> docker_repo_url(HostSettings(model="m/x", revision="0" * 40, engine="vllm", gpu="h200",
    ...                              docker_repo="https://m.example/docker-ce/rhel/"))
    'https://m.example/docker-ce/rhel/$releasever/$basearch/stable'
    """
    return f"{(s.docker_repo or t.DOCKER_RHEL_BASE).rstrip('/')}/$releasever/$basearch/stable"


def mirror_files(s: HostSettings, os_name: str, arch: str, nvidia: bool, container: bool = False) -> dict[str, str]:
    """path → text of k2fleet's source files for one host (``nvidia``: it gets NVIDIA's
    CUDA repository; ``container``: it gets Docker, and with ``nvidia`` the container
    toolkit); empty without mirror keys."""
    table = t.OS_TABLES[os_name]
    layout = t.MIRROR_LAYOUTS[os_name]
    files: dict[str, str] = {}
    if s.os_mirror:
        base = s.os_mirror.rstrip("/")
        key = keyring_path(table.manager, OS, s.os_mirror_keyring) if s.os_mirror_keyring else layout.archive_key
        if table.manager == "apt":  # Debian's security archive: same key (refused for other OSes: deployment)
            files[APT_SOURCES.format(name=OS)] = HEADER + "\n".join(
                apt_stanza(url, suites, layout.components, key)
                for url, suites in os_archives(s.os_mirror, s.os_security_mirror, layout))
        else:
            dnf_arch = t.DNF_ARCH[arch]
            files[DNF_REPO.format(name=OS)] = dnf_repo(
                [(f"k2fleet-os-{rid}", f"{os_name} {rid} (k2_os_mirror)", f"{base}/{path.format(arch=dnf_arch)}")
                 for rid, path in layout.repos], key)
    if s.nvidia_repo and nvidia:
        assert s.nvidia_repo_keyring is not None  # k2fleet.planning.deployment refuses one without the other
        url = nvidia_repo_url(s, table, arch)
        key = keyring_path(table.manager, NVIDIA, s.nvidia_repo_keyring)
        if table.manager == "apt":
            files[APT_SOURCES.format(name=NVIDIA)] = apt_sources(url, ("/",), "", key)
        else:
            files[DNF_REPO.format(name=NVIDIA)] = dnf_repo([("k2fleet-cuda", f"CUDA {table.cuda_repo} (k2_nvidia_repo)", url)], key)
    if s.container_toolkit_repo and container and nvidia:
        assert s.container_toolkit_repo_keyring is not None  # refused without it (k2fleet.planning.deployment)
        url = ctk_repo_url(s, table, arch)
        key = keyring_path(table.manager, CTK, s.container_toolkit_repo_keyring)
        if table.manager == "apt":
            files[APT_SOURCES.format(name=CTK)] = apt_sources(url, ("/",), "", key)
        else:
            files[DNF_REPO.format(name=CTK)] = dnf_repo(
                [("k2fleet-container-toolkit", "NVIDIA Container Toolkit (k2_container_toolkit_repo)", url)], key,
                signed="metadata")
    if s.docker_repo and container and table.docker_repo:  # Docker CE's own repository (RHEL family)
        assert s.docker_repo_keyring is not None
        files[DNF_REPO.format(name=DOCKER)] = dnf_repo(
            [("k2fleet-docker-ce", "Docker CE stable (k2_docker_repo)", docker_repo_url(s))],
            keyring_path(table.manager, DOCKER, s.docker_repo_keyring))
    return files


def keyring_files(s: HostSettings, manager: str, nvidia: bool, container: bool = False,
                  docker_repo: bool = False) -> dict[str, tuple[str, str]]:
    """host path → (inventory key, control-machine path) of the keyrings a host gets
    (``docker_repo``: its Docker comes from Docker's repository, not the distribution)."""
    out = {}
    wanted = [(OS, s.os_mirror, s.os_mirror_keyring, True), (NVIDIA, s.nvidia_repo, s.nvidia_repo_keyring, nvidia),
              (CTK, s.container_toolkit_repo, s.container_toolkit_repo_keyring, container and nvidia),
              (DOCKER, s.docker_repo, s.docker_repo_keyring, container and docker_repo)]
    for name, mirror, keyring, needed in wanted:
        if mirror and keyring and needed:
            out[keyring_path(manager, name, keyring)] = (KEYRING_KEYS[name], keyring)
    return out


def repo_keyrings(s: HostSettings) -> dict[str, str]:
    """The bootstrap repository name (``cuda``, ``nvidia-container-toolkit``, ``docker-ce``) →
    the control-machine keyring of its mirror, for those at a mirror (``k2fleet bundle`` reads
    them there)."""
    return {repo: getattr(s, f"{field}_keyring") for repo, (_, field) in REPO_MIRRORS.items()
            if getattr(s, field) and getattr(s, f"{field}_keyring")}


def pip_index_args(s: HostSettings) -> list[str]:
    """``--index-url URL`` of ``k2_pypi_index`` (empty: pip's own configuration).

    >>> from k2fleet.inventory.spec import HostSettings
    >>> pip_index_args(HostSettings(model="m/x", revision="0" * 40, engine="vllm", gpu="h200",
    ...                             pypi_index="https://pypi.corp/simple"))
    ['--index-url', 'https://pypi.corp/simple']
    """
    return ["--index-url", s.pypi_index] if s.pypi_index else []


def url_host(url: str) -> str:
    """The host name of a URL or of an apt line's URL (``deb [..] https://h/x /``)."""
    word = next((w for w in url.split() if "://" in w), url)
    return (urlsplit(word).hostname or "").lower()
