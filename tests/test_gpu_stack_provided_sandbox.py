"""``k2_gpu_stack: provided`` on sandbox hosts pre-imaged with the GPU stack, for real: the
hosts arrive as a cloud GPU image does — the TEST DOUBLE driver, fabric manager and NSCQ
(k2sandbox/driver_doubles.py) installed with ``dpkg -i`` before k2fleet ever saw them, the
driver "module" loaded and the fabric manager running, nothing held — and the deploy takes
them as they are.

One module-scoped fleet of 2 hosts (inventories/sandbox.py), tests in order: a host whose
provided driver (570) is too old for the engine (vLLM 0.33.0: CUDA 13.0) stops the deploy
before any change in one line naming host, what was found and what is needed; hosts
pre-imaged with 580 end healthy with their GPU stack's packages (``dpkg-query -W``
name=version before and after) exactly as delivered — no NVIDIA or Docker package
installed, removed, held or upgraded —, no package removed, no reboot; the re-run changes
nothing. (The deploy still installs the plan's host packages it lacks — python3-venv, nftables, … —
from the bundle, and their dependencies may move a base package such as python3.11 to the
bundle's version: the whole list is not equal, the GPU stack's is.)
"""

from __future__ import annotations

import subprocess

import pytest

from k2sandbox import nspawn as sandbox
from k2sandbox import driver_doubles as nd
from k2sandbox.harness import ssh

pytestmark = pytest.mark.sandbox
SANDBOX_HOSTS = 2
NAMES = (sandbox.host_name(1), sandbox.host_name(2))
PROVIDED = {"k2_gpu_stack": "provided"}
GPU_STACK = ("nvidia", "libnvidia", "cuda", "libnvsdm", "nvlsm", "docker", "containerd", "runc")


def image_packages(branch: int) -> list[str]:
    """The .deb files of a host image's GPU stack at ``branch``: the driver (and its branch
    meta package), fabric manager and NSCQ."""
    suffix = "" if branch >= nd.UNVERSIONED_FABRIC_SINCE else f"-{branch}"
    names = {"nvidia-open", f"nvidia-open-{branch}", f"nvidia-fabricmanager{suffix}", f"libnvidia-nscq{suffix}"}
    version = f"{nd.DRIVER_VERSIONS[branch]}-{nd.REVISION}"
    return sorted(p.filename for p in nd.double_packages() if p.name in names and p.version == version)


def pre_image(host: dict, branch: int) -> None:
    """What the vendor's image did before delivery: install the stack, boot with it (the
    module loads, the fabric manager and persistence daemon start)."""
    repo = nd.ensure_double_repo()
    debs = image_packages(branch)
    assert len(debs) == 4, debs
    ssh(host, "mkdir -p /var/tmp/image")
    subprocess.run(["scp", "-q", "-i", host["ssh_key"], "-o", "IdentitiesOnly=yes",
                    "-o", f"UserKnownHostsFile={host['ssh_known_hosts_file']}", "-o", "StrictHostKeyChecking=yes",
                    "-o", "BatchMode=yes", *(str(repo / d) for d in debs), f"root@{host['address']}:/var/tmp/image/"],
                   check=True, timeout=120)
    ssh(host, "dpkg -i /var/tmp/image/*.deb >/dev/null && rm -rf /var/tmp/image && "
              f"systemctl start {nd.MODULE_UNIT} && systemctl enable --now nvidia-persistenced nvidia-fabricmanager 2>&1")


def packages(host: dict) -> set[str]:
    return set(ssh(host, "dpkg-query -W -f='${Package}=${Version}\\n'").stdout.split())


def boots() -> dict[str, int]:
    return {row["name"]: row["boots"] for row in sandbox.status()}


def test_a_provided_driver_too_old_for_the_engine_stops_the_deploy_in_one_line(fleet) -> None:
    good, old = fleet.hosts
    pre_image(good, 580)
    pre_image(old, 570)
    assert ssh(old, "nvidia-smi --query-gpu=driver_version --format=csv,noheader | sort -u").stdout.strip() \
        == nd.DRIVER_VERSIONS[570]
    before = {h["name"]: packages(h) for h in fleet.hosts}
    result = fleet.deploy(PROVIDED)
    assert result.returncode != 0
    line = (f"{NAMES[1]}: preflight failed: the GPU stack is provided (k2_gpu_stack: provided) and cannot serve: "
            f"driver {nd.DRIVER_VERSIONS[570]} is loaded (CUDA 12.8 at most), 580.65.06 or newer is needed: "
            "vllm 0.33.0 is built with CUDA 13.0 (driver 580.65.06 or newer)")
    assert line in result.output.splitlines() or line in result.output, result.tail()
    assert f"{NAMES[0]}: preflight failed" not in result.output, result.tail()
    assert not result.ran_operations
    assert {h["name"]: packages(h) for h in fleet.hosts} == before


def test_pre_imaged_hosts_end_healthy_with_their_packages_untouched(fleet) -> None:
    fleet.boot_bare()
    for host in fleet.hosts:
        pre_image(host, 580)
    before = {h["name"]: packages(h) for h in fleet.hosts}
    booted = boots()
    result = fleet.deploy(PROVIDED)
    assert result.returncode == 0, result.tail()  # the GPU gate and the health gate passed
    for host in fleet.hosts:
        after = packages(host)
        had = before[host["name"]]
        # the GPU stack, name=version: exactly what the image had (nothing installed, removed, upgraded)
        assert sorted(p for p in after if p.startswith(GPU_STACK)) == sorted(p for p in had if p.startswith(GPU_STACK))
        names = {p.split("=", 1)[0] for p in after}
        assert not [p for p in had if p.split("=", 1)[0] not in names], "a package was removed"
        # the rest: the plan's host packages it lacks (python3-venv, nftables, ...) from the bundle, whose
        # dependencies may move a base package to the bundle's version (python3.11, libssl3)
        added = sorted(after - had)
        assert ssh(host, "apt-mark showhold").stdout.split() == []
        assert ssh(host, "test -e /etc/apt/apt.conf.d/51k2fleet-hold-drivers || echo none").stdout.strip() == "none"
        print(f"{host['name']}: {len(had)} packages before, {len(after)} after; added: {' '.join(added)}")
    assert boots() == booted  # no reboot
    again = fleet.deploy(PROVIDED)
    assert again.returncode == 0 and again.changed == 0, again.changed_operations
