"""The bootstrap role, offline (pyinfra's ``@fake`` connector, the real pipeline): what a
bare host, a driver-branch change and a settled host get, decided from the HostState
fact. The same role runs on sandbox hosts with the TEST DOUBLE driver packages in
tests/test_bootstrap_sandbox.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from k2fleet.planning.host_bootstrap import reboot_reason
from k2fleet.planning.host_fact import BootState
from k2fleet.deploy.pipeline import RebootRefused
from tests.test_roles_offline import H200, control_calls, planned, run_roles, settled_fleet  # noqa: F401

pytestmark = pytest.mark.usefixtures("control_calls")


def with_boot(facts: dict, host: str, **changes) -> dict:
    report = facts[host]
    facts = dict(facts)
    facts[host] = dataclasses.replace(report, boot=dataclasses.replace(report.boot, **changes),
                                      checks={**report.checks, "gpu-ready": 1})
    return facts


def bare(facts: dict, host: str) -> dict:
    """``host`` as it comes from the vendor: GPUs on the PCI bus, no driver, nothing held."""
    report = facts[host]
    units = {u: {**s, "ActiveState": "inactive"} for u, s in report.units.items() if not u.startswith("k2-")}
    kernel = {n: v for n, v in report.boot.package_versions.items() if n.startswith("linux-")}
    kernel.pop("linux-headers-6.8.0-60-generic")
    facts = with_boot(facts, host, package_versions=kernel, holds=(), modules={"nvidia": None, "amdgpu": None})
    facts[host] = dataclasses.replace(facts[host], units={**report.units, **units})
    return facts


def test_bare_host_gets_driver_then_fabric_at_its_version_holds_module_services_and_gate(
        tmp_path: Path, control_calls: list[str]) -> None:
    dep, plan, desired = planned(str(H200))
    facts = bare(settled_fleet(dep, desired), "h200-1")
    out = run_roles(dep, plan, desired, facts, tmp_path, control_calls)
    install = out.op("h200-1", "install the GPU stack").commands
    line = " ".join(install)
    driver_at, fabric_at = line.index("install nvidia-open-580 'nvidia-open=580.*'"), line.index('"nvidia-fabricmanager=${v}*"')
    assert driver_at < fabric_at and "dpkg-query -W -f='${Version}' nvidia-open)" in line
    assert "linux-headers-6.8.0-60-generic" in line  # DKMS builds against the running kernel
    assert out.op("h200-1", "hold the driver").commands == [
        "apt-mark hold nvidia-open-580 nvidia-open nvidia-fabricmanager libnvidia-nscq linux-generic linux-image-generic "
        "linux-headers-generic"]
    assert out.op("h200-1", "load the GPU kernel module").commands == ["modprobe -a nvidia nvidia-uvm"]
    assert "enable --now nvidia-fabricmanager.service" in " ".join(out.op("h200-1", "enable and start the GPU services").commands)
    gate = out.op("h200-1", "GPU gate: count").commands[0]
    assert "k2fleet-host.pyz hoststate --gate" in gate and '"fabric": true' in gate and '"count": 8' in gate
    assert "reboot (if-needed): the loaded driver module changes" not in out.changed("h200-1")  # modprobe instead
    assert out.changed("h200-0") == ["health gate: /health 200 and a real chat completion"]  # the other host: settled


@pytest.mark.parametrize("rollout", ["all-at-once", "rolling"])
def test_branch_change_removes_the_old_branch_and_reboots_one_host_at_a_time(
        tmp_path: Path, control_calls: list[str], rollout: str) -> None:
    """``k2_reboot: rolling``: host by host under ``k2_rollout: all-at-once`` (then every engine
    restarts in stage order); under ``rolling`` (the default) instance by instance, each
    instance's health gate before the next one reboots, and no restart of every engine after."""
    dep, plan, desired = planned(str(H200), ("k2_driver_branch=590", "k2_reboot=rolling", f"k2_rollout={rollout}"))
    facts = settled_fleet(dep, desired)
    for host in ("h200-0", "h200-1"):  # both run 580 (nvidia-open-580, held), module 580 loaded
        old = {"nvidia-open-580": "580.95.05-1", "nvidia-fabricmanager": "580.95.05-1", "libnvidia-nscq": "580.95.05-1",
               "linux-headers-6.8.0-60-generic": "6.8.0-60.63"}
        facts = with_boot(facts, host, package_versions=old, holds=("nvidia-open-580", "nvidia-fabricmanager"),
                          modules={"nvidia": "580.95.05", "amdgpu": None})
    reasons = {h: reboot_reason(desired[h].bootstrap, facts[h].boot) for h in facts}
    assert reasons == {h: "driver 580.95.05 is loaded and the newest of branch 590 will be installed" for h in facts}
    out = run_roles(dep, plan, desired, facts, tmp_path, control_calls)
    for host in ("h200-0", "h200-1"):
        line = " ".join(out.op(host, "install the GPU stack").commands)
        assert "install nvidia-driver-pinning-590 'nvidia-open=590.*' nvidia-open-580-" in line
        assert '"nvidia-fabricmanager=${v}*"' in line and "dpkg-query -W -f='${Version}' nvidia-open)" in line
        assert "load the GPU kernel module" not in out.changed(host)  # the reboot loads it
        if rollout == "all-at-once":
            reboot = out.op(host, "reboot (rolling): the loaded driver module changes")
            assert reboot.changed and "systemctl reboot" in " ".join(reboot.commands)
            # the engine restarts in stage order after the reboots (units came back unordered at boot)
            assert "stage 0: bring k2-vllm back up (its files changed or hosts rebooted)" in out.changed(host)
            continue
        i = int(host[-1])
        reboot = out.op(host, f"rolling reboot {i + 1}/2 (serve-{i}): reboot")
        assert reboot.changed and "systemctl reboot" in " ".join(reboot.commands)
        assert not out.op(host, f"rolling reboot {2 - i}/2 (serve-{1 - i}): reboot").changed  # not in the other step
        assert f"rolling reboot {i + 1}/2 (serve-{i}): health gate of serve-{i}: /health 200 and a real chat " \
               "completion" in out.changed(host)
        assert "stage 0: bring k2-vllm back up (its files changed or hosts rebooted)" not in out.changed(host)
    if rollout == "rolling":  # the second instance reboots after the first one's health gate
        ran = [(h, n) for h, n in out.timeline if n.startswith("rolling reboot") and out.ops[h][n].changed]
        assert [(h, n.split(": ", 1)[1][:6]) for h, n in ran] == [
            ("h200-0", "reboot"), ("h200-0", "health"), ("h200-1", "reboot"), ("h200-1", "health")], ran


def test_never_stops_before_any_change_naming_every_host(tmp_path: Path, control_calls: list[str]) -> None:
    dep, plan, desired = planned(str(H200), ("k2_driver_branch=590", "k2_reboot=never"))
    facts = settled_fleet(dep, desired)
    for host in ("h200-0", "h200-1"):
        facts = with_boot(facts, host, modules={"nvidia": "580.95.05", "amdgpu": None},
                          package_versions={"nvidia-open-580": "580.95.05-1"})
    with pytest.raises(RebootRefused) as err:
        run_roles(dep, plan, desired, facts, tmp_path, control_calls)
    text = str(err.value)
    assert "h200-0 (driver 580.95.05 is loaded" in text and "h200-1 (driver 580.95.05 is loaded" in text
    assert "nothing was changed" in text and "k2_reboot: rolling" in text


def test_stale_module_nouveau_and_new_kernel_each_need_a_reboot(tmp_path: Path) -> None:
    dep, plan, desired = planned(str(H200))
    b = desired["h200-0"].bootstrap
    good = settled_fleet(dep, desired)["h200-0"].boot
    assert reboot_reason(b, good) is None
    stale = dataclasses.replace(good, modules={"nvidia": "580.82.07"})
    assert reboot_reason(b, stale) == "driver 580.82.07 is loaded but 580.95.05 is installed"
    fresh = dataclasses.replace(good, modules={"nvidia": None})
    assert reboot_reason(b, fresh) is None  # first install: modprobe, no reboot
    assert "nouveau" in reboot_reason(b, dataclasses.replace(fresh, nouveau=True))
    assert "new kernel" in reboot_reason(b, dataclasses.replace(good, reboot_required=("linux-image-6.8.0-62-generic",)))
    assert reboot_reason(b, dataclasses.replace(good, reboot_required=("libc6",))) is None


def test_preflight_refuses_another_os_and_secure_boot_without_a_key(tmp_path: Path) -> None:
    from k2fleet.planning.host_bootstrap import bootstrap_problems

    dep, plan, desired = planned(str(H200))
    b = desired["h200-0"].bootstrap
    good = settled_fleet(dep, desired)["h200-0"].boot
    assert bootstrap_problems(b, good) == []
    debian = dataclasses.replace(good, os={"id": "debian", "version_id": "12"})
    assert bootstrap_problems(b, debian) == [
        "k2_os is ubuntu-22.04 (the default) but the host runs debian 12; set k2_os: debian-12"]
    sb = dataclasses.replace(good, secure_boot=True, modules={"nvidia": None}, package_versions={})
    assert "mokutil --import" in bootstrap_problems(b, sb)[0]
    assert bootstrap_problems(b, dataclasses.replace(good, secure_boot=True)) == []  # signed and loaded already
    assert BootState().simulated is False


def test_rhel_installs_the_driver_stream_then_fabric_at_the_driver_rpm_version(tmp_path: Path) -> None:
    from k2fleet.deploy.roles.bootstrap import _repo_line, install_line

    dep, plan, desired = planned(str(H200), ("k2_os=rhel-9",))
    b = desired["h200-0"].bootstrap
    line = install_line(b, list(b.packages), [], "", ["kernel-devel-5.14.0-503.el9.x86_64"])
    steps = line.split(" && ")
    assert "dnf -y install python3-dnf-plugin-versionlock nvidia-open" in line
    assert "v=$(rpm -q --qf '%{VERSION}' nvidia-open)" in steps
    assert line.index("nvidia-open") < line.index('"nvidia-fabricmanager-${v}"') < line.index("kernel-devel-5.14")
    assert [_repo_line(r) for r in b.repos if r.kind == "dnf-module"] == ["dnf -y module enable nvidia-driver:580-open"]


def test_online_hosts_refresh_with_their_own_package_manager() -> None:
    from k2fleet.planning.os_tables import PACKAGE_MANAGERS

    assert PACKAGE_MANAGERS["apt"].refresh == "DEBIAN_FRONTEND=noninteractive apt-get -q -y update"
    assert PACKAGE_MANAGERS["dnf"].refresh == "dnf -y makecache"  # not apt-get on RHEL


def test_missing_kernel_headers_alone_are_a_difference_and_are_installed(tmp_path: Path,
                                                                          control_calls: list[str]) -> None:
    """A host with the driver stack settled but without the running kernel's headers (DKMS
    builds against them; e.g. a new kernel booted since): not settled, and the bootstrap record
    carries the headers to the install, then (as after any install) the running GPU services
    restart and the gate runs; no hold, module load or reboot."""
    from k2fleet.planning.host_actions import host_actions
    from k2fleet.planning.role_actions import role_actions

    dep, plan, desired = planned(str(H200))
    facts = settled_fleet(dep, desired)
    report = facts["h200-1"]
    versions = {n: v for n, v in report.boot.package_versions.items() if n != "linux-headers-6.8.0-60-generic"}
    facts["h200-1"] = dataclasses.replace(report, boot=dataclasses.replace(report.boot, package_versions=versions))
    assert host_actions(desired["h200-1"], facts["h200-1"]).describe() == \
        "bootstrap packages: linux-headers-6.8.0-60-generic"
    record = role_actions(dep, desired["h200-1"], facts["h200-1"]).bootstrap
    assert record is not None and record.headers == ("linux-headers-6.8.0-60-generic",)
    assert record.pending == () and record.obsolete == () and record.reboot is None
    out = run_roles(dep, plan, desired, facts, tmp_path, control_calls)
    (install,) = out.op("h200-1", "install the GPU stack").commands
    assert install.startswith("DEBIAN_FRONTEND=noninteractive apt-get ") and " && " not in install
    assert install.endswith(" install linux-headers-6.8.0-60-generic"), install
    bootstrap_ops = [n for n in out.ops["h200-1"] if n in {
        "install the GPU stack at its pins", "hold the driver, fabric and kernel packages", "load the GPU kernel module",
        "enable and start the GPU services", "restart the running GPU services whose packages changed",
        "GPU gate: count, type, driver, module, NVLink fabric, services"} or n.startswith(("reboot", "rolling reboot"))]
    assert bootstrap_ops == ["install the GPU stack at its pins", "restart the running GPU services whose packages changed",
                             "GPU gate: count, type, driver, module, NVLink fabric, services"], bootstrap_ops
    assert out.absent("h200-0", "install the GPU stack")
