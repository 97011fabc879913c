"""``k2fleet`` command line: validate and plan inventories offline, report a fleet's status and
drift (read-only), read its journals, take it down, gather an air-gapped bundle;
with the sandbox package installed, also rehearse an inventory and run the sandbox fleet
(commands it adds through the entry-point group ``k2fleet.commands``).

    k2fleet validate inventories/h200.py [--data KEY=VALUE ...]
    k2fleet plan inventories/h200.py [--json] [--data KEY=VALUE ...]
    k2fleet status inventories/h200.py [--json] [--completion]   # read-only: drift and health, exit 1 on either
    k2fleet logs inventories/h200.py [--service S] [--since T] [--follow]   # the fleet's journals, each line prefixed by its host
    k2fleet down inventories/h200.py [--purge] [--host H]   # remove what k2fleet placed on every host, or on H (drained first); checkpoints stay unless --purge
    k2fleet keys                      # every inventory key, as Markdown
    k2fleet rehearse inventories/h200.py [--keep] [--bundle DIR --offline] [--engine real] [--data KEY=VALUE ...]
    k2fleet bundle inventories/h200.py --out DIR [--rehearsal] [--locked LOCK] [--only PART]
    k2fleet bench inventories/h200.py [--concurrency 1,2,4] [--num-prompts N] [--out DIR] [--client PATH]
    k2fleet eval inventories/h200.py --dataset gsm8k-test.jsonl [--limit N] [--expect 0.9416] [--client PATH]
    k2fleet sandbox up 3 | down | status
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from k2fleet.control.addresses import Resolver
from k2fleet.control.stand_ins import command_plugins
from k2fleet.deploy.gate import check_hosts, refuse
from k2fleet.inventory.loader import inventory_host_data, parse_data_overrides
from k2fleet.inventory.spec import SpecError, keys_markdown
from k2fleet.planning.deployment import Deployment
from k2fleet.planning import profiles
from k2fleet.planning.api_front import address
from k2fleet.planning.firewall import format_firewall, format_network, network_json
from k2fleet.planning import privileged_ports
from k2fleet.planning.processes import Plan
from k2fleet.planning.quoting import curl_line, shell_line


def load_plan(inventory: str | Path, data: list[str] | tuple[str, ...] = (),
              resolver: Resolver | None = None) -> tuple[Deployment, Plan]:
    """Inventory file (+ pyinfra-style ``--data KEY=VALUE`` overrides) → validated
    deployment and its plan (no host is contacted; DNS-name addresses are resolved to IPs
    on this machine, or by ``resolver``: :mod:`k2fleet.control.addresses`)."""
    hosts = inventory_host_data(inventory, parse_data_overrides(data))
    return check_hosts(str(inventory), hosts, resolver)


def address_origins(dep: Deployment) -> dict[str, str]:
    """Host → where its fleet address came from: the inventory key, and ``resolved`` when
    the control machine resolved a DNS name to it (the plan holds only the IP)."""
    return {h.name: h.address_key + (" (resolved)" if h.ip else "") for h in dep.fleet.hosts}


PLAIN_HTTP = ("plain HTTP: prompts, answers and any API key cross the network unencrypted; set k2_tls_cert_file, "
              "k2_tls_key_file and k2_tls_ca_file to serve HTTPS")


def format_plan(plan: Plan, api_key_file: str | None = None, model: str | None = None,
                resolved: dict[str, str] | None = None, ca_file: str | None = None) -> str:
    """``k2fleet plan``'s text; ``ca_file``: ``k2_tls_ca_file`` (the endpoints serve HTTPS, the
    curl line verifies against it), else the endpoint is said to be plain HTTP."""
    out = [
        f"# {plan.source}: {plan.engine} {plan.engine_version} ({plan.runtime}"
        + (f", {plan.image}" if plan.image else "")
        + ")",
        f"# checkpoint: {plan.checkpoint_path}",
    ]
    for role, cap in plan.capacity.items():
        out.append(f"# KV cache ({role}): {cap.summary()}")
    out += [f"# note: {note}" for note in plan.notes]
    endpoint = plan.endpoint()
    if endpoint:
        base = f"{'https' if ca_file else 'http'}://{address(*endpoint)}/v1"
        out.append(f"# endpoint: {base}" + (f" (HTTPS, verify with --cacert {ca_file})" if ca_file else f" ({PLAIN_HTTP})"))
        if model:  # with a key file, the key is read from it when the line runs, never printed
            out.append(f"# try: {curl_line(base, model, api_key_file, ca_file)}")
    for host in plan.hosts.values():
        origin = (resolved or {}).get(host.name)  # e.g. "resolved from ssh_hostname gpu-0.dc.example"
        out.append(f"\n== {host.name} ({host.address}{f', {origin}' if origin else ''}) role={host.role}")
        for svc in host.services:
            out.append(f"  [stage {svc.stage}] {svc.name}: {svc.description}")
            for key, value in sorted(svc.env.items()):
                out.append(f"    env {key}={value}")
            out += [f"    before: {shell_line(argv)}" for argv in svc.pre_start]
            out.append(f"    $ {shell_line(svc.argv)}")
            if svc.workdir:
                out.append(f"    (in {svc.workdir})")
            for path, content in svc.files.items():
                out.append(f"    file {path}:")
                out.extend(f"      {line}" for line in content.rstrip("\n").splitlines())
    return "\n".join(out) + "\n"


def format_profile(dep: Deployment) -> str:
    """``k2fleet plan``'s profile section: what ``k2_profile`` set, from which seed, and what the inventory overrode."""
    out = [f"\n== profile (k2_profile: {dep.s.profile})"]
    for role, pool in dep.pools.items():
        if role in ("router", "slurm-submit"):
            continue
        doc = profiles.describe(dep.engine, dep.version, dep.s.profile, pool.settings.engine_args, pool.settings.trtllm_config)
        for row in doc["settings"]:
            mine = " (overridden by the inventory)" if row["name"] in doc["overridden"] else ""
            out.append(f"  {role}: {row['name']} = {json.dumps(row['value'])}{mine}  <- {row['source']}")
        out += [f"  {role}: {name} overridden by the inventory" for name in doc["overridden"] if "." in name]
    return "\n".join(out) + "\n"


def _cmd_validate(args: argparse.Namespace) -> int:
    dep, plan = load_plan(args.inventory, args.data)
    n = sum(len(h.services) for h in plan.hosts.values())
    print(f"ok: {args.inventory}: {len(plan.hosts)} hosts, {n} services, {dep.engine} {dep.version}")
    return 0


def plan_document(dep: Deployment, plan: Plan) -> dict:
    """The ``k2fleet plan --json`` document: the plan, and per host its desired state
    (files with mode and sha256, units, packages, checks, checkpoint parent and round).
    Control artifacts (mesh keys, wheels) are only read: missing ones show sha256 null."""
    from k2fleet.control.artifacts import read_control_artifacts
    from k2fleet.control.checkpoint_copy import manifest_pins
    from k2fleet.planning.desired import desired_state

    dep = dep.pinned(manifest_pins(dep, fetch=False))  # the pins the control machine holds already (no Hub request)
    desired = desired_state(dep, plan, read_control_artifacts(dep, plan))
    doc = plan.to_json()
    doc["profile"] = {role: profiles.describe(dep.engine, dep.version, dep.s.profile, pool.settings.engine_args,
                                              pool.settings.trtllm_config)
                      for role, pool in dep.pools.items() if role not in ("router", "slurm-submit")}
    entries = {h.name: h for h in dep.fleet.hosts}
    origins = address_origins(dep)
    for name, host in doc["hosts"].items():
        host["address_from"] = origins[name]  # "address" is the IP every engine, mesh and firewall value uses
        host["ssh_hostname"] = entries[name].ssh_hostname  # what pyinfra connects to (None: the host name)
        host["desired"] = desired[name].to_json()
    doc["network"] = network_json(dep, plan)  # every place each host fetches from, its ports in and out
    return doc


def format_fetcher(dep: Deployment, plan: Plan) -> str:
    """``k2fleet plan``'s line on who talks to the Hub (``k2_checkpoint_fetcher``; how ``auto`` decides)."""
    from k2fleet.planning.desired import loads_weights
    from k2fleet.planning.fetcher_plan import describe

    return f"\n# {describe(dep, [h.name for h in dep.fleet.hosts if loads_weights(plan.hosts[h.name])])}\n"


def _cmd_plan(args: argparse.Namespace) -> int:
    from k2fleet.planning.fabric_plan import format_fabric

    dep, plan = load_plan(args.inventory, args.data)
    if args.json:
        sys.stdout.write(json.dumps(plan_document(dep, plan)))  # one line: the C encoder (indent is pure Python: 2.4 s of 1,024 hosts)
        sys.stdout.write("\n")
    else:
        resolved = {h.name: f"resolved from {'the host name' if h.address_key == 'inventory' else h.address_key} "
                    f"{h.configured_address}" for h in dep.fleet.hosts if h.ip}
        sys.stdout.write(format_plan(plan, dep.s.api_key_file, dep.api_model_name, resolved, dep.s.tls_ca_file))
        sys.stdout.write(format_fetcher(dep, plan))
        sys.stdout.write(format_profile(dep))
        sys.stdout.write(format_firewall(dep, plan))  # every port with who may reach it
        sys.stdout.write(format_fabric(dep))  # the RDMA fabric: packages, GPUDirect, devices, env, fabric gate
        sys.stdout.write(format_network(dep, plan))  # every place each host fetches from, its ports in and out
        sys.stdout.write(privileged_ports.format_section(dep, plan))  # ports no local user may bind
    return 0


def status_document(dep: Deployment, plan: Plan, desired: dict, facts: dict,
                    completion: tuple[bool, str] | None = None) -> dict:
    """The ``k2fleet status --json`` document: per host its :class:`~k2fleet.planning.host_status.HostStatus`
    against ``desired`` (host → its desired state; ``facts``: host → HostState report, or why
    it could not be gathered); ``ok``: every host settled and healthy (and the endpoint's
    completion answered, when asked)."""
    from k2fleet.planning.host_status import host_status, unreachable

    engine = {"engine": dep.engine, "planned_version": plan.engine_version, "runtime": plan.runtime}
    checks = tuple(ws.check for ws in dep.weight_sets)
    hosts = {}
    for h in dep.fleet.hosts:
        seen = facts.get(h.name, "no fact gathered")
        hosts[h.name] = (unreachable(h.name, seen) if isinstance(seen, str)
                         else host_status(desired[h.name], seen, engine, checks)).to_json()
        hosts[h.name]["address"] = h.address
    endpoint = plan.endpoint()
    ok = all(s["ok"] for s in hosts.values()) and (completion is None or completion[0])
    return {"source": plan.source, "ok": ok, **engine,
            "endpoint": f"http://{endpoint[0]}:{endpoint[1]}/v1" if endpoint else None,
            "completion": None if completion is None else {"ok": completion[0], "detail": completion[1]},
            "hosts": hosts}


def format_status(doc: dict) -> str:
    """``k2fleet status`` as text: a table (one row a host), then each host's units, engine,
    driver, checkpoint, checks and drift."""
    rows = [("HOST", "STATE", "UNITS", "CHECKPOINT", "HEALTH", "DRIFT")]
    for name, s in doc["hosts"].items():
        units = "-" if s["error"] else f"{sum(v.startswith('active') for v in s['units'].values())}/{len(s['units'])} active"
        marks = set(s["checkpoint"].values())
        rows.append((name, "ok" if s["ok"] else ("unreachable" if s["error"] else "DRIFT"), units,
                     "-" if not marks else ("verified" if marks == {"verified"} else "NOT VERIFIED"),
                     s["checks"].get("healthy", "-"), str(len(s["drift"]))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = [f"# {doc['source']}: {doc['engine']} {doc['planned_version']} ({doc['runtime']})"
           + (f", endpoint {doc['endpoint']}" if doc["endpoint"] else "")]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    for name, s in doc["hosts"].items():
        out.append(f"\n== {name} ({s['address']}): {'ok' if s['ok'] else 'drift' if not s['error'] else 'not reached'}")
        if s["error"]:
            out.append(f"  drift: host {name}: not reached: {s['error']}")
            continue
        out.append("  units: " + (", ".join(f"{u} {v}" for u, v in s["units"].items()) or "none"))
        e = s["engine"]
        pin = (f"image {e['image']}" if "image" in e else f"venv {e['venv']}" if "venv" in e else "")
        out.append(f"  engine: {e.get('engine')} {e.get('planned_version')} planned, running "
                   f"{e.get('running_version') or 'unknown'}" + (f"; {pin} (pin {e.get('pin')})" if pin else ""))
        d = s["driver"]
        line = f"  driver: {d.get('gpus')}x {d.get('gpu') or 'no GPU'}, driver {d.get('driver') or 'none'}"
        if "module" in d:
            line += f" (module {d['module'] or 'not loaded'}, planned branch {d.get('planned_branch')})"
            line += f", fabric {d.get('fabric') or 'none'}"
            line += "".join(f", {u} {v}" for u, v in d.get("fabric_services", {}).items())
            line += f"; gate {d['gate']}" if "gate" in d else ""
        out.append(line)
        if s["checkpoint"]:
            out.append("  checkpoint: " + ", ".join(f"{c} {v}" for c, v in s["checkpoint"].items()))
        out.append("  checks: " + (", ".join(f"{c} {v}" for c, v in s["checks"].items()) or "none"))
        out += [f"  drift: {d['kind']} {d['subject']}: {d['detail']}" for d in s["drift"]] or ["  drift: none"]
    if doc["completion"] is not None:
        c = doc["completion"]
        out.append(f"\nendpoint {doc['endpoint']}: {'ok' if c['ok'] else 'FAILING'}: {c['detail']}")
    bad = [n for n, s in doc["hosts"].items() if not s["ok"]]
    out.append(f"\nstatus: {len(doc['hosts'])} hosts, " + ("all settled and healthy" if not bad else
               f"{len(bad)} with drift or ill health: {', '.join(bad)}")
               + ("" if doc["completion"] is None or doc["completion"]["ok"] else "; the endpoint's completion failed"))
    return "\n".join(out) + "\n"


def _cmd_status(args: argparse.Namespace) -> int:
    dep, plan = load_plan(args.inventory, args.data)  # a bad inventory: one line, exit 2, before any connection
    from k2fleet.control.artifacts import read_control_artifacts
    from k2fleet.deploy import status as gathering
    from k2fleet.control.checkpoint_copy import manifest_pins
    from k2fleet.planning.desired import desired_state

    dep = dep.pinned(manifest_pins(dep, fetch=False))  # the manifests the control machine pinned at deploy
    desired = desired_state(dep, plan, read_control_artifacts(dep, plan))  # read only: nothing is made
    facts = gathering.gather_facts(str(args.inventory), args.data,
                                   {name: d.fact_query(dep.s.model_dir, full_gpu_look=True)
                                    for name, d in desired.items()})
    completion = None
    if args.completion:
        from k2fleet.control.artifacts import read_api_key
        from k2fleet.control.endpoint import endpoint_completion

        endpoint = plan.endpoint()
        base = f"{'https' if dep.s.tls_ca_file else 'http'}://{address(*endpoint)}" if endpoint else ""
        completion = (endpoint_completion(base, dep.api_model_name, read_api_key(dep), dep.s.tls_ca_file)
                      if endpoint else (False, "the plan has no endpoint"))
    doc = status_document(dep, plan, desired, facts, completion)
    if args.json:
        sys.stdout.write(json.dumps(doc) + "\n")
    else:
        sys.stdout.write(format_status(doc))
    return 0 if doc["ok"] else 1


def _fleet_desired(args: argparse.Namespace) -> tuple[Deployment, Plan, dict]:
    """The validated inventory (a bad one: one line, exit 2, before any connection) and every
    host's desired state, control artifacts only read (nothing is made), as ``status`` has them."""
    from k2fleet.control.artifacts import read_control_artifacts
    from k2fleet.control.checkpoint_copy import manifest_pins
    from k2fleet.planning.desired import desired_state

    dep, plan = load_plan(args.inventory, args.data)
    dep = dep.pinned(manifest_pins(dep, fetch=False))
    return dep, plan, desired_state(dep, plan, read_control_artifacts(dep, plan))


def format_down(name: str, result, purge: bool) -> list[str]:
    """``k2fleet down``'s lines for one host: what was removed and kept, then one line naming
    the packages k2fleet installed (left installed)."""
    if result.error or not result.stdout.strip():
        why = result.error or (result.stderr.strip().splitlines() or ["no report"])[-1]
        return [f"{name}: down FAILED: {why}"]
    try:
        r = json.loads(result.stdout.strip().splitlines()[-1])
    except ValueError:
        return [f"{name}: down FAILED: no report from the host ({result.stdout.strip()[-200:]})"]
    parts = [f"stopped and disabled {len(r['units'])} units", f"removed {len(r['removed'])} paths"]
    parts += [f"deleted nftables table {t}" for t in r["nft_tables"]]
    parts += [f"{k} back to {v}" for k, v in r["sysctl"].items()]
    parts += [f"removed images {', '.join(r['images'])}"] if r["images"] else []
    parts += [f"purged {', '.join(r['purged'])}"] if r["purged"] else []
    parts += [f"kept {', '.join(r['kept'])} (--purge removes)"] if r["kept"] and not purge else []
    out = [f"{name}: down: " + "; ".join(parts)]
    out += [f"{name}: error: {e}" for e in r["errors"]]
    pkgs = r["packages_installed"] + [f"{p} (version changed)" for p in r["packages_changed"]]
    origin = "" if r["packages_from"] == "record" else f" [from the plan: {r['packages_from']}]"
    out.append(f"{name}: packages k2fleet installed (left installed){origin}: {' '.join(pkgs) or 'none'}")
    return out


def _cmd_down(args: argparse.Namespace) -> int:
    from k2fleet.deploy.fleet_shell import run_on_hosts
    from k2fleet.planning.teardown import hosts_down, placed, program_argv

    dep, plan, desired = _fleet_desired(args)
    try:  # every host's desired state carries the same fleet-wide rollout
        names, drains = hosts_down(list(desired), next(iter(desired.values())).rollout, args.host)
    except ValueError as exc:
        sys.stderr.write(f"k2fleet down: {exc}\n")
        return 2
    for lb_host, argv in drains:  # the instances' requests in flight finish before their units stop
        drained = run_on_hosts(str(args.inventory), args.data, {lb_host: argv}, reason="k2fleet down: drain")[lb_host]
        said = (drained.stdout.strip() or drained.stderr.strip() or drained.error or "").splitlines()
        print(f"{lb_host}: load balancer: {said[-1] if said else 'drained'}", flush=True)
        if not drained.ok:
            print(f"down: the drain on {lb_host} failed: nothing was taken down", flush=True)
            return 1
    commands = {name: program_argv("down", placed(dep, plan.hosts[name], desired[name]).down_spec(args.purge))
                for name in names}
    results = run_on_hosts(str(args.inventory), args.data, commands, reason="k2fleet down")
    failed = []
    for name in commands:
        lines = format_down(name, results[name], args.purge)
        print("\n".join(lines), flush=True)
        if any(" FAILED: " in line or ": error: " in line for line in lines):
            failed.append(name)
    print(f"down: {len(commands)} hosts, " + (f"{len(failed)} failed: {', '.join(failed)}" if failed else
                                              "k2fleet's units, files and rules removed"
                                              + ("" if args.purge else "; checkpoints and engine caches kept")))
    if not failed and len(names) < len(desired):
        print(f"next: remove {', '.join(names)} from {args.inventory} and deploy: the load balancer and the "
              "other hosts' firewall allow lists drop it; nothing else changes there")
    return 1 if failed else 0


def _cmd_logs(args: argparse.Namespace) -> int:
    from k2fleet.planning.fleet_logs import LogsError, check_since, choose, fleet_units, journal_argv

    try:  # the arguments first: nothing is read or loaded for a bad --since
        since = None if args.since is None else check_since(args.since)
    except LogsError as exc:
        sys.stderr.write(f"k2fleet logs: {exc}\n")
        return 2
    dep, plan, desired = _fleet_desired(args)
    try:
        chosen = choose(fleet_units(desired), args.service)
    except LogsError as exc:
        sys.stderr.write(f"k2fleet logs: {exc}\n")
        return 2
    from k2fleet.deploy.fleet_shell import stream_on_hosts

    width = max(map(len, chosen), default=0)

    def emit(host: str, line: str) -> None:
        sys.stdout.write(f"{host.ljust(width)} | {line}\n")
        sys.stdout.flush()

    commands = {h: journal_argv(units, since, args.follow) for h, units in chosen.items()}
    try:
        results = stream_on_hosts(str(args.inventory), args.data, commands, emit, reason="k2fleet logs")
    except KeyboardInterrupt:
        return 130 if args.follow else 1
    bad = {h: r.error or (r.stderr.strip().splitlines() or ["journalctl failed"])[-1]
           for h, r in results.items() if not r.ok}
    for host, why in bad.items():
        sys.stderr.write(f"k2fleet logs: {host}: {why}\n")
    return 1 if bad else 0


def _cmd_keys(args: argparse.Namespace) -> int:
    sys.stdout.write(keys_markdown())
    return 0


def _cmd_bundle(args: argparse.Namespace) -> int:
    from k2fleet.control import airgap
    from k2fleet.control.addresses import placeholder_resolver
    from k2fleet.control.lockfile import Lock, LockError
    from k2fleet.inventory.loader import data_args

    locked = None
    if args.locked:
        try:
            locked = Lock.from_text(args.locked.read_text())
        except (OSError, LockError) as exc:
            sys.stderr.write(f"k2fleet bundle: --locked {args.locked}: {exc}\n")
            return 2
    rehearsal = args.rehearsal or bool(locked and locked.rehearsal)
    # The bundle is being made: the inventory's own k2_bundle (where the fleet will take it
    # from) names it, so it is not required to exist yet (it used to be refused: a loop).
    # A bundle holds no address: the fleet's names are not looked up (this control machine may
    # not resolve them: behind a bastion, air-gapped), each gets a placeholder address instead.
    dep, plan = load_plan(args.inventory, [*data_args(airgap.bundle_overlay(rehearsal))[1::2], *args.data, "k2_bundle=null"],
                          resolver=placeholder_resolver())

    def say(line: str) -> None:
        print(line, flush=True)

    try:
        _, drifted = airgap.make_bundle(dep, plan, args.out.resolve(), inventory=args.inventory, rehearsal=rehearsal,
                                        locked=locked, caches=airgap.Caches(args.cache), only=args.only,
                                        engine_cache_src=args.engine_cache, drop_engine_cache=args.no_engine_cache,
                                        say=say)
    except airgap.AirgapError as exc:
        sys.stderr.write(f"k2fleet bundle: {exc}\n")
        return 1
    for line in drifted:
        say(f"drifted: {line}")
    if drifted:
        say(f"k2fleet bundle: {len(drifted)} artifacts differ from {args.locked}")
        return 1
    if locked is not None:
        say(f"k2fleet bundle: identical to {args.locked} ({len(locked.artifacts)} artifacts, same sha256s)")
    return 0


def _cmd_metrics(args: argparse.Namespace) -> int:
    """Offline: the plan's scrape targets as Prometheus file_sd files, prometheus.yml and dashboards in DIR."""
    from k2fleet.planning.metrics import metrics_files, scrape_targets

    dep, plan = load_plan(args.inventory, args.data)
    for rel, text in metrics_files(dep, plan).items():
        path = args.out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    targets = scrape_targets(dep, plan)
    print(f"k2fleet metrics: {len(targets)} targets ({', '.join(sorted({t.job for t in targets})) or 'none'}) in {args.out}/; "
          f"run: prometheus --config.file={args.out}/prometheus.yml")
    if not dep.s.metrics:
        print("note: k2_metrics is off: SGLang serves no /metrics, no exporter target or port is planned")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    """The engine's own benchmark client from this machine against the fleet's endpoint(s), over a concurrency sweep."""
    from k2fleet.control.artifacts import read_api_key
    from k2fleet.control.bench_run import run_bench
    from k2fleet.planning.bench_plan import BenchError, parse_concurrency

    dep, plan = load_plan(args.inventory, args.data)
    try:
        levels = parse_concurrency(args.concurrency)
        points, _ = run_bench(dep, plan, read_api_key(dep), args.out, levels, args.num_prompts, args.input_len,
                              args.output_len, args.client, args.tokenizer, args.replicas, args.timeout)
    except BenchError as exc:
        sys.stderr.write(f"k2fleet bench: {exc}\n")
        return 2
    from k2fleet.control.bench_report import format_table

    sys.stdout.write(format_table(points))
    print(f"k2fleet bench: {len(points)} points in {args.out}/bench.json, bench.txt, bench.png")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    """lm-eval local-completions GSM8K 5-shot (offline, a local file) against the fleet's endpoint."""
    from k2fleet.control.artifacts import read_api_key
    from k2fleet.control.bench_run import run_eval
    from k2fleet.planning.bench_plan import BenchError

    dep, plan = load_plan(args.inventory, args.data)
    try:
        ok, _ = run_eval(dep, plan, read_api_key(dep), args.dataset, args.fewshot, args.out, args.limit, args.client,
                         args.expect, args.num_concurrent, args.max_gen_toks, args.timeout)
    except BenchError as exc:
        sys.stderr.write(f"k2fleet eval: {exc}\n")
        return 2
    return 0 if ok else 1


def _inventory_arguments(p: argparse.ArgumentParser) -> None:
    """INVENTORY and ``--data KEY=VALUE`` (pyinfra's own override syntax)."""
    p.add_argument("inventory")
    p.add_argument("--data", action="append", default=[], metavar="KEY=VALUE",
                   help="override inventory data, exactly as pyinfra's --data")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k2fleet", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="check an inventory; no host is contacted")
    _inventory_arguments(v)
    v.set_defaults(func=_cmd_validate)
    pl = sub.add_parser("plan", help="print what every host will run; no host is contacted")
    _inventory_arguments(pl)
    pl.add_argument("--json", action="store_true", help="machine-readable plan")
    pl.set_defaults(func=_cmd_plan)
    st = sub.add_parser("status", help="each host's units, engine, driver, checkpoint, health and drift from the "
                        "plan (read-only, one round trip a host); exit 1 on drift or ill health")
    _inventory_arguments(st)
    st.add_argument("--json", action="store_true", help="machine-readable status")
    st.add_argument("--completion", action="store_true",
                    help="also send one real chat completion through the fleet's endpoint from this machine")
    st.set_defaults(func=_cmd_status)
    lo = sub.add_parser("logs", help="the journals of the fleet's units from every host (through the deploy's "
                        "connections: bastion and sudo included), each line prefixed by its host",
                        description="journalctl on every host for k2fleet's units there (or the one --service names), "
                        "through the deploy's own connections. A bad inventory, service or time: one line, exit 2, "
                        "no host contacted.")
    _inventory_arguments(lo)
    lo.add_argument("--service", metavar="S", help="one of the fleet's units (k2-vllm or k2-vllm.service); "
                    "only the hosts that run it are read")
    lo.add_argument("--since", metavar="T", help="journalctl --since: YYYY-MM-DD [HH:MM[:SS]], HH:MM[:SS], today, "
                    "yesterday, @EPOCH, -1h, -30min, '2 hours ago'")
    lo.add_argument("--follow", action="store_true", help="stream new lines from every host at once until interrupted")
    lo.set_defaults(func=_cmd_logs)
    dn = sub.add_parser("down", help="stop and remove every unit, firewall table, sysctl drop-in, mesh key, load "
                        "balancer and file k2fleet placed on each host; checkpoints stay unless --purge",
                        description="Through the deploy's own connections. Units are stopped and disabled first; "
                        "what the deploy changed is given back from the record it kept on each host before its "
                        "first change; packages k2fleet installed stay installed and are listed, one line a host. "
                        "A bad inventory: one line, exit 2, no host contacted. Exit 1 when a host failed.")
    _inventory_arguments(dn)
    dn.add_argument("--purge", action="store_true", help="also remove the checkpoints (and engine caches)")
    dn.add_argument("--host", action="append", default=[], metavar="NAME",
                    help="only this host (repeat for more): its instance is drained at the load balancer first; "
                    "then remove it from the inventory and deploy")
    dn.set_defaults(func=_cmd_down)
    k = sub.add_parser("keys", help="print the inventory key reference (Markdown)")
    k.set_defaults(func=_cmd_keys)
    me = sub.add_parser("metrics", help="write DIR/prometheus.yml, DIR/targets/*.json (file_sd) and DIR/dashboards/ "
                        "from the plan; no host is contacted")
    _inventory_arguments(me)
    me.add_argument("--out", type=Path, required=True, help="output directory")
    me.set_defaults(func=_cmd_metrics)
    bu = sub.add_parser("bundle", help="gather everything an air-gapped fleet needs into DIR, with k2fleet.lock")
    _inventory_arguments(bu)
    bu.add_argument("--out", type=Path, required=True, help="bundle directory (made, or brought up to date)")
    bu.add_argument("--rehearsal", action="store_true",
                    help="for `k2fleet rehearse --bundle`: engine TEST DOUBLES and simulated GPUs")
    bu.add_argument("--locked", type=Path, metavar="LOCK", help="reproduce this k2fleet.lock; fail naming what drifted")
    bu.add_argument("--cache", type=Path, default=Path("/var/cache/k2fleet"), help="download/build cache")
    bu.add_argument("--only", action="append", default=[], choices=["debs", "wheels", "images", "checkpoints"],
                    help="build only this part (repeatable)")
    cache = bu.add_mutually_exclusive_group()
    cache.add_argument("--engine-cache", type=Path, metavar="SRC",
                       help="a warmed copy of a host's /var/cache/k2fleet/engine-cache/<engine>/ to carry: archived "
                       "(links refused, sizes capped) and unpacked on hosts whose cache directory is empty")
    cache.add_argument("--no-engine-cache", action="store_true",
                       help="drop the engine cache a previous build put in the bundle (kept otherwise)")
    bu.set_defaults(func=_cmd_bundle)
    be = sub.add_parser("bench", help="run the engine's own benchmark client (vLLM: `vllm bench serve`, SGLang: "
                        "`python -m sglang.bench_serving`) from this "
                        "machine against the fleet's endpoint over a concurrency sweep: JSON, a table and a PNG plot",
                        description="The client runs on this machine and must be installed here (--client: the "
                        "`vllm` executable or a Python that has vLLM; for SGLang a Python that has sglang); the "
                        "tokenizer must be readable here too (--tokenizer DIR on an air-gapped control machine). The "
                        "API key (k2_api_key_file) is passed as OPENAI_API_KEY in the client's environment. "
                        "TRT-LLM and KTransformers: not wired in.")
    _inventory_arguments(be)
    be.add_argument("--concurrency", metavar="N,N,...", help="levels to sweep (1..4096, at most 16; default 1,2,4,...,256)")
    be.add_argument("--num-prompts", type=int, help="requests per level (default 10 x the level, 10..1000)")
    be.add_argument("--input-len", type=int, default=1024, help="random input tokens per request (default 1024)")
    be.add_argument("--output-len", type=int, default=1024, help="output tokens per request, EOS ignored (default 1024)")
    be.add_argument("--out", type=Path, default=Path("k2fleet-bench"), help="output directory (default ./k2fleet-bench)")
    be.add_argument("--client", metavar="PATH", help="the vllm executable or a Python with vLLM; for SGLang a Python "
                    "with sglang (default: vllm, or python3, on PATH)")
    be.add_argument("--tokenizer", metavar="DIR", help="tokenizer for the random prompts (default: k2_model from the Hub)")
    be.add_argument("--replicas", action="store_true", help="also benchmark every serving replica on its own address")
    be.add_argument("--timeout", type=float, help="seconds per concurrency level (default: none)")
    be.set_defaults(func=_cmd_bench)
    ev = sub.add_parser("eval", help="GSM8K 5-shot with lm-eval local-completions against the fleet's endpoint, "
                        "offline from a local file; exit 1 below --expect minus the standard error",
                        description="lm-eval (`pip install 'lm-eval[api]'`) runs on this machine (--client: lm-eval, "
                        "or a Python that has it) with HF_DATASETS_OFFLINE=1 on --dataset (JSONL lines with "
                        "`question` and `answer`, as openai/gsm8k's test split); the API key is passed as OPENAI_API_KEY.")
    _inventory_arguments(ev)
    ev.add_argument("--dataset", type=Path, required=True, help="GSM8K test split as JSONL (question, answer)")
    ev.add_argument("--fewshot", type=Path, help="JSONL the 5 shots come from (GSM8K's train split; default --dataset)")
    ev.add_argument("--limit", type=int, help="evaluate only the first N questions")
    ev.add_argument("--expect", type=float, default=0.9416,
                    help="the score to reach, less its standard error (default 0.9416: the seeds' Kimi-K2-Thinking TP8)")
    ev.add_argument("--out", type=Path, default=Path("k2fleet-eval"), help="output directory (default ./k2fleet-eval)")
    ev.add_argument("--client", metavar="PATH", help="lm-eval executable or a Python with lm-eval (default: lm-eval on PATH)")
    ev.add_argument("--num-concurrent", type=int, default=32, help="requests in flight (default 32, as the seeds)")
    ev.add_argument("--max-gen-toks", type=int, default=256, help="tokens per answer (default 256, lm-eval's)")
    ev.add_argument("--timeout", type=float, help="seconds for the whole run (default: none)")
    ev.set_defaults(func=_cmd_eval)
    for add in command_plugins():  # the sandbox's `rehearse` and `sandbox` (k2fleet.control.stand_ins)
        add(sub, _inventory_arguments)
    return p


def main(argv: list[str] | None = None) -> int:
    from k2fleet.control import ControlError

    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except SpecError as exc:
        refuse(exc)
    except ControlError as exc:  # e.g. k2_bundle: an altered artifact (one line, no traceback)
        sys.stderr.write(f"k2fleet: {exc}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
