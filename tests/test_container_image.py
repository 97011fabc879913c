"""Container runtime, offline: the engine TEST DOUBLE image archive (deterministic, a real
``docker save`` layout whose python3 runs the doubles' entry points), the planned
``docker run`` argv and the container unit (pinned image ID, container removed on
stop/restart), and the Docker package for container hosts.

The sandbox side (``docker load`` on hosts, a unit refusing another image ID, the
rehearsals) is in ``tests/test_rehearse.py`` and ``tests/test_container_pin.py``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from k2sandbox import double_image as image, nspawn as sandbox
from k2fleet.cli import load_plan
from k2fleet.planning.desired import IMAGE_CHECK, IMAGE_DIR, ControlArtifacts, desired_state
from k2fleet.planning.host_archive import ARCHIVE
from k2fleet.planning.units import unit_file

ROOT = Path(__file__).resolve().parents[1]
ROOTFS = sandbox.ROOTFS_CACHE / sandbox.rootfs_key()
SIMULATED = ["k2_simulated_gpus=true", "k2_engine_doubles=true"]
TRT_REF = "nvcr.io/nvidia/tensorrt-llm/release:1.2.0"

@pytest.fixture(scope="module")
def sandbox_rootfs() -> Path:
    """The sandbox's root filesystem, built here when this machine has none yet (root only)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (debootstrap, chroot)")
    return sandbox.ensure_rootfs()


needs_rootfs = pytest.mark.usefixtures("sandbox_rootfs")


def members(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


# ---------------------------------------------------------------- the archive


@needs_rootfs
def test_archive_is_deterministic_and_its_id_is_the_config_digest(tmp_path: Path) -> None:
    started = time.monotonic()
    first = image.build_double_image(TRT_REF, ROOTFS, tmp_path / "a")
    seconds = time.monotonic() - started
    second = image.build_double_image(TRT_REF, ROOTFS, tmp_path / "b")
    print(f"double image: {first.path.stat().st_size} bytes gzip, built in {seconds:.1f}s")
    assert first.path.read_bytes() == second.path.read_bytes()
    assert first.image_id == second.image_id
    outer = members(subprocess.run(["gzip", "-dc", str(first.path)], capture_output=True, check=True).stdout)
    manifest = json.loads(outer["manifest.json"])
    assert len(manifest) == 1 and manifest[0]["RepoTags"] == [TRT_REF]
    config = outer[manifest[0]["Config"]]
    assert first.image_id == "sha256:" + hashlib.sha256(config).hexdigest()
    layer = outer[manifest[0]["Layers"][0]]
    assert json.loads(config)["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(layer).hexdigest()]
    assert json.loads(config)["config"]["Labels"]["org.k2fleet.test-double"] == "true"
    other = image.build_double_image("vllm/vllm-openai-rocm:v0.33.0", ROOTFS, tmp_path / "a")
    assert other.image_id != first.image_id  # the reference it stands in for is in its config


@needs_rootfs
def test_layer_runs_the_engine_entry_points(tmp_path: Path) -> None:
    """The layer's own python3 (no host library) runs the doubles as the units call them."""
    root = tmp_path / "root"
    root.mkdir()
    with tarfile.open(fileobj=io.BytesIO(image.layer_tar(ROOTFS))) as tar:
        tar.extractall(root)
    with tarfile.open(fileobj=io.BytesIO(image.layer_tar(ROOTFS))) as tar:
        assert all(m.mtime == 0 and m.uid == 0 for m in tar.getmembers())
        assert not [m.name for m in tar.getmembers() if "__pycache__" in m.name]
    for entry, version in (("trtllm-serve", "1.2.0"), ("vllm", "0.33.0")):
        out = subprocess.run([shutil.which("chroot"), str(root), f"/usr/local/bin/{entry}", "--version"],
                             capture_output=True, text=True, env={"PATH": "/usr/local/bin:/usr/bin"})
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == f"{version} k2fleet-test-double"
    group = (root / "etc/group").read_text()
    assert "\nvideo:x:" in group  # --group-add video resolves inside the image


# ---------------------------------------------------------------- argv, unit, packages


def argv_of(inventory: str, data: list[str] = ()) -> tuple[object, object, list[str]]:
    dep, plan = load_plan(ROOT / "inventories" / inventory, data)
    (svc,) = [s for _, s in plan.services()]
    return dep, plan, svc.argv


def test_b200_container_argv_as_planned() -> None:
    _, _, argv = argv_of("b200-trtllm.py")
    head = argv[: argv.index(TRT_REF)]
    assert argv[:5] == ["/usr/bin/docker", "run", "--rm", "--name", "k2-trtllm"]
    assert " --network host --ipc host --ulimit memlock=-1 --ulimit stack=67108864 --gpus all " in " ".join(head) + " "
    assert argv[argv.index(TRT_REF) + 1:argv.index(TRT_REF) + 3] == ["trtllm-serve", "serve"]
    assert "--entrypoint" not in argv


def test_mi300x_container_argv_as_planned() -> None:
    _, _, argv = argv_of("mi300x.py")
    ref = "vllm/vllm-openai-rocm:v0.33.0"
    assert " --device /dev/kfd --device /dev/dri --group-add video " in " ".join(argv)
    assert argv[argv.index(ref) - 2:argv.index(ref) + 2] == ["--entrypoint", "vllm", ref, "serve"]
    assert "--gpus" not in argv and "memlock=-1" in argv


def test_simulated_gpus_ask_for_the_sandbox_memlock_limit() -> None:
    _, _, argv = argv_of("mi300x.py", SIMULATED)
    assert "memlock=8388608" in argv and "memlock=-1" not in argv


def test_container_unit_pins_the_image_and_removes_the_container() -> None:
    dep, plan, _ = argv_of("b200-trtllm.py")
    (svc,) = [s for _, s in plan.services()]
    unit = unit_file(dep, svc, "sha256:" + "ab" * 32).splitlines()
    pre = [line for line in unit if line.startswith("ExecStartPre=")]
    # the container's removal, the image pin, then the engine cache directory the container binds
    assert pre[-3:] == ["ExecStartPre=-/usr/bin/docker rm --force k2-trtllm",
                        f"ExecStartPre=/usr/bin/python3 {ARCHIVE} image_pin {TRT_REF} sha256:{'ab' * 32}",
                        "ExecStartPre=/usr/bin/install -d -m 0700 -o root -g root /var/cache/k2fleet/engine-cache "
                        "/var/cache/k2fleet/engine-cache/trtllm"]
    assert "ExecStop=/usr/bin/docker stop --time 30 k2-trtllm" in unit
    assert "ExecStopPost=-/usr/bin/docker rm --force k2-trtllm" in unit
    assert "Requires=docker.service" in unit and "docker.service" in next(x for x in unit if x.startswith("After="))
    assert unit.index(pre[-1]) < unit.index(next(x for x in unit if x.startswith("ExecStart=")))


def test_venv_unit_has_no_docker_lines() -> None:
    dep, plan = load_plan(ROOT / "inventories/h200.py")
    svc = next(s for _, s in plan.services())
    assert "docker" not in unit_file(dep, svc)


def test_container_hosts_get_docker_and_the_pinned_archive(tmp_path: Path) -> None:
    dep, plan = load_plan(ROOT / "inventories/mi300x.py", SIMULATED)
    archive = tmp_path / "double-x.tar.gz"
    archive.write_bytes(b"archive")
    art = ControlArtifacts(images={dep.image: (str(archive), "sha256:" + "cd" * 32)})
    (d,) = desired_state(dep, plan, art).values()
    assert d.bootstrap.package("docker.io") and "docker.io" in d.bundle_request  # Docker is the bootstrap's
    assert "docker" in d.bootstrap.services
    assert d.image.ref == dep.image and d.image.archive == f"{IMAGE_DIR}/double-x.tar.gz"
    assert d.files["image"][d.image.archive].content == b"archive"
    assert d.checks[IMAGE_CHECK] == ["/usr/bin/python3", ARCHIVE, "image_pin", dep.image, "sha256:" + "cd" * 32]
    assert d.device_doubles == ("/dev/kfd", "/dev/dri/renderD128")
    h200_dep, h200_plan = load_plan(ROOT / "inventories/h200.py")
    h200 = desired_state(h200_dep, h200_plan, ControlArtifacts())
    assert all(d.bootstrap.package("docker.io") is None for d in h200.values())


def test_real_fleet_pins_k2_image_id_and_pulls() -> None:
    pinned = "sha256:" + "ef" * 32
    dep, plan = load_plan(ROOT / "inventories/b200-trtllm.py", [f"k2_image_id={pinned}"])
    (d,) = desired_state(dep, plan, ControlArtifacts()).values()
    assert d.image.ref == TRT_REF and d.image.image_id == pinned and d.image.archive is None
    assert d.files["image"] == {}
    assert d.checks[IMAGE_CHECK][-2:] == [TRT_REF, pinned]
    unit = d.service_files["k2-trtllm"]["/etc/systemd/system/k2-trtllm.service"].content.decode()
    assert f"ExecStartPre=/usr/bin/python3 {ARCHIVE} image_pin {TRT_REF} {pinned}" in unit.splitlines()


# ---------------------------------------------------------------- multi-node container form (mpirun)

MPI_PACKAGES = ("openmpi-bin", "openssh-client", "openssh-server", "python3-mpi4py")


def test_mpi_container_form_asks_the_image_for_sshd_openmpi_mpi4py() -> None:
    from k2sandbox.double_image import double_image_packages as _image_packages

    _, plan = load_plan(ROOT / "inventories/h200-trtllm-mpi.py", SIMULATED)
    assert _image_packages(plan) == MPI_PACKAGES
    _, single = load_plan(ROOT / "inventories/b200-trtllm.py", SIMULATED)
    assert _image_packages(single) == ()  # single-host images stay python3 + the doubles


def test_node_container_takes_the_mesh_port_from_the_host_mesh_sshd() -> None:
    dep, plan = load_plan(ROOT / "inventories/h200-trtllm-mpi.py", SIMULATED)
    desired = desired_state(dep, plan, ControlArtifacts())
    for name, d in desired.items():
        assert d.mesh_yields_to == ["k2-trtllm-node.service"], name
    node = next(s for _, s in plan.services() if s.name == "k2-trtllm-node")
    launcher = next(s for _, s in plan.services() if s.name == "k2-trtllm")
    assert "Conflicts=k2-mesh-sshd.service" in unit_file(dep, node).splitlines()
    assert not any(line.startswith("Conflicts=") for line in unit_file(dep, launcher).splitlines())
    _, venv_plan = load_plan(ROOT / "inventories/h200-trtllm-mpi.py", (*SIMULATED, "k2_runtime=venv"))
    assert not any(s.conflicts for _, s in venv_plan.services())  # venv form: mpirun uses the host's mesh sshd


@needs_rootfs
def test_mpi_image_is_deterministic_and_runs_sshd_mpirun_mpi4py(tmp_path: Path) -> None:
    """The .debs of the bundle's closure unpacked into the image: sshd (with its privilege
    separation user and directory), OpenMPI's mpirun/orted (alternatives links as the
    postinst makes them) and mpi4py; the image's own mpirun runs 2 ranks that allgather."""
    started = time.monotonic()
    first = image.build_double_image(TRT_REF, ROOTFS, tmp_path, packages=MPI_PACKAGES)
    seconds = time.monotonic() - started
    data = first.path.read_bytes()
    first.path.unlink()
    again = image.build_double_image(TRT_REF, ROOTFS, tmp_path, packages=MPI_PACKAGES)
    print(f"mpi double image: {len(data)} bytes gzip, built in {seconds:.1f}s (rootfs staged once)")
    assert again.path.read_bytes() == data and again.image_id == first.image_id
    assert first.image_id != image.build_double_image(TRT_REF, ROOTFS, tmp_path).image_id
    outer = members(subprocess.run(["gzip", "-dc", str(first.path)], capture_output=True, check=True).stdout)
    layer = outer[json.loads(outer["manifest.json"])[0]["Layers"][0]]
    root = tmp_path / "root"
    root.mkdir()
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        assert all(m.mtime == 0 and m.uid == 0 for m in tar.getmembers())
        assert not [m.name for m in tar.getmembers() if m.name.startswith(("usr/share/doc/", "usr/share/man/"))]
        tar.extractall(root)
    assert os.readlink(root / "usr/bin/mpirun") == "mpirun.openmpi"
    for rel in ("usr/sbin/sshd", "usr/bin/ssh", "usr/bin/orted", "usr/lib/python3/dist-packages/mpi4py/__init__.py"):
        assert (root / rel).exists(), rel
    assert (root / "run/sshd").is_dir() and "\nsshd:x:" in (root / "etc/passwd").read_text()
    chroot = shutil.which("chroot")
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root"}
    subprocess.run(["mknod", "-m", "666", str(root / "dev/null"), "c", "1", "3"], check=True)
    subprocess.run([chroot, str(root), "ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", "/tmp/hostkey"],
                   check=True, env=env)
    (root / "tmp/sshd_config").write_text("Port 2233\nHostKey /tmp/hostkey\nPidFile /run/test-sshd.pid\n")
    test = subprocess.run([chroot, str(root), "/usr/sbin/sshd", "-t", "-f", "/tmp/sshd_config"],
                          capture_output=True, text=True, env=env)
    assert test.returncode == 0, test.stderr  # config, host key, privilege separation user and directory
    hello = "from mpi4py import MPI; c = MPI.COMM_WORLD; print(c.Get_rank(), sum(c.allgather(c.Get_rank() + 1)))"
    (root / "proc").mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "proc", "proc", str(root / "proc")], check=True)
    try:
        out = subprocess.run([chroot, str(root), "mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2",
                              "python3", "-c", hello], capture_output=True, text=True, env=env, timeout=120)
    finally:
        subprocess.run(["umount", str(root / "proc")], check=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(out.stdout.split("\n")[:2]) == ["0 3", "1 3"], out.stdout
