"""HTTPS on the sandbox fleet: ``k2_tls_cert_file``/``k2_tls_key_file``/``k2_tls_ca_file`` with an
API key. The deploy's own health gate verifies the front against the CA (the deploy fails
otherwise); from the control machine a client that trusts the test CA gets a completion, a client
without it is refused in the handshake (the key never leaves), plain HTTP gets no answer.

The CA is made by the ``openssl`` CLI in the test (tests/test_tls.py's helpers); nothing else
trusts it.
"""

from __future__ import annotations

import json
import secrets
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.test_api_key import key_file
from tests.test_tls import make_ca, make_server

SANDBOX_HOSTS = 1  # read by the sandbox_fleet fixture (tests/conftest.py)
MODEL = "k2fleet-test/Kimi-K2-Thinking-synthetic"


def _chat(url: str, key: str | None, context: ssl.SSLContext | None) -> tuple[int, dict]:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=30, context=context) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}


@pytest.mark.sandbox
def test_an_https_endpoint_answers_a_client_that_trusts_the_ca_and_no_other(fleet, tmp_path: Path) -> None:
    host = fleet.hosts[0]
    ca = make_ca(tmp_path / "ca")
    cert, server_key = make_server(tmp_path / "ca", ca, [host["address"]])
    key = secrets.token_hex(24)
    result = fleet.deploy({"k2_api_key_file": key_file(tmp_path, key), "k2_tls_cert_file": str(cert),
                           "k2_tls_key_file": str(server_key), "k2_tls_ca_file": str(ca[0])})
    try:
        assert result.returncode == 0, result.tail()  # the deploy's health gate verified the front against the CA
        assert key not in result.log
        url = f"https://{host['address']}:8000/v1/chat/completions"
        trusting = ssl.create_default_context(cafile=str(ca[0]))
        status, answer = _chat(url, key, trusting)
        assert status == 200 and answer["choices"][0]["message"], answer
        assert _chat(url, None, trusting)[0] == 401
        with pytest.raises(urllib.error.URLError) as refused:  # the system's CAs: not the fleet's
            _chat(url, key, ssl.create_default_context())
        assert isinstance(refused.value.reason, ssl.SSLCertVerificationError), refused.value
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):  # plain HTTP to the TLS port
            _chat(f"http://{host['address']}:8000/v1/chat/completions", key, None)
        from k2sandbox.harness import ssh

        seen = ssh(host, "stat -c '%a %U %n' /etc/k2fleet/tls/server.pem; "
                         "ss -ltnH '( sport = :8000 )'").stdout
        assert "600 root /etc/k2fleet/tls/server.pem" in seen, seen
    finally:
        fleet.forget()  # the next module's deploy starts without TLS
