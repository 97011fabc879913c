"""The closed fleet, offline: each host's nftables rules as data (k2fleet/planning/firewall.py),
checked by ``nft -c`` where nft is installed (dev.sh installs Debian's nftables), the desired
state and the firewall role against @fake hosts (tests/test_roles_offline.py's harness)."""

from __future__ import annotations

import dataclasses
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k2fleet.cli import load_plan, main
from k2fleet.planning import firewall as fw
from k2fleet.planning.desired import UNIT_GLOB
from k2fleet.planning.host_actions import host_actions
from tests.test_roles_offline import control_calls, planned, run_roles, settled_fleet  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[1]
INV = REPO / "inventories"
NFT = shutil.which("nft")


def rules_of(inventory: str, *data: str) -> dict[str, fw.HostFirewall | None]:
    dep, plan = load_plan(INV / inventory, list(data))
    return {name: fw.host_firewall(dep, hp) for name, hp in plan.hosts.items()}


def closed(f: fw.HostFirewall) -> set[str]:
    return {o.ports for o in f.openings if o.who == fw.FLEET}


def reject_line(text: str) -> str:
    (line,) = [l for l in text.splitlines() if "reject" in l and "the fleet only" in l]
    return line


def nft_check(text: str, tmp_path: Path) -> None:
    if NFT is None:
        pytest.skip("nft is not installed (./dev.sh installs Debian's nftables)")
    path = tmp_path / "rules.nft"
    path.write_text(text)
    proc = subprocess.run([NFT, "-c", "-f", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


SEEDS = ["h200.py", "h200-dp-ep.py", "h200-sglang-pd.py", "h200-trtllm-mpi.py", "h800-pp.py"]


@pytest.mark.parametrize("inventory", SEEDS)
def test_every_host_keeps_ssh_open_names_the_fleet_and_is_valid_nft(inventory: str, tmp_path: Path) -> None:
    dep, plan = load_plan(INV / inventory)
    fleet = sorted(h.address for h in dep.fleet.hosts)
    for name, hp in plan.hosts.items():
        f = fw.host_firewall(dep, hp)
        assert f is not None, name
        text = f.rules()
        assert sorted(f.fleet) == fleet
        assert f"elements = {{ {', '.join(f.fleet)} }}" in text
        # SSH: accepted before any reject, never in a rejected set
        lines = text.splitlines()
        ssh = next(i for i, l in enumerate(lines) if "tcp dport { 22 } accept" in l)
        assert all(i > ssh for i, l in enumerate(lines) if "reject" in l)
        assert not re.search(r"\b22\b", reject_line(text).split("reject")[0])
        # the fleet is accepted before the rejects; the chain lets everything else through
        assert "policy accept;" in text and text.index("ip saddr @fleet4 accept") < text.index("reject")
        # atomic: create, delete, define in one file; only k2fleet's table
        assert text.splitlines()[3:6] == ["table inet k2fleet", "delete table inet k2fleet", "table inet k2fleet {"]
        assert set(re.findall(r"^table (\S+ \S+)", text, re.M)) == {"inet k2fleet"}
        assert "flush ruleset" not in text
        nft_check(text, tmp_path)


def test_h200_rendezvous_ports_are_the_fleets_the_api_anyones() -> None:
    r = rules_of("h200.py")
    for f in r.values():
        assert closed(f) == {"2233", "29700", "32768-60999"}
        assert [o.ports for o in f.openings if o.who == fw.ANYONE] == ["22", "8000"]
        assert 'tcp dport { 8000 } accept comment "API: anyone' in f.rules()
        assert "{ 2233, 29700, 32768-60999 }" in reject_line(f.rules())


def test_dp_ep_closes_the_dp_rpc_port_on_the_head() -> None:
    r = rules_of("h200-dp-ep.py")
    assert "13345" in closed(r["h200-0"]) and "13345" not in closed(r["h200-1"])
    assert "{ 2233, 13345, 29700, 32768-60999 }" in reject_line(r["h200-0"].rules())


def test_sglang_pd_backends_are_the_fleets_only_the_router_serves_clients() -> None:
    r = rules_of("h200-sglang-pd.py")
    head = closed(r["prefill-0"])
    assert {"8000", "8998", "5757", "2233", "29700", "32768-60999"} <= head  # backend API, bootstrap, dist-init
    assert "8000" in closed(r["decode-0"]) and "8998" not in closed(r["decode-0"])
    router = r["router-0"]
    assert [o.ports for o in router.openings if o.who == fw.ANYONE] == ["22", "8000"]
    assert closed(router) == {"2233"}  # no engine ranks: no relay, no ephemeral range
    assert sorted(router.fleet) == sorted(f"192.0.2.{n}" for n in (50, 51, 52, 53, 59))


def test_trtllm_mpi_closes_the_mesh_and_the_ranks_ephemeral_ports() -> None:
    for f in rules_of("h200-trtllm-mpi.py").values():
        assert {"2233", "29700", "32768-60999"} <= closed(f)


def test_ray_gcs_client_server_workers_and_dashboard_are_the_fleets() -> None:
    r = rules_of("h800-pp.py")
    assert {"6379", "10001-19999", "8265"} <= closed(r["h800-0"])
    assert {"10001-19999", "8265"} <= closed(r["h800-1"]) and "6379" not in closed(r["h800-1"])


def test_api_clients_get_the_api_port_and_everyone_else_a_reset(tmp_path: Path) -> None:
    r = rules_of("h200-sglang-pd.py", 'k2_api_clients=["10.0.0.0/8", "198.51.100.7", "2001:db8::/32"]')
    text = r["router-0"].rules()
    assert "elements = { 10.0.0.0/8, 198.51.100.7 }" in text and "elements = { 2001:db8::/32 }" in text
    lines = text.splitlines()
    accept4 = lines.index("\t\ttcp dport { 8000 } ip saddr @api_clients4 accept")
    accept6 = lines.index("\t\ttcp dport { 8000 } ip6 saddr @api_clients6 accept")
    reset = next(i for i, l in enumerate(lines) if l.startswith("\t\ttcp dport { 8000 } reject"))
    fleet = next(i for i, l in enumerate(lines) if "ip saddr @fleet4 accept" in l)
    assert fleet < accept4 < accept6 < reset
    assert "api_clients" not in r["prefill-0"].rules()  # its API port is a backend: the fleet's
    nft_check(text, tmp_path)


def test_a_custom_ssh_port_inside_a_closed_range_stays_open(tmp_path: Path) -> None:
    r = rules_of("h200.py", "ssh_port=40022")
    f = r["h200-0"]
    assert [o.ports for o in f.openings if o.who == fw.ANYONE] == ["22", "40022", "8000"]
    text = f.rules()
    assert text.index("tcp dport { 22, 40022 } accept") < text.index("reject")
    nft_check(text, tmp_path)


def test_an_api_port_inside_the_ephemeral_range_stays_open(tmp_path: Path) -> None:
    f = rules_of("h200.py", "k2_port=50080")["h200-0"]
    text = f.rules()
    assert text.index('tcp dport { 50080 } accept comment "API') < text.index("reject with tcp reset comment \"rendezvous")
    nft_check(text, tmp_path)


def test_the_desired_state_holds_rules_unit_package_and_check() -> None:
    dep, plan, desired = planned(str(INV / "h200.py"))
    d = desired["h200-0"]
    files = d.files["firewall"]
    assert set(files) == {"/etc/k2fleet/firewall.nft", fw.UNIT_PATH}
    unit = files[fw.UNIT_PATH].content.decode()
    assert "ExecStart=/usr/sbin/nft -f /etc/k2fleet/firewall.nft" in unit
    assert "Before=network-pre.target k2-mesh-sshd.service k2-vllm.service" in unit
    assert "DefaultDependencies=no" in unit and "After=local-fs.target nftables.service" in unit
    assert fw.UNIT in d.units and fw.PACKAGE in d.packages and fw.PACKAGE in d.bundle_request
    digest = re.search(r'comment "k2fleet rules ([0-9a-f]{32})"', files["/etc/k2fleet/firewall.nft"].content.decode())[1]
    assert d.checks[fw.CHECK] == ["/usr/sbin/nft", "list", "chain", "inet", "k2fleet", f"rules_{digest}"]
    assert f"\tchain rules_{digest} {{\n" in files["/etc/k2fleet/firewall.nft"].content.decode()
    assert d.to_json()["firewall"]["ports"][0] == {"ports": "22", "proto": "tcp", "who": "anyone",
                                                   "what": "ssh_port: pyinfra (never closed)"}


def test_the_fleet_parsed_once_for_every_host_gives_the_same_tables() -> None:
    """Every host's table parses the fleet's addresses once in all (parsed per host, N hosts
    cost N² parses): the same rules and check as a host's table rendered with nothing parsed
    before, and a table whose fleet was replaced afterwards never takes the old fleet's."""
    dep, plan = load_plan(INV / "h200-sglang-pd.py")
    fresh = {}
    for name, hp in plan.hosts.items():
        fw._families.cache_clear()
        alone = fw.host_firewall(dep, hp)
        fresh[name] = (alone.rules(), fw.check_argv(alone))
    fw._families.cache_clear()
    tables = {name: fw.host_firewall(dep, hp) for name, hp in plan.hosts.items()}
    for name, shared in tables.items():
        assert (shared.rules(), fw.check_argv(shared)) == fresh[name]
    parsed = fw._families.cache_info()
    assert parsed.hits >= len(tables) - 1 and parsed.misses < len(tables)  # the fleet: one parse for all
    moved = dataclasses.replace(shared, fleet=("10.9.9.9",))
    assert "elements = { 10.9.9.9 }" in moved.rules() and moved.digest != shared.digest


def test_firewall_off_plans_nothing_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    dep, plan, desired = planned(str(INV / "h200.py"), ("k2_firewall=false",))
    for d in desired.values():
        assert "firewall" not in d.files and fw.UNIT not in d.units and fw.PACKAGE not in d.packages
        assert fw.CHECK not in d.checks and d.to_json()["firewall"] is None
    assert main(["plan", str(INV / "h200.py"), "--data", "k2_firewall=false"]) == 0
    assert "== firewall: off" in capsys.readouterr().out


def test_a_slurm_login_host_gets_no_table() -> None:
    dep, plan, desired = planned(str(INV / "gb200-trtllm-disagg.py"))
    (d,) = desired.values()
    assert "firewall" not in d.files and fw.PACKAGE not in d.packages


def test_plan_prints_every_port_with_who_may_reach_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(INV / "h200-sglang-pd.py"), "--data", 'k2_api_clients=["10.0.0.0/8"]']) == 0
    out = capsys.readouterr().out
    section = out[out.index("== firewall"):]
    assert "the fleet: 192.0.2.50, 192.0.2.51, 192.0.2.52, 192.0.2.53, 192.0.2.59" in section
    router = section[section.index("  router-0:"):]
    assert re.search(r"22/tcp\s+anyone \(never closed\)", router)
    assert re.search(r"8000/tcp\s+k2_api_clients 10.0.0.0/8 and the fleet", router)
    assert re.search(r"2233/tcp\s+the fleet only\s+k2_mesh_port", router)
    prefill = section[section.index("  prefill-0:"):section.index("  prefill-1:")]
    for port in ("8000", "8998", "5757", "29700", "32768-60999"):
        assert re.search(rf"{port}/tcp\s+the fleet only", prefill), port


# --------------------------------------------------------------------------- the role, on @fake hosts


def test_rules_changed_are_reloaded_atomically(tmp_path: Path, control_calls) -> None:  # noqa: F811
    dep, plan, desired = planned(str(INV / "h200.py"))
    facts = settled_fleet(dep, desired)
    rules = "/etc/k2fleet/firewall.nft"
    facts["h200-1"] = dataclasses.replace(facts["h200-1"], files={**facts["h200-1"].files, rules: "0" * 64})
    assert host_actions(desired["h200-1"], facts["h200-1"]).describe() == f"files: {rules}"
    out = run_roles(dep, plan, desired, facts, tmp_path, control_calls)
    assert f"<upload> {rules}" in out.op("h200-1", "nftables rules").commands
    reload = out.op("h200-1", "reload k2fleet's nftables table")
    assert reload.changed and reload.commands[0].startswith("systemctl reload k2-firewall.service")
    assert out.absent("h200-0", "reload k2fleet's nftables table")


def test_a_flushed_table_is_loaded_again(tmp_path: Path, control_calls) -> None:  # noqa: F811
    dep, plan, desired = planned(str(INV / "h200.py"))
    facts = settled_fleet(dep, desired)
    facts["h200-0"] = dataclasses.replace(facts["h200-0"], checks={**facts["h200-0"].checks, fw.CHECK: 1})
    assert host_actions(desired["h200-0"], facts["h200-0"]).describe() == "failing checks: firewall"
    out = run_roles(dep, plan, desired, facts, tmp_path, control_calls)
    assert out.op("h200-0", "reload k2fleet's nftables table").changed
    assert out.absent("h200-0", "nftables rules")


def test_firewall_off_removes_the_table_unit_and_file(tmp_path: Path, control_calls) -> None:  # noqa: F811
    dep0, _, before = planned(str(INV / "h200.py"))
    dep, plan, desired = planned(str(INV / "h200.py"), ("k2_firewall=false",))
    facts = settled_fleet(dep0, before)  # the hosts hold the table
    assert "stale units: k2-firewall.service" in host_actions(desired["h200-0"], facts["h200-0"]).describe()
    out = run_roles(dep, plan, desired, facts, tmp_path, control_calls)
    removal = out.op("h200-0", "remove k2fleet's nftables table")
    assert removal.changed
    assert removal.commands == ["systemctl disable --now k2-firewall.service; /usr/sbin/nft delete table inet k2fleet "
                                "2>/dev/null; rm -f /etc/systemd/system/k2-firewall.service /etc/k2fleet/firewall.nft; "
                                "systemctl daemon-reload"]
    assert out.absent("h200-0", "stop and remove k2fleet units")  # the firewall role owns its unit
    # afterwards the host is settled
    gone = dataclasses.replace(facts["h200-0"], globs={UNIT_GLOB: [p for p in facts["h200-0"].globs[UNIT_GLOB]
                                                                   if not p.endswith(fw.UNIT)]})
    assert host_actions(desired["h200-0"], gone).describe() == ""


def test_the_check_passes_on_the_loaded_rules_alone(tmp_path: Path) -> None:
    """In a network namespace of its own: the check (one ``nft list chain``) passes once the
    rules are loaded, and fails on a flushed ruleset and on another plan's table."""
    if NFT is None or shutil.which("unshare") is None:
        pytest.skip("nft or unshare is not installed")
    now = planned(str(INV / "h200.py"))[2]["h200-0"].firewall
    other = planned(str(INV / "h200.py"), ("k2_port=8001",))[2]["h200-0"].firewall
    assert now.rules() != other.rules()
    (tmp_path / "now.nft").write_text(now.rules())
    (tmp_path / "other.nft").write_text(other.rules())
    check = shlex.join(fw.check_argv(now))
    script = (f"{NFT} -f {tmp_path / 'now.nft'} && {check} >/dev/null && {NFT} flush ruleset && ! {check} 2>/dev/null"
              f" && {NFT} -f {tmp_path / 'other.nft'} && ! {check} 2>/dev/null")
    proc = subprocess.run(["unshare", "-n", "sh", "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
