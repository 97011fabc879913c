"""Hosts named by DNS name plan IPs only (issue #22, addresses): the gate resolves every
name once, on the control machine, before planning (:mod:`k2fleet.control.addresses`), and
every argv word, environment value, mesh file and firewall rule of the plan holds the IP;
``ssh_hostname`` stays what pyinfra connects to. Offline: names come from the resolver seam,
and once from this machine's own ``localhost``. Refusals on all three entries (unresolvable
names) are cases in ``tests/test_validation.py`` (identity family)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from k2fleet.cli import load_plan, plan_document
from k2fleet.control import addresses
from k2fleet.inventory.loader import fleet_from_hosts, inventory_host_data
from k2fleet.inventory.spec import SpecError
from k2fleet.planning import deployment, mesh_config
from k2fleet.planning.desired import ControlArtifacts, desired_state
from tests.inventory_factory import write_inventory
from tests.test_validation import Listener, entry_argv, inventory, run

REPO = Path(__file__).resolve().parents[1]
SEEDS = ["h200.py", "h200-dp-ep.py", "h800-pp.py", "h200-sglang-tp16.py", "h200-sglang-pd.py", "h200-trtllm-mpi.py",
         "gb200-trtllm-disagg.py", "b200-trtllm.py"]
SEED_ADDRESS = re.compile(r'"ssh_hostname": "192\.0\.2\.(\d+)"')


class Names:
    """The resolver seam: ``gpu-N.dc1.example`` (what pyinfra connects to) and
    ``fleet-N.dc1.example`` (a ``k2_address``) → 10.77.0.N; every lookup is counted."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, name: str) -> list[str]:
        self.calls.append(name)
        match = re.fullmatch(r"(?:gpu|fleet)-(\d+)\.dc1\.example", name)
        if not match:
            raise OSError(f"{name}: Name or service not known")
        return [f"10.77.0.{match.group(1)}"]


def named_copy(tmp: Path, seed: str, k2_address_names: bool) -> Path:
    """``inventories/`` copied with ``seed``'s hosts by DNS name: ``ssh_hostname``
    ``gpu-N.dc1.example`` (192.0.2.N before), and with ``k2_address_names`` every other host
    also a ``k2_address`` ``fleet-N.dc1.example`` (which wins over its ``ssh_hostname``)."""
    shutil.copytree(REPO / "inventories", tmp / "inventories")
    path = tmp / "inventories" / seed
    count = 0

    def rename(m: re.Match[str]) -> str:
        nonlocal count
        count += 1
        n = m.group(1)
        extra = f', "k2_address": "fleet-{n}.dc1.example"' if k2_address_names and count % 2 == 0 else ""
        return f'"ssh_hostname": "gpu-{n}.dc1.example"{extra}'

    text, found = SEED_ADDRESS.subn(rename, path.read_text())
    assert found, f"{seed}: no ssh_hostname to rename"
    path.write_text(text)
    return path


def strings(value: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """Every string (and decoded bytes) in ``value`` with its path: dataclasses, mappings
    (keys too), sequences."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        for k, v in value.items():
            yield f"{path}/{k}", str(k)
            yield from strings(v, f"{path}/{k}")
    elif isinstance(value, (list, tuple, set, frozenset)):
        for i, v in enumerate(value):
            yield from strings(v, f"{path}/{i}")
    elif isinstance(value, bytes):
        yield path, value.decode("utf-8", "replace")
    elif isinstance(value, str):
        yield path, value


def artifacts(dep: deployment.Deployment, plan: Any) -> ControlArtifacts:
    """Mesh keys and a relay secret as the control step would make them, so the mesh's
    ``authorized_keys`` (``from=``) and ``known_hosts`` are rendered in full."""
    return ControlArtifacts(mesh_clients={n: (b"priv", b"ssh-ed25519 AAAA k") for n in mesh_config.mesh_links(plan)},
                            mesh_hosts={h.name: (b"hp", b"ssh-ed25519 BBBB " + h.name.encode()) for h in dep.fleet.hosts},
                            relay_secret=b"0" * 64 + b"\n")


@pytest.mark.parametrize("k2_address_names", [False, True], ids=["ssh-hostname-names", "k2-address-names"])
@pytest.mark.parametrize("seed", SEEDS)
def test_dns_names_plan_only_ips(tmp_path: Path, seed: str, k2_address_names: bool) -> None:
    inv = named_copy(tmp_path, seed, k2_address_names)
    names = Names()
    dep, plan = load_plan(inv, resolver=names)
    assert sorted(names.calls) == sorted({h.configured_address for h in dep.fleet.hosts}), "each name once"
    doc = plan_document(dep, plan)
    desired = desired_state(dep, plan, artifacts(dep, plan))
    everything = [*strings(doc, "plan"), *strings(desired, "desired"), *strings(plan, "processes")]
    leaks = [(p, text[:160]) for p, text in everything if ".dc1.example" in text and not p.endswith("/ssh_hostname")]
    assert not leaks, leaks[:5]
    for h in dep.fleet.hosts:
        ip = h.address
        assert re.fullmatch(r"10\.77\.0\.\d+", ip), (h.name, ip)
        assert doc["hosts"][h.name]["address"] == ip
        assert doc["hosts"][h.name]["address_from"] == f"{h.address_key} (resolved)"
        assert doc["hosts"][h.name]["ssh_hostname"].endswith(".dc1.example")  # pyinfra still connects by name
        if desired[h.name].firewall is not None:
            assert ip in doc["hosts"][h.name]["desired"]["firewall"]["fleet"]
    if k2_address_names:
        assert any(h.address_key == "k2_address" for h in dep.fleet.hosts) or len(dep.fleet.hosts) == 1


def test_the_engines_mesh_and_firewall_get_the_ips(tmp_path: Path) -> None:
    """What issue #22 saw leak, by name: VLLM_HOST_IP and --data-parallel-address (vLLM DP),
    mpirun's -H and the mesh sshd's ListenAddress/AllowUsers/from=/known_hosts (TRT-LLM), the
    nftables fleet set."""
    dp_inv = named_copy(tmp_path / "dp", "h200-dp-ep.py", False)
    dep, plan = load_plan(dp_inv, resolver=Names())
    head = plan.hosts["h200-0"].services[0]
    assert head.env["VLLM_HOST_IP"] == "10.77.0.30"
    assert head.argv[head.argv.index("--data-parallel-address") + 1] == "10.77.0.30"
    worker = plan.hosts["h200-1"].services[0]
    assert worker.env["VLLM_HOST_IP"] == "10.77.0.31"
    assert worker.argv[worker.argv.index("--data-parallel-address") + 1] == "10.77.0.30"

    mpi_inv = named_copy(tmp_path / "mpi", "h200-trtllm-mpi.py", False)
    dep, plan = load_plan(mpi_inv, resolver=Names())
    desired = desired_state(dep, plan, artifacts(dep, plan))
    argv = [w for s in plan.hosts["h200-0"].services for w in s.argv]
    assert "10.77.0.70:8,10.77.0.71:8" in argv
    files = {p: spec.content.decode() for role in desired["h200-1"].files.values() for p, spec in role.items()
             if spec.content is not None and not p.endswith(".pyz")}
    sshd = files["/etc/k2fleet/mesh/sshd_config"]
    assert "ListenAddress 10.77.0.71" in sshd and "AllowUsers root@10.77.0.70" in sshd, sshd
    assert 'from="10.77.0.70"' in files["/etc/k2fleet/mesh/authorized_keys"]
    assert "10.77.0.70" in files["/etc/k2fleet/firewall.nft"] and "10.77.0.71" in files["/etc/k2fleet/firewall.nft"]


def test_an_explicit_k2_address_wins_and_is_never_looked_up(tmp_path: Path) -> None:
    """A name with several addresses is refused unless k2_address chooses; then the name
    (pyinfra's ssh_hostname) is never resolved at all."""
    both = {"gpu-0.dc1.example": ["10.77.0.1", "fd00::1"], "gpu-1.dc1.example": ["10.77.0.2"]}
    calls: list[str] = []

    def resolver(name: str) -> list[str]:
        calls.append(name)
        return both[name]

    hosts = [("node-0", {"ssh_hostname": "gpu-0.dc1.example"}), ("node-1", {"ssh_hostname": "gpu-1.dc1.example"})]
    inv = write_inventory(tmp_path / "a", hosts, k2_tp=16)
    with pytest.raises(SpecError) as refused:
        load_plan(inv, resolver=resolver)
    assert refused.value.key == "ssh_hostname"
    assert "node-0's ssh_hostname gpu-0.dc1.example resolves to several addresses (10.77.0.1, fd00::1)" in str(refused.value)
    assert "set k2_address" in str(refused.value)
    calls.clear()
    hosts[0][1]["k2_address"] = "10.77.0.1"
    dep, _ = load_plan(write_inventory(tmp_path / "b", hosts, k2_tp=16), resolver=resolver)
    assert [h.address for h in dep.fleet.hosts] == ["10.77.0.1", "10.77.0.2"]
    assert calls == ["gpu-1.dc1.example"]


@pytest.mark.parametrize("answer, words", [
    ([], "resolves to no address peers can reach (nothing)"),
    (["0.0.0.0"], "resolves to no address peers can reach (0.0.0.0)"),
    (["10.77.0.9"], "hosts node-0 and node-1 (ssh_hostname gpu-1.dc1.example) both have address 10.77.0.9"),
])
def test_names_that_give_no_usable_own_address_are_one_line(tmp_path: Path, answer: list[str], words: str) -> None:
    hosts = [("node-0", {"ssh_hostname": "10.77.0.9"}), ("node-1", {"ssh_hostname": "gpu-1.dc1.example"})]
    with pytest.raises(SpecError) as refused:
        load_plan(write_inventory(tmp_path, hosts, k2_tp=16), resolver=lambda name: answer)
    assert refused.value.key == "ssh_hostname" and words in str(refused.value), str(refused.value)


def test_a_resolver_that_never_answers_is_capped(tmp_path: Path) -> None:
    inv = write_inventory(tmp_path, [("node-0", {"ssh_hostname": "gpu-0.dc1.example"})])
    fleet = fleet_from_hosts(str(inv), inventory_host_data(inv))
    started = time.monotonic()
    with pytest.raises(SpecError) as refused:
        addresses.resolve_addresses(fleet, lambda name: time.sleep(30) or [], timeout=0.3)
    assert time.monotonic() - started < 2
    assert str(refused.value).endswith("ssh_hostname: host node-0's ssh_hostname gpu-0.dc1.example does not resolve "
                                       "on this control machine (no answer within 0.3 s); set k2_address to the host's "
                                       "IP on the fleet network, or make the name resolvable here")


def test_pure_planning_refuses_a_fleet_whose_names_were_not_resolved(tmp_path: Path) -> None:
    """Planning receives IPs: a fleet that skipped the gate's resolution is refused there,
    naming the key, instead of planning the name into the engines."""
    inv = write_inventory(tmp_path, [("node-0", {"ssh_hostname": "gpu-0.dc1.example"})])
    fleet = fleet_from_hosts(str(inv), inventory_host_data(inv))
    with pytest.raises(SpecError, match="ssh_hostname: host node-0's address gpu-0.dc1.example is not an IP address"):
        deployment.resolve(fleet)
    assert deployment.resolve(addresses.resolve_addresses(fleet, Names())).fleet.hosts[0].address == "10.77.0.0"


def _localhost_is_one_address() -> bool:
    try:
        return len(addresses.system_resolver("localhost")) == 1
    except OSError:
        return False


@pytest.mark.skipif(not _localhost_is_one_address(), reason="this machine's localhost has several addresses")
def test_a_real_name_from_etc_hosts_on_every_entry(tmp_path: Path) -> None:
    """``localhost`` through the system resolver (getaddrinfo reads /etc/hosts): ``k2fleet plan
    --json`` plans its IP everywhere (the name only as ssh_hostname), validate passes, and
    pyinfra passes the gate and connects by the name."""
    (ip,) = addresses.system_resolver("localhost")
    listener = Listener()
    try:
        inv = inventory(tmp_path, [("node-0", {"ssh_hostname": "localhost"})], {}, listener.port)
        planned = run(entry_argv("plan", inv, ()))
        assert planned.returncode == 0, planned.stderr
        doc = json.loads(planned.stdout)
        host = doc["hosts"]["node-0"]
        assert (host["address"], host["address_from"], host["ssh_hostname"]) == (ip, "ssh_hostname (resolved)", "localhost")
        leaks = [p for p, text in strings(doc) if "localhost" in text and p != "/hosts/node-0/ssh_hostname"]
        assert not leaks, leaks
        text = run([sys.executable, "-m", "k2fleet.cli", "plan", str(inv)])
        assert f"== node-0 ({ip}, resolved from ssh_hostname localhost) role=serve" in text.stdout, text.stdout
        validated = run(entry_argv("validate", inv, ()))
        assert validated.returncode == 0 and validated.stdout.startswith("ok:"), validated.stderr
        deployed = run(entry_argv("pyinfra", inv, ()))
        assert not [line for line in deployed.stderr.splitlines() if line.startswith("error:")], deployed.stderr
    finally:
        listener.close()
    assert listener.count > 0, deployed.stdout + deployed.stderr  # pyinfra reached "localhost" (the listener)


def test_resolution_is_skipped_for_ip_literals() -> None:
    """Seed inventories name hosts by IP: no lookup at all (no thread, no resolver call)."""
    def never(name: str) -> list[str]:
        raise AssertionError(f"looked up {name}")

    dep, _ = load_plan(REPO / "inventories" / "h200-sglang-pd.py", resolver=never)
    assert all(h.ip is None for h in dep.fleet.hosts)
    doc = plan_document(*load_plan(REPO / "inventories" / "h200.py"))
    assert doc["hosts"]["h200-0"]["address_from"] == "ssh_hostname"
