"""``start_or_explain``'s shell line, run by ``sh`` against a ``systemctl`` double on PATH
(a shell script that logs its arguments and fails as told; the real systemctl on a sandbox
host runs it in tests/test_rehearse_restart.py): a start that fails at once (the cgroup
teardown race after a stop) is tried once more after ``reset-failed``; a start that failed
after its gate waited (an ``ExecStartPre`` that ran out its timeout) is not tried again,
so a deploy fails after one gate timeout, not two; a restart (whose own stop may take long)
is always tried again; either way the journal explains."""

from __future__ import annotations

import subprocess
from pathlib import Path

from k2fleet.deploy.operations import start_or_explain

SYSTEMCTL_DOUBLE = """#!/bin/sh
echo "systemctl $*" >> "$LOG"
case "$1" in
  start|restart) n=$(cat "$COUNT" 2>/dev/null || echo 0); n=$((n + 1)); echo $n > "$COUNT"
                 sleep "$START_S"; [ "$n" -ge "$OK_AT" ] ;;
  *) exit 0 ;;
esac
"""
JOURNALCTL_DOUBLE = """#!/bin/sh
echo "journalctl $*" >> "$LOG"
echo "the unit's last lines" >&2
"""


def _run(tmp_path: Path, start_s: float, ok_at: int, retry_within_s: int, verb: str = "start") -> tuple[int, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("systemctl", SYSTEMCTL_DOUBLE), ("journalctl", JOURNALCTL_DOUBLE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "LOG": str(log), "COUNT": str(tmp_path / "count"),
           "START_S": str(start_s), "OK_AT": str(ok_at)}
    proc = subprocess.run(["sh", "-c", start_or_explain("k2-vllm.service", verb, retry_within_s=retry_within_s)],
                          env=env, capture_output=True, text=True, timeout=60)
    return proc.returncode, log.read_text().splitlines()


def test_a_start_that_fails_at_once_is_tried_again_after_reset_failed(tmp_path: Path) -> None:
    rc, calls = _run(tmp_path, start_s=0, ok_at=2, retry_within_s=5)
    assert rc == 0
    assert calls == ["systemctl start k2-vllm.service", "systemctl reset-failed k2-vllm.service",
                     "systemctl start k2-vllm.service"]


def test_a_start_that_failed_after_its_gate_waited_is_not_tried_again(tmp_path: Path) -> None:
    rc, calls = _run(tmp_path, start_s=2, ok_at=2, retry_within_s=1)
    assert rc == 1
    assert calls == ["systemctl start k2-vllm.service",
                     "journalctl -u k2-vllm.service -n 30 --no-pager -o cat"]


def test_two_quick_failures_end_in_the_journal(tmp_path: Path) -> None:
    rc, calls = _run(tmp_path, start_s=0, ok_at=3, retry_within_s=5)
    assert rc == 1
    assert calls[-1] == "journalctl -u k2-vllm.service -n 30 --no-pager -o cat" and len(calls) == 4


def test_a_restart_whose_stop_took_long_is_still_tried_again(tmp_path: Path) -> None:
    rc, calls = _run(tmp_path, start_s=2, ok_at=2, retry_within_s=1, verb="restart")
    assert rc == 0
    assert calls == ["systemctl restart k2-vllm.service", "systemctl reset-failed k2-vllm.service",
                     "systemctl restart k2-vllm.service"]
