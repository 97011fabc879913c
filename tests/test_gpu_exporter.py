"""``k2_gpu_exporter`` offline: NVIDIA's dcgm-exporter as ``k2-dcgm-exporter.service`` (planning:
argv and unit, the bootstrap's Docker and container toolkit on a venv fleet, the firewall
opening, the ``dcgm`` target, the offline bundle's image, refusals through validate), its role
on @fake hosts, and the sandbox's TEST DOUBLE serving Prometheus text on loopback."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from k2fleet.cli import load_plan, main
from k2fleet.control.airgap import bundle_needs
from k2fleet.inventory.spec import SpecError
from k2fleet.planning import firewall as fw
from k2fleet.planning import gpu_exporter as gx
from k2fleet.planning.desired import ControlArtifacts, desired_state
from k2fleet.planning.metrics import DCGM_EXPORTER_PORT, exporter_ports, scrape_targets
from k2sandbox import DOUBLES
from k2sandbox.double_image import GPU_EXPORTER_ENTRYPOINT, image_config
from tests.test_firewall import nft_check
from tests.test_roles_offline import H200, control_calls, planned, run_roles, settled_fleet  # noqa: F401 (a fixture)

ON = ["k2_metrics=true", "k2_gpu_exporter=true"]
REF = "nvcr.io/nvidia/k8s/dcgm-exporter:4.2.3-4.1.3-ubuntu22.04"
ID = "sha256:" + "ab" * 32
DOUBLE = DOUBLES / "gpu_stack" / "dcgm_exporter.py"


def _desired(inventory: str, data: list[str], images: dict | None = None):
    dep, plan = load_plan(inventory, data)
    return dep, plan, desired_state(dep, plan, ControlArtifacts(images=images or {}))


# --- planning ------------------------------------------------------------------------------------


def test_unit_runs_nvidias_image_with_the_readme_capabilities_on_the_host_network() -> None:
    dep, _, desired = _desired("inventories/h200.py", ON + [f"k2_gpu_exporter_image_id={ID}"])
    assert gx.argv(dep, "10.0.0.1") == ["/usr/bin/docker", "run", "--rm", "--name", "k2-dcgm-exporter", "--network",
                                        "host", "--gpus", "all", "--cap-add", "SYS_ADMIN", REF]
    for d in desired.values():
        unit = d.files["gpu_exporter"][gx.UNIT_PATH].content.decode().splitlines()
        assert "Requires=docker.service" in unit
        assert any(line.startswith("ExecStartPre=") and "image_pin" in line and REF in line and ID in line for line in unit)
        assert f"ExecStart={' '.join(gx.argv(dep, '10.0.0.1'))}" in unit
        assert "ExecStop=/usr/bin/docker stop --time 30 k2-dcgm-exporter" in unit
        assert gx.UNIT in d.units and d.gpu_exporter.ref == REF and d.gpu_exporter.image_id == ID
        assert gx.CHECK in d.checks and d.gpu_exporter.archive is None  # a real fleet pulls it


def test_under_bind_address_fleet_it_listens_on_the_hosts_fleet_address_alone() -> None:
    """``k2_bind_address: fleet``: dcgm-exporter's listener (``DCGM_EXPORTER_LISTEN``, its
    ``--address``) is each host's own fleet address, as the engines' — not every interface."""
    dep, _, desired = _desired("inventories/h200.py", ON + [f"k2_gpu_exporter_image_id={ID}", "k2_bind_address=fleet"])
    for h in dep.fleet.hosts:
        unit = desired[h.name].files["gpu_exporter"][gx.UNIT_PATH].content.decode()
        (start,) = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
        assert f" -e DCGM_EXPORTER_LISTEN={h.address}:9400 " in start, start
    _, _, default = _desired("inventories/h200.py", ON + [f"k2_gpu_exporter_image_id={ID}"])
    assert all("DCGM_EXPORTER_LISTEN" not in d.files["gpu_exporter"][gx.UNIT_PATH].content.decode()
               for d in default.values())


def test_off_by_default_and_nothing_planned() -> None:
    dep, plan, desired = _desired("inventories/h200.py", ["k2_metrics=true"])
    for d in desired.values():
        assert "gpu_exporter" not in d.files and gx.UNIT not in d.units and d.gpu_exporter is None
        assert d.bootstrap.package("docker.io") is None  # a venv fleet: no Docker without the key


def test_a_venv_fleet_gets_docker_and_the_container_toolkit_for_it() -> None:
    dep, plan, desired = _desired("inventories/h200.py", ON)
    assert dep.runtime == "venv"
    for d in desired.values():
        boot = d.bootstrap
        assert boot.package("docker.io") and boot.package("nvidia-container-toolkit")
        assert ("nvidia-ctk", "runtime", "configure", "--runtime=docker") in boot.commands
        assert "docker" in boot.services


def test_router_hosts_run_none() -> None:
    dep, plan, desired = _desired("inventories/h200-sglang-pd.py", ON)
    for name, hp in plan.hosts.items():
        assert (gx.UNIT in desired[name].units) == (hp.role != "router"), name


def test_firewall_opens_9400_to_the_scrapers_and_the_fleet(tmp_path: Path) -> None:
    dep, plan = load_plan("inventories/h200.py", ON + ['k2_metrics_scrapers=["10.9.0.5"]'])
    for hp in plan.hosts.values():
        f = fw.host_firewall(dep, hp)
        assert DCGM_EXPORTER_PORT in {o.first for o in f.openings if o.who == fw.SCRAPERS}
        nft_check(f.rules(), tmp_path)


def test_metrics_target_per_gpu_host(tmp_path: Path) -> None:
    dep, plan = load_plan("inventories/h200.py", ON)
    dcgm = [t for t in scrape_targets(dep, plan) if t.job == "dcgm"]
    assert {t.host for t in dcgm} == set(plan.hosts) and {t.port for t in dcgm} == {9400}
    assert main(["metrics", "inventories/h200.py", "--out", str(tmp_path), *[w for d in ON for w in ("--data", d)]]) == 0
    groups = json.loads((tmp_path / "targets" / "dcgm.json").read_text())
    assert [g["labels"]["instance"] for g in groups] == list(plan.hosts)
    assert "targets/dcgm.json" in (tmp_path / "prometheus.yml").read_text()


def test_simulated_gpus_only_with_the_key_and_the_double_image(tmp_path: Path) -> None:
    sim = ["k2_simulated_gpus=true", "k2_engine_doubles=true", "k2_metrics=true"]
    dep, plan = load_plan("inventories/h200.py", sim)
    assert not [t for t in scrape_targets(dep, plan) if t.job == "dcgm"]  # the operator's exporter: not on a sandbox
    assert all(p != DCGM_EXPORTER_PORT for hp in plan.hosts.values() for p, _ in exporter_ports(dep, hp.role))
    archive = tmp_path / "double-dcgm.tar.gz"
    archive.write_bytes(b"image")
    dep, plan, desired = _desired("inventories/h200.py", sim + ["k2_gpu_exporter=true"], {REF: (str(archive), ID)})
    assert {t.host for t in scrape_targets(dep, plan) if t.job == "dcgm"} == set(plan.hosts)
    argv = gx.argv(dep, "10.0.0.1")
    assert "--gpus" not in argv and "/etc/k2fleet-doubles/gpus.json:/etc/k2fleet-doubles/gpus.json:ro" in argv
    for d in desired.values():
        assert d.gpu_exporter.archive == f"/var/cache/k2fleet/images/{archive.name}" and d.gpu_exporter.image_id == ID
        assert d.files["gpu_exporter"][d.gpu_exporter.archive].content == b"image"
    _, _, dry = _desired("inventories/h200.py", sim + ["k2_gpu_exporter=true"])  # --dry: not built yet
    assert all(d.files["gpu_exporter"][gx.UNIT_PATH].content is None for d in dry.values())


def test_the_offline_bundle_carries_the_image() -> None:
    dep, plan = load_plan("inventories/h200.py", ON)
    assert bundle_needs(dep, plan).images == (REF,)
    dep, plan = load_plan("inventories/b200-trtllm.py", ON)
    assert bundle_needs(dep, plan).images == (dep.image, REF)


def test_egress_allows_its_registry() -> None:
    dep, _ = load_plan("inventories/h200.py", ON)
    assert "nvcr.io" in fw.egress_names(dep)


@pytest.mark.parametrize(("data", "inventory", "key", "words"), [
    (["k2_gpu_exporter=true"], "h200.py", "k2_gpu_exporter", "set k2_metrics: True"),
    (ON, "mi300x.py", "k2_gpu_exporter", "AMD GPU"),
    (["k2_metrics=true", f"k2_gpu_exporter_image_id={ID}"], "h200.py", "k2_gpu_exporter_image_id", "k2_gpu_exporter: True"),
    (ON + ["k2_gpu_exporter_image_id=sha256:abc"], "h200.py", "k2_gpu_exporter_image_id", "an image ID"),
    (ON + ["k2_gpu_exporter_image=Bad Ref"], "h200.py", "k2_gpu_exporter_image", "Docker image reference"),
])
def test_refusals_through_validate(data, inventory, key, words, capsys) -> None:
    with pytest.raises(SpecError) as exc:
        load_plan(f"inventories/{inventory}", data)
    assert exc.value.key == key and words in str(exc.value)
    with pytest.raises(SystemExit) as code:
        main(["validate", f"inventories/{inventory}", *[w for d in data for w in ("--data", d)]])
    assert code.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0]


def test_refused_without_a_gpu_host() -> None:
    with pytest.raises(SpecError, match="no host of this inventory carries GPUs") as exc:
        load_plan("inventories/gb200-trtllm-disagg.py", ON)  # a SLURM submit host alone
    assert exc.value.key == "k2_gpu_exporter"


# --- the role on @fake hosts ------------------------------------------------------------------------


def test_role_writes_the_unit_loads_the_image_and_starts_it(tmp_path: Path, control_calls: list[str]) -> None:
    dep, plan, desired = planned(str(H200), tuple(ON + [f"k2_gpu_exporter_image_id={ID}"]))
    facts = settled_fleet(dep, desired)
    out = run_roles(dep, plan, desired, facts, tmp_path, control_calls)
    assert out.ops == {name: {} for name in desired}  # settled: nothing

    for name, fact in list(facts.items()):
        units = {**fact.units, gx.UNIT: {"ActiveState": "inactive", "UnitFileState": "disabled"}}
        files = {**fact.files, gx.UNIT_PATH: None}
        facts[name] = dataclasses.replace(fact, units=units, files=files, checks={**fact.checks, gx.CHECK: 1})
    out = run_roles(dep, plan, desired, facts, tmp_path, control_calls)
    for name in desired:
        cmds = out.commands(name)
        assert any(c.startswith(f"docker pull {REF} && ") and "image_pin" in c for c in cmds), cmds
        assert any(c.startswith(f"systemctl enable --now {gx.UNIT}") for c in cmds)
        assert out.op(name, "dcgm-exporter's unit and image").changed
        order = list(out.ops[name])
        assert order.index(next(n for n in order if "load (or pull) dcgm-exporter" in n)) < \
            order.index(next(n for n in order if "start dcgm-exporter" in n))


# --- the TEST DOUBLE on loopback -----------------------------------------------------------------------

_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)\{(.*)\} (\S+)$')
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_exposition(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample: prometheus_client's parser when installed, else
    a small one for the text format's labelled samples (what the double writes)."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        out = []
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            m = _SAMPLE.match(line)
            assert m, f"not a labelled sample: {line!r}"
            out.append((m[1], dict(_LABEL.findall(m[2])), float(m[3])))
        return out
    return [(s.name, dict(s.labels), s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_scrape(proc: subprocess.Popen, url: str) -> tuple[str, str]:
    """(body, Content-Type) of the double's first answer at ``url``, waiting up to 20 s for it to
    listen (it must not have exited meanwhile)."""
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.read().decode(), r.headers["Content-Type"]
        except OSError:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline
            time.sleep(0.1)


def _start_double(tmp_path: Path, count: int, listen: str) -> tuple[subprocess.Popen, Path]:
    """The dcgm-exporter double serving ``count`` simulated H200s on ``listen``; and its hardware file."""
    hw = tmp_path / "gpus.json"
    hw.write_text(json.dumps({"vendor": "nvidia", "name": "NVIDIA H200", "count": count, "memory_mib": 143771}))
    env = {**os.environ, "K2FLEET_DOUBLE_HARDWARE": str(hw), "DCGM_EXPORTER_LISTEN": listen}
    return subprocess.Popen([sys.executable, str(DOUBLE)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE), hw


def test_the_double_serves_dcgm_fields_per_simulated_gpu(tmp_path: Path) -> None:
    port = _free_port()
    proc, hw = _start_double(tmp_path, 8, f"127.0.0.1:{port}")
    try:
        text, ctype = _first_scrape(proc, f"http://127.0.0.1:{port}/metrics")
        assert ctype.startswith("text/plain; version=0.0.4")
        samples = parse_exposition(text)
        util = [s for s in samples if s[0] == "DCGM_FI_DEV_GPU_UTIL"]
        used = [s for s in samples if s[0] == "DCGM_FI_DEV_FB_USED"]
        assert sorted(int(s[1]["gpu"]) for s in util) == list(range(8)) == sorted(int(s[1]["gpu"]) for s in used)
        assert {s[1]["modelName"] for s in util} == {"NVIDIA H200"} and len({s[1]["UUID"] for s in util}) == 8
        assert all(0 <= s[2] <= 100 for s in util)
        assert "TEST DOUBLE" in text
        hw.write_text(json.dumps({"vendor": "amd", "count": 8}))  # read at every scrape
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
        assert err.value.code == 503
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert proc.returncode == 0  # SIGTERM (docker stop): a clean exit


def test_the_double_listens_on_an_ipv6_address_as_the_plan_writes_it(tmp_path: Path) -> None:
    """``DCGM_EXPORTER_LISTEN=[::1]:PORT`` (what :func:`gx.listen` writes for an IPv6 fleet address)."""
    port = _free_port()
    proc, _ = _start_double(tmp_path, 2, f"[::1]:{port}")
    try:
        text, _ = _first_scrape(proc, f"http://[::1]:{port}/metrics")
        assert "DCGM_FI_DEV_GPU_UTIL" in text
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_the_double_refuses_a_host_without_nvidia_gpus(tmp_path: Path) -> None:
    env = {**os.environ, "K2FLEET_DOUBLE_HARDWARE": str(tmp_path / "missing.json")}
    proc = subprocess.run([sys.executable, str(DOUBLE)], env=env, capture_output=True, text=True, timeout=20)
    assert proc.returncode == 1 and "no simulated NVIDIA GPUs" in proc.stderr


def test_the_double_image_config_has_the_entry_point_and_says_test_double() -> None:
    config = json.loads(image_config(REF, "sha256:" + "0" * 64, GPU_EXPORTER_ENTRYPOINT))
    assert config["config"]["Entrypoint"] == ["/usr/bin/python3", "/opt/k2fleet/doubles/gpu_stack/dcgm_exporter.py"]
    assert config["config"]["Labels"] == {"org.k2fleet.test-double": "true", "org.k2fleet.double-of": REF}
    assert "dcgm-exporter TEST DOUBLE" in config["history"][0]["created_by"]
    engine = json.loads(image_config("vllm/vllm-openai:v0.33.0", "sha256:" + "0" * 64))
    assert "Entrypoint" not in engine["config"]  # the engine double's image is unchanged
