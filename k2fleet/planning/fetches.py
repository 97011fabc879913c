"""Where each host fetches from, and the ports it listens on and opens: the network team's
list (``k2fleet plan``; ``network`` in ``plan --json``) and what a closed plan may reach (pure).

:func:`host_fetches` lists, per host, every place its plan fetches from, each a :class:`Fetch`
naming the inventory key that decides the place and whether the inventory set it (a declared
mirror, index or registry) or left the vendor's default:

- ``k2_package_source: apt``: the distribution (``k2_os_mirror``, on Debian with
  ``k2_os_security_mirror``, else the hosts' own sources, which k2fleet does not read); the repositories of the host's bootstrap
  (:func:`k2fleet.planning.host_bootstrap.bootstrap_plan`): NVIDIA's CUDA repository
  (``k2_nvidia_repo``), where the host runs containers the container toolkit's
  (``k2_container_toolkit_repo``) and, RHEL family, Docker CE's (``k2_docker_repo``), AMD's
  (no mirror key), and the key files those name;
- the engine venv's package index (``k2_pypi_index``, else PyPI and its file host), on hosts
  that install the venv (venv runtime, no ``k2_bundle``);
- the Hub, on the checkpoint fetcher host (``k2_hub_endpoint``, else huggingface.co);
- the image registry of the engine's image (``k2_image``) and of dcgm-exporter's
  (``k2_gpu_exporter_image``), on hosts that pull them (no ``k2_bundle``).

A plan is closed with ``k2_egress: mirrors-only`` or ``k2_bundle``: :func:`refusal` is the
first fetch of a closed plan the inventory did not declare (the key that sends a host
outside, and the fix), which the inventory gate refuses in one line.

:func:`k2fleet.planning.firewall.format_network` and :func:`~k2fleet.planning.firewall.network_json`
add each host's ports, in and out.

>>> Fetch("https://mirror.corp:8443/ubuntu", "apt: the distribution", "k2_os_mirror", True).target
'mirror.corp:8443/tcp'
>>> registry_url("registry.corp:5000/vllm/vllm-openai:v1"), registry_url("vllm/vllm-openai:v1")
('https://registry.corp:5000', 'https://registry-1.docker.io')
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

from k2fleet.inventory.spec import SpecError
from k2fleet.planning import mirrors
from k2fleet.planning import os_tables as t
from k2fleet.planning.deployment import Deployment

DOCKER_HUB = "https://registry-1.docker.io"
HUB = "https://huggingface.co"
PYPI = "https://pypi.org/simple"
PYPI_FILES = "https://files.pythonhosted.org"
OWN_SOURCES = ""  # the hosts' own apt/dnf sources: k2fleet does not know their URLs
# bootstrap repository name → (the key that puts it at a mirror, what it is, the fix)
REPO_KEYS = {
    "cuda": ("k2_nvidia_repo", "NVIDIA's CUDA repository",
             "set k2_nvidia_repo and k2_nvidia_repo_keyring to your mirror of it"),
    "nvidia-container-toolkit": ("k2_container_toolkit_repo", "the NVIDIA Container Toolkit's repository",
                                 "set k2_container_toolkit_repo and k2_container_toolkit_repo_keyring to your mirror of it"),
    "docker-ce": ("k2_docker_repo", "Docker CE's repository",
                  "set k2_docker_repo and k2_docker_repo_keyring to your mirror of it"),
    "amdgpu": ("k2_package_source", "AMD's amdgpu repository",
               "it has no mirror key: use k2_package_source: bundle with k2_bundle"),
}
FETCH_KINDS = ("apt", "apt-keyring-deb", "dnf-repo", "dnf-baseurl", "k2fleet-file")  # the others fetch nothing


@dataclass(frozen=True)
class Fetch:
    """One place a host fetches from: ``url`` (empty: the hosts' own sources, unknown to
    k2fleet), what it is, the inventory key that decides it, whether the inventory set that
    key (``declared``: a mirror, index or registry of the inventory's) and how to declare one."""

    url: str
    what: str
    key: str
    declared: bool
    fix: str = ""

    @property
    def host(self) -> str:
        return _host_port(self.url)[0]

    @property
    def port(self) -> int | None:
        return _host_port(self.url)[1]

    @property
    def target(self) -> str:
        """``host:port/tcp`` (a bracketed IPv6 host), what a network team opens."""
        host = self.host
        return f"{f'[{host}]' if ':' in host else host}:{self.port}/tcp" if host else "unknown"

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url or None, "host": self.host or None, "port": self.port, "what": self.what,
                "key": self.key, "declared": self.declared}


@lru_cache(maxsize=256)
def _host_port(url: str) -> tuple[str, int | None]:
    """A URL's host name and port, parsed once (every host of a fleet fetches from the same few)."""
    if not url:
        return "", None
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    return mirrors.url_host(url), port or {"https": 443, "http": 80}.get(parts.scheme)


def registry_url(image: str) -> str:
    """The registry an image reference is pulled from (Docker Hub without one), as a URL."""
    first, slash, _ = image.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost") and first not in (
            "docker.io", "index.docker.io", "registry-1.docker.io"):
        return f"https://{first}"
    return DOCKER_HUB


def _repo_fetches(repo: Any, arch: str) -> list[Fetch]:
    if repo.kind not in FETCH_KINDS:
        return []
    key, what, fix = REPO_KEYS.get(repo.name, ("k2_package_source", f"repository {repo.name}", ""))
    declared = repo.kind == "k2fleet-file"
    word = next((w for w in repo.source.split() if "://" in w), repo.source)
    out = [Fetch(word.replace("$(ARCH)", t.DEB_ARCH.get(arch, arch)), f"packages: {what}", key, declared, fix)]
    if repo.key and "://" in repo.key:  # the repository's key, fetched from its URL
        out.append(Fetch(repo.key, f"packages: {what}'s key", key, declared, fix))
    return out


def host_fetches(dep: Deployment) -> dict[str, tuple[Fetch, ...]]:
    """Host name → every place its plan fetches from (inventory order; see the module doc)."""
    from k2fleet.planning import gpu_exporter, host_bootstrap

    s = dep.s
    hub = any(ws.source == "hub" for ws in dep.weight_sets)
    repos: dict[tuple[str, bool, bool], list[Fetch]] = {}  # a host's repositories depend on its OS, GPUs and Docker only
    out: dict[str, tuple[Fetch, ...]] = {}
    for h in dep.fleet.hosts:
        found: list[Fetch] = []
        exporter = gpu_exporter.runs_on(dep, h.settings.role)
        docker = dep.runtime == "container" or exporter
        if s.package_source == "apt":
            found.append(Fetch(s.os_mirror, "packages: the distribution", "k2_os_mirror", True)
                         if s.os_mirror else
                         Fetch(OWN_SOURCES, "packages: the distribution, from the hosts' own apt/dnf sources",
                               "k2_os_mirror", False,
                               "set k2_os_mirror to your distribution mirror (or k2_package_source: bundle)"))
            if s.os_security_mirror:
                found.append(Fetch(s.os_security_mirror, "packages: the distribution's security archive",
                                   "k2_os_security_mirror", True))
            sig = (t.host_os(h), host_bootstrap.host_needs_gpu_stack(h), docker)
            if sig not in repos:
                boot = host_bootstrap.bootstrap_plan(dep, h, docker=docker)
                repos[sig] = [f for repo in boot.repos for f in _repo_fetches(repo, boot.arch)]
            found += repos[sig]
        if dep.runtime == "venv" and s.bundle is None and not s.simulated_gpus:
            fix = "set k2_pypi_index to your index (or ship the wheels in k2_bundle)"
            found += ([Fetch(s.pypi_index, "the engine venv's packages", "k2_pypi_index", True)]
                      if s.pypi_index else
                      [Fetch(PYPI, "the engine venv's packages: PyPI", "k2_pypi_index", False, fix),
                       Fetch(PYPI_FILES, "the engine venv's packages: PyPI's files", "k2_pypi_index", False, fix)])
        if hub and s.checkpoint_fetcher == h.name:
            found.append(Fetch(s.hub_endpoint, "the checkpoint: the Hub", "k2_hub_endpoint", True)
                         if s.hub_endpoint else
                         Fetch(HUB, "the checkpoint: the Hub, and the CDN hosts it redirects to", "k2_hub_endpoint", False,
                               "set k2_hub_endpoint to your Hub mirror (or k2_checkpoint_fetcher: control)"))
        if dep.runtime == "container" and s.bundle is None and not s.engine_doubles and dep.image:
            hub_cdn = " (Docker Hub: its layers come from CDN hosts)" if registry_url(dep.image) == DOCKER_HUB else ""
            found.append(Fetch(registry_url(dep.image), f"the engine's image {dep.image}{hub_cdn}", "k2_image",
                               s.image is not None,
                               "set k2_image to the image on your registry (or ship images in k2_bundle)"))
        if exporter and s.bundle is None and not s.simulated_gpus:
            found.append(Fetch(registry_url(s.gpu_exporter_image), f"dcgm-exporter's image {s.gpu_exporter_image}",
                               "k2_gpu_exporter_image", "gpu_exporter_image" in s.model_fields_set,
                               "set k2_gpu_exporter_image to the image on your registry (or ship it in k2_bundle)"))
        out[h.name] = tuple(dict.fromkeys(found))
    return out


def closed(dep: Deployment) -> str | None:
    """What closes the plan to all but the fleet and its declared mirrors (None: open)."""
    if dep.s.egress == "mirrors-only":
        return "k2_egress: mirrors-only"
    if dep.s.bundle is not None:
        return "k2_bundle"
    return None


def refusal(dep: Deployment) -> SpecError | None:
    """The first fetch a closed plan would make outside the fleet and the inventory's declared
    mirrors, as the one-line refusal naming the key that sends it there (None: none)."""
    why = closed(dep)
    if why is None:
        return None
    for host, fetches in host_fetches(dep).items():
        for f in fetches:
            if not f.declared:
                place = f.host or "sources k2fleet does not know"
                because = "k2_package_source: apt" if f.key == "k2_package_source" else f"{f.key} unset"
                return SpecError(f.key, f"with {why} nothing may be fetched from outside the fleet and the declared "
                                 f"mirrors, but {host} would fetch {f.what.split(': ', 1)[-1]} from {place} "
                                 f"({because}); {f.fix}", dep.fleet.source)
    return None


def destinations(dep: Deployment, fetches: dict[str, tuple[Fetch, ...]] | None = None) -> list[str]:
    """Every host name the hosts fetch from (sorted; what ``k2_egress: mirrors-only`` allows);
    ``fetches``: :func:`host_fetches`, when the caller has it."""
    found = host_fetches(dep) if fetches is None else fetches
    return sorted({f.host for mine in found.values() for f in mine if f.host})
