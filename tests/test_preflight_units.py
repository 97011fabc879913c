"""Pure parts of the deploy: preflight rules over a HostReport, unit and mesh rendering."""

from __future__ import annotations

from pathlib import Path

from k2fleet.cli import load_plan
from k2fleet.planning.mesh_config import authorized_keys, known_hosts, sshd_config
from k2fleet.planning.host_fact import BootState, Gpus, HostReport
from k2fleet.planning.preflight_checks import check_host
from k2fleet.planning.units import env_file, unit_file
from tests.inventory_factory import write_inventory

GIB = 1024**3
ACTIVE_PORT = {"state": "4: ACTIVE", "phys_state": "5: LinkUp", "link_layer": "InfiniBand", "rate": "400 Gb/sec (4X NDR)"}
H200 = Gpus("nvidia", tuple(["NVIDIA H200"] * 8), tuple([143771] * 8), "570.148.08")


def report(**kw) -> HostReport:
    base = dict(gpus=H200, disk_free=2000 * GIB, mem_total=1024 * GIB, shm_size=512 * GIB,
                nics={"lo": ["127.0.0.1"], "ens10f0np0": ["192.0.2.10"]}, ib_hcas=("mlx5_0",),
                ib_ports={"mlx5_0": {"1": ACTIVE_PORT}})
    return HostReport(**(base | kw))


def deployment(tmp_path: Path, **data):
    inv = write_inventory(tmp_path, hosts=[("node-0", {"ssh_hostname": "192.0.2.10"})], k2_tp=8, **data)
    dep, plan = load_plan(inv)
    return dep, dep.fleet.hosts[0], plan


def test_a_fit_host_passes(tmp_path: Path) -> None:
    dep, entry, _ = deployment(tmp_path, k2_nic="ens10f0np0", k2_ib_hcas=["mlx5_0"])
    assert check_host(dep, entry, report(), checkpoint_present=False) == []


def test_each_shortfall_is_named(tmp_path: Path) -> None:
    dep, entry, _ = deployment(tmp_path, k2_nic="ens9", k2_ib_hcas=["mlx5_3"])
    problems = check_host(dep, entry, report(
        gpus=Gpus("nvidia", ("NVIDIA H100 80GB HBM3",) * 8, (81559,) * 8, "525.60"),
        disk_free=10 * GIB, shm_size=64 * 2**20, mem_total=32 * GIB,
        nics={"eth0": ["198.51.100.7"]}, ib_hcas=()), checkpoint_present=False)
    text = " | ".join(problems)
    for words in ("plan is for h200, host has NVIDIA H100", "/dev/shm is 0.1 GiB",
                  "RAM is 32.0 GiB", "the checkpoint needs", "k2_nic ens9 does not exist", "IB HCAs mlx5_3 not present",
                  "fleet address 192.0.2.10 is not on any interface"):
        assert words in text, (words, text)
    assert check_host(dep, entry, report(gpus=Gpus(None, (), (), None)), True)[0].startswith("needs 8 h200 GPUs, found 0")


def test_verified_checkpoint_needs_no_disk(tmp_path: Path) -> None:
    dep, entry, _ = deployment(tmp_path)
    assert check_host(dep, entry, report(disk_free=1 * GIB), checkpoint_present=True) == []


def sandbox_boot(count: int = 8) -> BootState:
    return BootState(hardware={"vendor": "nvidia", "count": count, "name": "NVIDIA H200", "simulated": True})


def test_simulated_gpus_refuse_real_ones(tmp_path: Path) -> None:
    dep, entry, _ = deployment(tmp_path, k2_simulated_gpus=True, k2_engine_doubles=True, k2_checkpoint_bytes=10**6)
    assert check_host(dep, entry, report(gpus=Gpus(None, (), (), None), boot=sandbox_boot()), False) == []
    assert "simulated GPUs but the host has real ones" in check_host(dep, entry, report(), False)[0]
    assert "not a k2fleet sandbox host" in check_host(dep, entry, report(gpus=Gpus(None, (), (), None)), False)[0]
    assert "needs 8 simulated GPUs, the sandbox host has 4" in check_host(
        dep, entry, report(boot=sandbox_boot(4)), False)[0]


def test_real_inventory_refuses_a_sandbox_host_and_counts_gpus_on_the_pci_bus(tmp_path: Path) -> None:
    dep, entry, _ = deployment(tmp_path)
    assert "TEST DOUBLE GPUs" in check_host(dep, entry, report(boot=sandbox_boot()), False)[0]
    bare = report(gpus=Gpus(None, (), (), None), boot=BootState(hardware={"vendor": "nvidia", "count": 8}))
    assert check_host(dep, entry, bare, False) == []  # no driver yet: the bootstrap installs it
    amd = report(gpus=Gpus(None, (), (), None), boot=BootState(hardware={"vendor": "amd", "count": 8}))
    assert check_host(dep, entry, amd, False) == ["plan is for nvidia GPUs, host has amd"]


def test_unit_gates_on_the_checkpoint_and_escapes_systemd_specials(tmp_path: Path) -> None:
    dep, _, plan = deployment(tmp_path, k2_env={"PCT": "100%"}, k2_engine_args={"chat-template": "$HOME/x%y"})
    svc = plan.hosts["node-0"].services[0]
    unit = unit_file(dep, svc)
    assert (f"ExecStartPre=/usr/bin/python3 /opt/k2fleet/lib/k2fleet-host.pyz verify --repo {dep.s.model} "
            f"--revision {dep.s.revision} {dep.checkpoint_path}") in unit
    assert "$$HOME/x%%y" in unit and "EnvironmentFile=/etc/k2fleet/env/k2-vllm.env" in unit
    assert "Restart=on-failure" in unit and "LimitMEMLOCK=infinity" in unit
    assert 'PCT="100%"' in env_file(svc)


def test_mesh_sshd_accepts_only_the_fleet(tmp_path: Path) -> None:
    inv = write_inventory(tmp_path, hosts=2, k2_tp=8)
    dep, _ = load_plan(inv)
    cfg = sshd_config(dep, dep.fleet.hosts[1])
    assert "Port 2233" in cfg and "ListenAddress 192.0.2.11" in cfg and "PasswordAuthentication no" in cfg
    assert "AllowUsers root@192.0.2.10 root@192.0.2.11" in cfg
    assert authorized_keys(dep, "ssh-ed25519 AAAA k").startswith('from="192.0.2.10,192.0.2.11",')
    kh = known_hosts(dep, {"node-0": "ssh-ed25519 AAA0 c", "node-1": "ssh-ed25519 AAA1 c"})
    assert kh == "[192.0.2.10]:2233 ssh-ed25519 AAA0\n[192.0.2.11]:2233 ssh-ed25519 AAA1\n"


def test_a_fleet_address_on_another_nic_than_k2_nic_is_refused_naming_both(tmp_path: Path) -> None:
    dep, entry, _ = deployment(tmp_path, k2_nic="ens10f0np0", k2_ib_hcas=["mlx5_0"])
    nics = {"lo": ["127.0.0.1"], "ens10f0np0": ["10.9.0.5", "fe80::1"], "bond0": ["192.0.2.10"]}
    (line,) = check_host(dep, entry, report(nics=nics), checkpoint_present=False)
    assert line == ("fleet address 192.0.2.10 is on bond0, not on k2_nic ens10f0np0 (ens10f0np0 has 10.9.0.5, fe80::1); "
                    "set k2_nic: bond0, or k2_address to ens10f0np0's address")
    # without k2_nic any interface carrying the address is fine; an IPv6 address is compared canonically
    dep, entry, _ = deployment(tmp_path / "no-nic", k2_ib_hcas=["mlx5_0"])
    assert check_host(dep, entry, report(nics=nics), checkpoint_present=False) == []
