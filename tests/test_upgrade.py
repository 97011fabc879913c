"""Upgrades without the sandbox (issue #36 item 1): ``k2_keep_revisions`` validated; a revision
change that would not fit on a host's disk refused in one line naming host, need and free
before any operation; the revisions host program on a real directory tree (the order it
keeps, what it never follows); the kept-revisions operation runs after the health gate and
only where the fact's check failed; an engine version change installs into a venv of its
own. The rolls themselves: tests/test_upgrade_sandbox.py."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k2fleet.cli import load_plan
from k2fleet.deploy.roles.preflight import PreflightError
from k2fleet.hostprogs import revisions
from k2fleet.inventory.spec import SpecError
from k2fleet.planning.desired import CHECKPOINT_CHECK
from k2fleet.planning.kept_revisions import VENV_CHECK
from tests.inventory_factory import write_inventory
from tests.test_roles_offline import H200, control_calls, planned, run_roles, settled_fleet  # noqa: F401 - a fixture

OTHER_SHA = "0123456789abcdef0123456789abcdef01234567"
A, B, C = "a" * 40, "b" * 40, "c" * 40
GIB = 1024**3


@pytest.mark.parametrize("value", [0, -1, "2", True])
def test_keep_revisions_is_at_least_one_and_an_integer(tmp_path: Path, value: object) -> None:
    inv = write_inventory(tmp_path, hosts=1, k2_tp=8, k2_keep_revisions=value)
    with pytest.raises(SpecError) as refused:
        load_plan(inv)
    assert refused.value.key == "k2_keep_revisions" and "\n" not in str(refused.value)
    good = write_inventory(tmp_path / "good", hosts=1, k2_tp=8, k2_keep_revisions=3)
    assert load_plan(good)[0].s.keep_revisions == 3


def test_a_revision_that_does_not_fit_is_refused_before_any_operation(tmp_path: Path, control_calls) -> None:  # noqa: F811
    """The new revision goes beside the one that serves: a host whose free disk cannot hold it
    stops the deploy in preflight, one line naming the host, the need and the free space; no
    host ran a command, the control machine fetched nothing."""
    dep, plan, desired = planned(str(H200), (f"k2_revision={OTHER_SHA}",))
    facts = settled_fleet(dep, desired)
    # both hosts still serve the old revision: the new one's gate fails; h200-1 has 100 GiB left
    for name in facts:
        facts[name] = dataclasses.replace(facts[name], checks={**facts[name].checks, CHECKPOINT_CHECK: 1})
    facts["h200-1"] = dataclasses.replace(facts["h200-1"], disk_free=100 * GIB)
    with pytest.raises(PreflightError) as refused:
        run_roles(dep, plan, desired, facts, tmp_path, control_calls)
    line = str(refused.value)
    need = int(dep.checkpoint_bytes * 1.05) / GIB
    assert "\n" not in line and line.startswith("h200-1: preflight failed: 100.0 GiB free under /srv/k2fleet/models, "
                                                f"the checkpoint needs {need:.1f} GiB"), line
    assert OTHER_SHA[:12] in line and "k2_keep_revisions 2" in line
    assert control_calls == []
    # enough room: the same change plans the fetch beside the old revision
    facts["h200-1"] = dataclasses.replace(facts["h200-1"], disk_free=4 * 10**12)
    out = run_roles(dep, plan, desired, facts, tmp_path, control_calls)
    assert "prepare_control_copy" in out.control_calls


def test_the_kept_revisions_operation_runs_after_the_health_gate_where_its_check_failed(tmp_path: Path,
                                                                                       control_calls) -> None:  # noqa: F811
    dep, plan, desired = planned(str(H200))
    kept = {k.check: k for k in desired["h200-0"].kept}
    assert set(kept) == {"checkpoint-revisions-kept", VENV_CHECK}
    assert kept["checkpoint-revisions-kept"].root == "/srv/k2fleet/models/moonshotai--Kimi-K2-Thinking"
    assert kept[VENV_CHECK].root == "/opt/k2fleet/venv" and kept[VENV_CHECK].current == "vllm-0.33.0"
    facts = settled_fleet(dep, desired)
    facts["h200-1"] = dataclasses.replace(facts["h200-1"], checks={**facts["h200-1"].checks,
                                                                   "checkpoint-revisions-kept": 1})
    out = run_roles(dep, plan, desired, facts, tmp_path, control_calls)
    prune = [n for n in out.changed("h200-1") if n.startswith("keep 2 checkpoint revision(s)")]
    assert out.changed("h200-1") == prune and out.changed("h200-0") == []  # the pruning alone, where it is due
    assert out.op("h200-1", prune[0]).commands[0].endswith(
        f"revisions /srv/k2fleet/models/moonshotai--Kimi-K2-Thinking --current {dep.s.revision} --keep 2 --kind checkpoint")
    assert not any(o.changed for n, o in out.ops["h200-1"].items() if n.startswith("keep 2 venv"))
    order = list(out.ops["h200-1"])  # the host's operation sequence
    assert order.index("health gate: /health 200 and a real chat completion") < order.index(prune[0])
    assert control_calls == []  # nothing fetched


def test_an_engine_version_change_installs_into_a_venv_of_its_own(tmp_path: Path) -> None:
    inv = write_inventory(tmp_path, hosts=1, k2_tp=8, k2_engine_version="0.10.0", k2_reasoning_parser=None)
    old, new = load_plan(inv), load_plan(write_inventory(tmp_path / "new", hosts=1, k2_tp=8))
    assert old[0].venv == "/opt/k2fleet/venv/vllm-0.10.0" and new[0].venv == "/opt/k2fleet/venv/vllm-0.33.0"
    assert old[1].hosts["node-0"].services[0].argv[0] == "/opt/k2fleet/venv/vllm-0.10.0/bin/vllm"
    assert new[1].hosts["node-0"].services[0].argv[0] == "/opt/k2fleet/venv/vllm-0.33.0/bin/vllm"


# --------------------------------------------------------------------------- the host program


def _revision(root: Path, name: str, mtime: int, size: int = 4096) -> None:
    (root / name / ".k2fleet").mkdir(parents=True)
    (root / name / "model.safetensors").write_bytes(b"x" * size)
    os.utime(root / name, ns=(mtime, mtime))


def _run(root: Path, current: str, keep: int, check: bool = False, kind: str = "checkpoint") -> tuple[int, str]:
    """The program as the hosts run it (its own process, argv as planned)."""
    argv = [sys.executable, "-m", "k2fleet.hostprogs.revisions", str(root), "--current", current, "--keep", str(keep),
            "--kind", kind, *(["--check"] if check else [])]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    return done.returncode, done.stdout + done.stderr


def test_the_revisions_kept_are_the_pinned_one_then_those_served_last(tmp_path: Path) -> None:
    root = tmp_path / "moonshotai--Kimi-K2-Thinking"
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep-me").write_text("not k2fleet's")
    for name, mtime in ((A, 1), (B, 2)):
        _revision(root, name, mtime * 10**9)
    (root / f"{A}.overlay-deepseek_v3").mkdir()
    (root / ("d" * 40)).symlink_to(outside, target_is_directory=True)  # a revision-like symlink: left alone
    (root / "notes").mkdir()  # not a revision: never touched
    (root / A / "link-out").symlink_to(outside, target_is_directory=True)  # inside a revision: unlinked, not followed

    assert _run(root, A, 2, check=True)[0] == 1  # nothing recorded yet: the deploy runs the program
    assert _run(root, A, 2) == (0, "")  # A served; B kept as the second
    assert _run(root, A, 2, check=True)[0] == 0
    assert (root / revisions.RECORD).read_text() == f"{A}\n{B}\n"
    assert _run(root, B, 2)[0] == 0 and _run(root, A, 2)[0] == 0  # B served, then back to A: both kept
    assert (root / revisions.RECORD).read_text() == f"{A}\n{B}\n"

    _revision(root, C, 5 * 10**9)  # C fetched and served: A (served before C) stays, B goes
    code, said = _run(root, C, 2)
    assert code == 0 and said.startswith(f"removed {root}/{B} (") and said.count("removed") == 1, said
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [A, f"{A}.overlay-deepseek_v3", C, "d" * 40, "notes", revisions.RECORD])
    code, said = _run(root, C, 1)  # keep 1: A and its overlay go, the symlink inside is unlinked, not followed
    assert code == 0 and f"removed {root}/{A} (" in said
    assert sorted(p.name for p in root.iterdir()) == sorted([C, "d" * 40, "notes", revisions.RECORD])
    assert (outside / "keep-me").read_text() == "not k2fleet's" and (root / ("d" * 40)).is_symlink()
    assert _run(root, C, 1, check=True)[0] == 0

    # the pinned revision must be there, or nothing is removed
    code, said = _run(root, B, 1)
    assert code == 1 and "nothing removed" in said and (root / C).is_dir()
    assert _run(root, "not-a-commit", 1)[0] == 2


def test_never_served_revisions_go_first_newest_kept(tmp_path: Path) -> None:
    root = tmp_path / "venv"
    for name, mtime in (("vllm-0.10.0", 1), ("vllm-0.11.0", 3), ("vllm-0.33.0", 2)):
        _revision(root, name, mtime * 10**9)
    (root / "bin").mkdir()  # an old single venv's own directories are not releases
    assert _run(root, "vllm-0.33.0", 2, kind="venv")[0] == 0
    assert sorted(p.name for p in root.iterdir()) == sorted(["bin", "vllm-0.11.0", "vllm-0.33.0", revisions.RECORD])
