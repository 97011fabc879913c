"""Host programs are standard-library only and run from the one place they are shipped to.

Every program of ``k2fleet.planning.desired.HOST_PROGRAMS`` (and the HostState probe) is copied
alone into an empty directory — as the engine role lays out ``/opt/k2fleet/lib`` — and
loaded by an isolated interpreter without site-packages (``python3 -I -S``), so an
import of anything outside the standard library (k2fleet, pydantic, ...) fails here.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k2fleet.planning.desired import HOST_PROGRAMS, REPO
from k2fleet.deploy.facts import PROBE

# As ``python3 /opt/k2fleet/lib/PROG.py`` sees it: its own directory first on sys.path.
LOAD = ("import importlib.util, os, sys; sys.path.insert(0, os.path.dirname(sys.argv[1])); "
        "spec = importlib.util.spec_from_file_location('prog', sys.argv[1]); "
        "mod = importlib.util.module_from_spec(spec); sys.modules['prog'] = mod; spec.loader.exec_module(mod); "
        "print('loaded')")


@pytest.mark.parametrize("host_path", sorted(HOST_PROGRAMS))
def test_host_program_loads_with_the_standard_library_only(tmp_path: Path, host_path: str) -> None:
    for path, rel in HOST_PROGRAMS.items():  # the directory as shipped: every program, nothing else
        shutil.copy(REPO / rel, tmp_path / Path(path).name)
    target = tmp_path / Path(host_path).name
    out = subprocess.run([sys.executable, "-S", "-E", "-s", "-c", LOAD, str(target)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "loaded", out.stderr


def test_hoststate_probe_runs_piped_with_the_standard_library_only(tmp_path: Path) -> None:
    query = '{"files": ["/etc/hostname"], "exists": ["/nonexistent"], "disk_path": "/"}'
    out = subprocess.run([sys.executable, "-S", "-E", "-s", "-", query], input=PROBE, capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert '"/nonexistent": false' in out.stdout


def test_every_host_program_is_shipped_by_the_desired_state() -> None:
    from k2fleet.cli import load_plan
    from k2fleet.planning.desired import ControlArtifacts, desired_state

    dep, plan = load_plan(REPO / "inventories" / "h200.py")
    for host in desired_state(dep, plan, ControlArtifacts()).values():
        shipped = host.files["engine"]
        assert set(HOST_PROGRAMS) <= set(shipped)
        for path, rel in HOST_PROGRAMS.items():
            assert shipped[path].content == (REPO / rel).read_bytes()
    assert shutil.which("python3")
