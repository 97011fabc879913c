"""``k2fleet.lock``: what an offline bundle holds, byte for byte (pure; no I/O but text).

``k2fleet bundle INVENTORY --out DIR`` writes ``DIR/k2fleet.lock``, one JSON document::

    {
      "format": 1,
      "inventory": "inventories/h200.py",
      "rehearsal": false,
      "parts": {                              # what the deploy looks up in the bundle
        "debs":        [{"os", "arch", "packages": [...], "path": "debs/bundle-<key>.tar"}],
        "wheels":      [{"use": "engine" | "hub", "requirements": [...], "pythons": [...],
                         "archs": [...], "path": "wheels/<key>"}],
        "images":      [{"ref", "image_id", "path": "images/<name>.tar.gz"}],
        "checkpoints": [{"repo", "revision", "patterns", "path": "checkpoint/<org>--<name>/<revision>"}],
        "engine_caches": [{"engine", "files", "bytes", "path": "engine-cache/<engine>.tar.gz"}]   # --engine-cache
      },
      "artifacts": [                          # every file, sorted by path
        {"path", "kind", "name", "version", "sha256", "bytes", "origin", "in"?, "image_id"?}
      ]
    }

``kind`` is ``deb`` (``in`` names the tar holding it), ``deb-repo`` (that tar),
``wheel``, ``image`` (``docker save`` archive; ``image_id`` its config digest),
``checkpoint-manifest`` and ``checkpoint-file`` (the Hub's sha256 of each file, checked
by the checkpoint role, not on every read), ``engine-cache`` (an operator's warmed compile/JIT
cache of the engine ``name``, a deterministic tar.gz: :mod:`k2fleet.hostprogs.cache_archive`;
``version`` is the engine's pin it was bundled for). ``origin`` says where the bytes came
from: an apt source line, ``pypi:<requirement>``, ``docker save <ref>``,
``hub:<repo>@<revision>``, ``k2fleet bundle --engine-cache <dir>``, or ``k2fleet`` for what
k2fleet builds itself (the TEST DOUBLE wheel, image and packages).

>>> a = Artifact("wheels/k/ray-2.60.0-cp311-none-any.whl", "wheel", "ray", "2.60.0", "ab" * 32, 10, "pypi:ray")
>>> lock = Lock("inv.py", False, {"wheels": []}, (a,))
>>> Lock.from_text(lock.to_text()) == lock
True
>>> drift(lock, Lock("inv.py", False, {"wheels": []}, (a._replace(version="2.61.0", sha256="cd" * 32),)))
['wheel ray: 2.60.0 sha256 abababababab… → 2.61.0 sha256 cdcdcdcdcdcd…']
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NamedTuple

LOCK_NAME = "k2fleet.lock"
LOCK_FORMAT = 1
KINDS = ("deb", "deb-repo", "wheel", "image", "checkpoint-manifest", "checkpoint-file", "engine-cache")
VERIFIED_ON_READ = frozenset({"deb-repo", "wheel", "image", "checkpoint-manifest", "engine-cache"})  # hashed whenever the deploy reads them


class LockError(ValueError):
    """A lock file that cannot be read."""


class Artifact(NamedTuple):
    """One file of a bundle (``in``: the tar a ``deb`` sits in, else "")."""

    path: str
    kind: str
    name: str
    version: str
    sha256: str
    bytes: int
    origin: str
    inside: str = ""
    image_id: str = ""

    def to_json(self) -> dict[str, Any]:
        doc = {"path": self.path, "kind": self.kind, "name": self.name, "version": self.version,
               "sha256": self.sha256, "bytes": self.bytes, "origin": self.origin}
        if self.inside:
            doc["in"] = self.inside
        if self.image_id:
            doc["image_id"] = self.image_id
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Artifact:
        try:
            return cls(str(doc["path"]), str(doc["kind"]), str(doc["name"]), str(doc["version"]),
                       str(doc["sha256"]), int(doc["bytes"]), str(doc["origin"]), str(doc.get("in", "")),
                       str(doc.get("image_id", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise LockError(f"artifact entry {doc!r:.120} lacks {exc}") from None

    @property
    def identity(self) -> tuple[str, str]:
        """What drift is reported against: (kind, name)."""
        return self.kind, self.name


@dataclass(frozen=True)
class Lock:
    """A parsed ``k2fleet.lock``."""

    inventory: str
    rehearsal: bool
    parts: dict[str, list[dict[str, Any]]]
    artifacts: tuple[Artifact, ...]

    def to_text(self) -> str:
        doc = {"format": LOCK_FORMAT, "inventory": self.inventory, "rehearsal": self.rehearsal,
               "parts": self.parts, "artifacts": [a.to_json() for a in sorted(self.artifacts)]}
        return json.dumps(doc, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_text(cls, text: str) -> Lock:
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise LockError(f"not JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != LOCK_FORMAT:
            raise LockError(f"not a k2fleet.lock of format {LOCK_FORMAT}")
        parts = doc.get("parts")
        if not isinstance(parts, dict) or not all(isinstance(v, list) for v in parts.values()):
            raise LockError("its `parts` is not a table of lists")
        return cls(str(doc.get("inventory", "")), bool(doc.get("rehearsal")), parts,
                   tuple(sorted(Artifact.from_json(a) for a in doc.get("artifacts", []))))

    def by_path(self) -> dict[str, Artifact]:
        return {a.path: a for a in self.artifacts if not a.inside}

    def part(self, kind: str) -> list[dict[str, Any]]:
        return list(self.parts.get(kind, []))


def _short(a: Artifact) -> str:
    return f"{a.version} sha256 {a.sha256[:12]}…"


def drift(locked: Lock, rebuilt: Lock) -> list[str]:
    """What differs between a lock and a rebuild of it, one line per artifact (by kind
    and name; files inside a tar are named, the tar itself only if nothing inside is)."""
    old = {a.identity: a for a in locked.artifacts}
    new = {a.identity: a for a in rebuilt.artifacts}
    lines = []
    for ident in sorted(old.keys() | new.keys()):
        a, b = old.get(ident), new.get(ident)
        if a is not None and b is not None and (a.version, a.sha256) == (b.version, b.sha256):
            continue
        kind, name = ident
        if kind == "deb-repo" and any(x.kind == "deb" and (x in locked.artifacts) != (x in rebuilt.artifacts)
                                      for x in (*locked.artifacts, *rebuilt.artifacts)):
            continue
        if a is None:
            lines.append(f"{kind} {name}: not in the lock, now {_short(b)}")  # type: ignore[arg-type]
        elif b is None:
            lines.append(f"{kind} {name}: locked {_short(a)}, now missing")
        else:
            lines.append(f"{kind} {name}: {_short(a)} → {_short(b)}")
    return lines
