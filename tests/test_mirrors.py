"""Mirrors as keys, offline: k2fleet's apt deb822 / dnf .repo files per OS, the keyrings,
pip's --index-url on hosts and on the control machine, and k2_egress: mirrors-only's nftables
output chain (checked with ``nft -c``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k2fleet.cli import load_plan, main
from k2fleet.control import wheelhouse
from k2fleet.inventory.spec import SpecError
from k2fleet.planning import firewall as fw
from k2fleet.planning import mirrors
from k2fleet.planning.desired import ControlArtifacts, desired_state, venv_install_argv
from k2fleet.planning.host_bootstrap import bootstrap_plan
from tests.inventory_factory import write_inventory
from tests.test_firewall import nft_check

KEY = b"\x99\x01\x0d" + b"k" * 64  # a binary OpenPGP public key packet's first bytes
ARMORED = b"-----BEGIN PGP PUBLIC KEY BLOCK-----\n\nmQENBF...\n-----END PGP PUBLIC KEY BLOCK-----\n"
NAMES = {"mirror.corp.example": ["192.0.2.80"], "cuda.corp.example": ["192.0.2.81", "2001:db8::81"],
         "pypi.corp.example": ["192.0.2.82"], "nvidia.github.io": ["185.199.108.153"]}


def resolver(name: str) -> list[str]:
    if name not in NAMES:
        raise OSError(f"{name}: unknown")
    return NAMES[name]


def keyring(tmp_path: Path, name: str = "corp.gpg", data: bytes = KEY) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def plan_of(tmp_path: Path, hosts=None, **data):
    inv = write_inventory(tmp_path, hosts=hosts or [("node-0", {"ssh_hostname": "192.0.2.10"})], **({"k2_tp": 8} | data))
    return load_plan(inv, resolver=resolver)


def mirrored(tmp_path: Path, **more) -> dict:
    return dict(k2_os_mirror="https://mirror.corp.example/ubuntu", k2_os_mirror_keyring=keyring(tmp_path),
                k2_nvidia_repo="https://cuda.corp.example/cuda-repos/", k2_nvidia_repo_keyring=keyring(tmp_path, "cuda.asc", ARMORED),
                k2_pypi_index="https://pypi.corp.example/simple") | more


def files_of(tmp_path: Path, **data) -> tuple[dict, object]:
    dep, plan = plan_of(tmp_path, **data)
    art = ControlArtifacts(keyrings={dep.s.os_mirror_keyring: KEY, dep.s.nvidia_repo_keyring: ARMORED})
    d = desired_state(dep, plan, art)["node-0"]
    return d.files["package_sources"], d


def test_apt_hosts_get_deb822_sources_signed_by_the_uploaded_keyrings(tmp_path: Path) -> None:
    files, d = files_of(tmp_path, **mirrored(tmp_path))
    assert set(files) == {"/etc/apt/sources.list.d/k2fleet-os.sources", "/etc/apt/sources.list.d/k2fleet-nvidia.sources",
                          "/etc/apt/keyrings/k2fleet-os.gpg", "/etc/apt/keyrings/k2fleet-nvidia.asc"}
    assert files["/etc/apt/sources.list.d/k2fleet-os.sources"].content.decode().splitlines()[1:] == [
        "Types: deb", "URIs: https://mirror.corp.example/ubuntu", "Suites: jammy jammy-updates jammy-security",
        "Components: main restricted universe multiverse", "Signed-By: /etc/apt/keyrings/k2fleet-os.gpg"]
    assert files["/etc/apt/sources.list.d/k2fleet-nvidia.sources"].content.decode().splitlines()[1:] == [
        "Types: deb", "URIs: https://cuda.corp.example/cuda-repos/ubuntu2204/x86_64/", "Suites: /",
        "Signed-By: /etc/apt/keyrings/k2fleet-nvidia.asc"]
    assert files["/etc/apt/keyrings/k2fleet-os.gpg"].content == KEY and files["/etc/apt/keyrings/k2fleet-os.gpg"].mode == "644"
    # NVIDIA's cuda-keyring package (which points apt at NVIDIA's own URL) is not installed
    (cuda,) = [r for r in d.bootstrap.repos if r.name == "cuda"]
    assert (cuda.kind, cuda.source) == ("k2fleet-file", "https://cuda.corp.example/cuda-repos/ubuntu2204/x86_64/")
    assert "developer.download.nvidia.com" not in json.dumps(d.to_json())


def test_without_a_keyring_the_distributions_own_key_signs_the_mirror(tmp_path: Path) -> None:
    files, _ = files_of(tmp_path, k2_os_mirror="https://mirror.corp.example/debian", k2_os="debian-12")
    assert set(files) == {"/etc/apt/sources.list.d/k2fleet-os.sources"}
    text = files["/etc/apt/sources.list.d/k2fleet-os.sources"].content.decode()
    assert "Suites: bookworm bookworm-updates\n" in text
    assert "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n" in text


def test_a_debian_security_mirror_is_a_second_stanza_and_a_bundle_source(tmp_path: Path) -> None:
    """Debian's security archive is a separate archive (debian-security): with
    ``k2_os_security_mirror`` the hosts' source file lists its ``bookworm-security`` suite,
    checked with the same key, and a bundle resolves it too; it is a place the hosts fetch from."""
    from k2fleet.control.airgap import _os_sources
    from k2fleet.planning.fetches import host_fetches

    data = dict(k2_os_mirror="https://mirror.corp.example/debian", k2_os="debian-12",
                k2_os_security_mirror="https://mirror.corp.example/debian-security/")
    files, _ = files_of(tmp_path, **data)
    text = files["/etc/apt/sources.list.d/k2fleet-os.sources"].content.decode()
    stanzas = [block.splitlines() for block in text.split("\n\n")]
    assert stanzas[1] == ["Types: deb", "URIs: https://mirror.corp.example/debian-security", "Suites: bookworm-security",
                          "Components: main contrib", "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg"]
    assert stanzas[0][2:4] == ["URIs: https://mirror.corp.example/debian", "Suites: bookworm bookworm-updates"]
    sources, _ = _os_sources("debian-12", "amd64", data["k2_os_mirror"], None, data["k2_os_security_mirror"])
    assert sources == ["deb https://mirror.corp.example/debian bookworm main contrib",
                       "deb https://mirror.corp.example/debian bookworm-updates main contrib",
                       "deb https://mirror.corp.example/debian-security bookworm-security main contrib"]
    dep, _ = plan_of(tmp_path, **data)
    assert ("k2_os_security_mirror", True) in {(f.key, f.declared) for f in host_fetches(dep)["node-0"]}


def test_rhel_hosts_get_dnf_repo_files(tmp_path: Path) -> None:
    files, d = files_of(tmp_path, **mirrored(tmp_path, k2_os="rocky-9", k2_os_mirror="https://mirror.corp.example/rocky/9/",
                                             k2_os_mirror_keyring=keyring(tmp_path, "rocky.asc", ARMORED)))
    os_repo = files["/etc/yum.repos.d/k2fleet-os.repo"].content.decode()
    assert "[k2fleet-os-baseos]\n" in os_repo and "baseurl=https://mirror.corp.example/rocky/9/BaseOS/x86_64/os/\n" in os_repo
    assert "baseurl=https://mirror.corp.example/rocky/9/AppStream/x86_64/os/\n" in os_repo
    assert os_repo.count("gpgcheck=1\n") == 2 and "gpgkey=file:///etc/pki/rpm-gpg/RPM-GPG-KEY-k2fleet-os\n" in os_repo
    cuda = files["/etc/yum.repos.d/k2fleet-nvidia.repo"].content.decode()
    assert "baseurl=https://cuda.corp.example/cuda-repos/rhel9/x86_64/\n" in cuda
    assert "/etc/pki/rpm-gpg/RPM-GPG-KEY-k2fleet-nvidia" in files


def test_a_binary_keyring_is_refused_for_dnf_hosts(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="k2_os_mirror_keyring: .* armored"):
        plan_of(tmp_path, **mirrored(tmp_path, k2_os="rhel-9"))


def test_pip_takes_the_index_on_hosts_and_on_the_control_machine(tmp_path: Path) -> None:
    dep, _ = plan_of(tmp_path, **mirrored(tmp_path))
    line = venv_install_argv(dep, "python3.11")[2]
    offline, online = line.split(" || ")
    assert "--no-index" in offline and "--index-url" not in offline
    # no byte-compiling at install, either way (k2fleet.planning.desired.PIP_INSTALL: ~78 s of a vLLM install)
    assert "/bin/pip install --no-compile " in offline and "/bin/pip install --no-compile " in online
    assert online.endswith("--index-url https://pypi.corp.example/simple")
    dep, _ = plan_of(tmp_path / "default")
    assert "--index-url" not in venv_install_argv(dep, "python3.11")[2]
    argv = wheelhouse.pip_download_argv(["x==1"], tmp_path, "3.11", wheelhouse.PLATFORMS["x86_64"], index=dep.s.pypi_index)
    assert "--index-url" not in argv


def test_the_wheelhouse_build_runs_pip_download_against_the_index(tmp_path: Path, monkeypatch) -> None:
    seen: list[list[str]] = []

    class Proc:
        def __init__(self, argv, **kw):
            seen.append(argv)
            self.stdout, self.stderr = iter(()), type("E", (), {"read": lambda self: ""})()

        def wait(self):
            return 0

    monkeypatch.setattr(wheelhouse.subprocess, "Popen", Proc)
    wheelhouse.ensure_wheelhouse(["x==1"], tmp_path, ("3.11",), ("x86_64",), index="https://pypi.corp.example/simple")
    (argv,) = seen
    assert argv[argv.index("--index-url") + 1] == "https://pypi.corp.example/simple"


def test_plan_notes_a_debian_mirror_read_without_its_security_archive(tmp_path: Path, capsys) -> None:
    """A current Debian host can hold packages newer than a mirror of the main archive has (its
    python3.11 from bookworm-security), which apt cannot install python3-venv beside: k2fleet
    cannot see that before it connects, so ``k2fleet plan`` says so, and not once the security
    mirror is set or on Ubuntu (whose -security pocket is in k2_os_mirror itself)."""
    def notes(**data) -> list[str]:
        where = tmp_path / str(len(list(tmp_path.iterdir())))
        where.mkdir()
        inv = write_inventory(where, hosts=[("node-0", {"ssh_hostname": "192.0.2.10"})], k2_tp=8, **data)
        assert main(["plan", str(inv)]) == 0
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith("# note: k2_os_mirror")]

    debian = dict(k2_os="debian-12", k2_os_mirror="https://mirror.corp.example/debian")
    [note] = notes(**debian)
    assert "k2_os_security_mirror" in note and "debian-12" in note and "python3-venv" in note
    assert notes(**debian, k2_os_security_mirror="https://mirror.corp.example/debian-security") == []
    assert notes(k2_os_mirror="https://mirror.corp.example/ubuntu") == []
    assert notes(k2_os="debian-12") == []


def test_plan_json_shows_the_sources_and_the_index(tmp_path: Path, capsys) -> None:
    inv = write_inventory(tmp_path, hosts=[("node-0", {"ssh_hostname": "192.0.2.10"})], k2_tp=8,
                          k2_os_mirror="https://mirror.corp.example/ubuntu", k2_pypi_index="https://pypi.corp.example/simple")
    assert main(["plan", str(inv), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    text = json.dumps(out)
    assert "/etc/apt/sources.list.d/k2fleet-os.sources" in text and "--index-url https://pypi.corp.example/simple" in text


@pytest.mark.parametrize("data, key, words", [
    ({"k2_nvidia_repo": "https://cuda.corp.example/r"}, "k2_nvidia_repo", "k2_nvidia_repo_keyring"),
    ({"k2_os_mirror_keyring": "/etc/hostname"}, "k2_os_mirror_keyring", "k2_os_mirror, which is not set"),
    ({"k2_os_mirror": "http://mirror.corp.example/ubuntu"}, "k2_os_mirror", "https"),
    ({"k2_pypi_index": "https://u:pw@pypi.corp.example/simple"}, "k2_pypi_index", "user:password@"),
    ({"k2_egress": "mirrors-only", "k2_firewall": False}, "k2_egress", "k2_firewall"),
    ({"k2_egress": "mirrors-only"}, "k2_egress", "k2_os_mirror"),
    ({"k2_egress": "mirrors-only", "k2_os_mirror": "https://unknown.corp.example/ubuntu",
      "k2_nvidia_repo": "https://cuda.corp.example/r", "k2_nvidia_repo_keyring": "KEYRING",
      "k2_pypi_index": "https://pypi.corp.example/simple"}, "k2_egress", "does not resolve"),
    ({"k2_container_toolkit_repo": "https://ctk.corp.example/c"}, "k2_container_toolkit_repo",
     "k2_container_toolkit_repo_keyring"),
    ({"k2_docker_repo": "https://docker.corp.example/rhel"}, "k2_docker_repo", "k2_docker_repo_keyring"),
    ({"k2_docker_repo_keyring": "/etc/hostname"}, "k2_docker_repo_keyring", "k2_docker_repo, which is not set"),
    ({"k2_container_toolkit_repo_keyring": "/etc/hostname"}, "k2_container_toolkit_repo_keyring",
     "k2_container_toolkit_repo, which is not set"),
    ({"k2_docker_repo": "http://docker.corp.example/rhel"}, "k2_docker_repo", "https"),
    ({"k2_os_security_mirror": "https://mirror.corp.example/debian-security", "k2_os": "debian-12"},
     "k2_os_security_mirror", "k2_os_mirror, which is not set"),
    ({"k2_os_security_mirror": "https://mirror.corp.example/debian-security",
      "k2_os_mirror": "https://mirror.corp.example/ubuntu"}, "k2_os_security_mirror", "runs ubuntu-22.04"),
    ({"k2_os_security_mirror": "https://u:pw@mirror.corp.example/debian-security", "k2_os": "debian-12",
      "k2_os_mirror": "https://mirror.corp.example/debian"}, "k2_os_security_mirror", "user:password@"),
])
def test_mirror_keys_are_refused_with_one_line(tmp_path: Path, data, key, words) -> None:
    data = {k: keyring(tmp_path) if v == "KEYRING" else v for k, v in data.items()}
    with pytest.raises(SpecError) as exc:
        plan_of(tmp_path, **data)
    assert exc.value.key == key and words in exc.value.message, str(exc.value)


def test_egress_mirrors_only_allows_the_fleet_and_the_plans_mirrors(tmp_path: Path) -> None:
    hosts = [("node-0", {"ssh_hostname": "192.0.2.10"}), ("node-1", {"ssh_hostname": "192.0.2.11"})]
    dep, plan = plan_of(tmp_path, hosts=hosts, k2_tp=16, k2_egress="mirrors-only", **mirrored(tmp_path))
    assert fw.egress_names(dep) == ["cuda.corp.example", "mirror.corp.example", "pypi.corp.example"]
    f = fw.host_firewall(dep, plan.hosts["node-0"])
    assert f is not None and set(f.egress) == {"192.0.2.80", "192.0.2.81", "2001:db8::81", "192.0.2.82"}
    text = f.rules()
    out = text[text.index("chain output"):]
    assert "hook output priority filter; policy accept;" in out
    assert out.index("ct state established,related accept") < out.index("ip daddr @egress4 accept") < out.index("reject")
    assert "ip daddr @fleet4 accept" in out and "udp dport 53 accept" in out and "ipv6-icmp" in out
    assert "elements = { 192.0.2.80, 192.0.2.81, 192.0.2.82 }" in text and "elements = { 2001:db8::81 }" in text
    nft_check(text, tmp_path)
    assert f.to_json()["egress"]["names"] == fw.egress_names(dep)


def test_egress_without_a_cuda_mirror_is_refused_naming_the_key(tmp_path: Path) -> None:
    """#34: mirrors-only means the fleet and the inventory's mirrors: a host that would fetch from
    NVIDIA's own server (k2_nvidia_repo unset) is refused in one line naming the key and the fix,
    even when that server's name resolves (it was allowed, resolved, before)."""
    NAMES["developer.download.nvidia.com"] = ["192.0.2.90"]
    try:
        with pytest.raises(SpecError) as exc:
            plan_of(tmp_path, k2_egress="mirrors-only", k2_os_mirror="https://mirror.corp.example/ubuntu",
                    k2_pypi_index="https://pypi.corp.example/simple")
    finally:
        del NAMES["developer.download.nvidia.com"]
    assert exc.value.key == "k2_nvidia_repo", str(exc.value)
    assert "node-0 would fetch NVIDIA's CUDA repository from developer.download.nvidia.com" in exc.value.message
    assert "set k2_nvidia_repo and k2_nvidia_repo_keyring" in exc.value.message and "\n" not in str(exc.value)


def test_egress_open_renders_no_output_chain(tmp_path: Path) -> None:
    dep, plan = plan_of(tmp_path)
    text = fw.host_firewall(dep, plan.hosts["node-0"]).rules()
    assert "chain output" not in text and "egress" not in text


def test_bootstrap_without_mirrors_is_unchanged(tmp_path: Path) -> None:
    dep, plan = plan_of(tmp_path)
    boot = bootstrap_plan(dep, dep.fleet.hosts[0])
    (cuda,) = [r for r in boot.repos if r.name == "cuda"]
    assert cuda.kind == "apt-keyring-deb" and cuda.source.startswith("https://developer.download.nvidia.com/")
    assert mirrors.mirror_files(dep.s, "ubuntu-22.04", "x86_64", True) == {}


# --- #34: the container toolkit's and Docker's repositories, and every place a host fetches from ---------------------

CORP = {"mirror.corp.example": ["192.0.2.80"], "cuda.corp.example": ["192.0.2.81"], "pypi.corp.example": ["192.0.2.82"],
        "ctk.corp.example": ["192.0.2.83"], "docker.corp.example": ["192.0.2.84"], "hub.corp.example": ["192.0.2.85"],
        "registry.corp.example": ["192.0.2.86"]}
VENDORS = ("developer.download.nvidia.com", "nvidia.github.io", "download.docker.com", "pypi.org", "pythonhosted.org",
           "huggingface.co", "registry-1.docker.io", "index.docker.io", "nvcr.io", "repo.radeon.com")
SGLANG_4 = [(f"gpu-{i}", {"ssh_hostname": f"10.1.0.{10 + i}"}) for i in range(4)]


def corp_resolver(name: str) -> list[str]:
    if name not in CORP:
        raise OSError(f"{name}: unknown")
    return CORP[name]


def every_mirror(tmp_path: Path, **more) -> dict:
    """A 4 × 8 H200 SGLang DP-attention + EP fleet with every mirror key, closed (mirrors-only)."""
    key = keyring(tmp_path, "corp.asc", ARMORED)
    return dict(k2_engine="sglang", k2_tp=32, k2_dp=32, k2_ep=32, k2_attn_dp=True, k2_max_model_len=32768,
                k2_ib_hcas=["mlx5_0", "mlx5_1"], k2_dist_init_port=50000,
                k2_os="ubuntu-24.04", k2_runtime="container",
                k2_image="registry.corp.example:5000/lmsysorg/sglang:v0.5.23",
                k2_os_mirror="https://mirror.corp.example/ubuntu", k2_os_mirror_keyring=key,
                k2_nvidia_repo="https://cuda.corp.example/cuda-repos", k2_nvidia_repo_keyring=key,
                k2_container_toolkit_repo="https://ctk.corp.example/libnvidia-container",
                k2_container_toolkit_repo_keyring=key,
                k2_docker_repo="https://docker.corp.example/linux/rhel", k2_docker_repo_keyring=key,
                k2_pypi_index="https://pypi.corp.example/simple",
                k2_hub_endpoint="https://hub.corp.example", k2_checkpoint_fetcher="gpu-0",
                k2_metrics=True, k2_gpu_exporter=True,
                k2_gpu_exporter_image="registry.corp.example:5000/nvidia/k8s/dcgm-exporter:4.2.3-4.1.3-ubuntu22.04",
                k2_firewall=True, k2_egress="mirrors-only") | more


@pytest.mark.parametrize("os_name, runtime", [("ubuntu-24.04", "container"), ("rocky-9", "container"),
                                              ("ubuntu-24.04", "venv")])
def test_a_four_node_plan_with_every_mirror_key_fetches_only_from_the_fleet_and_the_mirrors(
        tmp_path: Path, capsys, monkeypatch, os_name, runtime) -> None:
    """#34's done-when: ``k2fleet plan`` of the 4-node SGLang inventory with every mirror key lists
    only the fleet and the mirrors as places a host fetches from, in text and in --json."""
    from k2fleet.control import addresses

    monkeypatch.setattr(addresses, "system_resolver", corp_resolver)
    inv = write_inventory(tmp_path, hosts=SGLANG_4, **every_mirror(tmp_path, k2_os=os_name, k2_runtime=runtime))
    assert main(["plan", str(inv)]) == 0
    text = capsys.readouterr().out
    section = text[text.index("== network"):]
    fetch_lines = [line for line in section.splitlines() if line.startswith("    fetch ")]
    assert len({line for line in fetch_lines}) >= 4 and all("unset: the default" not in line for line in fetch_lines)
    targets = {line.split()[1] for line in fetch_lines}
    assert {t.split(":")[0] for t in targets} <= set(CORP), targets
    assert "mirror.corp.example:443/tcp" in targets and "cuda.corp.example:443/tcp" in targets
    assert "ctk.corp.example:443/tcp" in targets  # Docker (the container runtime, dcgm-exporter) brings the toolkit
    assert ("docker.corp.example:443/tcp" in targets) == (os_name == "rocky-9")  # Ubuntu: docker.io from the OS mirror
    assert ("pypi.corp.example:443/tcp" in targets) == (runtime == "venv")
    assert ("registry.corp.example:5000/tcp" in targets) and "hub.corp.example:443/tcp" in targets
    places = section.splitlines()[1]
    assert "closed by k2_egress: mirrors-only" in places
    assert not any(vendor in section for vendor in VENDORS), section
    for i in range(4):  # every host's outbound: the fleet and the mirrors, nothing else
        out_line = next(line for line in section.splitlines()[section.splitlines().index(f"  gpu-{i} (10.1.0.{10 + i}):"):]
                        if line.startswith("    out "))
        assert {t.split(":")[0] for t in out_line.split("; ", 1)[1].split(", ")} <= set(CORP), out_line
    assert main(["plan", str(inv), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    net = doc["network"]
    assert net["closed_by"] == "k2_egress: mirrors-only" and set(net["destinations"]) <= set(CORP)
    assert set(net["hosts"]) == {f"gpu-{i}" for i in range(4)}
    for name, host in net["hosts"].items():
        assert host["fetches"] and all(f["declared"] and f["host"] in CORP for f in host["fetches"]), (name, host)
        assert {"ports": "22", "proto": "tcp", "who": "anyone", "what": "ssh_port: pyinfra (never closed)"} in host["inbound"]
        assert host["outbound"][0] == {"to": "the fleet", "ports": "all"}
        assert {o["to"].rsplit(":", 1)[0] for o in host["outbound"][1:]} <= set(CORP)
    assert any(f["what"] == "the checkpoint: the Hub" for f in net["hosts"]["gpu-0"]["fetches"])
    assert not any(f["what"] == "the checkpoint: the Hub" for f in net["hosts"]["gpu-1"]["fetches"])
    assert not any(vendor in json.dumps(doc) for vendor in VENDORS)  # not in any host's desired state either
    # the hosts' firewall lets out exactly those mirrors' addresses
    dep, plan = load_plan(inv, resolver=corp_resolver)
    assert set(fw.egress_names(dep)) == set(net["destinations"])
    assert set(fw.host_firewall(dep, plan.hosts["gpu-1"]).egress) == {CORP[n][0] for n in net["destinations"]}


def test_plan_lists_the_vendors_servers_the_hosts_would_fetch_from_by_default(tmp_path: Path) -> None:
    """Without mirror keys the list names the vendors' own servers, each with the key that would move it."""
    inv = write_inventory(tmp_path, hosts=SGLANG_4, k2_engine="sglang", k2_tp=32, k2_dp=32, k2_ep=32, k2_attn_dp=True, k2_max_model_len=32768,
                k2_ib_hcas=["mlx5_0", "mlx5_1"],
                          k2_os="rocky-9", k2_runtime="container", k2_image="lmsysorg/sglang:v0.5.23", k2_firewall=False)
    dep, plan = load_plan(inv)
    net = fw.network_json(dep, plan)
    assert net["closed_by"] is None
    assert {"developer.download.nvidia.com", "nvidia.github.io", "download.docker.com",
            "registry-1.docker.io"} <= set(net["destinations"])
    keys = {f["host"]: (f["key"], f["declared"]) for f in net["hosts"]["gpu-0"]["fetches"]}
    assert keys["nvidia.github.io"] == ("k2_container_toolkit_repo", False)
    assert keys["download.docker.com"] == ("k2_docker_repo", False)
    assert keys["registry-1.docker.io"] == ("k2_image", True)  # set in the inventory (Docker Hub, its choice)
    assert keys[None] == ("k2_os_mirror", False)  # the hosts' own sources: k2fleet does not know their URLs
    text = fw.format_network(dep, plan)
    assert "nvidia.github.io:443/tcp" in text and "(k2_container_toolkit_repo unset: the default)" in text
    # the inbound ports come from the firewall plan even with k2_firewall off
    assert "in     8000/tcp" in text and not dep.s.firewall


def test_the_toolkit_and_docker_mirrors_are_k2fleets_own_source_files(tmp_path: Path) -> None:
    """apt: the toolkit's flat repository at the mirror, signed by its uploaded keyring; dnf: the
    toolkit's metadata-signed repository (as NVIDIA's own .repo) and Docker CE's at the mirror."""
    def desired_of(os_name: str) -> tuple[dict, object]:
        data = every_mirror(tmp_path, k2_os=os_name, k2_egress="open")
        dep, plan = load_plan(write_inventory(tmp_path / os_name, hosts=SGLANG_4, **data), resolver=corp_resolver)
        art = ControlArtifacts(keyrings={dep.s.os_mirror_keyring: ARMORED})
        d = desired_state(dep, plan, art)["gpu-1"]
        return d.files["package_sources"], d

    files, d = desired_of("ubuntu-24.04")
    ctk = files["/etc/apt/sources.list.d/k2fleet-container-toolkit.sources"].content.decode()
    assert ctk.splitlines()[1:] == ["Types: deb", "URIs: https://ctk.corp.example/libnvidia-container/stable/deb/amd64/",
                                    "Suites: /", "Signed-By: /etc/apt/keyrings/k2fleet-container-toolkit.asc"]
    assert files["/etc/apt/keyrings/k2fleet-container-toolkit.asc"].content == ARMORED
    assert "/etc/yum.repos.d/k2fleet-docker.repo" not in files  # Ubuntu's docker.io comes from the OS mirror
    repos = {r.name: r for r in d.bootstrap.repos}
    assert repos["nvidia-container-toolkit"].kind == "k2fleet-file" and "docker-ce" not in repos
    assert d.bootstrap.package("nvidia-container-toolkit") is not None
    assert not any(v in json.dumps(d.to_json()) for v in ("nvidia.github.io", "download.docker.com"))

    files, d = desired_of("rocky-9")
    ctk = files["/etc/yum.repos.d/k2fleet-container-toolkit.repo"].content.decode()
    assert "baseurl=https://ctk.corp.example/libnvidia-container/stable/rpm/x86_64/\n" in ctk
    assert "gpgcheck=0\nrepo_gpgcheck=1\n" in ctk and "gpgkey=file:///etc/pki/rpm-gpg/RPM-GPG-KEY-k2fleet-container-toolkit" in ctk
    docker = files["/etc/yum.repos.d/k2fleet-docker.repo"].content.decode()
    assert "baseurl=https://docker.corp.example/linux/rhel/$releasever/$basearch/stable\n" in docker
    assert "gpgcheck=1\nrepo_gpgcheck=0\n" in docker and "/etc/pki/rpm-gpg/RPM-GPG-KEY-k2fleet-docker" in files
    repos = {r.name: r for r in d.bootstrap.repos}
    assert repos["docker-ce"].kind == "k2fleet-file" and repos["nvidia-container-toolkit"].kind == "k2fleet-file"
    assert not any(v in json.dumps(d.to_json()) for v in ("nvidia.github.io", "download.docker.com"))


def test_hosts_without_docker_get_no_toolkit_or_docker_source(tmp_path: Path) -> None:
    data = every_mirror(tmp_path, k2_os="rocky-9", k2_egress="open", k2_runtime="venv", k2_metrics=False,
                        k2_gpu_exporter=False, k2_image=None, k2_gpu_exporter_image=None)
    dep, plan = load_plan(write_inventory(tmp_path, hosts=SGLANG_4, **data), resolver=corp_resolver)
    d = desired_state(dep, plan, ControlArtifacts(keyrings={dep.s.os_mirror_keyring: ARMORED}))["gpu-0"]
    assert not [p for p in d.files["package_sources"] if "docker" in p or "container-toolkit" in p]
    assert not any("ctk.corp" in f["host"] or "docker.corp" in f["host"]
                   for f in fw.network_json(dep, plan)["hosts"]["gpu-0"]["fetches"] if f["host"])


@pytest.mark.parametrize("more, key, words", [
    ({"k2_container_toolkit_repo": None, "k2_container_toolkit_repo_keyring": None}, "k2_container_toolkit_repo",
     "the NVIDIA Container Toolkit's repository from nvidia.github.io"),
    ({"k2_os": "rocky-9", "k2_docker_repo": None, "k2_docker_repo_keyring": None}, "k2_docker_repo",
     "Docker CE's repository from download.docker.com"),
    ({"k2_gpu_exporter_image": None}, "k2_gpu_exporter_image", "from nvcr.io"),
    ({"k2_runtime": "venv", "k2_pypi_index": None}, "k2_pypi_index", "from pypi.org"),
    ({"k2_nvidia_repo": None, "k2_nvidia_repo_keyring": None}, "k2_nvidia_repo", "from developer.download.nvidia.com"),
])
def test_mirrors_only_refuses_a_fetch_from_outside_the_mirrors_naming_the_key(tmp_path: Path, more, key, words) -> None:
    with pytest.raises(SpecError) as exc:
        load_plan(write_inventory(tmp_path, hosts=SGLANG_4, **every_mirror(tmp_path, **more)), resolver=corp_resolver)
    assert exc.value.key == key and words in exc.value.message, str(exc.value)
    assert f"set {key}" in exc.value.message and "\n" not in str(exc.value)


def test_mirrors_only_refuses_amds_repository_which_has_no_mirror_key(tmp_path: Path) -> None:
    CORP["repo.radeon.com"] = ["192.0.2.87"]  # resolvable, and still not the inventory's
    try:
        with pytest.raises(SpecError) as exc:
            load_plan(write_inventory(tmp_path, hosts=SGLANG_4[:1], k2_gpu="mi300x", k2_tp=8, k2_firewall=True,
                                      k2_egress="mirrors-only", k2_os_mirror="https://mirror.corp.example/ubuntu",
                                      k2_image="registry.corp.example:5000/rocm/vllm:v0.33.0"), resolver=corp_resolver)
    finally:
        del CORP["repo.radeon.com"]
    assert exc.value.key == "k2_package_source", str(exc.value)
    assert ("gpu-0 would fetch AMD's amdgpu repository from repo.radeon.com (k2_package_source: apt); it has no "
            "mirror key: use k2_package_source: bundle with k2_bundle") in exc.value.message


def test_a_bundle_refuses_a_fetcher_host_that_would_reach_the_hub(tmp_path: Path) -> None:
    """``k2_bundle``: the air-gapped fleet takes everything from the bundle; a fetcher host without
    a Hub mirror would download from huggingface.co, so validate refuses it, naming the key."""
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "k2fleet.lock").write_text("{}")
    inv = write_inventory(tmp_path / "inv", hosts=SGLANG_4[:2], k2_tp=16, k2_package_source="bundle",
                          k2_bundle=str(bundle), k2_checkpoint_fetcher="gpu-0")
    with pytest.raises(SpecError) as exc:
        load_plan(inv)
    assert exc.value.key == "k2_hub_endpoint" and "with k2_bundle" in exc.value.message
    assert "gpu-0 would fetch the Hub, and the CDN hosts it redirects to from huggingface.co" in exc.value.message


def test_bundle_builds_read_the_toolkit_mirror_with_its_keyring(tmp_path: Path) -> None:
    """``k2fleet bundle`` resolves the toolkit's packages at its mirror (a flat repository),
    checked with k2_container_toolkit_repo_keyring (no fetch: the sources and keyrings only)."""
    from k2fleet.control import airgap

    ctk_key = keyring(tmp_path, "ctk.gpg")
    dep, plan = load_plan(write_inventory(tmp_path, hosts=SGLANG_4, **every_mirror(
        tmp_path, k2_egress="open", k2_container_toolkit_repo_keyring=ctk_key)), resolver=corp_resolver)
    debs = [d for d in airgap.bundle_needs(dep, plan).debs if any(r.name == "nvidia-container-toolkit" for r in d.repos)]
    assert len(debs) >= 1
    deb = debs[0]
    assert dict(deb.mirror_keyrings)["nvidia-container-toolkit"] == ctk_key
    sources, keys = airgap._vendor_sources(deb.repos, deb.arch, None, dict(deb.mirror_keyrings))  # type: ignore[arg-type]
    assert "deb https://ctk.corp.example/libnvidia-container/stable/deb/amd64/ /" in sources
    assert "deb https://cuda.corp.example/cuda-repos/ubuntu2404/x86_64/ /" in sources and Path(ctk_key) in keys
