"""Checkpoint fan-out: fetched once per fleet, then passed host to host over the SSH mesh.

Only ONE transfer leaves the control machine: to the *root* (the first host that loads
weights). Every other host pulls from a peer that already holds a verified copy, in
doubling rounds — round 0: control → root; round r ≥ 1: hosts ``[2^(r-1), 2^r)`` each
pull from host ``i - 2^(r-1)`` — so the control machine sends each byte once and the
whole fleet has it after ``1 + ceil(log2 N)`` rounds. A host is verified
(``verify.py --full``) in its own round, before any later round uses it as a source.

The tree is static (it depends on the fleet, not on what hosts hold), so every host
runs the same operation sequence; a host is active only in its round and only when
its checkpoint gate fails. A parent always comes in an earlier round than its
children, so by the time a child pulls, its parent either passed the gate already or
was (re)fetched and verified.

Repair: a host with a copy first receives the source's manifest (a few KB, compared by
checksum), runs ``verify.py --json`` against it and then receives only the files it
names (``rsync --files-from``, ``--ignore-times`` because a bit flip keeps size and
mtime), from the same source; a host with no usable copy gets a full sync.

Pure planning (who pulls from whom, the rsync argv, which files to re-send) is at the
top; the control-side steps (Hub download into the cache, push to the root) follow.

Example:
    >>> plan_fanout(["a", "b", "c"]).parents
    {'a': None, 'b': 'a', 'c': 'a'}
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from k2fleet.host.pull import EXCLUDES, REPAIRABLE
from typing import Any

log = logging.getLogger(__name__)

CONTROL = None  # a host's parent when it receives from the control machine
MESH_SSH = "ssh -F {config}"
PULL_PY = "/opt/k2fleet/lib/pull.py"  # k2fleet/host/pull.py on every host
HOST_LOG = "/var/log/k2fleet/checkpoint-transfers.jsonl"


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class FanoutPlan:
    """Who receives the checkpoint from whom, in which round.

    ``order``: hosts that load weights, fleet order (``order[0]`` is the root);
    ``parents``: host → source host (None: the control machine);
    ``rounds``: round → hosts active in it (round 0 is the root alone);
    ``shared``: shared storage — only the root fetches, the others only pass the gate.
    """

    order: tuple[str, ...]
    parents: dict[str, str | None] = field(default_factory=dict)
    rounds: tuple[tuple[str, ...], ...] = ()
    shared: bool = False

    @property
    def root(self) -> str | None:
        return self.order[0] if self.order else None

    def round_of(self, host: str) -> int | None:
        """The round in which ``host`` receives (None: never, e.g. shared storage non-root)."""
        return next((r for r, hosts in enumerate(self.rounds) if host in hosts), None)

    def control_transfers(self) -> int:
        """How many transfers leave the control machine (1 for any non-empty fleet)."""
        return sum(1 for h in self.order if self.parents.get(h, "") is CONTROL and self.round_of(h) is not None)


def plan_fanout(hosts: list[str], shared_storage: bool = False, root: str | None = None) -> FanoutPlan:
    """The doubling fan-out over ``hosts`` (fleet order, only hosts that load weights),
    rooted at ``root`` (default: the first host) — the one host that gets the checkpoint
    from outside the fleet (from the control machine, or from the Hub itself).

    Example:
        >>> p = plan_fanout(["h1", "h2", "h3", "h4", "h5"])
        >>> p.rounds
        (('h1',), ('h2',), ('h3', 'h4'), ('h5',))
        >>> p.parents["h5"], p.parents["h4"]
        ('h1', 'h2')
        >>> plan_fanout(["h1", "h2"], shared_storage=True).rounds
        (('h1',),)
        >>> plan_fanout(["h1", "h2", "h3"], root="h2").parents
        {'h2': None, 'h1': 'h2', 'h3': 'h2'}
    """
    order = tuple(dict.fromkeys(hosts))
    if root is not None:
        if root not in order:
            raise ValueError(f"fan-out root {root} is not among the hosts that load weights")
        order = (root,) + tuple(h for h in order if h != root)
    if not order:
        return FanoutPlan(order=(), shared=shared_storage)
    if shared_storage:
        return FanoutPlan(order=order, parents={order[0]: CONTROL}, rounds=((order[0],),), shared=True)
    parents: dict[str, str | None] = {order[0]: CONTROL}
    rounds: list[tuple[str, ...]] = [(order[0],)]
    have = 1
    while have < len(order):
        batch = order[have : 2 * have]
        for k, h in enumerate(batch):
            parents[h] = order[k]
        rounds.append(batch)
        have += len(batch)
    return FanoutPlan(order=order, parents=parents, rounds=tuple(rounds), shared=False)


def rsync_argv(source: str, dest: str, rsh: str, files_from: str | None = None) -> list[str]:
    """rsync of checkpoint directory ``source`` to ``dest`` (either may be ``host:/path``).

    Full sync (``files_from`` None): ``--delete`` extra files, resumable (``--partial``).
    Repair: only the files listed in ``files_from`` (relative paths), re-sent even when
    size and mtime look unchanged (``--ignore-times``). Per-machine state is excluded.

    Example:
        >>> rsync_argv("10.0.0.1:/m/k2", "/m/k2", "ssh -F /etc/k2fleet/mesh/ssh_config")[:4]
        ['rsync', '-a', '--partial', '--stats']
    """
    argv = ["rsync", "-a", "--partial", "--stats", "--out-format=K2SENT %n"]
    argv += [f"--exclude={e}" for e in EXCLUDES]
    argv += ["-e", rsh]
    if files_from is None:
        argv += ["--delete", "--mkpath"]
    else:
        argv += ["--ignore-times", f"--files-from={files_from}"]
    return argv + [source.rstrip("/") + "/", dest.rstrip("/") + "/"]


def mesh_rsh(mesh_dir: str) -> str:
    """The ``-e`` of peer transfers: the deployment's own mesh (port, key, pinned known_hosts)."""
    return MESH_SSH.format(config=posixpath.join(mesh_dir, "ssh_config"))


def files_to_send(report: Any) -> list[str] | None:
    """From a ``verify.py --json`` report: ``[]`` nothing to send, a file list to re-send
    only those, or None for a full sync (no usable copy or manifest, index problems).

    Example:
        >>> files_to_send({"ok": False, "problems": [{"path": "a.safetensors", "kind": "hash_mismatch"}]})
        ['a.safetensors']
        >>> files_to_send({"ok": False, "problems": [{"path": "<manifest>", "kind": "bad_manifest"}]}) is None
        True
    """
    if not isinstance(report, dict) or not isinstance(report.get("problems"), list):
        return None
    if report.get("ok"):
        return []
    problems = report["problems"]
    if not problems or any(not isinstance(p, dict) or p.get("kind") not in REPAIRABLE for p in problems):
        return None
    paths = sorted({str(p["path"]) for p in problems})
    if all(p["kind"] == "missing" for p in problems) and len(paths) >= int(report.get("files_total") or 0):
        return None  # nothing there yet: a full sync
    return paths


def parse_rsync_output(text: str) -> dict[str, Any]:
    """Files rsync transferred (``--out-format=K2SENT %n``) and its ``--stats`` byte counts.

    Example:
        >>> parse_rsync_output("K2SENT a\\nTotal bytes sent: 1,234\\nTotal bytes received: 56\\n")
        {'files': ['a'], 'bytes_sent': 1234, 'bytes_received': 56}
    """
    files = [line[7:] for line in text.splitlines() if line.startswith("K2SENT ") and not line.endswith("/")]
    out: dict[str, Any] = {"files": files, "bytes_sent": 0, "bytes_received": 0}
    for key, label in (("bytes_sent", "Total bytes sent"), ("bytes_received", "Total bytes received")):
        m = re.search(rf"^{label}:\s*([\d,.]+)", text, re.M)
        if m:
            out[key] = int(re.sub(r"[,.]", "", m.group(1)))
    return out


def host_pull_argv(dest: str, verify_py: str, source: str, rsh: str, log_file: str = HOST_LOG,
                   pull_py: str = PULL_PY) -> list[str]:
    """argv run on a host: verify its copy, pull only the bad files (or everything) from ``source``
    (:mod:`k2fleet.host.pull`).

    Example:
        >>> host_pull_argv("/m/k2", "/opt/k2fleet/lib/verify.py", "10.0.0.1:/m/k2", "ssh")[:2]
        ['/usr/bin/python3', '/opt/k2fleet/lib/pull.py']
    """
    return ["/usr/bin/python3", pull_py, dest, verify_py, source, rsh, log_file]


# --------------------------------------------------------------------------- control side


def control_dir(cache: str, repo_id: str, revision: str) -> str:
    """Control-machine cache directory of one pinned checkpoint: ``CACHE/<org>--<name>/<revision>``.

    Example:
        >>> control_dir("/var/cache/k2fleet/checkpoints", "moonshotai/Kimi-K2-Thinking", "a" * 40)[-12:]
        'aaaaaaaaaaaa'
    """
    return posixpath.join(cache, repo_id.replace("/", "--"), revision)


def ensure_control_copy(
    repo_id: str,
    revision: str,
    root: str,
    *,
    hub: bool,
    endpoint: str | None = None,
    token_file: str | None = None,
    patterns: list[str] | None = None,
) -> dict[str, Any]:
    """Make ``root`` (on the control machine) a verified copy of ``repo_id@revision``
    (of its files matching ``patterns``; None: all).

    Hub source: a verified cache is used as is (stat-fast re-verify, no Hub request);
    bad files of a cache are re-fetched alone (:func:`download.repair`); otherwise the
    manifest (``model_info(files_metadata=True)``) and the files are fetched at the pinned
    commit and verified. ``control:`` source: verified only (air-gapped, nothing to fetch).
    The token is read here, at execution time (env ``HF_TOKEN`` or ``token_file``), never
    passed in argv or logged. Returns a summary; raises RuntimeError when not verified.
    """
    from k2fleet.checkpoint.download import ensure_manifest, fetch_and_verify, read_token, repair, repairable_files
    from k2fleet.checkpoint.manifest import manifest_path
    from k2fleet.checkpoint.verify import load_manifest, verify

    t0 = time.monotonic()
    mpath = manifest_path(root)
    manifest = None
    if mpath.is_file():
        manifest = load_manifest(str(mpath))
        if manifest.get("repo_id") != repo_id or manifest.get("revision") != revision:
            if not hub:
                raise RuntimeError(f"{mpath} pins {manifest.get('repo_id')}@{manifest.get('revision')}, not {repo_id}@{revision}")
            manifest = None
    elif not hub:
        raise RuntimeError(f"{root} has no .k2fleet/manifest.json (make it with `hf download` + a manifest)")
    action = "none"
    report = verify(root, manifest) if manifest is not None else None
    if report is None or not report.ok:
        if not hub:
            raise RuntimeError(f"the control copy {root} is not verified:\n" + "\n".join(report.lines()[-20:]))
        token = read_token(token_file)
        bad = repairable_files(report) if report is not None else []
        if report is not None and bad and len(bad) == len({p.path for p in report.problems}):
            manifest = ensure_manifest(repo_id, revision, root, token=token, endpoint=endpoint,
                                       allow_patterns=patterns)
            log.warning("re-fetching %d bad file(s) of the control cache: %s", len(bad), ", ".join(bad))
            repair(root, manifest, bad, token=token, endpoint=endpoint)
            report, action = verify(root, manifest), "repair"
        else:
            report, action = fetch_and_verify(repo_id, revision, root, token=token, endpoint=endpoint,
                                              allow_patterns=patterns), "download"
        if not report.ok:
            raise RuntimeError(f"the control cache {root} failed verification:\n" + "\n".join(report.lines()[-20:]))
    return {"dir": root, "action": action, "seconds": round(time.monotonic() - t0, 3),
            "bytes": report.bytes_total, "files": report.files_total}


def prepare_control_copy(
    repo_id: str,
    revision: str,
    root: str,
    *,
    hub: bool,
    endpoint: str | None = None,
    token_file: str | None = None,
    log_file: str | os.PathLike[str] | None = None,
    patterns: list[str] | None = None,
) -> dict[str, Any]:
    """:func:`ensure_control_copy` in a child process (pyinfra's gevent-patched process
    cannot import huggingface_hub's HTTP stack, and hashing there would stall every
    host's connection). The endpoint goes in the child's environment, the token is
    read by the child (env ``HF_TOKEN`` or ``token_file``): neither is in argv."""
    argv = [sys.executable, "-m", "k2fleet.checkpoint.fanout", "control-copy", repo_id, revision, root]
    argv += ["--hub"] if hub else []
    argv += ["--pattern", *patterns] if patterns else []
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH")]))
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    if token_file:
        env["K2FLEET_HUB_TOKEN_FILE"] = token_file
    result = subprocess.run(argv, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    if result.returncode:
        raise RuntimeError(f"control copy of {repo_id}@{revision} failed:\n{result.stderr.strip()[-3000:]}")
    record = json.loads(result.stdout.strip().splitlines()[-1])
    if log_file:
        _append(log_file, {"step": "control-copy", **record})
    return record


def _append(log_file: str | os.PathLike[str], record: dict[str, Any]) -> None:
    Path(log_file).parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


def push_to_host(
    source: str,
    dest: str,
    target: str,
    ssh: list[str],
    verify_py: str,
    log_file: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Control machine → one host (the root): verify the host's copy over SSH, then rsync
    only the bad files (or everything when it has no usable copy). Returns the record
    also appended as one JSON line to ``log_file``."""
    rsh = shlex.join(ssh)
    manifest = f"{dest.rstrip('/')}/.k2fleet/manifest.json"
    remote = shlex.join(["/usr/bin/python3", verify_py, "--json", dest])
    probe = subprocess.run([*ssh, target, f"test -f {shlex.quote(manifest)} && echo yes"],
                           capture_output=True, text=True, stdin=subprocess.DEVNULL)
    report = None
    if probe.stdout.strip() == "yes":
        # the source's manifest first (tiny; compared by checksum), so the check is against it
        sync = subprocess.run(["rsync", "-a", "--checksum", "-e", rsh, f"{source.rstrip('/')}/.k2fleet/manifest.json",
                               f"{target}:{manifest}"], capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if sync.returncode:
            raise RuntimeError(f"rsync of the manifest to {target} failed: {sync.stderr.strip()[-2000:]}")
        check = subprocess.run([*ssh, target, remote], capture_output=True, text=True, stdin=subprocess.DEVNULL)
        try:
            report = json.loads(check.stdout)
        except ValueError:
            report = None
    send = files_to_send(report)
    record: dict[str, Any] = {"target": target, "source": source, "dir": dest, "asked": send}
    if send == []:
        record.update(mode="none", files=[], bytes_sent=0, bytes_received=0)
    else:
        with tempfile.NamedTemporaryFile("w", prefix="k2fleet-files-", suffix=".txt") as listing:
            if send is not None:
                listing.write("".join(f + "\n" for f in send))
                listing.flush()
            argv = rsync_argv(source, f"{target}:{dest}", rsh, listing.name if send is not None else None)
            t0 = time.monotonic()
            result = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if result.returncode:
            raise RuntimeError(f"rsync to {target} failed: {result.stderr.strip()[-2000:]}")
        record.update(mode="full" if send is None else "repair", **parse_rsync_output(result.stdout),
                      seconds=round(time.monotonic() - t0, 3))
    record["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if log_file:
        _append(log_file, {"step": "push", **record})
    return record


def main(argv: list[str] | None = None) -> int:
    """``python -m k2fleet.checkpoint.fanout control-copy REPO REVISION DIR [--hub] [--pattern GLOB...]``
    (endpoint: env ``HF_ENDPOINT``; token: env ``HF_TOKEN`` or ``K2FLEET_HUB_TOKEN_FILE``)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m k2fleet.checkpoint.fanout")
    sub = ap.add_subparsers(dest="cmd", required=True)
    cc = sub.add_parser("control-copy", help="make DIR a verified copy of REPO@REVISION on this machine")
    cc.add_argument("repo_id")
    cc.add_argument("revision")
    cc.add_argument("dir")
    cc.add_argument("--hub", action="store_true", help="fetch missing or bad files from the Hub")
    cc.add_argument("--pattern", nargs="+", metavar="GLOB", help="only the repository files matching these globs")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    try:
        record = ensure_control_copy(args.repo_id, args.revision, args.dir, hub=args.hub,
                                     endpoint=os.environ.get("HF_ENDPOINT") or None,
                                     token_file=os.environ.get("K2FLEET_HUB_TOKEN_FILE") or None,
                                     patterns=args.pattern)
    except (RuntimeError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(record, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
