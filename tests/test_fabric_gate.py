"""The fabric gate on TEST DOUBLE ``/sys/class/infiniband`` trees (k2sandbox.fabric_doubles):
the real host probe reads the tree, the real preflight decides, before any engine starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k2fleet.cli import load_plan
from k2fleet.hostprogs import hoststate
from k2fleet.planning.host_fact import HostReport
from k2fleet.planning.preflight_checks import check_fabric, check_host
from k2sandbox import fabric_doubles as fd
from tests.inventory_factory import write_inventory

HCAS = ["mlx5_0", "mlx5_1"]
GIB = 1024**3


def entry_of(tmp_path: Path, **data):
    inv = write_inventory(tmp_path, hosts=[("node-3", {"ssh_hostname": "192.0.2.13"})], k2_tp=8,
                          k2_nic="ens10f0np0", **({"k2_ib_hcas": HCAS} | data))
    dep, _ = load_plan(inv)
    return dep, dep.fleet.hosts[0]


def probe(tmp_path: Path, devices: dict, monkeypatch: pytest.MonkeyPatch | None = None) -> HostReport:
    """The real probe's answer on a host whose RDMA tree is ``devices`` (read straight from the
    tree, as hoststate reads /sys/class/infiniband)."""
    root = fd.write_tree(tmp_path / "sys-class-infiniband", devices)
    names = hoststate.ib_hcas(str(root))
    data = {"gpus": {"vendor": "nvidia", "names": ["NVIDIA H200"] * 8, "memory_mib": [143771] * 8,
                     "driver": "570.86.15"},
            "disk_free": 4000 * GIB, "mem_total": 2048 * GIB, "shm_size": 512 * GIB,
            "nics": {"lo": ["127.0.0.1"], "ens10f0np0": ["192.0.2.13"]},
            "ib_hcas": names, "ib_ports": hoststate.ib_ports(names, str(root)), "ib_simulated": False}
    return HostReport.from_json(json.loads(json.dumps(data)))  # through JSON, as the fact travels


def test_active_ports_pass(tmp_path: Path) -> None:
    dep, entry = entry_of(tmp_path, k2_ib_link_layer="InfiniBand", k2_ib_rate_gbps=400)
    report = probe(tmp_path, fd.healthy(HCAS + ["mlx5_2"]))
    assert report.ib_ports["mlx5_0"]["1"] == {"state": "4: ACTIVE", "phys_state": "5: LinkUp",
                                              "link_layer": "InfiniBand", "rate": "400 Gb/sec (4X NDR)"}
    assert check_fabric(entry, report) == []
    assert check_host(dep, entry, report, checkpoint_present=True) == []


def test_a_down_port_is_refused_naming_hca_and_port(tmp_path: Path) -> None:
    """Only its state: the rate a DOWN port reads (10 Gb/sec SDR) is not a link trained down."""
    dep, entry = entry_of(tmp_path, k2_ib_rate_gbps=400)
    report = probe(tmp_path, fd.healthy(HCAS) | {"mlx5_1": fd.down()})
    problems = check_host(dep, entry, report, checkpoint_present=True)
    assert problems == ["HCA mlx5_1 port 1 is DOWN (physical state 2: Polling), needs ACTIVE: check the cable, "
                        "the switch port and the subnet manager (ibstat)"]
    # the preflight role's one line: host, HCA, port
    line = f"{entry.name}: preflight failed: " + "; ".join(problems)
    assert line.startswith("node-3: preflight failed: HCA mlx5_1 port 1 is DOWN") and "\n" not in line


def test_every_port_of_a_device_or_the_one_named(tmp_path: Path) -> None:
    two = {"mlx5_0": fd.PortDouble(), "mlx5_1": {1: fd.PortDouble(), 2: fd.down()}}
    _, whole = entry_of(tmp_path / "a")
    assert [p.split(" is ")[0] for p in check_fabric(whole, probe(tmp_path / "a", two))] == ["HCA mlx5_1 port 2"]
    _, port1 = entry_of(tmp_path / "b", k2_ib_hcas=["mlx5_0", "mlx5_1:1"])
    assert check_fabric(port1, probe(tmp_path / "b", two)) == []
    _, port3 = entry_of(tmp_path / "c", k2_ib_hcas=["mlx5_0", "mlx5_1:3"])
    assert check_fabric(port3, probe(tmp_path / "c", two)) == ["HCA mlx5_1 port 3 does not exist (ports: 1, 2)"]


def test_a_missing_device_is_named(tmp_path: Path) -> None:
    _, entry = entry_of(tmp_path, k2_ib_hcas=["mlx5_0", "mlx5_7"])
    assert check_fabric(entry, probe(tmp_path, fd.healthy(HCAS))) == [
        "IB HCAs mlx5_7 not present (found: mlx5_0, mlx5_1)"]


def test_wrong_link_layer(tmp_path: Path) -> None:
    _, entry = entry_of(tmp_path, k2_ib_link_layer="InfiniBand")
    problems = check_fabric(entry, probe(tmp_path, fd.healthy(HCAS, fd.roce())))
    assert problems == [f"HCA {h} port 1 link layer is Ethernet, k2_ib_link_layer is InfiniBand" for h in HCAS]


def test_wrong_rate(tmp_path: Path) -> None:
    from dataclasses import replace

    _, entry = entry_of(tmp_path, k2_ib_rate_gbps=400)
    hdr = replace(fd.PortDouble(), rate="200 Gb/sec (4X HDR)")
    assert check_fabric(entry, probe(tmp_path, fd.healthy(HCAS) | {"mlx5_0": hdr})) == [
        "HCA mlx5_0 port 1 runs at 200 Gb/sec (4X HDR), below k2_ib_rate_gbps 400: a link trained down "
        "(cable, transceiver or switch port)"]


def test_roce_needs_a_v2_gid(tmp_path: Path) -> None:
    _, entry = entry_of(tmp_path, k2_ib_link_layer="Ethernet")
    report = probe(tmp_path, fd.healthy(HCAS, fd.roce()) | {"mlx5_1": fd.roce_without_v2()})
    assert report.ib_ports["mlx5_0"]["1"]["gids"]["3"] == ["0000:0000:0000:0000:0000:ffff:0a00:000b", "RoCE v2",
                                                          "ens10f0np0"]
    assert "0" not in report.ib_ports["mlx5_1"]["1"]["gids"] or report.ib_ports["mlx5_1"]["1"]["gids"]["0"][1] != "RoCE v2"
    assert check_fabric(entry, report) == [
        "HCA mlx5_1 port 1 (RoCE) has no RoCE v2 GID: give its netdev an IP address (NCCL and NVSHMEM cannot "
        "connect over RoCE without one)"]


def test_roce_gid_index_must_be_v2(tmp_path: Path) -> None:
    _, at3 = entry_of(tmp_path / "a", k2_ib_gid_index=3)
    assert check_fabric(at3, probe(tmp_path / "a", fd.healthy(HCAS, fd.roce()))) == []
    _, at2 = entry_of(tmp_path / "b", k2_ib_gid_index=2)
    assert check_fabric(at2, probe(tmp_path / "b", fd.healthy(["mlx5_0"], fd.roce()) | {"mlx5_1": fd.roce()})) == [
        f"HCA {h} port 1 (RoCE) has no RoCE v2 GID at k2_ib_gid_index 2 (RoCE v2 GIDs at 1, 3)" for h in HCAS]


def test_the_probe_reads_the_sandbox_double_tree_and_production_refuses_it(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch,
                                                                           capfd: pytest.CaptureFixture[str]) -> None:
    """On a host with /etc/k2fleet-doubles/infiniband the probe reads that tree, marked simulated;
    a production inventory refuses it, a sandbox one (simulated GPUs) takes it."""
    double = fd.write_tree(tmp_path / "doubles", fd.healthy(HCAS) | {"mlx5_1": fd.down()})
    monkeypatch.setattr(hoststate, "SIMULATED_IB", str(double))
    capfd.readouterr()
    assert hoststate.main([json.dumps({"disk_path": str(tmp_path)})]) == 0
    report = HostReport.from_json(json.loads(capfd.readouterr().out))
    assert report.ib_simulated and report.ib_hcas == ("mlx5_0", "mlx5_1")
    assert report.ib_ports["mlx5_1"]["1"]["state"] == "1: DOWN"
    _, entry = entry_of(tmp_path / "prod")
    assert check_fabric(entry, report) == [
        "the host's RDMA devices are TEST DOUBLES (/etc/k2fleet-doubles/infiniband): a sandbox host"]
    assert [p[:25] for p in check_fabric(entry, report, sandbox=True)] == ["HCA mlx5_1 port 1 is DOWN"]


def test_hostile_port_values_stay_one_short_line(tmp_path: Path) -> None:
    _, entry = entry_of(tmp_path, k2_ib_hcas=["mlx5_0"])
    report = HostReport.from_json({
        "gpus": {"vendor": None, "names": [], "memory_mib": [], "driver": None}, "disk_free": 0, "mem_total": 0,
        "shm_size": 0, "nics": {}, "ib_hcas": ["mlx5_0"],
        "ib_ports": {"mlx5_0": {"x\n": {}, "1": {"state": "1: \x1b[31mDOWN" + "A" * 500 + "\nfake"}}}})
    (line,) = check_fabric(entry, report)
    assert "\n" not in line and "\x1b" not in line and len(line) < 200, line
