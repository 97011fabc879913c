"""TLS on the endpoints (issue 33 item 5): ``k2_tls_cert_file``, ``k2_tls_key_file`` and
``k2_tls_ca_file`` make every endpoint k2fleet's HAProxy front serving HTTPS (vLLM's too),
the load balancer HTTPS on both sides, and every client verify the server against the CA.

The test CA and certificates are made here with the ``openssl`` CLI (as
:mod:`k2sandbox.package_mirror` makes its company CA). The loopback tests run the real HAProxy
(the OS package) with k2fleet's rendered configs before a stdlib OpenAI stand-in, and the
real health gate program against it: a client that trusts the CA gets a completion, one that
does not (no CA, another CA, another name) is refused before it sends a byte of the request.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import ssl
import subprocess
import threading
import time
from pathlib import Path

import pytest

from k2fleet.cli import format_plan, load_plan
from k2fleet.control.artifacts import read_control_artifacts
from k2fleet.control.endpoint import endpoint_completion
from k2fleet.deploy.gate import refusal_line
from k2fleet.hostprogs import health
from k2fleet.inventory.spec import SpecError
from k2fleet.planning import api_front, load_balancer
from k2fleet.planning.desired import desired_state
from k2fleet.planning.units import holds_api_key
from tests.test_api_front import OpenAIStandIn
from tests.test_api_key import key_file
from tests.test_doubles import LOCAL, free_port

HAPROXY = shutil.which("haproxy") or api_front.HAPROXY


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def make_ca(work: Path, name: str = "k2fleet test CA") -> tuple[Path, Path]:
    """A test CA (EC P-256, one day): (certificate, key)."""
    work.mkdir(parents=True, exist_ok=True)
    cert, key = work / "ca.pem", work / "ca.key"
    _openssl("req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", str(key), "-subj", f"/CN={name}", "-days", "1",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             "-out", str(cert), cwd=work)
    return cert, key


def make_server(work: Path, ca: tuple[Path, Path], ips: list[str], stem: str = "server") -> tuple[Path, Path]:
    """A server certificate for ``ips`` (subjectAltName IP) signed by ``ca``: (certificate, key 0600)."""
    cert, key, csr = work / f"{stem}.pem", work / f"{stem}.key", work / f"{stem}.csr"
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", str(key),
             "-subj", f"/CN={stem}", "-out", str(csr), cwd=work)
    ext = work / f"{stem}.ext"
    ext.write_text("subjectAltName=" + ",".join(f"IP:{ip}" for ip in ips) + "\nextendedKeyUsage=serverAuth\n"
                   "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
             "-days", "1", "-extfile", str(ext), "-out", str(cert), cwd=work)
    os.chmod(key, 0o600)
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """The test CA, a certificate for 127.0.0.1 and the sandbox-style addresses of the example
    inventories, a certificate of another CA, and one for another address."""
    work = tmp_path_factory.mktemp("pki")
    ca = make_ca(work / "ca")
    other = make_ca(work / "other", "another CA")
    ips = ["127.0.0.1", *(f"192.0.2.{i}" for i in range(1, 64)), *(f"198.51.100.{i}" for i in range(1, 64))]
    cert, key = make_server(work / "ca", ca, ips)
    stray, stray_key = make_server(work / "other", other, ips, "stray")
    wrong_name, wrong_key = make_server(work / "ca", ca, ["10.9.9.9"], "wrong-name")
    return {"ca": ca[0], "cert": cert, "key": key, "other_ca": other[0], "stray": stray, "stray_key": stray_key,
            "wrong_name": wrong_name, "wrong_name_key": wrong_key}


def tls_data(pki: dict[str, Path], cert: str = "cert", key: str = "key", ca: str = "ca") -> list[str]:
    return [f"k2_tls_cert_file={pki[cert]}", f"k2_tls_key_file={pki[key]}", f"k2_tls_ca_file={pki[ca]}"]


# --------------------------------------------------------------------------- validation (one line, naming the key)


def _refused(inventory: str, data: list[str]) -> str:
    with pytest.raises(SpecError) as info:
        load_plan(inventory, data)
    line = refusal_line(info.value)
    assert "\n" not in line
    return line


def test_all_three_keys_or_none(pki) -> None:
    line = _refused("inventories/h200.py", [f"k2_tls_cert_file={pki['cert']}", f"k2_tls_key_file={pki['key']}"])
    assert "k2_tls_ca_file" in line and "set all three" in line


def test_a_key_readable_by_others_is_refused(pki, tmp_path: Path) -> None:
    loose = tmp_path / "loose.key"
    loose.write_bytes(pki["key"].read_bytes())
    os.chmod(loose, 0o644)
    line = _refused("inventories/h200.py", [f"k2_tls_cert_file={pki['cert']}", f"k2_tls_key_file={loose}",
                                            f"k2_tls_ca_file={pki['ca']}"])
    assert "k2_tls_key_file" in line and "chmod 600" in line


def test_missing_and_unparsable_files_are_refused(pki, tmp_path: Path) -> None:
    line = _refused("inventories/h200.py", tls_data(pki)[:1] + [f"k2_tls_key_file={tmp_path / 'none.key'}",
                                                                tls_data(pki)[2]])
    assert "k2_tls_key_file" in line and "does not exist" in line
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    line = _refused("inventories/h200.py", [f"k2_tls_cert_file={junk}", *tls_data(pki)[1:]])
    assert "k2_tls_cert_file" in line and "no PEM certificate" in line
    line = _refused("inventories/h200.py", [*tls_data(pki)[:2], f"k2_tls_ca_file={junk}"])
    assert "k2_tls_ca_file" in line
    bad_key = tmp_path / "bad.key"
    fd = os.open(bad_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    os.close(fd)
    line = _refused("inventories/h200.py", [tls_data(pki)[0], f"k2_tls_key_file={bad_key}", tls_data(pki)[2]])
    assert "k2_tls_key_file" in line and "not a PEM private key" in line


def test_a_certificate_not_of_the_key_is_refused(pki) -> None:
    line = _refused("inventories/h200.py", tls_data(pki, cert="cert", key="stray_key"))
    assert "k2_tls_cert_file" in line and "not the certificate of the key" in line


def test_a_certificate_of_another_ca_or_for_other_addresses_is_refused(pki) -> None:
    line = _refused("inventories/h200.py", tls_data(pki, cert="stray", key="stray_key"))
    assert "k2_tls_cert_file" in line and "does not verify against k2_tls_ca_file" in line
    line = _refused("inventories/h200.py", tls_data(pki, cert="wrong_name", key="wrong_name_key"))
    assert "k2_tls_cert_file" in line and "192.0.2.10" in line


def test_the_cli_refuses_in_one_line_exit_2(pki) -> None:
    done = subprocess.run(["python", "-m", "k2fleet.cli", "validate", "inventories/h200.py",
                           *(w for d in tls_data(pki, key="stray_key") for w in ("--data", d))],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "k2_tls_cert_file" in done.stderr, done.stderr


# --------------------------------------------------------------------------- the plan


@pytest.mark.parametrize("inventory", ["inventories/h200.py", "inventories/h200-sglang-pd.py", "inventories/b200-trtllm.py"])
def test_every_endpoint_is_an_https_front_and_the_pem_is_root_only(pki, inventory: str) -> None:
    dep, plan = load_plan(inventory, tls_data(pki))
    assert api_front.fronted(dep) and api_front.tls(dep)
    fronts = [(h, s) for h in plan.hosts.values() for s in h.services if s.name == api_front.FRONT]
    assert fronts
    desired = desired_state(dep, plan, read_control_artifacts(dep, plan))
    for host, front in fronts:
        cfg = front.files[api_front.config_path(dep)]
        assert f"ssl crt {api_front.pem_path(dep)}" in cfg
        files = desired[host.name].service_files[api_front.FRONT]
        pem = files[api_front.pem_path(dep)]
        assert pem.mode == "600" and pem.secret and pem.content is not None
        assert pki["key"].read_bytes().strip() in pem.content and pki["cert"].read_bytes().strip() in pem.content
        assert files[api_front.ca_path(dep)].content == pki["ca"].read_bytes()
        argv = desired[host.name].health_argv
        assert argv is not None
        base = argv[argv.index("--base") + 1]
        assert base.startswith("https://") and argv[argv.index("--ca-file") + 1] == api_front.ca_path(dep)
        assert argv[argv.index("--tls-name") + 1] == host.address
        assert pki["key"].read_bytes().strip() not in json.dumps(plan.to_json()).encode()
    text = format_plan(plan, dep.s.api_key_file, dep.api_model_name, None, dep.s.tls_ca_file)
    assert "# endpoint: https://" in text and f"--cacert {pki['ca']}" in text and "plain HTTP" not in text
    plain_dep, plain = load_plan(inventory)
    text = format_plan(plain, None, plain_dep.api_model_name)
    assert "# endpoint: http://" in text and "plain HTTP" in text


def test_vllm_behind_a_tls_front_still_checks_its_own_key(pki, tmp_path: Path) -> None:
    path = key_file(tmp_path, "k2-secret-key")
    dep, plan = load_plan("inventories/h200.py", [*tls_data(pki), f"k2_api_key_file={path}"])
    assert not api_front.checks_key(dep)
    head = next(iter(plan.hosts.values()))
    front = next(s for s in head.services if s.name == api_front.FRONT)
    vllm = next(s for s in head.services if s.name == "k2-vllm")
    assert "api-front.keys" not in front.files[api_front.config_path(dep)]
    assert holds_api_key(dep, vllm) and not holds_api_key(dep, front)
    assert vllm.argv[vllm.argv.index("--host") + 1] == api_front.LOOPBACK


def test_the_load_balancer_serves_https_and_verifies_the_replicas(pki) -> None:
    dep, plan = load_plan("inventories/h200.py", [*tls_data(pki), "k2_load_balancer=h200-0"])
    lb = next(s for h in plan.hosts.values() for s in h.services if s.name == load_balancer.LB)
    cfg = lb.files[load_balancer.config_path(dep)]
    assert f"ssl crt {api_front.pem_path(dep)}" in cfg
    assert f"ssl verify required ca-file {api_front.ca_path(dep)}" in cfg
    desired = desired_state(dep, plan, read_control_artifacts(dep, plan))
    assert api_front.pem_path(dep) in desired["h200-0"].service_files[load_balancer.LB]
    assert api_front.pem_path(dep) in desired["h200-0"].rollout.reloads[load_balancer.LB]


# --------------------------------------------------------------------------- the real HAProxy on loopback


def _start(cfg: Path, log: Path, port: int, ca: Path, ready: bool = True) -> subprocess.Popen:
    check = subprocess.run([HAPROXY, "-c", "-f", str(cfg)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    proc = subprocess.Popen([HAPROXY, "-Ws", "-f", str(cfg)], stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        status = health.get_status(f"https://{LOCAL}:{port}/health", (str(ca), None))
        if status == 200 or (status is not None and not ready):
            return proc
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"HAProxy did not serve: {log.read_text()}")


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _pem(tmp_path: Path, pki) -> Path:
    pem = tmp_path / "server.pem"
    fd = os.open(pem, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, pki["cert"].read_bytes() + pki["key"].read_bytes())
    os.close(fd)
    return pem


@pytest.fixture
def tls_front(tmp_path: Path, pki):
    """The real HAProxy with k2fleet's TLS-only front config on 127.0.0.1 before the stand-in;
    yields (front port, stand-in)."""
    if not os.path.exists(HAPROXY):
        pytest.fail(f"{HAPROXY} is missing: install Debian's haproxy (dev.sh does)")
    backend, port = free_port(), free_port()
    engine = OpenAIStandIn(backend)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    cfg = tmp_path / "api-front.cfg"
    cfg.write_text(api_front.config(LOCAL, port, backend, None, "the stand-in", str(_pem(tmp_path, pki))))
    proc = _start(cfg, tmp_path / "haproxy.log", port, pki["ca"])
    engine.seen_auth.clear()
    try:
        yield port, engine
    finally:
        _stop(proc)
        engine.shutdown()
        engine.server_close()


def test_a_client_that_trusts_the_ca_gets_a_completion(tls_front, pki) -> None:
    port, engine = tls_front
    ctx = ssl.create_default_context(cafile=str(pki["ca"]))
    conn = http.client.HTTPSConnection(LOCAL, port, context=ctx, timeout=30)
    body = json.dumps({"model": "kimi-k2", "messages": [{"role": "user", "content": "hi"}]})
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json", "Authorization": "Bearer k"})
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["choices"][0]["message"]["content"] == "ready"
    assert conn.sock.version() in ("TLSv1.2", "TLSv1.3")
    conn.close()
    ok, line = endpoint_completion(f"https://{LOCAL}:{port}", "kimi-k2", b"k", str(pki["ca"]))
    assert ok, line


def test_a_client_without_the_ca_is_refused_before_sending_the_key(tls_front, pki) -> None:
    port, engine = tls_front
    with pytest.raises(ssl.SSLCertVerificationError):  # the system's CAs do not vouch for it
        conn = http.client.HTTPSConnection(LOCAL, port, context=ssl.create_default_context(), timeout=30)
        conn.request("GET", "/v1/models", headers={"Authorization": "Bearer secret-key"})
    for ca, name in ((pki["other_ca"], None), (pki["ca"], "10.9.9.9")):  # another CA; the right CA, another name
        with pytest.raises(health.Untrusted, match="does not verify"):
            health.chat(f"https://{LOCAL}:{port}", "kimi-k2", "secret-key", tls=(str(ca), name))
        ok, line = endpoint_completion(f"https://{LOCAL}:{port}", "kimi-k2", b"secret-key", str(ca)) if not name \
            else (False, "does not verify")
        assert not ok and "does not verify" in line
    assert engine.seen_auth == []  # no request reached the engine: the key was never sent


def test_plain_http_to_the_tls_port_gets_no_answer(tls_front) -> None:
    port, engine = tls_front
    with pytest.raises((OSError, ValueError)):
        health.request(f"http://{LOCAL}:{port}/health", timeout=5)
    with pytest.raises(ValueError, match="TLS expected"):  # a CA given with an http:// URL: no silent downgrade
        health.request(f"http://{LOCAL}:{port}/health", timeout=5, tls=("/nonexistent", None))


def _health_main(port: int, ca: Path, name: str, timeout: str = "20") -> subprocess.CompletedProcess:
    return subprocess.run(["python", "-m", "k2fleet.hostprogs.health", "--base", f"https://{LOCAL}:{port}", "--model",
                           "kimi-k2", "--unit", "k2-api-front.service", "--timeout", timeout, "--ca-file", str(ca),
                           "--tls-name", name], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_the_health_gate_verifies_the_front(tls_front, pki) -> None:
    port, engine = tls_front
    good = _health_main(port, pki["ca"], LOCAL)
    assert good.returncode == 0 and "healthy" in good.stdout, good.stderr
    t = time.monotonic()
    bad = _health_main(port, pki["other_ca"], LOCAL, timeout="60")
    assert bad.returncode == 1 and "TLS:" in bad.stderr and "does not verify" in bad.stderr, bad.stderr
    assert time.monotonic() - t < 30  # at once: a certificate that does not verify is not a server still starting
    wrong = _health_main(port, pki["ca"], "10.9.9.9")
    assert wrong.returncode == 1 and "10.9.9.9" in wrong.stderr, wrong.stderr


def test_the_load_balancer_serves_https_before_an_https_replica(tmp_path: Path, pki) -> None:
    """Client → LB (TLS, verified by the client) → the replica's TLS front (verified by the LB
    against the CA) → the stand-in; a replica whose certificate the CA did not sign is DOWN."""
    if not os.path.exists(HAPROXY):
        pytest.fail(f"{HAPROXY} is missing")
    backend, front_port, lb_port = free_port(), free_port(), free_port()
    engine = OpenAIStandIn(backend)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    (tmp_path / "front").mkdir()
    pem = _pem(tmp_path / "front", pki)
    front_cfg = tmp_path / "front.cfg"
    front_cfg.write_text(api_front.config(LOCAL, front_port, backend, None, "the stand-in", str(pem)))
    sock = tmp_path / "admin.sock"
    lb_cfg = tmp_path / "lb.cfg"
    lb_cfg.write_text(load_balancer.config(LOCAL, lb_port, [load_balancer.Server("r0", LOCAL, front_port)], "/health",
                                           str(sock), str(pem), str(pki["ca"])))
    front = _start(front_cfg, tmp_path / "front.log", front_port, pki["ca"])
    lb = _start(lb_cfg, tmp_path / "lb.log", lb_port, pki["ca"])
    try:
        deadline = time.monotonic() + 20
        answer = None
        while time.monotonic() < deadline and answer is None:
            try:
                answer = health.chat(f"https://{LOCAL}:{lb_port}", "kimi-k2", tls=(str(pki["ca"]), LOCAL))
            except (OSError, ValueError):
                time.sleep(0.5)
        assert answer == "ready"
        with pytest.raises(health.Untrusted):
            health.chat(f"https://{LOCAL}:{lb_port}", "kimi-k2", tls=(str(pki["other_ca"]), LOCAL))
    finally:
        _stop(lb)
    # the same LB config verifying against another CA: the replica is never UP, nothing answers
    lb_cfg.write_text(load_balancer.config(LOCAL, lb_port, [load_balancer.Server("r0", LOCAL, front_port)], "/health",
                                           str(sock), str(pem), str(pki["other_ca"])))
    lb = _start(lb_cfg, tmp_path / "lb2.log", lb_port, pki["ca"], ready=False)
    try:
        time.sleep(5)  # two failed checks (2 s apart) mark it DOWN
        status, _ = health.request(f"https://{LOCAL}:{lb_port}/v1/models", timeout=10, tls=(str(pki["ca"]), LOCAL))
        assert status == 503
    finally:
        _stop(lb)
        _stop(front)
        engine.shutdown()
        engine.server_close()
