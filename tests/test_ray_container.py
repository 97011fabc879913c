"""Ray's token authentication when the engine runs in containers (``k2_runtime:
container`` over the h800-pp seed: vLLM TP8×PP2 on a Ray cluster of two hosts), offline.

The Ray head, the Ray worker and the vLLM driver each run in the engine image; each gets
the deployment's token file bound read-only at its path, ``RAY_AUTH_MODE`` and
``RAY_AUTH_TOKEN_PATH`` by name (``-e NAME``: the values are in the unit's environment
file, paths only), and Ray's session directory shared from the host (the driver reaches
the head's raylet through it, as on a venv host). The token itself reaches no argv, no
plan, no unit and no environment file: only the root-only file the hosts hold.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest

from k2fleet.cli import load_plan
from k2fleet.planning import instance_watch
from k2fleet.planning.desired import ControlArtifacts, HostDesired, desired_state
from k2fleet.planning.firewall import RAY_CLIENT_AND_WORKERS, RAY_DASHBOARD, host_firewall
from k2fleet.planning.render.common import DOCKER
from k2fleet.planning.engines.vllm.render import RAY_DIR_ARGV, RAY_ROOT, RAY_SESSION_DIR, RAY_TOKEN
from k2fleet.planning.units import env_file, unit_file

REPO = Path(__file__).resolve().parents[1]
H800_PP = str(REPO / "inventories" / "h800-pp.py")
CONTAINER = ("k2_runtime=container",)
TOKEN = b"k2-ray-token-" + b"7" * 51 + b"\n"  # what the control step would make (a stand-in)


@lru_cache(maxsize=None)
def planned(data: tuple[str, ...] = CONTAINER):
    dep, plan = load_plan(H800_PP, data=list(data))
    art = ControlArtifacts(relay_secret=b"0123456789abcdef" * 4 + b"\n", ray_token=TOKEN)
    return dep, plan, desired_state(dep, plan, art)


def ray_processes(plan) -> list[tuple[str, object]]:
    return [(h.name, s) for h in plan.hosts.values() for s in h.services if s.name in ("k2-ray", "k2-vllm")]


def test_ray_head_worker_and_driver_run_in_the_image_with_the_token_file_bound_read_only() -> None:
    dep, plan, _ = planned()
    procs = ray_processes(plan)
    assert sorted((host, s.name) for host, s in procs) == [("h800-0", "k2-ray"), ("h800-0", "k2-vllm"),
                                                           ("h800-1", "k2-ray")]
    for host, svc in procs:
        argv = svc.argv
        assert argv[:2] == [DOCKER, "run"] and dep.image in argv, (host, svc.name, argv)
        image = argv.index(dep.image)
        options, command = argv[:image], argv[image + 1:]
        # the token file, read-only at its own path; Ray's session directory shared from the host
        assert f"{RAY_TOKEN}:{RAY_TOKEN}:ro" in options and f"{RAY_ROOT}:{RAY_ROOT}" in options
        assert options[options.index(f"{RAY_TOKEN}:{RAY_TOKEN}:ro") - 1] == "-v"
        # the variables by name only; their values (paths and a mode) in the plan's env
        names = [options[i + 1] for i, w in enumerate(options) if w == "-e"]
        assert {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"} <= set(names), names
        assert not any("=" in n for n in names), names
        assert svc.env["RAY_AUTH_MODE"] == "token" and svc.env["RAY_AUTH_TOKEN_PATH"] == RAY_TOKEN
        entry = options[options.index("--entrypoint") + 1]
        assert (entry, command[0]) == (("ray", "start") if svc.name == "k2-ray" else ("vllm", "serve"))
    head = dict((s.name, s) for h, s in procs if h == "h800-0")["k2-ray"]
    assert head.argv[head.argv.index(dep.image) + 1:] == ["start", "--head", "--port", "6379", "--temp-dir",
                                                          RAY_SESSION_DIR, "--node-ip-address",
                                                          "192.0.2.20", "--num-gpus", "8", "--block"]


@pytest.mark.parametrize("data", [CONTAINER, ()], ids=["container", "venv"])
def test_ray_keeps_its_files_under_a_root_only_directory_and_the_driver_names_its_cluster(data) -> None:
    """Not the shared /tmp/ray (another local user can make it first, or reach the sockets Ray
    leaves there): every Ray process's temp root is RAY_ROOT, made 0700 by root before each
    unit starts; the vLLM driver finds the cluster by RAY_ADDRESS, not by a file in a temp dir."""
    dep, plan, _ = planned(data)
    for host, svc in ray_processes(plan):
        assert svc.env["RAY_TMPDIR"] == RAY_ROOT and RAY_DIR_ARGV in svc.pre_start, (host, svc.name)
        assert f"ExecStartPre=/usr/bin/install -d -m 0700 -o root -g root {RAY_ROOT}" in unit_file(dep, svc)
        assert "/tmp/ray" not in json.dumps([svc.argv, svc.env]) + unit_file(dep, svc)
        if svc.name == "k2-vllm":
            assert svc.env["RAY_ADDRESS"] == f"192.0.2.20:{dep.s.ray_port}"
        else:
            assert "RAY_ADDRESS" not in svc.env
    assert RAY_SESSION_DIR.startswith(RAY_ROOT + "/") and RAY_ROOT.startswith("/var/lib/k2fleet/")


def test_the_token_is_only_in_its_root_only_file() -> None:
    dep, plan, desired = planned()
    for name, d in desired.items():
        d: HostDesired
        token_file = d.files["host"][RAY_TOKEN]
        assert token_file.content == TOKEN and token_file.mode == "600", name
        everywhere = json.dumps(plan.to_json()) + json.dumps(d.to_json()) + json.dumps(
            [s.argv for s in plan.hosts[name].services]) + json.dumps([s.env for s in plan.hosts[name].services])
        texts = [unit_file(dep, s) + env_file(s) for s in plan.hosts[name].services]
        secret = TOKEN.strip().decode()
        assert secret not in everywhere and not any(secret in t for t in texts), name
        others = {p: f for group, files in d.files.items() for p, f in files.items() if p != RAY_TOKEN}
        others |= {p: f for files in d.service_files.values() for p, f in files.items()}
        assert not any(f.content and TOKEN.strip() in f.content for f in others.values()), name
        for svc in plan.hosts[name].services:
            if instance_watch.watched(svc):  # the watchdog is a host program, not in the container
                continue
            unit = unit_file(dep, svc)
            assert "Requires=docker.service" in unit and f"ExecStart={DOCKER} run" in unit, svc.name
            assert f'RAY_AUTH_TOKEN_PATH="{RAY_TOKEN}"' in env_file(svc).splitlines(), svc.name


def test_the_firewall_still_closes_rays_ports_of_the_containers() -> None:
    dep, plan, _ = planned()
    for hp in plan.hosts.values():
        fw = host_firewall(dep, hp)
        assert fw is not None
        spans = {(o.first, o.last) for o in fw.openings if o.who == "fleet"}
        assert RAY_CLIENT_AND_WORKERS in spans and (RAY_DASHBOARD, RAY_DASHBOARD) in spans, hp.name


def test_the_venv_runtime_is_unchanged_and_other_containers_get_no_ray_files() -> None:
    _, venv_plan, _ = planned(())
    for _, svc in ray_processes(venv_plan):
        assert svc.argv[0] != DOCKER and f"{RAY_ROOT}:{RAY_ROOT}" not in " ".join(svc.argv)
        assert svc.env["RAY_AUTH_TOKEN_PATH"] == RAY_TOKEN
    dep, plan = load_plan(str(REPO / "inventories" / "h200.py"), data=["k2_runtime=container"])
    for hp in plan.hosts.values():
        for svc in hp.services:
            assert svc.argv[0] == DOCKER and RAY_TOKEN not in " ".join(svc.argv) and "RAY_AUTH_MODE" not in svc.env
