"""Runs ON a host (standard library only): bring a checkpoint copy up to date from a
verified peer — only the files ``verify.py --json`` names, or everything when there is
no usable copy — over the deployment's SSH mesh.

    python3 /opt/k2fleet/lib/pull.py DIR VERIFY_PY SOURCE RSH LOG

Prints one JSON line (also appended to LOG): mode (none, repair, full), files sent,
byte counts. The control machine plans when it runs (:mod:`k2fleet.checkpoint.fanout`).
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time

# Problems a re-transfer of the named file fixes (the same set download.repair accepts).
REPAIRABLE = ("missing", "size_mismatch", "hash_mismatch", "bad_header", "changed_during_verify")
# Never copied between machines: per-machine verify marker, hf download's cache/lock.
EXCLUDES = ("/.cache/", "/.k2fleet/verified.json", "/.k2fleet/download.lock", "/.k2fleet/partial/", "/.k2fleet/*.tmp.*")


def main() -> None:
    d, verify_py, source, rsh, logf = sys.argv[1:6]
    send = None
    if os.path.isfile(os.path.join(d, ".k2fleet", "manifest.json")):
        # the source's manifest first (tiny; compared by checksum), so the check below is against it
        m = subprocess.run(["rsync", "-a", "--checksum", "-e", rsh, source.rstrip("/") + "/.k2fleet/manifest.json",
                            os.path.join(d, ".k2fleet", "manifest.json")], capture_output=True, text=True)
        if m.returncode:
            sys.stderr.write(m.stderr[-3000:])
            sys.exit(m.returncode)
        r = subprocess.run([sys.executable, verify_py, "--json", d], capture_output=True, text=True)
        try:
            rep = json.loads(r.stdout)
        except ValueError:
            rep = None
        if isinstance(rep, dict) and rep.get("ok"):
            send = []
        elif isinstance(rep, dict) and rep.get("problems") and all(p.get("kind") in REPAIRABLE for p in rep["problems"]):
            send = sorted({p["path"] for p in rep["problems"]})
            if all(p["kind"] == "missing" for p in rep["problems"]) and len(send) >= int(rep.get("files_total") or 0):
                send = None
    argv = ["rsync", "-a", "--partial", "--stats", "--out-format=K2SENT %n"] + ["--exclude=" + e for e in EXCLUDES] + ["-e", rsh]
    listing = None
    if send == []:
        out = {"mode": "none", "files": []}
    else:
        if send is None:
            argv += ["--delete", "--mkpath"]
        else:
            listing = tempfile.NamedTemporaryFile("w", delete=False, prefix="k2fleet-files-")
            listing.write("".join(f + "\n" for f in send)); listing.close()
            argv += ["--ignore-times", "--files-from=" + listing.name]
        argv += [source.rstrip("/") + "/", d.rstrip("/") + "/"]
        t0 = time.monotonic()
        p = subprocess.run(argv, capture_output=True, text=True)
        if listing:
            os.unlink(listing.name)
        if p.returncode:
            sys.stderr.write(p.stderr[-3000:])
            sys.exit(p.returncode)
        files = [l[7:] for l in p.stdout.splitlines() if l.startswith("K2SENT ") and not l.endswith("/")]
        stats = {}
        for k, label in (("bytes_sent", "Total bytes sent"), ("bytes_received", "Total bytes received")):
            m = re.search(label + r":\s*([\d,.]+)", p.stdout)
            stats[k] = int(re.sub(r"[,.]", "", m.group(1))) if m else 0
        out = {"mode": "full" if send is None else "repair", "asked": send, "files": files, **stats,
               "seconds": round(time.monotonic() - t0, 3)}
    out.update(source=source, dir=d, time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    line = json.dumps(out, sort_keys=True)
    print(line)
    os.makedirs(os.path.dirname(logf), exist_ok=True)
    with open(logf, "a") as f:
        f.write(line + "\n")


if __name__ == "__main__":
    main()
