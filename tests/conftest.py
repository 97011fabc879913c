"""Shared pytest configuration for k2fleet's tests, and THE sandbox fixture.

Every test that uses the sandbox fleet asks for ``fleet`` (or ``sandbox_fleet``): the one
global lock (``/tmp/k2sb.lock``) is held for the module, the 3 hosts are booted bare at
its start and brought down at its end. Tests get the state they need from it
(``fleet.ensure_deployed(...)``, ``fleet.ensure_bare()``), never from an earlier test.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from k2sandbox.harness import SandboxFleet

_FAILED = pytest.StashKey[bool]()


def pytest_configure(config: pytest.Config) -> None:
    """Register the markers k2fleet's tests use."""
    config.addinivalue_line(
        "markers",
        "sandbox: boots the real nspawn sandbox fleet (root; holds /tmp/k2sb.lock)",
    )


# Modules whose tests change or take what the whole machine shares beyond the sandbox lock (local
# users and sudoers, the control machine's apt and dpkg, the engine and checkpoint caches built on
# first use, the real vLLM's CPU time): under ``pytest -n 2 --dist loadgroup`` (dev.sh test) they
# run in the one "serial" worker with every sandbox test, one at a time; the rest run beside them.
SERIAL_MODULES = {
    "test_sudo_uploads", "test_local_users", "test_squatter", "test_airgap", "test_aptroot", "test_bundle",
    "test_real_vllm", "test_benches", "test_relay",
    "test_relay_hostile", "test_checkpoint_fleet", "test_company_network", "test_ktransformers",
    "test_container_image", "test_nvidia_doubles", "test_dry_run",
}
# Modules that touch nothing the sandbox stream shares (loopback servers on free ports, their own
# temporary directories): each is its own xdist group, so its tests stay together on one worker
# (module fixtures built once) and run beside the sandbox stream instead of inside it.
LOOPBACK_MODULES = {"test_doubles", "test_relay_trust", "test_package_mirror", "test_gate_outside_checkout"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that asks for the sandbox fleet is a ``sandbox`` test, marked or not (so that
    ``-m "not sandbox"`` never boots or takes down the fleet another run is using). Sandbox,
    real-engine and :data:`SERIAL_MODULES` tests share one xdist group (one worker, in order).
    ``tryfirst``: xdist's worker reads the groups in its own hook of this name (pytest-xdist 3.8,
    ``remote.py``), which otherwise ran before this one and found none
    (tests/test_xdist_groups.py)."""
    for item in items:
        if "sandbox_fleet" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.sandbox)
        module = getattr(item, "module", None)
        name = module.__name__.rsplit(".", 1)[-1] if module is not None else ""
        if item.get_closest_marker("sandbox") or item.get_closest_marker("real_engine") or name in SERIAL_MODULES \
                or name.startswith("test_rehearse") or "sandbox" in name:
            item.add_marker(pytest.mark.xdist_group("serial"))
        elif name in LOOPBACK_MODULES:
            item.add_marker(pytest.mark.xdist_group(name))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    if outcome.get_result().failed:
        item.stash[_FAILED] = True


SANDBOX_GPUS = "h200"  # the sandbox inventories' k2_gpu (k2sandbox/inventory_data.py)


@pytest.fixture(scope="module")
def sandbox_fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SandboxFleet]:
    """The sandbox fleet, booted bare, under the sandbox lock for the whole module
    (module scope: another module's fixture, or test_bundle's own 2-host sandbox, takes
    the lock only after this one's teardown released it). A module may set
    ``SANDBOX_HOSTS = N`` (default 3), ``SANDBOX_DOCKER = False`` and ``SANDBOX_GPUS = "h200:8"``
    (simulated hardware, :func:`k2sandbox.nspawn.parse_gpus`; default the sandbox inventories'
    h200, None: hosts without the hardware file)."""
    if os.geteuid() != 0:
        pytest.skip("the sandbox fleet needs root (network namespaces, bridge, systemd-nspawn)")
    from k2sandbox import nspawn as sandbox
    from k2sandbox.checkpoint_cache import ensure_sandbox_checkpoint

    with sandbox.hold_sandbox_lock():
        ensure_sandbox_checkpoint()  # the sandbox inventories' control: source
        fleet = SandboxFleet(getattr(request.module, "SANDBOX_HOSTS", 3),
                             env={"K2FLEET_STATE_DIR": str(tmp_path_factory.mktemp("k2state"))},
                             docker=getattr(request.module, "SANDBOX_DOCKER", True),
                             hardware=sandbox.parse_gpus(gpus) if (gpus := getattr(request.module, "SANDBOX_GPUS",
                                                                                  SANDBOX_GPUS)) else None)
        try:
            yield fleet.boot_bare()
        finally:
            sandbox.down()


@pytest.fixture
def fleet(sandbox_fleet: SandboxFleet, request: pytest.FixtureRequest) -> Iterator[SandboxFleet]:
    """The module's sandbox fleet, up (re-booted bare if a test took it down); after a
    failed test its hosts' state counts as unknown."""
    yield sandbox_fleet.ensure_up()
    if request.node.stash.get(_FAILED, False):
        sandbox_fleet.forget()
