#!/usr/bin/env python3
"""k2fleet health gate, run ON a host: a service is healthy when its readiness route
(``/health``, or ``--ready-path``) answers 200 AND a real chat completion returns a
non-empty answer, within a timeout.

    k2fleet-host.pyz health --base http://127.0.0.1:8000 --model NAME --unit k2-vllm.service --timeout 600

On failure it exits 1 naming the host and unit, with the unit's last log lines.
Standard library only (hosts have only python3).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


def get_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return None


def chat(base: str, model: str) -> str:
    body = json.dumps({
        "model": model,
        "messages": [{"role": "user", "content": "Reply with one word: ready?"}],
        "max_tokens": 16,
        "temperature": 0,
    }).encode()
    request = urllib.request.Request(f"{base}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        data = json.load(response)
    message = data["choices"][0]["message"]
    return (message.get("content") or message.get("reasoning_content") or "").strip()


class NotHealthy(Exception):
    """The service did not prove it serves the planned topology."""


def world_mismatch(base: str, expected: dict) -> str | None:
    """Compare the topology the engine reports in ``/v1/models`` metadata (k2fleet's
    engine test doubles report their parallel sizes there) with the planned one."""
    with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as response:
        data = json.load(response)
    reported = (data.get("data") or [{}])[0].get("metadata") or {}
    for key, want in sorted(expected.items()):
        if key not in reported:
            return f"topology: the engine does not report {key} (planned {want})"
        if reported[key] != want:
            return f"topology: planned {key}={want}, the engine reports {reported[key]}"
    return None


def pd_mismatch(pools: dict) -> str | None:
    """Did one completion through the PD router reach a prefill AND a decode server?
    ``pools``: {"prefill": [base URL], "decode": [base URL]}; k2fleet's SGLang test doubles
    list the bootstrap fields of the requests they answered at ``/k2fleet/pd_requests``."""
    rooms = {}
    for pool, bases in sorted(pools.items()):
        rooms[pool] = set()
        for base in bases:
            with urllib.request.urlopen(f"{base}/k2fleet/pd_requests", timeout=30) as response:
                rooms[pool] |= {r.get("bootstrap_room") for r in json.load(response).get("requests", [])}
    common = set.intersection(*rooms.values()) if rooms else set()
    if not common:
        seen = ", ".join(f"{pool}: {len(r)} request(s)" for pool, r in sorted(rooms.items()))
        return f"PD: no request reached both prefill and decode with one bootstrap_room ({seen})"
    return None


def journal_tail(unit: str, lines: int = 30) -> str:
    try:
        out = subprocess.run(["journalctl", "-u", unit, "-n", str(lines), "--no-pager", "-o", "cat"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"(no journal: {exc})"


def wait_healthy(base: str, model: str, timeout: float, expected: dict | None = None,
                 ready_path: str = "/health", pd: dict | None = None) -> str:
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        status = get_status(f"{base}{ready_path}")
        if status == 200:
            try:
                answer = chat(base, model)
                if answer and expected:
                    problem = world_mismatch(base, expected)
                    if problem:
                        raise NotHealthy(problem)  # the topology that formed is not the plan's
                if answer and pd:
                    problem = pd_mismatch(pd)
                    if problem:
                        raise NotHealthy(problem)  # the router answered without both pools
                if answer:
                    return answer
                last = "chat completion returned an empty answer"
            except (OSError, ValueError, KeyError, IndexError) as exc:
                last = f"chat completion failed: {exc}"
        else:
            last = f"{ready_path} answered {status}"
        time.sleep(1)
    raise NotHealthy(f"not healthy after {timeout:.0f}s: {last}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--unit", required=True)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--ready-path", default="/health",
                    help="readiness route that must answer 200 before the chat completion (default /health)")
    ap.add_argument("--expect-world", type=json.loads, default=None,
                    help="JSON {key: value} the engine must report in /v1/models metadata (the planned topology)")
    ap.add_argument("--expect-pd", type=json.loads, default=None,
                    help='JSON {"prefill": [URL], "decode": [URL]}: the completion must reach both pools')
    args = ap.parse_args()
    try:
        answer = wait_healthy(args.base, args.model, args.timeout, args.expect_world, args.ready_path,
                              args.expect_pd)
    except NotHealthy as exc:
        print(f"{socket.gethostname()}: {args.unit}: {exc}", file=sys.stderr)
        print(f"--- last log lines of {args.unit} ---", file=sys.stderr)
        print(journal_tail(args.unit), file=sys.stderr)
        return 1
    print(f"{socket.gethostname()}: {args.unit} healthy; completion: {answer[:60]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
