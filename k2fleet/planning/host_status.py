"""What ``k2fleet status`` says about one host, from (its desired state, its fact) alone (pure).

:func:`host_status` turns the differences :func:`~k2fleet.planning.host_actions.host_actions`
finds (the one owner of "what differs": the deploy repairs exactly these) into named
drift items, with what the fact saw for each, and adds what the host runs: its units and
their state, the engine and its image or venv pin, the GPU driver and fabric, each
weight set's verified marker and the health check. A host with no drift is *settled*
(the deploy would plan nothing for it) and, when its checks pass, healthy.

>>> from k2fleet.planning.desired import FileSpec, HostDesired
>>> from k2fleet.planning.host_fact import Gpus, HostReport
>>> d = HostDesired("h", "10.0.0.1", files={"engine": {"/x": FileSpec(b"x", "644")}}, units=["k2-vllm.service"],
...                 checks={"healthy": ["true"]})
>>> fact = HostReport(Gpus(None, (), (), None), 0, 0, 0, {}, (), files={"/x": "0" * 64},
...                   units={"k2-vllm.service": {"ActiveState": "failed"}}, checks={"healthy": 1})
>>> for item in host_status(d, fact).drift: print(item.line())
file /x: content differs (sha256 000000000000…, planned 2d711642b726…)
unit k2-vllm.service: failed (planned active)
health healthy: failing (exit 1)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from k2fleet.planning import host_bootstrap as bootstrap
from k2fleet.planning.desired import ENGINE_SIDE_CHECK, HEALTH_CHECK, HUB_CLIENT_CHECK, IMAGE_CHECK, HostDesired
from k2fleet.planning.firewall import CHECK as FIREWALL_CHECK
from k2fleet.planning.host_actions import host_actions
from k2fleet.planning.host_fact import HostReport

# A failing check's kind (the weight sets' checks are "checkpoint"; any other: "check").
CHECK_KINDS = {HEALTH_CHECK: "health", bootstrap.GPU_GATE_CHECK: "gpu-gate", IMAGE_CHECK: "image-pin",
               ENGINE_SIDE_CHECK: "engine-side", HUB_CLIENT_CHECK: "hub-client", FIREWALL_CHECK: "firewall"}


@dataclass(frozen=True)
class Drift:
    """One difference between a host and its plan: ``kind`` (file, unit, package, hold,
    checkpoint, health, gpu-gate, ...), what (a path, unit, package or check) and what the
    fact saw."""

    kind: str
    subject: str
    detail: str

    def line(self) -> str:
        return f"{self.kind} {self.subject}: {self.detail}"

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "subject": self.subject, "detail": self.detail}


@dataclass(frozen=True)
class HostStatus:
    """One host's status (see the module doc); ``error``: the fact could not be gathered."""

    host: str
    units: dict[str, str] = field(default_factory=dict)  # unit → "active/enabled"
    checks: dict[str, str] = field(default_factory=dict)  # check → "ok" | "failing (exit N)" | "did not finish"
    engine: dict[str, Any] = field(default_factory=dict)  # engine, planned version, running version, image/venv pin
    driver: dict[str, Any] = field(default_factory=dict)  # GPUs, driver, loaded module, fabric and its services
    checkpoint: dict[str, str] = field(default_factory=dict)  # weight set check → "verified" | "not verified"
    drift: tuple[Drift, ...] = ()
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Settled and healthy: no drift (a failing check is drift) and the fact was gathered."""
        return self.error is None and not self.drift

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "ok": self.ok, "error": self.error, "units": self.units, "checks": self.checks,
                "engine": self.engine, "driver": self.driver, "checkpoint": self.checkpoint,
                "drift": [d.to_json() for d in self.drift]}


def unreachable(host: str, why: str) -> HostStatus:
    """A host whose fact could not be gathered (not connected, the probe failed)."""
    return HostStatus(host, drift=(Drift("host", host, f"not reached: {why}"),), error=why)


def _short(digest: str | None) -> str:
    return "none" if digest is None else digest[:12] + "…"


def _check_state(fact: HostReport, name: str) -> str:
    code = fact.checks.get(name)
    if code == 0:
        return "ok"
    return "did not finish" if code is None else f"failing (exit {code})"


def _unit_state(fact: HostReport, unit: str) -> str:
    seen = fact.units.get(unit, {})
    active = seen.get("ActiveState") or "unknown"
    if seen.get("LoadState") == "not-found":
        return "not installed"
    enabled = seen.get("UnitFileState")
    return f"{active}/{enabled}" if enabled else active


def _file_drift(desired: HostDesired, fact: HostReport, path: str) -> Drift:
    spec = next(files[path] for files in (*desired.files.values(), *desired.service_files.values()) if path in files)
    have = fact.files.get(path)
    if spec.content is None:
        return Drift("file", path, f"not made yet on the control machine ({spec.origin})")
    if have is None:
        return Drift("file", path, "missing")
    if spec.secret:  # a user's secret: never its digest
        return Drift("file", path, "content differs (secret)")
    return Drift("file", path, f"content differs (sha256 {_short(have)}, planned {_short(spec.sha256)})")


def _package_drift(desired: HostDesired, fact: HostReport, name: str) -> Drift:
    boot = desired.bootstrap
    have = fact.boot.package_versions.get(name)
    pkg = boot.package(name) if boot else None
    if pkg is None:
        return Drift("package", name, f"installed {have}, of another driver branch than the plan's (obsolete)")
    if have is None:
        return Drift("package", name, "not installed")
    want = bootstrap.installed_driver(boot, fact.boot) if pkg.same_as_driver else pkg.version
    return Drift("package", name, f"installed {have}, planned {want or 'the installed driver version'}")


def host_status(desired: HostDesired, fact: HostReport, engine: dict[str, Any] | None = None,
                weight_checks: tuple[str, ...] = ()) -> HostStatus:
    """The status of one host (see the module doc). ``engine``: what the plan says of the
    engine (name, planned version, runtime), shown with the image or venv pin;
    ``weight_checks``: the weight sets' checks (their failures are ``checkpoint`` drift)."""
    actions = host_actions(desired, fact)
    drift: list[Drift] = [_file_drift(desired, fact, p) for p in actions.files]
    drift += [Drift("package", p, "not installed") for p in actions.packages]
    drift += [_package_drift(desired, fact, p) for p in actions.bootstrap_packages]
    drift += [Drift("hold", p, f"not held (installed {fact.boot.package_versions.get(p) or 'nothing'})")
              for p in actions.holds]
    drift += [Drift("reboot", desired.name, actions.reboot)] if actions.reboot else []
    drift += [Drift("unit", u, "not in the plan (stale)") for u in actions.stale_units]
    drift += [Drift("unit", u, f"{_unit_state(fact, u)} (planned active)") for u in actions.start]
    drift += [Drift("unit", u, f"{_unit_state(fact, u)} (planned enabled)") for u in actions.enable]
    for name in actions.failing_checks:
        kind = "checkpoint" if name in weight_checks else CHECK_KINDS.get(name, "check")
        state = _check_state(fact, name)
        drift.append(Drift(kind, name, f"marker not verified ({state})" if kind == "checkpoint" else state))
    drift += [Drift("missing", p, "does not exist") for p in actions.missing]
    drift += [Drift("present", p, "must not exist") for p in actions.remove]

    boot = desired.bootstrap
    units = [*desired.units, *(f"{s}.service" for s in (boot.services if boot else ()))]
    info = dict(engine or {})
    if desired.image is not None:
        info["image"] = f"{desired.image.ref}@{desired.image.image_id or '(not built yet)'}"
        info["pin"] = _check_state(fact, IMAGE_CHECK) if IMAGE_CHECK in desired.checks else "unchecked"
    elif desired.engine_entry:
        info["venv"] = desired.engine_entry.rsplit("/bin/", 1)[0]
        info["pin"] = (_check_state(fact, ENGINE_SIDE_CHECK) if ENGINE_SIDE_CHECK in desired.checks else
                       ("entry present" if fact.exists.get(desired.engine_entry) else "entry missing"))
    info.setdefault("running_version", None)  # the HostState fact does not report it (yet): unknown
    driver: dict[str, Any] = {"gpus": fact.gpus.count, "gpu": fact.gpus.names[0] if fact.gpus.names else None,
                              "driver": fact.gpus.driver}
    if boot is not None:
        module = fact.boot.modules.get(bootstrap.KERNEL_MODULE.get(boot.vendor or "", ""))
        driver |= {"planned_branch": boot.driver.branch if boot.driver else None, "module": module,
                   "fabric": boot.fabric,
                   "fabric_services": {s: _unit_state(fact, f"{s}.service") for s in boot.services}}
        if bootstrap.GPU_GATE_CHECK in desired.checks:
            driver["gate"] = _check_state(fact, bootstrap.GPU_GATE_CHECK)
    return HostStatus(
        host=desired.name,
        units={u: _unit_state(fact, u) for u in dict.fromkeys(units)},
        checks={name: _check_state(fact, name) for name in sorted(desired.checks)},
        engine=info,
        driver=driver,
        checkpoint={c: "verified" if fact.passed(c) else "not verified" for c in weight_checks if c in desired.checks},
        drift=tuple(drift),
    )
