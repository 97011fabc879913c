#!/usr/bin/env python3
"""k2fleet-test-double of TensorRT-LLM's examples/disaggregated/slurm/benchmark/submit.py -- TEST DOUBLE.

Installed only by ``k2fleet rehearse`` into the sandbox's TensorRT-LLM checkout (with
``disaggr_torch.slurm``, also a double, and the engine doubles ``k2fleet_doubles``).
Like the real one it reads ``-c CONFIG`` (PyYAML) and uses the same keys:
``slurm.{script_file, partition, account, job_time, job_name, extra_args, numa_bind}``,
``hardware.{gpus_per_node, num_ctx_servers, num_gen_servers}``,
``benchmark.{mode, input_length, output_length, concurrency_list, ...}``,
``environment.{container_image, container_mount, model_path, work_dir, trtllm_repo,
worker_env_var, server_env_var}`` and ``worker_config.{ctx, gen}``; it computes the
nodes the same way (ceil(TP*PP*servers / gpus_per_node) per side), makes the same log
directory (``work_dir/DATE/ISL-OSL/ctxN_genM_{dep|tep}TP_batchB_eplbS_mtpK``) with
``ctx_config.yaml``/``gen_config.yaml``, and submits with the REAL ``sbatch``.

Differences, all because the sandbox is not a GB200 site: no ``--segment`` (Debian
bookworm's Slurm 22.05 has no such option) and the job script's containers/pmix are not
used (see disaggr_torch.slurm).
"""

import argparse
import math
import os
import shutil
import subprocess
import sys
from datetime import datetime

import yaml

REQUIRED = {
    "slurm": ("script_file", "partition", "account", "job_time", "job_name", "numa_bind"),
    "hardware": ("gpus_per_node", "num_ctx_servers", "num_gen_servers"),
    "benchmark": ("mode", "input_length", "output_length", "concurrency_list"),
    "environment": ("container_image", "container_mount", "model_path", "work_dir"),
    "worker_config": ("ctx", "gen"),
}


def nodes_for(world_size, servers, gpus_per_node):
    return math.ceil(world_size * servers / gpus_per_node)


def world_of(worker):
    return int(worker["tensor_parallel_size"]) * int(worker.get("pipeline_parallel_size", 1))


def check(config):
    for section, keys in REQUIRED.items():
        if not isinstance(config.get(section), dict):
            raise SystemExit(f"submit.py (test double): config has no {section!r} section")
        for key in keys:
            if key not in config[section]:
                raise SystemExit(f"submit.py (test double): {section}.{key} is missing")
    for key in ("max_batch_size", "enable_attention_dp"):
        if key not in config["worker_config"]["gen"]:
            raise SystemExit(f"submit.py (test double): worker_config.gen.{key} is missing")


def log_dir_of(config):
    env, gen = config["environment"], config["worker_config"]["gen"]
    hw, bench = config["hardware"], config["benchmark"]
    balancer = (gen.get("moe_config") or {}).get("load_balancer") or {}
    slots = balancer.get("num_slots", 0) if isinstance(balancer, dict) else 0
    mtp = (gen.get("speculative_config") or {}).get("num_nextn_predict_layers", 0)
    kind = "dep" if gen["enable_attention_dp"] else "tep"
    return os.path.join(env["work_dir"], datetime.now().strftime("%Y%m%d"),
                        f"{bench['input_length']}-{bench['output_length']}",
                        f"ctx{hw['num_ctx_servers']}_gen{hw['num_gen_servers']}_{kind}"
                        f"{gen['tensor_parallel_size']}_batch{gen['max_batch_size']}_eplb{slots}_mtp{mtp}")


def sbatch_argv(config, log_dir):
    slurm, hw, env = config["slurm"], config["hardware"], config["environment"]
    bench, workers = config["benchmark"], config["worker_config"]
    per = int(hw["gpus_per_node"])
    ctx_nodes = nodes_for(world_of(workers["ctx"]), int(hw["num_ctx_servers"]), per)
    gen_nodes = nodes_for(world_of(workers["gen"]), int(hw["num_gen_servers"]), per)
    total = ctx_nodes + gen_nodes
    return [
        "sbatch", f"--partition={slurm['partition']}", f"--account={slurm['account']}",
        f"--time={slurm['job_time']}", f"--job-name={slurm['job_name']}",
        f"--nodes={total}", f"--ntasks={total * per}", f"--ntasks-per-node={per}",
        f"--output={log_dir}/slurm-%j.out", f"--error={log_dir}/slurm-%j.err",
        *[a for a in str(slurm.get("extra_args") or "").split() if a],
        slurm["script_file"],
        "--num-ctx-servers", str(hw["num_ctx_servers"]), "--num-gen-servers", str(hw["num_gen_servers"]),
        "--ctx-world-size", str(world_of(workers["ctx"])), "--gen-world-size", str(world_of(workers["gen"])),
        "--gpus-per-node", str(per), "--concurrency-list", str(bench["concurrency_list"]),
        "--isl", str(bench["input_length"]), "--osl", str(bench["output_length"]),
        "--model-path", env["model_path"], "--trtllm-repo", str(env.get("trtllm_repo") or ""),
        "--work-dir", env["work_dir"], "--full-logdir", log_dir,
        "--container-mount", env["container_mount"], "--container-image", env["container_image"],
        "--worker-env-var", str(env.get("worker_env_var") or ""),
        "--server-env-var", str(env.get("server_env_var") or ""),
    ]


def main():
    parser = argparse.ArgumentParser(description="Submit disaggregated benchmark job (k2fleet-test-double)")
    parser.add_argument("-c", "--config", required=True)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    with open(args.config) as handle:
        config = yaml.safe_load(handle)
    check(config)
    log_dir = log_dir_of(config)
    if os.path.exists(log_dir):
        print(f"[WARNING] Removing existing log directory: {log_dir}")
        shutil.rmtree(log_dir)
    os.makedirs(log_dir)
    print(f"Log will be saved to: {log_dir}")
    for side in ("ctx", "gen"):
        with open(os.path.join(log_dir, f"{side}_config.yaml"), "w") as handle:
            yaml.dump(config["worker_config"][side], handle, default_flow_style=False)
    argv = sbatch_argv(config, log_dir)
    print(" ".join(argv))
    if args.dry_run:
        return 0
    return subprocess.run(argv, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
