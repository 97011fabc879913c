"""``k2fleet down`` on one host, and the record it needs from before k2fleet's first change
(:mod:`k2fleet.planning.teardown` computes both specs; standard library only).

    python3 teardown.py record '{"record": "/var/lib/k2fleet/before.json", "dirs": [...], "groups": {...}, ...}'
    python3 teardown.py down '{"units": [...], "files": [...], "trees": [...], ...}'

Sent as source in the command (like the state probe on a bare host): ``record`` runs before the
host archive exists, ``down`` removes the archive.

``record``: once per host (an existing record is kept as it is): the packages installed with
their versions (dpkg, else rpm), which of the given directories exist, each given user's
groups and which given groups exist, the given sysctl values, and whether k2fleet had been
here already (``after_k2fleet``: a path it places exists); written root-only (0600 in a 0700
directory), atomically.

``down``: stops and disables the units (and every unit file matching the globs), stops the
transient units matching ``transient``, removes the containers and images, deletes the
nftables tables, removes the files and trees (never following a link out of them), the
directories the record says were not there before once empty, gives back the sysctl values
and the group memberships the record holds, reloads systemd, and removes ``purge`` paths only
when they are given. It prints one JSON report: what it did, what it kept, and the packages
installed (or of another version) since the record. Exit 0, or 1 with ``errors`` in the report.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import stat
import subprocess
import sys

MAX_SPEC = 1 << 20  # bytes of a spec (argv)
TIMEOUT_S = 120  # any one command


def _run(argv: list[str], timeout: float = TIMEOUT_S) -> tuple[int, str]:
    """(exit status, stdout); a command not there is 127."""
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=timeout, text=True, errors="replace")
    except FileNotFoundError:
        return 127, ""
    except subprocess.TimeoutExpired:
        return 124, ""
    return done.returncode, done.stdout


def installed_packages() -> dict[str, str]:
    """Package name (``name:arch`` for dpkg's multi-arch ones as ``dpkg-query -W`` names them) → version,
    for the installed ones: dpkg's status letter (the second; the first is the wish: ``i``
    install, ``h`` hold) is ``i`` — a held package is installed."""
    code, out = _run(["dpkg-query", "-W", "-f", "${db:Status-Abbrev}\t${binary:Package}\t${Version}\n"])
    if code == 0:
        rows = (line.split("\t") for line in out.splitlines())
        return {r[1]: r[2] for r in rows if len(r) == 3 and r[0][1:2] == "i"}
    code, out = _run(["rpm", "-qa", "--qf", "%{NAME}\t%{VERSION}-%{RELEASE}\n"])
    if code == 0:
        return dict(line.split("\t", 1) for line in out.splitlines() if "\t" in line)
    return {}


def _groups() -> dict[str, list[str]]:
    """Group name → its members, from /etc/group."""
    out = {}
    with contextlib.suppress(OSError), open("/etc/group", encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.rstrip("\n").split(":")
            if len(parts) == 4:
                out[parts[0]] = [m for m in parts[3].split(",") if m]
    return out


def _sysctl_path(key: str) -> str:
    return "/proc/sys/" + key.replace(".", "/")


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def record(spec: dict) -> dict:
    """Write the record (see the module doc) unless one is there; the report says which."""
    path = spec["record"]
    if os.path.lexists(path):
        return {"record": path, "written": False}
    groups = _groups()
    doc = {
        "packages": installed_packages(),
        "dirs": sorted(d for d in spec.get("dirs", []) if os.path.isdir(d) and not os.path.islink(d)),
        "groups": {g: groups[g] for g in spec.get("groups", []) if g in groups},
        "sysctl": {k: _read(_sysctl_path(k)) for k in spec.get("sysctl", [])},
        "after_k2fleet": any(os.path.lexists(p) for p in spec.get("k2fleet_marks", [])),
    }
    parent = os.path.dirname(path)
    os.makedirs(parent, mode=0o700, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return {"record": path, "written": True}


def _remove(path: str, done: list[str], errors: list[str]) -> None:
    """Remove ``path``: a file or link itself, a directory with everything in it (rmtree on
    file descriptors: a link inside is removed, never followed)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        errors.append(f"{path}: {exc.strerror}")
        return
    try:
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)
        done.append(path)
    except OSError as exc:
        errors.append(f"{path}: {exc.strerror or exc}")


def _remove_except(path: str, keep: list[str], done: list[str], errors: list[str]) -> None:
    """:func:`_remove` ``path``, except the ``keep`` paths inside it and the directories leading to them."""
    inside = [k for k in keep if k == path or k.startswith(path.rstrip("/") + "/")]
    if not inside:
        _remove(path, done, errors)
        return
    if path in inside or os.path.islink(path) or not os.path.isdir(path):
        return
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        errors.append(f"{path}: {exc.strerror}")
        return
    for name in names:
        _remove_except(os.path.join(path, name), inside, done, errors)


def _remove_made(d: str, before: set[str] | None, removed: list[str]) -> None:
    """Remove directory ``d`` if k2fleet made it (not in the record's ``before``; without a
    record, a path naming k2fleet) and it is empty (else something else is in it)."""
    made = d not in before if before is not None else "k2fleet" in d
    if made and os.path.isdir(d) and not os.path.islink(d):
        with contextlib.suppress(OSError):
            os.rmdir(d)
            removed.append(d)


def _existing_units(names: list[str]) -> list[str]:
    """Those of ``names`` systemd knows (loaded, or with a unit file)."""
    if not names:
        return []
    code, out = _run(["systemctl", "show", "--property=Id,LoadState", "--", *names])
    known = []
    for block in out.split("\n\n"):  # one block a unit, its properties in systemd's order
        props = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        if props.get("Id") and props.get("LoadState") not in (None, "", "not-found"):
            known.append(props["Id"])
    return known


def down(spec: dict) -> dict:
    """Tear down what ``spec`` names (see the module doc); the report."""
    rec_path = spec.get("record")
    rec = None
    if rec_path:
        try:
            with open(rec_path, encoding="utf-8") as f:
                rec = json.load(f)
        except (OSError, ValueError):
            rec = None
    errors: list[str] = []
    units = list(dict.fromkeys(spec.get("units", [])))
    for pattern in spec.get("unit_globs", []):
        units += [p.rsplit("/", 1)[1] for p in sorted(glob.glob(pattern)) if p.rsplit("/", 1)[1] not in units]
    units = _existing_units(units)
    if units:
        _run(["systemctl", "stop", "--", *units], timeout=300)
        _run(["systemctl", "disable", "--", *units])
    for pattern in spec.get("transient", []):  # e.g. the relays' k2-relay-*.service
        _run(["systemctl", "stop", "--", pattern])
    docker = shutil.which("docker")
    images = []
    if docker:
        for name in spec.get("containers", []):
            _run([docker, "rm", "--force", "--", name])
        for ref in spec.get("images", []):
            if _run([docker, "image", "rm", "--", ref])[0] == 0:
                images.append(ref)
    tables = []
    nft = shutil.which("nft")
    for table in spec.get("nft_tables", []):
        if nft and _run([nft, "list", "table", *table.split()])[0] == 0:
            if _run([nft, "delete", "table", *table.split()])[0] == 0:
                tables.append(table)
            else:
                errors.append(f"nft table {table}: not deleted")
    removed: list[str] = []
    for pattern in spec.get("unit_globs", []):
        for path in sorted(glob.glob(pattern)):
            _remove(path, removed, errors)
            _remove(path + ".d", removed, errors)
    for path in spec.get("files", []):
        _remove(path, removed, errors)
    for path in spec.get("trees", []):
        _remove_except(path, spec.get("kept", []), removed, errors)
    purged: list[str] = []
    for path in spec.get("purge", []):
        _remove(path, purged, errors)
    kept = [p for p in spec.get("kept", []) if os.path.lexists(p)]
    # directories k2fleet made (absent from the record), deepest first, once empty
    before = set(rec["dirs"]) if rec else None
    dirs = sorted(set(spec.get("dirs", [])), key=lambda d: (-d.count("/"), d))
    for d in dirs:
        _remove_made(d, before, removed)
    restored = {}
    for key in spec.get("sysctl", []):
        was = (rec or {}).get("sysctl", {}).get(key)
        if was is not None and _read(_sysctl_path(key)) != was:
            try:
                with open(_sysctl_path(key), "w", encoding="ascii") as f:
                    f.write(was + "\n")
                restored[key] = was
            except OSError as exc:
                errors.append(f"sysctl {key} = {was}: {exc.strerror}")
    left_groups = []
    if rec is not None:
        now = _groups()
        for user, groups in spec.get("joins", {}).items():
            for g in groups:
                if user in now.get(g, []) and user not in rec["groups"].get(g, []):
                    if _run(["gpasswd", "--delete", user, g])[0] == 0:
                        left_groups.append(f"{user}:{g}")
        for g in spec.get("groups", []):
            if g in now and g not in rec["groups"]:
                if _run(["groupdel", g])[0] == 0:
                    left_groups.append(g)
    _run(["systemctl", "daemon-reload"])
    if units:
        _run(["systemctl", "reset-failed", "--", *units])
    now_pkgs = installed_packages()
    if rec is not None and not rec.get("after_k2fleet"):
        was = rec.get("packages", {})
        installed = sorted(p for p in now_pkgs if p not in was)
        changed = sorted(p for p in now_pkgs if p in was and was[p] != now_pkgs[p])
        source = "record"
    else:  # no record from before k2fleet's first deploy: the packages k2fleet plans, as far as installed
        planned = set(spec.get("packages", []))
        installed = sorted(p for p in now_pkgs if p.split(":", 1)[0] in planned)
        changed = []
        source = "planned" if rec is None else "planned (the record was made after k2fleet's first deploy)"
    # the record goes last: it is k2fleet's too
    if rec_path:
        _remove(rec_path, removed, errors)
        _remove_made(os.path.dirname(rec_path), before, removed)
    return {"units": units, "removed": removed, "purged": purged, "kept": kept, "images": images, "nft_tables": tables,
            "sysctl": restored, "groups": left_groups, "packages_installed": installed, "packages_changed": changed,
            "packages_from": source, "errors": errors}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("record", "down") or len(argv[1]) > MAX_SPEC:
        sys.stderr.write("usage: teardown.py {record,down} SPEC_JSON\n")
        return 2
    spec = json.loads(argv[1])
    report = record(spec) if argv[0] == "record" else down(spec)
    sys.stdout.write(json.dumps(report, sort_keys=True) + "\n")
    return 1 if report.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
