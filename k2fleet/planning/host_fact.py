"""The one fact k2fleet gathers per host, as data: what :mod:`k2fleet.hostprogs.hoststate`
saw (GPUs, disk, memory, NICs, file digests, units, packages, checks, the bootstrap's
state). :mod:`k2fleet.deploy.facts` gathers it; planning decides from it
(:mod:`k2fleet.planning.preflight_checks`, :mod:`k2fleet.planning.host_actions`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


NOT_ENABLED = ("disabled", "masked", "masked-runtime")  # UnitFileState of a unit that does not start at boot


@dataclass(frozen=True)
class Gpus:
    """The GPUs as NVML reported them; ``proven_by``: the checks (a healthy engine on all of
    them) that stood in for NVML, which was not asked — then no names or memory, the vendor
    from the PCI bus and the loaded module's driver version."""

    vendor: str | None
    names: tuple[str, ...]
    memory_mib: tuple[int, ...]
    driver: str | None
    proven_by: tuple[str, ...] = ()

    @property
    def count(self) -> int:
        return len(self.names)


@dataclass(frozen=True)
class BootState:
    """What the bootstrap decides on (see :mod:`k2fleet.hostprogs.hoststate`)."""

    os: dict[str, str] = field(default_factory=dict)  # os-release ID, VERSION_ID
    kernel: str = ""
    secure_boot: bool | None = None
    hardware: dict[str, Any] = field(default_factory=dict)  # vendor, count, name, simulated
    modules: dict[str, str | None] = field(default_factory=dict)  # loaded version of nvidia / amdgpu / nvidia_peermem / gdrdrv
    nvidia_driver: dict[str, Any] = field(default_factory=dict)  # open (modules), params (hoststate.nvidia_driver)
    nouveau: bool = False
    package_versions: dict[str, str] = field(default_factory=dict)
    holds: tuple[str, ...] = ()
    reboot_required: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "BootState":
        return cls(os=data.get("os", {}), kernel=data.get("kernel", ""), secure_boot=data.get("secure_boot"),
                   hardware=data.get("hardware", {}), modules=data.get("modules", {}),
                   nvidia_driver=data.get("nvidia_driver") or {},
                   nouveau=bool(data.get("nouveau")), package_versions=data.get("package_versions", {}),
                   holds=tuple(data.get("holds", [])), reboot_required=tuple(data.get("reboot_required", [])))

    @property
    def simulated(self) -> bool:
        return bool(self.hardware.get("simulated"))


@dataclass(frozen=True)
class HostReport:
    """What :mod:`k2fleet.hostprogs.hoststate` saw on a host."""

    gpus: Gpus
    disk_free: int
    mem_total: int
    shm_size: int
    nics: dict[str, list[str]]
    ib_hcas: tuple[str, ...]
    # RDMA device → port number → state, phys_state, link_layer, rate, (RoCE) gids: index → [gid, type, netdev]
    ib_ports: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    ib_simulated: bool = False  # read from the sandbox's TEST DOUBLE tree (/etc/k2fleet-doubles/infiniband)
    files: dict[str, str | None] = field(default_factory=dict)
    exists: dict[str, bool] = field(default_factory=dict)
    globs: dict[str, list[str]] = field(default_factory=dict)
    units: dict[str, dict[str, str]] = field(default_factory=dict)
    packages: tuple[str, ...] = ()
    checks: dict[str, int | None] = field(default_factory=dict)
    boot: BootState = field(default_factory=BootState)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "HostReport":
        g = data["gpus"]
        return cls(
            gpus=Gpus(g["vendor"], tuple(g["names"]), tuple(g["memory_mib"]), g["driver"], tuple(g.get("proven_by", ()))),
            disk_free=data["disk_free"],
            mem_total=data["mem_total"],
            shm_size=data["shm_size"],
            nics=data["nics"],
            ib_hcas=tuple(data["ib_hcas"]),
            ib_ports=data.get("ib_ports", {}),
            ib_simulated=bool(data.get("ib_simulated")),
            files=data.get("files", {}),
            exists=data.get("exists", {}),
            globs=data.get("globs", {}),
            units=data.get("units", {}),
            packages=tuple(data.get("packages", [])),
            checks=data.get("checks", {}),
            boot=BootState.from_json(data.get("bootstrap", {})),
        )

    def passed(self, check: str) -> bool:
        return self.checks.get(check) == 0

    def unit_active(self, unit: str) -> bool:
        return self.units.get(unit, {}).get("ActiveState") == "active"

    def unit_enabled(self, unit: str) -> bool:
        """Does ``unit`` start at boot? False only when systemd reported it ``disabled`` or
        masked (a fact without ``UnitFileState``, or a static unit, counts as enabled)."""
        return self.units.get(unit, {}).get("UnitFileState") not in NOT_ENABLED
