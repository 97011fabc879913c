#!/usr/bin/python3
"""k2fleet-host.pyz image_pin IMAGE_REF IMAGE_ID: exit 0 only if Docker's IMAGE_REF is image IMAGE_ID.

Stdlib only (runs on hosts). A container unit runs it as ``ExecStartPre=``, so systemd
refuses to start the container when the reference (a tag, which anyone with Docker
access can move) names any other image than the one the plan pinned; the HostState
fact runs it too, to decide whether the image archive must be ``docker load``-ed.

Exit codes: 0 pinned image present; 1 the reference names another image (the message
names both IDs); 2 the reference is not present (or Docker does not answer).
"""

from __future__ import annotations

import subprocess
import sys


def image_id(ref: str) -> str | None:
    """The image ID Docker resolves ``ref`` to, or None when it has no such image."""
    try:
        done = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", ref], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, errors="replace", timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: k2fleet-host.pyz image_pin IMAGE_REF IMAGE_ID", file=sys.stderr)
        return 2
    ref, want = argv
    got = image_id(ref)
    if got is None:
        print(f"image-pin: {ref} is not present in Docker (the plan pins {want}); refusing to start", file=sys.stderr)
        return 2
    if got != want:
        print(f"image-pin: {ref} is {got}, the plan pins {want}; refusing to start a different image",
              file=sys.stderr)
        return 1
    print(f"image-pin: {ref} is {want}, as pinned")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
