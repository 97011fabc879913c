"""TEST DOUBLES of ``/sys/class/infiniband``: RDMA device trees the fabric gate reads.

Sandbox hosts (and this machine) have no HCA. The host probe
(:func:`k2fleet.hostprogs.hoststate.ib_ports`) reads a host's RDMA ports from
``/sys/class/infiniband``, or, where it exists, from the sandbox's TEST DOUBLE tree at
:data:`k2fleet.hostprogs.hoststate.SIMULATED_IB` (``/etc/k2fleet-doubles/infiniband``), which
:func:`write_tree` lays into a sandbox host's overlay before it boots (the way
:func:`k2sandbox.nspawn.write_hardware` lays the simulated GPUs). The preflight refuses that
tree outside a sandbox inventory.

What the files hold, and where each value's form comes from:

- the kernel's ABI document ``Documentation/ABI/stable/sysfs-class-infiniband`` names the
  files: ``<dev>/node_type``, ``node_guid``, ``sys_image_guid``, ``fw_ver``, ``hca_type``,
  ``board_id``; ``<dev>/ports/<n>/state``, ``phys_state``, ``rate``, ``link_layer``, ``lid``,
  ``sm_lid``, ``lmc``, ``cap_mask``, ``gids/<k>``, ``pkeys/<k>``, ``gid_attrs/types/<k>``,
  ``gid_attrs/ndevs/<k>``;
- the kernel's ``drivers/infiniband/core/sysfs.c`` prints them: ``state`` as ``"%d: %s"``
  of IB_PORT_* (``4: ACTIVE``, ``1: DOWN``, ``2: INIT``), ``phys_state`` alike (``5: LinkUp``,
  ``3: Disabled``, ``2: Polling``), ``rate`` as ``"%d%s Gb/sec (%dX%s)"`` (``400 Gb/sec (4X
  NDR)``, ``200 Gb/sec (4X HDR)``), ``node_type`` ``1: CA``; ``drivers/infiniband/core/cache.c``
  names the GID types ``IB/RoCE v1`` and ``RoCE v2``; an unused GID slot reads all zeros;
- rdma-core's ``ibstat`` (infiniband-diags) and ``ibv_devinfo`` print the same port as
  ``State: Active`` / ``Physical state: LinkUp`` / ``Rate: 400`` / ``Link layer:
  InfiniBand`` (a public ``ibstat`` output: Advanced Clustering's knowledge base, "InfiniBand
  Port States": ``CA 'mlx4_0'``, ``CA type: MT4099``, ``State: Active``, ``Physical state:
  LinkUp``, ``Rate: 40``, ``Link layer: InfiniBand``); MT4129 is a ConnectX-7 (NDR).

>>> port = PortDouble()
>>> port.state, port.phys_state, port.rate, port.link_layer
('4: ACTIVE', '5: LinkUp', '400 Gb/sec (4X NDR)', 'InfiniBand')
>>> down().state, roce().gids[3]
('1: DOWN', ('0000:0000:0000:0000:0000:ffff:0a00:000b', 'RoCE v2', 'ens10f0np0'))

A rehearsal (``k2fleet rehearse``) lays on every sandbox host the tree its inventory declares
(:func:`host_spec`, :func:`devices_of`: the ``k2_ib_hcas`` devices, their ports ACTIVE, of
``k2_ib_link_layer`` and ``k2_ib_rate_gbps``, a RoCE v2 GID at ``k2_ib_gid_index``), with the
ports ``--fabric-down HOST:HCA:PORT`` names DOWN (:func:`down`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

DOUBLE_DIR = "/etc/k2fleet-doubles/infiniband"  # = k2fleet.hostprogs.hoststate.SIMULATED_IB
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
IB_GID_SLOTS = 4  # a double's GID table (a ConnectX port has more; unused slots read all zeros)


@dataclass(frozen=True)
class PortDouble:
    """One port's files (defaults: an NDR InfiniBand port, ACTIVE, as ``ibstat`` shows a healthy one)."""

    state: str = "4: ACTIVE"
    phys_state: str = "5: LinkUp"
    rate: str = "400 Gb/sec (4X NDR)"
    link_layer: str = "InfiniBand"
    lid: str = "0x5"
    sm_lid: str = "0x1"
    # index → (GID, type, netdev); on InfiniBand GID 0 is the port GID (subnet prefix fe80:: + port GUID)
    gids: dict[int, tuple[str, str, str]] = field(default_factory=lambda: {
        0: ("fe80:0000:0000:0000:a088:c203:0045:6b1e", "IB/RoCE v1", "")})


def down() -> PortDouble:
    """A port whose cable or switch port is gone: ``1: DOWN``, ``2: Polling`` (what ``ibstat``
    shows as ``State: Down`` / ``Physical state: Polling``)."""
    return replace(PortDouble(), state="1: DOWN", phys_state="2: Polling", rate="10 Gb/sec (4X SDR)")


def roce(netdev: str = "ens10f0np0", ipv4: str | None = "10.0.0.11") -> PortDouble:
    """A RoCE port (``link_layer`` Ethernet, LID 0): the link-local GID at 0 and 1 (v1, v2) and,
    with ``ipv4``, its IPv4-mapped GIDs at 2 (v1) and 3 (v2), as mlx5 fills the table when the
    netdev gets an address; ``ipv4=None``: a netdev without address (no routable GID)."""
    local = "fe80:0000:0000:0000:0a2a:c2ff:fe11:2233"
    gids = {0: (local, "IB/RoCE v1", netdev), 1: (local, "RoCE v2", netdev)}
    if ipv4:
        a, b, c, d = (int(x) for x in ipv4.split("."))
        mapped = f"0000:0000:0000:0000:0000:ffff:{a:02x}{b:02x}:{c:02x}{d:02x}"
        gids |= {2: (mapped, "IB/RoCE v1", netdev), 3: (mapped, "RoCE v2", netdev)}
    return replace(PortDouble(), link_layer="Ethernet", rate="400 Gb/sec (4X NDR)", lid="0x0", sm_lid="0x0",
                   gids=gids)


def roce_without_v2() -> PortDouble:
    """A RoCE port whose only GIDs are link-local (its netdev has no IP address): no routable RoCE v2 GID."""
    port = roce(ipv4=None)
    return replace(port, gids={0: port.gids[0]})


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def write_device(root: Path, name: str, ports: dict[int, PortDouble], hca_type: str = "MT4129") -> None:
    """``root/<name>/`` as the kernel lays one mlx5 device (the files the gate and ``ibstat`` read)."""
    dev = root / name
    index = int(name.rsplit("_", 1)[-1]) if name.rsplit("_", 1)[-1].isdigit() else 0
    guid = f"a088:c203:0045:{0x6b00 + index:04x}"
    for file, text in (("node_type", "1: CA"), ("node_guid", guid), ("sys_image_guid", guid),
                       ("fw_ver", "28.39.1002"), ("hca_type", hca_type), ("board_id", "MT_0000000838")):
        _write(dev / file, text)
    for number, port in ports.items():
        p = dev / "ports" / str(number)
        for file in ("state", "phys_state", "rate", "link_layer", "lid", "sm_lid"):
            _write(p / file, getattr(port, file))
        _write(p / "lmc", "0")
        _write(p / "cap_mask", "0xa651e848")
        _write(p / "pkeys" / "0", "0xffff")
        for k in range(max(IB_GID_SLOTS, max(port.gids, default=0) + 1)):
            gid, kind, ndev = port.gids.get(k, (ZERO_GID, "", ""))
            _write(p / "gids" / str(k), gid)
            if gid != ZERO_GID:  # the kernel answers EINVAL for an unused slot's type; the double has no file
                _write(p / "gid_attrs" / "types" / str(k), kind)
                _write(p / "gid_attrs" / "ndevs" / str(k), ndev)


def write_tree(root: Path, devices: dict[str, PortDouble | dict[int, PortDouble]]) -> Path:
    """Lay ``devices`` (name → its port 1, or port number → port) under ``root`` (a directory
    standing for ``/sys/class/infiniband``); returns ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    for name, ports in devices.items():
        write_device(root, name, ports if isinstance(ports, dict) else {1: ports})
    return root


def healthy(names: list[str] | tuple[str, ...], port: PortDouble | None = None) -> dict[str, PortDouble]:
    """Every device in ``names`` with one healthy port (``port``: another kind, e.g. :func:`roce`)."""
    return {name: port or PortDouble() for name in names}


def write_host_doubles(upper: Path, devices: dict[str, PortDouble | dict[int, PortDouble]]) -> Path:
    """Lay the tree at :data:`DOUBLE_DIR` in a sandbox host's overlay upper dir (before it boots)."""
    return write_tree(upper / DOUBLE_DIR.lstrip("/"), devices)


# ``rate`` as the kernel prints it for a 4X link of each speed (drivers/infiniband/core/sysfs.c
# rate_show: the IB_RATE's Gb/s and the width/speed names of ib_width_enum_to_int / speed)
RATES = {100: "100 Gb/sec (4X EDR)", 200: "200 Gb/sec (4X HDR)", 400: "400 Gb/sec (4X NDR)",
         800: "800 Gb/sec (4X XDR)"}


def host_spec(hcas: list[str] | tuple[str, ...], link_layer: str | None = None, rate_gbps: int | None = None,
              gid_index: int | None = None, down_ports: list[tuple[str, int]] | tuple = ()) -> dict[str, object]:
    """The JSON description of one sandbox host's RDMA devices (what :func:`k2sandbox.nspawn.up`
    records and :func:`devices_of` lays): its inventory's fabric keys and the ports to show DOWN.

    >>> host_spec(["mlx5_0", "mlx5_1:1"], "InfiniBand", 400, down_ports=[("mlx5_1", 1)])["down"]
    [['mlx5_1', 1]]
    """
    return {"hcas": list(hcas), "link_layer": link_layer, "rate_gbps": rate_gbps, "gid_index": gid_index,
            "down": sorted([device, int(port)] for device, port in down_ports)}


def ports_of(hca: str) -> tuple[str, list[int]]:
    """(device, its ports in the double) of one ``k2_ib_hcas`` entry: port 1, and the port an
    ``HCA:PORT`` entry names.

    >>> ports_of("mlx5_0"), ports_of("mlx5_1:2")
    (('mlx5_0', [1]), ('mlx5_1', [1, 2]))
    """
    device, _, port = hca.partition(":")
    return device, sorted({1, int(port)} if port else {1})


def devices_of(spec: dict[str, object]) -> dict[str, dict[int, PortDouble]]:
    """The devices a host of ``spec`` (:func:`host_spec`) has: every port healthy as the
    inventory declares it (InfiniBand unless ``link_layer`` is Ethernet; the rate of
    ``rate_gbps``, NDR when unset; on Ethernet a RoCE v2 GID at ``gid_index`` too), the ``down``
    ones :func:`down`.

    >>> tree = devices_of(host_spec(["mlx5_0", "mlx5_1"], "InfiniBand", 200, down_ports=[("mlx5_1", 1)]))
    >>> tree["mlx5_0"][1].rate, tree["mlx5_0"][1].state, tree["mlx5_1"][1].state
    ('200 Gb/sec (4X HDR)', '4: ACTIVE', '1: DOWN')
    >>> sorted(devices_of(host_spec(["mlx5_0"], "Ethernet", gid_index=5))["mlx5_0"][1].gids)
    [0, 1, 2, 3, 5]
    """
    rate_gbps = spec.get("rate_gbps")
    rate = RATES[min((r for r in RATES if r >= int(rate_gbps)), default=max(RATES))] if rate_gbps else RATES[400]
    if spec.get("link_layer") == "Ethernet":
        port = replace(roce(), rate=rate)
        gid_index = spec.get("gid_index")
        if gid_index is not None and gid_index not in port.gids:
            port = replace(port, gids={**port.gids, int(gid_index): port.gids[3]})
    else:
        port = replace(PortDouble(), rate=rate)
    off = {(str(device), int(number)) for device, number in spec.get("down", [])}  # type: ignore[union-attr]
    devices: dict[str, dict[int, PortDouble]] = {}
    for hca in spec.get("hcas", []):  # type: ignore[union-attr]
        device, numbers = ports_of(str(hca))
        for number in numbers:
            devices.setdefault(device, {})[number] = down() if (device, number) in off else port
    return devices


def sysfs_tree_of(path: str | os.PathLike[str]) -> dict[str, list[str]]:
    """The device → ports found under a tree (a check that a double looks like what it stands for)."""
    root = Path(path)
    return {d.name: sorted(p.name for p in (d / "ports").iterdir()) for d in sorted(root.iterdir()) if d.is_dir()}
