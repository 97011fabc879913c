"""Tests for the k2fleet-test-double engines in files/doubles (loopback only).

Every test runs the doubles as real processes, exactly as systemd would, on
free loopback ports, and talks to them over HTTP.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest

DOUBLES = Path(__file__).resolve().parent.parent / "k2sandbox" / "files" / "doubles"
BIN = DOUBLES / "bin"
LOCAL = "127.0.0.1"
DEBIAN_PYTHON = "/usr/bin/python3"


# ---------------------------------------------------------------- helpers

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOCAL, 0))
        return int(sock.getsockname()[1])


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "K2FLEET_DOUBLE_", "PMIX_"))}
    env.update(PYTHONPATH=str(DOUBLES), PYTHONUNBUFFERED="1", K2FLEET_DOUBLE_RDZV_TIMEOUT="20")
    env.update(extra)
    return env


def http(method: str, url: str, body: Optional[bytes] = None) -> tuple[int, Any, dict[str, str]]:
    request = urllib.request.Request(url, data=body, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            raw, status, headers = response.read(), response.status, dict(response.headers)
    except urllib.error.HTTPError as exc:
        raw, status, headers = exc.read(), exc.code, dict(exc.headers)
    try:
        return status, json.loads(raw), headers
    except ValueError:
        return status, raw.decode(), headers


def get(url: str) -> tuple[int, Any, dict[str, str]]:
    return http("GET", url)


def post(url: str, payload: Any) -> tuple[int, Any, dict[str, str]]:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return http("POST", url, data)


def status_or_none(url: str) -> Optional[int]:
    try:
        return get(url)[0]
    except OSError:
        return None


def wait_for(predicate: Callable[[], bool], timeout: float = 15, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def wait_status(url: str, expected: int, timeout: float = 15) -> None:
    wait_for(lambda: status_or_none(url) == expected, timeout, f"{url} -> {expected}")


class Procs:
    """Starts doubles with logs in tmp files; terminates them by pid at teardown."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.started = tmp, []

    def start(self, argv: list[str], env: Optional[dict[str, str]] = None) -> subprocess.Popen:
        log = open(self.tmp / f"proc{len(self.started)}.log", "w+")
        proc = subprocess.Popen(argv, env=env or base_env(), stdout=log,
                                stderr=subprocess.STDOUT, cwd=self.tmp)
        proc.log = log  # type: ignore[attr-defined]
        self.started.append(proc)
        return proc

    @staticmethod
    def output(proc: subprocess.Popen) -> str:
        proc.log.flush()  # type: ignore[attr-defined]
        return Path(proc.log.name).read_text()  # type: ignore[attr-defined]

    def stop_all(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.started:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.log.close()  # type: ignore[attr-defined]


def run(argv: list[str], env: Optional[dict[str, str]] = None, timeout: float = 15) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env or base_env(), capture_output=True, text=True, timeout=timeout)


def vllm(*args: str) -> list[str]:
    return [sys.executable, str(BIN / "vllm"), "serve", *args]


def sglang(*args: str) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", *args]


def trtllm(*args: str) -> list[str]:
    return [sys.executable, str(BIN / "trtllm-serve"), *args]


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    manager = Procs(tmp_path)
    yield manager
    manager.stop_all()


@pytest.fixture
def model(tmp_path: Path) -> str:
    path = tmp_path / "Kimi-K2-Instruct"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "kimi_k2"}))
    return str(path)


CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {}}}}]


# ---------------------------------------------------------------- vLLM

def test_vllm_single_node_serves_openai_api(procs: Procs, model: str) -> None:
    port = free_port()
    procs.start(vllm(model, "--host", LOCAL, "--port", str(port), "--served-model-name", "kimi-k2",
                     "--trust-remote-code", "-tp", "8", "--reasoning-parser", "kimi_k2",
                     "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k2",
                     "--max-model-len", "128k", "--no-enable-prefix-caching"))
    url = f"http://{LOCAL}:{port}"
    wait_status(f"{url}/health", 200)

    status, models, headers = get(f"{url}/v1/models")
    assert status == 200 and "k2fleet-test-double" in headers["Server"]
    entry = models["data"][0]
    assert entry["id"] == "kimi-k2" and entry["metadata"]["model_type"] == "kimi_k2"

    status, answer, _ = post(f"{url}/v1/chat/completions", dict(CHAT, model="kimi-k2"))
    assert status == 200 and answer["system_fingerprint"] == "k2fleet-test-double"
    message = answer["choices"][0]["message"]
    assert message["content"] and message["reasoning_content"]
    assert post(f"{url}/v1/chat/completions", CHAT)[1]["choices"][0]["message"] == message

    status, answer, _ = post(f"{url}/v1/chat/completions", dict(CHAT, tools=TOOLS))
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {}

    short = post(f"{url}/v1/chat/completions", dict(CHAT, max_tokens=3))[1]["choices"][0]
    assert len(short["message"]["content"].split()) <= 3 and short["finish_reason"] == "length"
    assert post(f"{url}/v1/chat/completions", b"{not json")[0] == 400
    assert post(f"{url}/v1/chat/completions", {"model": "kimi-k2"})[0] == 400
    assert post(f"{url}/v1/chat/completions", dict(CHAT, model="other"))[0] == 404
    assert post(f"{url}/v1/completions", {"prompt": "Hello"})[1]["choices"][0]["text"]


def test_vllm_double_serves_metrics_that_move_with_completions(procs: Procs, model: str) -> None:
    """GET /metrics (open, as vLLM's): Prometheus text with vLLM's family names, its request
    and token counters moving with each completion answered."""
    port = free_port()
    procs.start(vllm(model, "--host", LOCAL, "--port", str(port), "--served-model-name", "kimi-k2", "--api-key", "k"))
    url = f"http://{LOCAL}:{port}"
    wait_status(f"{url}/health", 200)

    def counter(name: str) -> float:
        status, text, headers = get(f"{url}/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain"), (status, text)
        found = [line.split()[-1] for line in text.splitlines() if line.startswith(name + "{")]
        assert len(found) == 1 and f"# TYPE {name} " in text, text
        return float(found[0])

    assert counter("vllm:request_success_total") == 0.0 and counter("vllm:kv_cache_usage_perc") == 0.0
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(dict(CHAT, model="kimi-k2")).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": "Bearer k"})
    with urllib.request.urlopen(request, timeout=10) as response:
        usage = json.loads(response.read())["usage"]
    assert counter("vllm:request_success_total") == 1.0
    assert counter("vllm:generation_tokens_total") == usage["completion_tokens"] > 0


def test_vllm_refuses_unknown_and_inconsistent_argv(model: str) -> None:
    result = run(vllm(model, "--double-startup-delay", "3"))
    assert result.returncode == 2 and "unrecognized arguments" in result.stderr
    result = run(vllm(model, "-tp", "8", "-dcp", "3"))
    assert result.returncode == 2 and "divide" in result.stderr
    result = run(vllm(model, "--headless"))
    assert result.returncode == 2 and "--headless requires" in result.stderr
    version = run([sys.executable, str(BIN / "vllm"), "--version"])
    assert version.returncode == 0 and "k2fleet-test-double" in version.stdout


def test_vllm_tools_need_auto_tool_choice(procs: Procs, model: str) -> None:
    port = free_port()
    procs.start(vllm(model, "--host", LOCAL, "--port", str(port)))
    wait_status(f"http://{LOCAL}:{port}/health", 200)
    status, body, _ = post(f"http://{LOCAL}:{port}/v1/chat/completions", dict(CHAT, tools=TOOLS))
    assert status == 400 and "--enable-auto-tool-choice" in json.dumps(body)


@pytest.mark.parametrize("keep_alive", ["0", "1"])
def test_vllm_data_parallel_head_waits_for_headless(procs: Procs, model: str, keep_alive: str) -> None:
    port, rpc = free_port(), free_port()
    dp = ["-dp", "2", "-dpl", "1", "-dpa", LOCAL, "-dpp", str(rpc), "-tp", "8",
          "--enable-expert-parallel"]
    head = procs.start(vllm(model, "--host", LOCAL, "--port", str(port), *dp),
                       env=base_env(VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=keep_alive))
    health = f"http://{LOCAL}:{port}/health"
    wait_status(health, 503)
    time.sleep(0.5)
    assert status_or_none(health) == 503

    headless = procs.start(vllm(model, "--headless", "-dpr", "1", *dp))
    wait_status(health, 200)
    assert "joined rendezvous" in procs.output(headless)
    status, models, _ = get(f"http://{LOCAL}:{port}/v1/models")
    assert status == 200 and models["data"][0]["metadata"]["members"] == []  # same host: not another node

    headless.terminate()
    headless.wait(5)
    if keep_alive == "1":
        wait_status(health, 503)  # VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1: the server stays, not ready
    else:
        assert head.wait(10) == 1  # vLLM's default: the API server exits when an engine dies
        assert "ranks [1] on" in procs.output(head) and "died: engine core dead" in procs.output(head)


def test_vllm_multinode_master_rendezvous(procs: Procs, model: str) -> None:
    port, master = free_port(), free_port()
    nodes = ["-tp", "16", "--nnodes", "2", "--master-addr", LOCAL, "--master-port", str(master),
             "--distributed-executor-backend", "mp"]
    procs.start(vllm(model, "--host", LOCAL, "--port", str(port), "--node-rank", "0", *nodes))
    health = f"http://{LOCAL}:{port}/health"
    wait_status(health, 503)
    procs.start(vllm(model, "--headless", "--node-rank", "1", *nodes))
    wait_status(health, 200)


def test_vllm_headless_without_head_times_out(model: str) -> None:
    rpc = free_port()
    result = run(vllm(model, "--headless", "-dp", "2", "-dpl", "1", "-dpr", "1", "-dpa", LOCAL,
                      "-dpp", str(rpc)), env=base_env(K2FLEET_DOUBLE_RDZV_TIMEOUT="1"))
    assert result.returncode == 1 and f"{LOCAL}:{rpc}" in result.stderr


def test_vllm_ray_backend_across_nodes_refused_without_ray(model: str) -> None:
    result = run(vllm(model, "-tp", "16", "--distributed-executor-backend", "ray"))
    assert result.returncode == 1 and "ray" in result.stderr


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm"])
def test_model_dir_without_config_is_refused(tmp_path: Path, engine: str) -> None:
    empty = tmp_path / "no-config"
    empty.mkdir()
    argv = {"vllm": vllm(str(empty)), "sglang": sglang("--model-path", str(empty)),
            "trtllm": trtllm(str(empty))}[engine]
    result = run(argv)
    assert result.returncode == 1 and "config.json" in result.stderr


def test_hub_id_model_is_accepted_after_simulated_load(procs: Procs) -> None:
    port = free_port()
    procs.start(sglang("--model-path", "moonshotai/Kimi-K2-Instruct", "--port", str(port)),
                env=base_env(K2FLEET_DOUBLE_STARTUP_SECONDS="1"))
    health = f"http://{LOCAL}:{port}/health"
    wait_status(health, 503)
    wait_status(health, 200)
    assert get(f"http://{LOCAL}:{port}/v1/models")[1]["data"][0]["id"] == "moonshotai/Kimi-K2-Instruct"


# ---------------------------------------------------------------- SGLang

def test_sglang_two_node_dist_init(procs: Procs, model: str) -> None:
    port, dist = free_port(), free_port()
    common = ["--model-path", model, "--tp-size", "16", "--nnodes", "2",
              "--dist-init-addr", f"{LOCAL}:{dist}", "--trust-remote-code",
              "--tool-call-parser", "kimi_k2", "--reasoning-parser", "kimi_k2",
              "--host", LOCAL, "--port", str(port)]
    procs.start(sglang(*common, "--node-rank", "0"))
    health = f"http://{LOCAL}:{port}/health"
    wait_status(health, 503)
    worker = procs.start(sglang(*common, "--node-rank", "1"))
    wait_status(health, 200)
    assert worker.poll() is None and "no HTTP server" in procs.output(worker)
    answer = post(f"http://{LOCAL}:{port}/v1/chat/completions", dict(CHAT, tools=TOOLS))[1]
    assert answer["choices"][0]["message"]["tool_calls"]
    assert run(sglang(*common, "--node-rank", "0", "--bogus-flag")).returncode == 2


@pytest.fixture(scope="module")
def real_router_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A venv with the REAL SGLang router, installed as the router host gets it: from the
    control machine's engine-side wheelhouse (downloaded once), with no package index."""
    from k2fleet.control import wheelhouse
    from k2fleet.planning import engine_side

    requirement = engine_side.ENGINE_SIDE_PINS[("sglang", "sglang_router.launch_router")]
    wheels = wheelhouse.ensure_wheelhouse([requirement], pythons=(engine_side.host_python("debian-12"),), archs=("x86_64",))
    venv = tmp_path_factory.mktemp("router") / "venv"
    subprocess.run([DEBIAN_PYTHON, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin/pip"), "install", "--quiet", "--no-index", "--find-links", str(wheels),
                    requirement], check=True)
    return str(venv / "bin/python")


def pd_rooms(base: str) -> set:
    return {r["bootstrap_room"] for r in get(f"{base}/k2fleet/pd_requests")[1]["requests"]}


def test_real_sglang_router_over_prefill_and_decode(procs: Procs, model: str, real_router_python: str) -> None:
    prefill, decode, router, boot = free_port(), free_port(), free_port(), free_port()
    pd = ["--model-path", model, "--host", LOCAL, "--disaggregation-ib-device", "mlx5_0",
          "--reasoning-parser", "kimi_k2"]
    procs.start(sglang(*pd, "--port", str(prefill), "--disaggregation-mode", "prefill",
                       "--disaggregation-bootstrap-port", str(boot)))
    decode_proc = procs.start(sglang(*pd, "--port", str(decode), "--disaggregation-mode", "decode"))
    wait_status(f"http://{LOCAL}:{decode}/health", 200)
    # a PD server answers only what the router sends (the bootstrap fields), like SGLang's
    status, refused, _ = post(f"http://{LOCAL}:{decode}/v1/chat/completions", CHAT)
    assert status == 400 and "bootstrap_room" in refused["message"]
    env = {k: v for k, v in base_env().items() if k != "PYTHONPATH"}  # the real package, not a double
    procs.start([real_router_python, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                 "--prefill", f"http://{LOCAL}:{prefill}", str(boot),
                 "--decode", f"http://{LOCAL}:{decode}", "--worker-startup-check-interval", "1",
                 "--host", LOCAL, "--port", str(router), "--policy", "round_robin"], env=env)
    health = f"http://{LOCAL}:{router}/health"
    wait_status(health, 200)

    status, answer, _ = post(f"http://{LOCAL}:{router}/v1/chat/completions", dict(CHAT, model=model))
    assert status == 200 and answer["choices"][0]["message"]["reasoning_content"], answer
    common = pd_rooms(f"http://{LOCAL}:{prefill}") & pd_rooms(f"http://{LOCAL}:{decode}")
    assert len(common) == 1  # one request, one bootstrap room, seen by both pools

    gate = [sys.executable, str(Path(__file__).resolve().parents[1] / "k2fleet/hostprogs/health.py"),
            "--base", f"http://{LOCAL}:{router}", "--model", model, "--unit", "k2-sglang-router.service",
            "--timeout", "10", "--expect-pd",
            json.dumps({"prefill": [f"http://{LOCAL}:{prefill}"], "decode": [f"http://{LOCAL}:{decode}"]})]
    assert subprocess.run(gate, capture_output=True, text=True).returncode == 0
    # a request that reached only the prefill pool has no room in common with decode
    post(f"http://{LOCAL}:{prefill}/v1/chat/completions",
         dict(CHAT, bootstrap_host=LOCAL, bootstrap_port=boot, bootstrap_room=7))
    assert pd_rooms(f"http://{LOCAL}:{prefill}") - pd_rooms(f"http://{LOCAL}:{decode}") == {7}

    decode_proc.terminate()
    decode_proc.wait(5)
    assert subprocess.run(gate, capture_output=True, text=True).returncode == 1  # decode gone: not healthy


# ---------------------------------------------------------------- TensorRT-LLM

def mpi_env(rank: int, size: int, rdzv: str) -> dict[str, str]:
    return base_env(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE=str(size),
                    K2FLEET_DOUBLE_RDZV=rdzv)


def test_trtllm_tcp_rendezvous_under_faked_mpi(procs: Procs, model: str, tmp_path: Path) -> None:
    port, rdzv = free_port(), f"{LOCAL}:{free_port()}"
    config = tmp_path / "extra.yaml"
    config.write_text("enable_attention_dp: true\nkv_cache_config:\n  dtype: fp8\n")
    argv = trtllm("serve", model, "--host", LOCAL, "--port", str(port), "--backend", "pytorch",
                  "--tp_size", "2", "--ep_size", "2", "--trust_remote_code",
                  "--config", str(config), "--reasoning_parser", "deepseek-r1")
    head = procs.start(argv, env=mpi_env(0, 2, rdzv))
    health = f"http://{LOCAL}:{port}/health"
    wait_status(health, 503)
    worker = procs.start(argv, env=mpi_env(1, 2, rdzv))
    wait_status(health, 200)
    models = get(f"http://{LOCAL}:{port}/v1/models")[1]
    assert models["data"][0]["metadata"]["extra_llm_api_options"] == ["enable_attention_dp",
                                                                      "kv_cache_config"]
    head.terminate()
    head.wait(5)
    assert worker.wait(10) == 0


def test_trtllm_refuses_bad_world_yaml_and_flags(model: str, tmp_path: Path) -> None:
    rdzv = f"{LOCAL}:{free_port()}"
    result = run(trtllm(model, "--tp_size", "4"), env=mpi_env(0, 2, rdzv))
    assert result.returncode == 1 and "world size 2" in result.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("")
    result = run(trtllm(model, "--extra_llm_api_options", str(bad)))
    assert result.returncode == 1 and "extra_llm_api_options" in result.stderr
    result = run(trtllm(model, "--tp-size", "2"))
    assert result.returncode == 2


def srun_env(rank: int, size: int, rdzv: str) -> dict[str, str]:
    """What srun gives each task of a step (one task per GPU)."""
    return base_env(SLURM_STEP_ID="0", SLURM_PROCID=str(rank), SLURM_NTASKS=str(size), K2FLEET_DOUBLE_RDZV=rdzv)


def test_trtllm_under_srun_takes_world_from_slurm_and_sizes_from_yaml(procs: Procs, model: str, tmp_path: Path) -> None:
    port, rdzv = free_port(), f"{LOCAL}:{free_port()}"
    config = tmp_path / "gen_config.yaml"
    config.write_text("tensor_parallel_size: 2\nmoe_expert_parallel_size: 2\nenable_attention_dp: true\n"
                      "kv_cache_config:\n  dtype: fp8\n")
    argv = trtllm("serve", model, "--host", LOCAL, "--port", str(port), "--config", str(config))
    head = procs.start(argv, env=srun_env(0, 2, rdzv))
    health = f"http://{LOCAL}:{port}/health"
    wait_status(health, 503)
    procs.start(argv, env=srun_env(1, 2, rdzv))
    wait_status(health, 200)
    meta = get(f"http://{LOCAL}:{port}/v1/models")[1]["data"][0]["metadata"]
    assert (meta["tp_size"], meta["ep_size"], meta["world"], meta["enable_attention_dp"]) == (2, 2, 2, True)
    wait_for(lambda: get(f"http://{LOCAL}:{port}/v1/models")[1]["data"][0]["metadata"]["hosts"] == [socket.gethostname()])
    head.terminate()
    head.wait(5)
    # a step of 3 tasks for a TP2 config: the world does not match, the double refuses
    result = run(argv, env=srun_env(0, 3, f"{LOCAL}:{free_port()}"))
    assert result.returncode == 1 and "world size 3" in result.stderr


def test_trtllm_disaggregated_front_end_routes_ctx_then_gen(procs: Procs, model: str, tmp_path: Path) -> None:
    ctx_port, gen_port, front_port = free_port(), free_port(), free_port()
    server_config = tmp_path / "server_config.yaml"
    server_config.write_text(f"hostname: {LOCAL}\nport: {front_port}\nbackend: pytorch\n"
                             f"context_servers:\n  num_instances: 1\n  urls:\n  - {LOCAL}:{ctx_port}\n"
                             f"generation_servers:\n  num_instances: 1\n  urls:\n  - {LOCAL}:{gen_port}\n")
    front = procs.start(trtllm("disaggregated", "-c", str(server_config)))
    health = f"http://{LOCAL}:{front_port}/health"
    wait_status(health, 503)
    ctx = procs.start(trtllm("serve", model, "--host", LOCAL, "--port", str(ctx_port)))
    wait_for(lambda: "gen server" in str(get(health)[1]), what="503 naming the missing gen server")
    gen = procs.start(trtllm("serve", model, "--host", LOCAL, "--port", str(gen_port), "--tp_size", "1"))
    wait_status(health, 200)
    status, answer, _ = post(f"http://{LOCAL}:{front_port}/v1/chat/completions", dict(CHAT, model=model))
    assert status == 200 and answer["choices"][0]["message"]["content"]
    assert "POST /v1/chat/completions" in procs.output(ctx) and "POST /v1/chat/completions" in procs.output(gen)
    topology = get(f"http://{LOCAL}:{front_port}/v1/models")[1]["data"][0]["metadata"]["disaggregated"]
    assert [s["url"] for s in topology["context_servers"]] == [f"http://{LOCAL}:{ctx_port}"]
    assert [s["tp_size"] for s in topology["generation_servers"]] == [1]
    front.terminate()
    assert front.wait(5) == 0


def test_trtllm_disaggregated_refuses_a_config_without_servers(tmp_path: Path) -> None:
    bad = tmp_path / "server_config.yaml"
    bad.write_text("hostname: 127.0.0.1\nport: 8333\ncontext_servers:\n  urls: []\n")
    result = run(trtllm("disaggregated", "-c", str(bad)))
    assert result.returncode == 1 and "context_servers.urls" in result.stderr


def mpirun_usable() -> Optional[str]:
    if not shutil.which("mpirun"):
        return "mpirun is not installed (apt-get install openmpi-bin python3-mpi4py)"
    probe = subprocess.run([DEBIAN_PYTHON, "-c", "import mpi4py"], capture_output=True)
    if probe.returncode:
        return f"{DEBIAN_PYTHON} has no mpi4py (apt-get install python3-mpi4py)"
    return None


@pytest.mark.skipif(mpirun_usable() is not None, reason=str(mpirun_usable()))
def test_trtllm_real_mpirun_with_mpi4py(procs: Procs, model: str) -> None:
    port = free_port()
    env = base_env(PATH=f"{BIN}:/usr/bin:/bin")
    env.pop("K2FLEET_DOUBLE_RDZV", None)
    mpirun = procs.start(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2",
                          "-x", "PATH", "-x", "PYTHONPATH", "-x", "PYTHONUNBUFFERED",
                          DEBIAN_PYTHON, str(BIN / "trtllm-llmapi-launch"), "trtllm-serve", model,
                          "--host", LOCAL, "--port", str(port), "--tp_size", "2"], env=env)
    wait_status(f"http://{LOCAL}:{port}/health", 200, timeout=30)
    assert "MPI rendezvous complete: rank 1/2" in procs.output(mpirun)
    mpirun.terminate()
    mpirun.wait(15)


# --------------------------------------------------------------------------- health gate vs the double's world

HEALTH_PY = Path(__file__).resolve().parent.parent / "k2fleet" / "hostprogs" / "health.py"


def health_gate(port: int, model: str, world: dict[str, int]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HEALTH_PY), "--base", f"http://127.0.0.1:{port}", "--model", model,
                           "--unit", "k2-vllm.service", "--timeout", "20", "--expect-world", json.dumps(world)],
                          capture_output=True, text=True, timeout=60)


def test_health_gate_compares_the_topology_the_double_reports_with_the_plan(procs: Procs, model: str) -> None:
    port = free_port()
    procs.start(vllm(model, "--port", str(port), "--tensor-parallel-size", "8", "--served-model-name", "k2"))
    wait_status(f"http://127.0.0.1:{port}/health", 200)
    ok = health_gate(port, "k2", {"tensor_parallel_size": 8, "pipeline_parallel_size": 1, "data_parallel_size": 1})
    assert ok.returncode == 0, ok.stderr
    wrong = health_gate(port, "k2", {"tensor_parallel_size": 16})
    assert wrong.returncode == 1
    assert "topology: planned tensor_parallel_size=16, the engine reports 8" in wrong.stderr
    missing = health_gate(port, "k2", {"nodes_in_ray_cluster": 2})
    assert missing.returncode == 1 and "does not report nodes_in_ray_cluster" in missing.stderr
