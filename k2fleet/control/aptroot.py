"""A private apt configuration on the control machine: resolve and download
packages against sources of our choosing (another Debian release, an extra
repository) without reading or writing the machine's own ``/etc/apt`` or
``/var/lib/apt``.

An :class:`AptRoot` is one directory, named by a hash of its sources and
architecture (so two roots never share lists)::

    CACHE_DIR/root-<key>/
        apt.conf           handed to apt as APT_CONFIG; points every Dir:: below
        etc/sources.list   the one-line ``deb ...`` entries, as given
        etc/trusted.gpg.d/ copies of the keyrings (Debian's archive keyring by default)
        state/lists/       apt's lists for these sources
        state/status       an empty dpkg status: nothing is assumed installed
        cache/             apt's binary caches
        debs/              downloaded .debs, kept across runs (pool file names)
        updated.json       what the last ``apt-get update`` saw (freshness stamp)
        .lock              flock: one update / resolve / download at a time

apt reads ``APT_CONFIG`` before ``Dir::Etc::parts``, and that file moves
``Dir::Etc`` into the root, so none of the machine's ``apt.conf.d`` snippets,
sources or preferences apply either.

Usage: ``python -m k2fleet.control.aptroot resolve|bundle PKG... [--suite S] [--source LINE]...``
(``resolve`` prints the closure, ``bundle`` the path of the offline bundle tar).

Example::

    root = AptRoot(debian_sources("trixie") + ["deb [trusted=yes] file:/srv/nv ./"])
    closure = root.resolve(["jq", "nvidia-fabricmanager=550*"])
    files = root.download(closure, Path("/tmp/repo"))
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from k2fleet.hostprogs import locks
from k2fleet.control import deb_bundles
from k2fleet.control.deb_bundles import ResolvedPackage

DEFAULT_CACHE_DIR = Path("/var/cache/k2fleet/aptroot")
DEBIAN_KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
ETC_APT = Path("/etc/apt")
OS_RELEASE = Path("/etc/os-release")
# Lists older than this are refreshed by update(); younger ones are reused as is.
DEFAULT_MAX_AGE_S = 24 * 3600
# Bump when the root's layout or apt.conf changes, to start from fresh roots.
ROOT_FORMAT = 1
KEY_LENGTH = 16
# the pockets of a Debian release besides the release itself, and where they live
DEBIAN_POCKETS: dict[str, str] = {"{suite}": "mirror", "{suite}-updates": "mirror",
                                  "{suite}-security": "security"}

__all__ = ["AptRoot", "AptRootError", "ResolvedPackage", "apt_mirror", "control_codename",
           "debian_sources", "machine_sources"]


class AptRootError(deb_bundles.BundleError):
    """Raised when a private apt configuration cannot be made or used (a BundleError,
    so a bundle build through an AptRoot fails the same way as one without)."""


# --------------------------------------------------------------------------
# the control machine's own apt sources (read only)


def _deb822_entries(text: str) -> list[tuple[str, list[str]]]:
    """(uri, suites) pairs from a deb822 ``.sources`` file."""
    found: list[tuple[str, list[str]]] = []
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line.startswith("#") or ":" not in line or line[:1].isspace():
                continue
            key, _, value = line.partition(":")
            fields[key.strip().lower()] = value.strip()
        if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes") == "no":
            continue
        suites = fields.get("suites", "").split()
        found += [(uri, suites) for uri in fields.get("uris", "").split()]
    return found


def _one_line_entries(text: str) -> list[tuple[str, list[str]]]:
    """(uri, suites) pairs from a one-line-style ``.list`` file."""
    found: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if not words or words[0] != "deb":
            continue
        words = words[1:]
        if words and words[0].startswith("["):
            while words and not words[0].endswith("]"):
                words = words[1:]
            words = words[1:]
        if len(words) >= 2:
            found.append((words[0], [words[1]]))
    return found


def machine_sources(etc_apt: Path = ETC_APT) -> list[tuple[str, list[str]]]:
    """(uri, suites) of every enabled ``deb`` source in the machine's apt config."""
    paths = [etc_apt / "sources.list"]
    paths += sorted((etc_apt / "sources.list.d").glob("*.list"))
    paths += sorted((etc_apt / "sources.list.d").glob("*.sources"))
    found: list[tuple[str, list[str]]] = []
    for path in paths:
        if path.is_file():
            parse = _deb822_entries if path.suffix == ".sources" else _one_line_entries
            found += parse(path.read_text(errors="replace"))
    return found


def apt_mirror(suite: str, security: bool = False, etc_apt: Path = ETC_APT) -> str:
    """The mirror this machine's apt uses for ``suite``: the Debian archive, or with
    ``security`` the security archive (a URI holding ``security``)."""
    for uri, suites in machine_sources(etc_apt):
        if suite in suites and ("security" in uri) == security:
            return uri
    kind = "security mirror" if security else "mirror"
    raise AptRootError(f"no apt source for '{suite}' ({kind}) found in {etc_apt}")


def control_codename(os_release: Path = OS_RELEASE) -> str:
    """The control machine's Debian codename (``VERSION_CODENAME`` in os-release)."""
    for line in os_release.read_text().splitlines():
        key, _, value = line.partition("=")
        if key == "VERSION_CODENAME" and value.strip('"'):
            return value.strip('"')
    raise AptRootError(f"no VERSION_CODENAME in {os_release}")


def debian_sources(suite: str, mirror: str | None = None, components: Sequence[str] = ("main",),
                   security_mirror: str | None = None) -> list[str]:
    """One-line sources for Debian release ``suite`` with its updates and security pockets.

    The mirrors default to the ones the control machine's apt already uses for its
    own release (the only Debian hosts it may contact), so ``debian_sources("trixie")``
    on a bookworm machine whose apt uses ``http://deb.debian.org/debian`` gives::

        deb http://deb.debian.org/debian trixie main
        deb http://deb.debian.org/debian trixie-updates main
        deb http://deb.debian.org/debian-security trixie-security main
    """
    if not components or not all(c.replace("-", "").isalnum() for c in components):
        raise AptRootError(f"bad components {list(components)!r}")
    own = control_codename()
    uris = {"mirror": mirror or apt_mirror(own),
            "security": security_mirror or apt_mirror(f"{own}-security", security=True)}
    return [_checked_source(f"deb {uris[where]} {pocket.format(suite=suite)} {' '.join(components)}")
            for pocket, where in DEBIAN_POCKETS.items()]


# --------------------------------------------------------------------------
# the private configuration


def _checked_source(line: str) -> str:
    """A one-line ``deb`` entry, refused if it could smuggle anything else into sources.list."""
    words = line.split()
    if "\n" in line or "\r" in line or "#" in line or len(words) < 3 or words[0] != "deb":
        raise AptRootError(f"not a one-line 'deb URI SUITE [COMPONENT...]' source: {line!r}")
    return " ".join(words)


def _conf_path(path: Path, directory: bool = True) -> str:
    """``path`` as an apt.conf string value (refused if it holds apt.conf syntax)."""
    text = str(path)
    if any(c in text for c in '"\n\r;{}'):
        raise AptRootError(f"path not usable in apt.conf: {text!r}")
    return f'"{text}/"' if directory else f'"{text}"'


def _file_repo_dirs(sources: Iterable[str]) -> list[Path]:
    """The local directories of ``file:`` sources (their content may change in place)."""
    uris = [uri for line in sources for uri, _ in _one_line_entries(line)]
    return [Path(uri.removeprefix("file:").removeprefix("//")) for uri in uris if uri.startswith("file:")]


class AptRoot:
    """A private apt configuration: its own sources, keyrings, lists, caches and an
    empty dpkg status, under ``cache_dir/root-<key>``.

    + sources: one-line ``deb ...`` entries (``deb [trusted=yes] file:/DIR ./`` for a
      local flat repository)
    + arch: the target's dpkg architecture; only this one is resolved
    + cache_dir: parent of the root directories
    + keyrings: keyrings the Release files are checked against
    + max_age_s: lists younger than this are reused by :meth:`update` without asking
      the mirror; a ``file:`` repository whose index changed is re-read regardless
    """

    def __init__(self, sources: Iterable[str], arch: str = "amd64",
                 cache_dir: Path = DEFAULT_CACHE_DIR,
                 keyrings: Iterable[Path] = (DEBIAN_KEYRING,),
                 max_age_s: float = DEFAULT_MAX_AGE_S) -> None:
        self.sources: tuple[str, ...] = tuple(_checked_source(s) for s in sources)
        if not self.sources:
            raise AptRootError("an apt root needs at least one source")
        if not arch.replace("-", "").isalnum():
            raise AptRootError(f"bad architecture {arch!r}")
        self.arch = arch
        self.keyrings = tuple(Path(k) for k in keyrings)
        self.max_age_s = max_age_s
        identity = json.dumps({"format": ROOT_FORMAT, "sources": self.sources, "arch": arch})
        self.key = hashlib.sha256(identity.encode()).hexdigest()[:KEY_LENGTH]
        self.path = Path(cache_dir).resolve() / f"root-{self.key}"

    def __repr__(self) -> str:
        return f"AptRoot({list(self.sources)!r}, arch={self.arch!r}, path={str(self.path)!r})"

    # ---- layout

    @property
    def lists_dir(self) -> Path:
        """apt's lists for these sources."""
        return self.path / "state" / "lists"

    @property
    def debs_dir(self) -> Path:
        """Downloaded .debs, kept across runs under their pool file names."""
        return self.path / "debs"

    @property
    def config_file(self) -> Path:
        return self.path / "apt.conf"

    @property
    def stamp_file(self) -> Path:
        return self.path / "updated.json"

    def env(self) -> dict[str, str]:
        """Environment that makes apt-get / apt-cache use this root only."""
        return dict(os.environ, APT_CONFIG=str(self.config_file), DEBIAN_FRONTEND="noninteractive",
                    LC_ALL="C")

    def _apt_conf(self) -> str:
        p = self.path
        settings = {
            "Dir::Etc": _conf_path(p / "etc"),
            "Dir::Etc::main": '"apt.conf"',
            "Dir::Etc::parts": '"apt.conf.d"',
            "Dir::Etc::sourcelist": '"sources.list"',
            "Dir::Etc::sourceparts": '"sources.list.d"',
            "Dir::Etc::trusted": '"trusted.gpg"',
            "Dir::Etc::trustedparts": '"trusted.gpg.d"',
            "Dir::Etc::preferences": '"preferences"',
            "Dir::Etc::preferencesparts": '"preferences.d"',
            "Dir::State": _conf_path(p / "state"),
            "Dir::State::lists": '"lists/"',
            "Dir::State::status": _conf_path(p / "state" / "status", directory=False),
            "Dir::State::extended_states": '"extended_states"',
            "Dir::Cache": _conf_path(p / "cache"),
            "Dir::Cache::archives": '"archives/"',
            "Dir::Cache::srcpkgcache": '""',  # no source cache: half the disk, nothing uses it
            "Dir::Log": _conf_path(p / "log"),
            "APT::Architecture": f'"{self.arch}"',
            "APT::Architectures": f'{{ "{self.arch}"; }}',
            "APT::Install-Recommends": '"false"',
            "APT::Install-Suggests": '"false"',
            "Acquire::Languages": '"none"',
            "Acquire::GzipIndexes": '"true"',
        }
        return "".join(f"{k} {v};\n" for k, v in settings.items())

    @staticmethod
    def _write_if_changed(path: Path, text: str) -> None:
        if not path.is_file() or path.read_text() != text:
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)

    def _prepare(self) -> None:
        """Create the root's directories and files (idempotent, cheap; under the lock)."""
        p = self.path
        for d in (p / "etc" / "apt.conf.d", p / "etc" / "sources.list.d", p / "etc" / "preferences.d",
                  p / "etc" / "trusted.gpg.d", self.lists_dir / "partial",
                  p / "cache" / "archives" / "partial", p / "log", self.debs_dir):
            d.mkdir(parents=True, exist_ok=True)
        status = p / "state" / "status"
        if not status.is_file() or status.stat().st_size:
            status.write_text("")
        self._write_if_changed(self.config_file, self._apt_conf())
        self._write_if_changed(p / "etc" / "sources.list", "\n".join(self.sources) + "\n")
        wanted = set()
        for keyring in self.keyrings:
            if not keyring.is_file():
                raise AptRootError(f"keyring {keyring} not found")
            if keyring.suffix not in (".gpg", ".asc"):
                raise AptRootError(f"keyring {keyring} is neither .gpg nor .asc (apt ignores others)")
            dest = p / "etc" / "trusted.gpg.d" / keyring.name
            wanted.add(dest.name)
            if not dest.is_file() or dest.read_bytes() != keyring.read_bytes():
                shutil.copyfile(keyring, dest)
        for stale in (p / "etc" / "trusted.gpg.d").iterdir():
            if stale.name not in wanted:
                stale.unlink()

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Exclusive lock on this root (updates, solver caches and the .deb pool)."""
        with locks.exclusive(self.path / ".lock"):
            yield

    # ---- update

    def _local_signature(self) -> list[list[object]]:
        """(path, size, mtime) of the index files of the ``file:`` sources."""
        entries: list[list[object]] = []
        for repo in _file_repo_dirs(self.sources):
            for f in sorted([*repo.glob("*Release"), *repo.glob("Packages*"), *repo.glob("dists/*/*Release")]):
                st = f.stat()
                entries.append([str(f), st.st_size, st.st_mtime_ns])
        return entries

    def is_fresh(self) -> bool:
        """True if the lists were made for these sources less than ``max_age_s`` ago
        and no ``file:`` source's index changed since."""
        try:
            stamp = json.loads(self.stamp_file.read_text())
        except (OSError, ValueError):
            return False
        return (stamp.get("sources") == list(self.sources) and stamp.get("arch") == self.arch
                and time.time() - float(stamp.get("time", 0)) < self.max_age_s
                and stamp.get("local") == self._local_signature()
                and deb_bundles.apt_lists_present(self.lists_dir))

    def update(self, force: bool = False) -> bool:
        """``apt-get update`` for this root unless its lists are fresh; True if it ran."""
        if not force and self.is_fresh():
            return False
        with self._locked():
            if not force and self.is_fresh():  # another builder updated while we waited
                return False
            self._prepare()
            local = self._local_signature()
            try:  # --error-on=any: a source that cannot be fetched fails the update
                deb_bundles._run(["apt-get", "update", "-q", "--error-on=any"], env=self.env())
            except deb_bundles.BundleError as exc:
                raise AptRootError(f"apt-get update for {self.path} failed: {exc}") from exc
            if not deb_bundles.apt_lists_present(self.lists_dir):
                raise AptRootError(f"apt-get update for {self.path} left no Packages list")
            stamp = {"sources": list(self.sources), "arch": self.arch, "time": time.time(), "local": local}
            self._write_if_changed(self.stamp_file, json.dumps(stamp, indent=1) + "\n")
        return True

    # ---- resolve / download

    def resolve(self, packages: Iterable[str]) -> list[ResolvedPackage]:
        """Depends + Pre-Depends closure of ``packages`` (``name``, ``name=version`` or
        ``name=version*``) against an empty dpkg status, no Recommends; see
        :func:`k2fleet.control.deb_bundles.resolve_closure`."""
        self.update()
        with self._locked():
            return deb_bundles.resolve_closure(packages, env=self.env())

    def index_sha256(self, packages: Iterable[ResolvedPackage]) -> dict[ResolvedPackage, set[str]]:
        """The SHA256 sums the root's (signed or trusted) lists give for each package."""
        wanted = sorted(set(packages))
        out = deb_bundles._run(["apt-cache", "show", *(r.spec for r in wanted)], env=self.env()).stdout
        sums: dict[ResolvedPackage, set[str]] = {r: set() for r in wanted}
        for record in out.split("\n\n"):
            fields = dict(line.split(": ", 1) for line in record.splitlines() if ": " in line and line[0] != " ")
            pkg = ResolvedPackage(fields.get("Package", ""), fields.get("Version", ""), fields.get("Architecture", ""))
            if pkg in sums and "SHA256" in fields:
                sums[pkg].add(fields["SHA256"])
        return sums

    def _pooled(self, pkg: ResolvedPackage, sums: set[str]) -> bool:
        """True if the pool holds ``pkg`` with one of the SHA256 sums the lists give."""
        deb = self.debs_dir / deb_bundles.pool_filename(pkg)
        return deb.is_file() and deb_bundles.sha256_file(deb) in sums

    def download(self, resolved: Iterable[ResolvedPackage], dest: Path) -> dict[ResolvedPackage, Path]:
        """Put the .deb of every package in ``dest`` (pool file names); map each to its file.

        A package already in the root's pool is linked from there if its SHA256 is
        the one the lists give; the others are downloaded by apt (which checks them
        against the lists) first.
        """
        wanted = sorted(set(resolved))
        with self._locked():
            self._prepare()
            sums = self.index_sha256(wanted)
            missing = [r for r in wanted if not self._pooled(r, sums[r])]
            if missing:
                with tempfile.TemporaryDirectory(prefix=".dl-", dir=self.debs_dir) as tmp:
                    for deb in deb_bundles.download(missing, Path(tmp), env=self.env()).values():
                        deb.replace(self.debs_dir / deb.name)
        dest.mkdir(parents=True, exist_ok=True)
        files: dict[ResolvedPackage, Path] = {}
        for pkg in wanted:
            src, out = self.debs_dir / deb_bundles.pool_filename(pkg), dest / deb_bundles.pool_filename(pkg)
            out.unlink(missing_ok=True)
            try:
                os.link(src, out)
            except OSError:
                shutil.copyfile(src, out)
            files[pkg] = out
        return files


# --------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None) -> int:
    """CLI: ``resolve|bundle PKG... [--suite S] [--component C]... [--source LINE]... [--arch A]``."""
    parser = argparse.ArgumentParser(prog="python -m k2fleet.control.aptroot", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["resolve", "bundle"])
    parser.add_argument("packages", nargs="+", metavar="PKG", help="name, name=version or name=version*")
    parser.add_argument("--suite", help="Debian release to add (from the mirrors this machine's apt uses)")
    parser.add_argument("--component", action="append", help="Debian components (default: main)")
    parser.add_argument("--source", action="append", default=[], metavar="LINE",
                        help="extra one-line source, e.g. 'deb [trusted=yes] file:/DIR ./'")
    parser.add_argument("--arch", default="amd64")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE_DIR, help="where apt roots live")
    parser.add_argument("--out", type=Path, default=deb_bundles.DEFAULT_CACHE_DIR, help="bundle cache directory")
    args = parser.parse_args(argv)
    try:
        sources = debian_sources(args.suite, components=args.component or ["main"]) if args.suite else []
        root = AptRoot([*sources, *args.source], arch=args.arch, cache_dir=args.cache)
        if args.command == "resolve":
            for pkg in root.resolve(args.packages):
                print(pkg.spec)
        else:
            print(deb_bundles.ensure_bundle(args.packages, args.out, apt_root=root))
    except deb_bundles.BundleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
