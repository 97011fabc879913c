"""Checkpoint distribution: fetched once per fleet, then passed host to host shard by shard.

Only ONE copy leaves the control machine: to the *root* (the first host that loads
weights, or the fetcher host, which downloads from the Hub itself). Every host that
loads weights runs a relay (:mod:`k2fleet.hostprogs.relay`) serving the files it has
verified; every host whose checkpoint gate failed receives each shard from its parent in
the per-shard plan (:mod:`k2fleet.hostprogs.swarm`: a chain up to 16 hosts, per-shard
binary trees beyond), verifies it and serves it onward at once — so the fleet holds the
checkpoint a few shard-times after one host's transfer time, not after 1 + ⌈log2 N⌉
whole rounds. A dead parent is routed around (its ancestors, then the control copy).

The control machine's verified copy is served on its loopback (:class:`ControlRelay`)
and reaches a host through a reverse tunnel of the deploy's own SSH connection to it
(:func:`relay_to_host`): the fleet need not reach the control machine.

Repair and resume: a receiving host first hashes what it holds and keeps every file that
passes; only the others travel. Every step runs at execution time and only while some
host's gate failed in the one HostState fact, so ``--dry`` and no-op runs move nothing.

Who receives from whom, and the relays' argv, are planned without effects in
:mod:`k2fleet.planning.relay_plan`; this module runs them.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

from typing import Any

from k2fleet.hostprogs.verify import load_manifest, manifest_digest
from k2fleet.planning import relay_plan
from k2fleet.planning.deployment import Deployment
from k2fleet.planning.relay_plan import HOST_LOG, control_dir

log = logging.getLogger(__name__)

class ControlRelay:
    """The control machine's relay (:mod:`k2fleet.hostprogs.relay` ``serve``) over its verified
    copies, on loopback, one per directory, started on first use; hosts reach it through a
    reverse tunnel of their own SSH connection (the control machine need not be reachable
    from the fleet). It stops with :meth:`stop`, or by itself when the deploy's process is
    gone. One per run (:class:`k2fleet.deploy.fleet_run.FleetRun`)."""

    def __init__(self, secret_file: str | os.PathLike[str] | None = None) -> None:
        self.secret_file = secret_file  # the deployment's relay secret: required of every request
        self._servers: dict[str, tuple[subprocess.Popen, int]] = {}
        self._lock = threading.Lock()  # hosts' greenlets ask at once (pyinfra patches threading)

    def port_for(self, root: str) -> int:
        """The loopback port serving ``root`` (started now if it is not running)."""
        with self._lock:
            return self._port_for(root)

    def _port_for(self, root: str) -> int:
        proc, port = self._servers.get(root, (None, 0))
        if proc is None or proc.poll() is not None:
            secret = ["--secret-file", str(self.secret_file)] if self.secret_file else []
            proc = subprocess.Popen([sys.executable, "-m", "k2fleet.hostprogs.relay", "serve", root, "--bind", "127.0.0.1",
                                     "--port", "0", "--exit-with-parent", *secret], stdout=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, text=True, env=_with_this_checkout())
            line = proc.stdout.readline() if proc.stdout else ""
            try:
                port = int(json.loads(line)["port"])
            except (ValueError, KeyError):
                proc.kill()
                raise RuntimeError(f"the control machine's relay for {root} did not start") from None
            self._servers[root] = (proc, port)
        return port

    def stop(self) -> None:
        """Stop every relay this run started (a second call does nothing)."""
        with self._lock:
            for proc, _ in self._servers.values():
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
            self._servers.clear()


def relay_to_host(control: ControlRelay, source: str | None, target: str, ssh: list[str], fetch_argv: list[str],
                  tunnel_port: int, log_file: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Run one host's relay fetch (``fetch_argv``) over its SSH connection from the control
    machine; with a control copy ``source``, the connection also carries a reverse tunnel
    from the host's ``127.0.0.1:tunnel_port`` to the control machine's relay of it (given
    to the fetch as its last source). Returns the host's report (also one JSON line in
    ``log_file``, step ``relay``); raises RuntimeError naming the host when it fails.
    The fetch carries the control machine's pin (``--manifest-digest``, :func:`manifest_pins`):
    the host takes no manifest but that one; a control copy whose manifest is not the pinned
    one is refused here (without a pin in ``fetch_argv``, the copy's digest is added)."""
    argv = [*ssh]
    if source is not None:
        digest = manifest_digest(load_manifest(os.path.join(source, ".k2fleet", "manifest.json")))
        pinned = fetch_argv[fetch_argv.index("--manifest-digest") + 1] if "--manifest-digest" in fetch_argv else None
        if pinned is None:
            fetch_argv = [*fetch_argv[:-1], "--manifest-digest", digest, fetch_argv[-1]]
        elif pinned != digest:
            raise RuntimeError(f"the control machine's copy {source} has manifest digest {digest}, not the pinned "
                               f"{pinned}: refusing to serve it to {target}")
        pieces = pieces_pin(source) if "--pieces-digest" not in fetch_argv else None
        if pieces is not None:  # the copy's pieces, pinned here: passed on as each verifies
            fetch_argv = [*fetch_argv[:-1], "--pieces-digest", pieces, fetch_argv[-1]]
        argv += ["-o", "ExitOnForwardFailure=yes", "-R", f"127.0.0.1:{tunnel_port}:127.0.0.1:{control.port_for(source)}"]
    result = subprocess.run([*argv, target, shlex.join(fetch_argv)], capture_output=True, text=True,
                            stdin=subprocess.DEVNULL)
    if result.returncode:
        raise RuntimeError(f"checkpoint relay to {target} failed: {result.stderr.strip()[-2000:]}")
    record = {"target": target, **json.loads(result.stdout.strip().splitlines()[-1])}
    if log_file:
        _append(log_file, {"step": "relay", **record})
    return record


_PIECES_LOCK = threading.Lock()
_UNPINNABLE: set[str] = set()  # copies this run could not pin piece by piece: not hashed again for each host


def pieces_pin(source: str) -> str | None:
    """The digest of the control copy ``source``'s pieces document (``relay pieces``,
    :func:`k2fleet.hostprogs.relay.make_pieces`: a sha256 per piece of each file, made once
    from the verified copy and reused while its files are unchanged), which every fetch from
    it carries (``--pieces-digest``). None, with a warning, where it cannot be made (e.g. a
    ``control:`` directory on a read-only mount): files then move on once whole."""
    with _PIECES_LOCK:  # one hashing pass per copy, however many hosts' transfers start at once
        if source in _UNPINNABLE:
            return None
        # a child process: its threads hash on every core (this process's threads are pyinfra's greenlets)
        done = subprocess.run([sys.executable, "-m", "k2fleet.hostprogs.relay", "pieces", source], capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, env=_with_this_checkout())
        try:
            return str(json.loads(done.stdout.strip().splitlines()[-1])["pieces_digest"])
        except (ValueError, KeyError, IndexError):
            _UNPINNABLE.add(source)
    log.warning("the control machine's copy %s is not pinned piece by piece (files move on once whole): %s",
                source, done.stderr.strip()[-500:])
    return None


# --------------------------------------------------------------------------- the pin


def manifest_pins(dep: Deployment, *, fetch: bool) -> dict[str, str]:
    """Weight set check → the digest (:func:`~k2fleet.hostprogs.verify.manifest_digest`) of
    the manifest every host must accept, held by the control machine before any host
    receives a byte, in every mode: a ``control:`` directory's manifest (of the pinned
    repository and revision); for a Hub source — the control machine's copy or a fetcher
    host — the manifest in the control cache (``k2_checkpoint_cache``), which, when missing,
    is built from the Hub's own file metadata for the pinned revision (sizes, LFS sha256s,
    git blob ids; no file is downloaded) when ``fetch`` (the deploy), in a child process.
    Without ``fetch`` (``plan``, ``--dry``, ``status``) a weight set with no cached manifest
    has no pin yet. Raises :class:`~k2fleet.control.ControlError` naming the weight set when
    its pin cannot be had."""
    from k2fleet.control import ControlError
    from k2fleet.hostprogs.verify import pin_problem

    pins: dict[str, str] = {}
    for ws in dep.weight_sets:
        directory, from_hub = relay_plan.control_source(dep, ws)
        path = os.path.join(directory, ".k2fleet", "manifest.json")
        what = f"{ws.repo}@{ws.revision}"
        try:
            if from_hub and (fetch or os.path.isdir(directory)):
                owned_cache(directory)  # another local user's planted manifest is never a pin
            if from_hub and fetch and not os.path.isfile(path):
                pin_manifest_from_hub(ws.repo, ws.revision, directory, endpoint=dep.s.hub_endpoint,
                                      token_file=dep.s.hub_token_file, patterns=list(ws.patterns) if ws.patterns else None)
            manifest = load_manifest(path) if os.path.isfile(path) else None
            problem = pin_problem(manifest, ws.repo, ws.revision) if manifest is not None else (
                f"{directory} has no .k2fleet/manifest.json (make it with `hf download` + a manifest)")
        except (RuntimeError, OSError, ValueError) as e:
            problem = str(e)
        if problem is None:
            pins[ws.check] = manifest_digest(manifest)
        elif fetch:
            raise ControlError(f"the checkpoint {what} cannot be pinned: {problem}")
    return pins


def pin_manifest_from_hub(repo_id: str, revision: str, root: str, *, endpoint: str | None = None,
                          token_file: str | None = None, patterns: list[str] | None = None) -> None:
    """Write ``ROOT/.k2fleet/manifest.json``: the Hub's file metadata of ``repo_id`` at the
    pinned ``revision`` (:func:`k2fleet.hostprogs.manifest.build_manifest`), in a child process
    (pyinfra's gevent-patched process cannot import huggingface_hub's HTTP stack); the token
    is read by the child (env ``HF_TOKEN`` or ``token_file``), never in argv. At most 120 s.
    Raises RuntimeError with the child's last lines."""
    try:
        result = _hub_child(["pin-manifest", repo_id, revision, root, *(["--pattern", *patterns] if patterns else [])],
                            endpoint, token_file, timeout=120)
    except subprocess.TimeoutExpired:
        raise RuntimeError("the Hub did not answer with its file metadata within 120 s") from None
    if result.returncode:
        raise RuntimeError(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else f"exit {result.returncode}")


# --------------------------------------------------------------------------- control side


def owned_cache(root: str | os.PathLike[str], levels: int = 3) -> None:
    """The control cache ``CACHE/<org>--<name>/<revision>`` (``root``) and the two
    directories above it are this user's and writable by no one else (the first made
    0700 where missing): a manifest another local user could plant there would be trusted.
    Raises RuntimeError naming the directory and the fix."""
    path = Path(root)
    chain = [path, *list(path.parents)[: levels - 1]]
    for directory in reversed(chain):
        if not directory.exists():
            directory.mkdir(mode=0o700, parents=True)
        st = directory.lstat()
        if not directory.is_dir() or directory.is_symlink():
            raise RuntimeError(f"the control cache {directory} is not a directory of its own (a symlink?)")
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise RuntimeError(f"the control cache {directory} is owned by uid {st.st_uid} with mode "
                               f"{st.st_mode & 0o777:o}: another user could plant a manifest there; make it "
                               f"yours and 0700 (chown; chmod 700) or set k2_checkpoint_cache to such a directory")


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
    from k2fleet.hostprogs.download import ensure_manifest, fetch_and_verify, read_token, repair, repairable_files
    from k2fleet.hostprogs.manifest import manifest_path
    from k2fleet.hostprogs.verify import load_manifest, verify

    t0 = time.monotonic()
    if hub:
        owned_cache(root)
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
        nothing_yet = report is not None and len(bad) == report.files_total  # the pinned manifest alone (manifest_pins)
        if report is not None and bad and not nothing_yet and len(bad) == len({p.path for p in report.problems}):
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
    result = _hub_child(["control-copy", repo_id, revision, root, *(["--hub"] if hub else []),
                         *(["--pattern", *patterns] if patterns else [])], endpoint, token_file)
    if result.returncode:
        raise RuntimeError(f"control copy of {repo_id}@{revision} failed:\n{result.stderr.strip()[-3000:]}")
    record = json.loads(result.stdout.strip().splitlines()[-1])
    if log_file:
        _append(log_file, {"step": "control-copy", **record})
    return record


def _hub_child(args: list[str], endpoint: str | None, token_file: str | None,
               timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m k2fleet.control.checkpoint_copy ARGS`` (this checkout's), the Hub endpoint in its
    environment and the token only as a file it reads (env ``K2FLEET_HUB_TOKEN_FILE``), never in argv."""
    env = _with_this_checkout()
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    if token_file:
        env["K2FLEET_HUB_TOKEN_FILE"] = token_file
    return subprocess.run([sys.executable, "-m", "k2fleet.control.checkpoint_copy", *args], capture_output=True,
                          text=True, env=env, stdin=subprocess.DEVNULL, timeout=timeout)


def _with_this_checkout() -> dict[str, str]:
    """This environment with this k2fleet first on ``PYTHONPATH`` (for ``python -m`` children)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH")]))
    return env


def _append(log_file: str | os.PathLike[str], record: dict[str, Any]) -> None:
    Path(log_file).parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    """``python -m k2fleet.control.checkpoint_copy control-copy REPO REVISION DIR [--hub] [--pattern GLOB...]``
    (endpoint: env ``HF_ENDPOINT``; token: env ``HF_TOKEN`` or ``K2FLEET_HUB_TOKEN_FILE``)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m k2fleet.control.checkpoint_copy")
    sub = ap.add_subparsers(dest="cmd", required=True)
    cc = sub.add_parser("control-copy", help="make DIR a verified copy of REPO@REVISION on this machine")
    cc.add_argument("repo_id")
    cc.add_argument("revision")
    cc.add_argument("dir")
    cc.add_argument("--hub", action="store_true", help="fetch missing or bad files from the Hub")
    cc.add_argument("--pattern", nargs="+", metavar="GLOB", help="only the repository files matching these globs")
    pm = sub.add_parser("pin-manifest", help="write DIR/.k2fleet/manifest.json from the Hub's file metadata of REPO@REVISION")
    pm.add_argument("repo_id")
    pm.add_argument("revision")
    pm.add_argument("dir")
    pm.add_argument("--pattern", nargs="+", metavar="GLOB", help="only the repository files matching these globs")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    if args.cmd == "pin-manifest":
        from k2fleet.hostprogs.manifest import build_manifest, read_token, save_manifest

        try:
            owned_cache(args.dir)
            manifest = build_manifest(args.repo_id, args.revision, endpoint=os.environ.get("HF_ENDPOINT") or None,
                                      token=read_token(os.environ.get("K2FLEET_HUB_TOKEN_FILE") or None),
                                      allow_patterns=args.pattern)
            save_manifest(args.dir, manifest)
        except Exception as e:  # noqa: BLE001 — the Hub client's errors: one line for the parent
            print(f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr)
            return 1
        print(json.dumps({"dir": args.dir, "manifest_sha256": manifest_digest(manifest)}))
        return 0
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
