"""Shared pytest configuration for k2fleet's tests, and THE sandbox fixture.

Every test that uses the sandbox fleet asks for ``fleet`` (or ``sandbox_fleet``): the lock of
this process's sandbox instance (``/tmp/k2sb.lock`` for instance 0) is held for the module, the
3 hosts are booted bare at its start and brought down at its end. Tests get the state they need
from it (``fleet.ensure_deployed(...)``, ``fleet.ensure_bare()``), never from an earlier test.

Under ``pytest -n 2 --dist loadgroup`` (``./dev.sh test``) xdist worker ``gwN`` drives sandbox
instance N (its own hosts, names, subnets, lock and state directory: ``k2sandbox.nspawn.INSTANCE``),
so the modules' fleets run side by side and never meet; each test module is an xdist group (one
worker, in order, its fleet booted once), and the modules that change what the whole machine shares
are one group that :func:`pytest_xdist_make_scheduler` keeps on worker gw0.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# before anything imports k2sandbox.nspawn (its names are fixed at import): worker gwN drives
# sandbox instance N; outside xdist (or with the variable set) the instance is the caller's
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER[2:].isdigit() and "K2FLEET_SANDBOX_INSTANCE" not in os.environ:
    os.environ["K2FLEET_SANDBOX_INSTANCE"] = str(min(int(_WORKER[2:]), 9))

from k2sandbox.harness import SandboxFleet  # noqa: E402

_FAILED = pytest.StashKey[bool]()


def pytest_configure(config: pytest.Config) -> None:
    """Register the markers k2fleet's tests use."""
    config.addinivalue_line(
        "markers",
        "sandbox: boots the real nspawn sandbox fleet (root; holds its instance's lock, /tmp/k2sb.lock for instance 0)",
    )


# Modules whose tests change or watch what the whole machine shares beyond a sandbox instance
# (local users and sudoers, the control machine's apt and dpkg and its /tmp, the bundle and its
# offline rehearsal's network namespace, the benches' control state and page cache, the real
# vLLM the warm-restart bench starts on the control machine, a relay's timing against an unloaded
# run): one xdist group, :data:`MACHINE_GROUP`, run on worker gw0 in order (none of them beside
# another), while the other worker takes the other modules one after another.
MACHINE_MODULES = {
    "test_sudo_uploads", "test_aptroot", "test_bundle", "test_airgap", "test_benches", "test_relay_hostile",
}
MACHINE_GROUP = "machine"


# Seconds each of the longest groups took in a whole run (./dev.sh test on this 2-core machine,
# both workers busy, warm caches, 2026-11-28, 11c3820): only their order matters, the longest handed
# out first; a group not named (a short one, :func:`next_group`) counts 1 s a test.
GROUP_SECONDS: dict[str, float] = {
    "test_rehearse_restart": 538, "test_rehearse_real_engine": 477, "test_rehearse": 297,
    "test_fault_drills_sandbox": 231, "test_company_network": 224, "test_validation": 177,
    "test_checkpoint_fleet": 176, "test_hosts_sandbox": 159, "test_e2e_sandbox": 154, "test_rehearse_fabric": 118,
    "test_upgrade_sandbox": 85, "test_ktransformers": 85, "test_status_sandbox": 75, "test_bootstrap_sandbox": 74,
    "test_down_logs_sandbox": 69, "test_instance_watch_sandbox": 67, "test_dry_run": 64, "test_reach_sandbox": 62,
    "test_gpu_exporter_sandbox": 52, "test_metrics_sandbox": 50, "test_gpu_stack_provided_sandbox": 49,
    "test_container_pin": 48, "test_firewall_sandbox": 47, "test_doubles": 46, "test_sudo_fleet": 44,
    "test_rolling_sandbox": 43, "test_scenarios": 41, "test_relay": 40,
}


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the directories test modules made at import (``REMOVE_AT_UNCONFIGURE``: files their
    parametrized cases name at collection). ``atexit`` handlers do not run in an xdist worker."""
    import shutil
    import sys

    for module in list(sys.modules.values()):
        # the module's own namespace: getattr could run a module's lazy __getattr__ (an import)
        for directory in (vars(module).get("REMOVE_AT_UNCONFIGURE", ()) if hasattr(module, "__dict__") else ()):
            shutil.rmtree(directory, ignore_errors=True)


def group_of(item: pytest.Item) -> str | None:
    """The xdist group ``item`` runs in: :data:`MACHINE_GROUP`, else its module's name (a module's
    tests run on one worker, in order: its module fixtures, a booted fleet or a shared outcome, are
    made once); None for an item of no module (a doctest: any worker)."""
    module = getattr(item, "module", None)
    if module is None:
        return None
    name = module.__name__.rsplit(".", 1)[-1]
    return MACHINE_GROUP if name in MACHINE_MODULES else name


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that asks for the sandbox fleet is a ``sandbox`` test, marked or not (so that
    ``-m "not sandbox"`` never boots or takes down the fleet another run is using); each test
    joins the xdist group :func:`group_of` names.
    ``tryfirst``: xdist's worker reads the groups in its own hook of this name (pytest-xdist 3.8,
    ``remote.py``), which otherwise ran before this one and found none
    (tests/test_xdist_groups.py)."""
    for item in items:
        if "sandbox_fleet" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.sandbox)
        if (group := group_of(item)) is not None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's: none without it (-p no:xdist)
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN201 (xdist's scheduler type)
    """Under ``--dist loadgroup``: xdist's own group scheduling (each worker given the next group
    when it has two tests left), except that the :data:`MACHINE_GROUP` goes to worker gw0 only
    (with no gw0, to the first worker: no two of its tests run at once, whatever else does), and
    the next group is :func:`next_group`'s. None: xdist's default for any other ``--dist``."""
    if config.getoption("dist", "no") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class MachineOnGw0(LoadGroupScheduling):
        def _assign_work_unit(self, node) -> None:  # noqa: ANN001
            first = next((n for n in self.nodes if n.gateway.id == "gw0"), self.nodes[0])
            if node is first and MACHINE_GROUP in self.workqueue:
                scope = MACHINE_GROUP
            else:
                running = {scope for other, scopes in self.assigned_work.items() if other is not node
                           for scope, tests in scopes.items() if not all(tests.values())}
                scope = next_group({scope: len(tests) for scope, tests in self.workqueue.items()
                                    if scope != MACHINE_GROUP}, running)
            if scope is None:
                return  # only the machine group is left, and it is gw0's: this worker idles to the end
            work_unit = self.workqueue.pop(scope)
            self.assigned_work.setdefault(node, {})[scope] = work_unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(nodeid) for nodeid, done in work_unit.items() if not done])

    return MachineOnGw0(config, log)


def next_group(waiting: dict[str, int], running: set[str]) -> str | None:
    """The group a worker takes next, of ``waiting`` (group → its number of tests) while the other
    workers run ``running``: while another worker runs a long group (:data:`GROUP_SECONDS`: a
    sandbox fleet's, busy on both cores), the longest short group, whose tests mostly wait (on a
    socket, a deadline, a child) and leave that fleet the cores; otherwise the longest long group
    (a long group taken last would end the run alone). Short groups all left to the end ran
    beside each other with 40% of the cores idle for its last ~5 minutes (2026-11-28, 11c3820).

    >>> next_group({"test_rehearse": 9, "test_reach": 12, "test_tls": 3}, set())
    'test_rehearse'
    >>> next_group({"test_rehearse": 9, "test_reach": 12, "test_tls": 3}, {"test_e2e_sandbox"})
    'test_reach'
    >>> next_group({"test_rehearse": 9}, {"test_e2e_sandbox"}), next_group({}, set())
    ('test_rehearse', None)
    """
    long_running = any(scope in GROUP_SECONDS or scope == MACHINE_GROUP for scope in running)
    short = [scope for scope in waiting if scope not in GROUP_SECONDS]
    if long_running and short:
        return max(short, key=lambda scope: waiting[scope])
    return max(waiting, key=lambda scope: GROUP_SECONDS.get(scope, waiting[scope]), default=None)


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
