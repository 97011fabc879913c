"""Offline checks of what the rehearsal generates for a Slurm inventory (k2sandbox/slurm_site.py):
the compute host count, slurm.conf, the partition/account overlay, and the submit.py /
disaggr_torch.slurm TEST DOUBLES run on the config k2fleet renders for the seed inventory.
The sandbox run itself is tests/test_rehearse.py::test_rehearse_gb200_slurm."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from k2sandbox import slurm_site as sandbox_slurm
from k2fleet.deploy.gate import check_hosts
from k2fleet.inventory.loader import inventory_host_data
from k2sandbox.rehearse import SLURM_MAX_HOSTS, slurm_job_config, unsupported

ROOT = Path(__file__).resolve().parent.parent
SEED = "inventories/gb200-trtllm-disagg.py"
DOUBLES = ROOT / "k2sandbox" / "files" / "sandbox_site" / "trtllm_checkout"


def seed(overrides: dict | None = None):
    dep, plan = check_hosts(SEED, inventory_host_data(str(ROOT / SEED), overrides or {}))
    return dep, plan


def test_seed_job_needs_twelve_compute_hosts_and_is_rehearsable() -> None:
    dep, plan = seed()
    job = slurm_job_config(dep)
    assert job is not None
    # 4 ctx servers x TP4 / 4 GPUs per node + 1 gen server x TP32 / 4
    assert sandbox_slurm.compute_node_count(job) == 12
    assert unsupported(dep, plan) is None


def test_a_job_larger_than_the_sandbox_is_refused_with_the_count() -> None:
    dep, _ = seed()
    slurm = dict(dep.pools["slurm-submit"].settings.slurm)
    slurm["hardware"] = {**slurm["hardware"], "num_gen_servers": 2}
    dep, plan = seed({"k2_slurm": slurm})
    assert unsupported(dep, plan) == f"21 hosts (login + Slurm compute nodes; the sandbox boots at most {SLURM_MAX_HOSTS})"


def test_slurm_conf_lists_every_compute_host_in_one_partition_without_cgroup_plugins() -> None:
    nodes = [(f"k2sb-{i}", f"10.213.0.{10 + i}") for i in range(2, 14)]
    text = sandbox_slurm.slurm_conf(("k2sb-1", "10.213.0.11"), nodes, 4, "rehearsal")
    conf = dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith(("#", "NodeName", "PartitionName")))
    assert conf["SlurmctldHost"] == "k2sb-1(10.213.0.11)"
    assert (conf["ProctrackType"], conf["TaskPlugin"], conf["SelectType"]) == ("proctrack/linuxproc", "task/none", "select/cons_tres")
    settings = [line for line in text.splitlines() if not line.startswith("#")]
    assert not [line for line in settings if "cgroup" in line or "Gres" in line]
    node_lines = [line for line in text.splitlines() if line.startswith("NodeName=")]
    assert len(node_lines) == 12
    assert node_lines[0].startswith("NodeName=k2sb-2 NodeAddr=10.213.0.12 CPUs=4 ")
    partitions = [line for line in text.splitlines() if line.startswith("PartitionName=")]
    assert partitions == ["PartitionName=rehearsal Nodes=" + ",".join(n for n, _ in nodes)
                          + " Default=YES MaxTime=INFINITE State=UP"]


def test_only_placeholder_partition_and_account_are_overlaid() -> None:
    dep, _ = seed()
    user = dep.pools["slurm-submit"].settings.slurm
    data, changed = sandbox_slurm.site_overlay(user)
    assert changed == {"slurm.partition": ("<partition>", "rehearsal"), "slurm.account": ("<account>", "rehearsal")}
    assert {k: v for k, v in data["slurm"].items() if k not in ("partition", "account")} == \
        {k: v for k, v in user["slurm"].items() if k not in ("partition", "account")}
    assert {k: v for k, v in data.items() if k != "slurm"} == {k: v for k, v in user.items() if k != "slurm"}
    named, changed = sandbox_slurm.site_overlay({"slurm": {"partition": "gb200", "account": "llm"}})
    assert named["slurm"] == {"partition": "gb200", "account": "llm"} and changed == {}


def test_shared_storage_refuses_system_directories() -> None:
    env = {"trtllm_repo": "/opt/TensorRT-LLM", "work_dir": "/lustre/w", "model_path": "/lustre/m"}
    try:
        sandbox_slurm.shared_tops({"environment": env})
    except sandbox_slurm.SlurmSiteError as exc:
        assert "/opt" in str(exc)
    else:
        raise AssertionError("a repo under /opt was accepted")


def test_submit_double_reads_the_rendered_config_and_asks_sbatch_for_the_planned_nodes(tmp_path: Path) -> None:
    dep, _ = seed()
    job = slurm_job_config(dep)
    data, _ = sandbox_slurm.site_overlay(dep.pools["slurm-submit"].settings.slurm)
    job = {**job, "slurm": data["slurm"], "environment": {**job["environment"], "work_dir": str(tmp_path / "work")}}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(job))
    proc = subprocess.run([sys.executable, str(DOUBLES / "submit.py"), "-c", str(config), "--dry-run"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    argv = proc.stdout.strip().splitlines()[-1].split()
    assert argv[0] == "sbatch"
    for flag in ("--partition=rehearsal", "--account=rehearsal", "--nodes=12", "--ntasks=48", "--ntasks-per-node=4",
                 "--job-name=kimi-k2-thinking-disagg", "--time=02:00:00"):
        assert flag in argv, (flag, argv)
    assert argv[argv.index("disaggr_torch.slurm") + 1:][:4] == ["--num-ctx-servers", "4", "--num-gen-servers", "1"]
    log_dirs = list((tmp_path / "work").glob("*/1024-1024/ctx4_gen1_dep32_batch128_eplb416_mtp0"))
    assert len(log_dirs) == 1
    assert yaml.safe_load((log_dirs[0] / "ctx_config.yaml").read_text()) == job["worker_config"]["ctx"]
    assert yaml.safe_load((log_dirs[0] / "gen_config.yaml").read_text())["tensor_parallel_size"] == 32


def test_submit_double_refuses_a_config_missing_a_key_submit_py_reads(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"slurm": {"script_file": "x"}}))
    proc = subprocess.run([sys.executable, str(DOUBLES / "submit.py"), "-c", str(config), "--dry-run"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and "slurm.partition is missing" in proc.stderr


def test_job_script_double_is_valid_bash_and_named_as_a_double() -> None:
    script = DOUBLES / "disaggr_torch.slurm"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    for path in (script, DOUBLES / "submit.py"):
        assert "TEST DOUBLE" in path.read_text()[:600]
