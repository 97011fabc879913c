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
