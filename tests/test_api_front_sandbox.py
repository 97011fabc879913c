"""The API front on the sandbox: ``k2fleet rehearse`` of the SGLang PD scenario with
``k2_api_key_file`` — HAProxy (k2-api-front.service) in front of the PD router checks the key.

Its own module: ``k2fleet rehearse`` takes the sandbox lock itself, so it cannot run inside a
module whose ``fleet`` fixture holds that lock (tests/test_api_key.py's).
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import subprocess
import urllib.request
from pathlib import Path

import pytest

from tests.test_api_key import _chat, key_file

@pytest.mark.sandbox
@pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox fleet needs root")
def test_rehearse_sglang_pd_behind_the_api_front(tmp_path: Path) -> None:
    """``k2fleet rehearse inventories/h200-sglang-pd.py`` with ``k2_api_key_file``: the PD
    router's host runs k2-api-front.service (HAProxy) on k2_router_port, the router on
    127.0.0.1:k2_api_backend_port; the rehearsal's gates and probes pass with the key; from
    the control machine the endpoint answers 401 without the key or with a wrong one, a
    completion with it, /health without it; the key is in no argv and in two 0600 files."""
    import re

    from k2sandbox import nspawn as sandbox
    from k2sandbox.harness import ROOT, tool
    from tests.test_rehearse import last_line, rehearse, sandbox_is_down

    key = secrets.token_hex(24)
    path = key_file(tmp_path, key)
    inventory = "inventories/h200-sglang-pd.py"
    proc, _ = rehearse(inventory, "--keep", "--data", f"k2_api_key_file={path}")
    try:
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out
        assert key not in out
        assert last_line(proc) == f"rehearsal {inventory}: 3/3 endpoints healthy, re-run 0 changes"
        main = re.search(r"^endpoint: (http://\S+/v1)$", proc.stdout, re.M)
        sent = re.search(r"^try: curl .* -d '(\{.*\})'$", proc.stdout, re.M)
        assert main and sent, proc.stdout
        model = json.loads(sent.group(1))["model"]
        url = f"{main.group(1)}/chat/completions"
        assert _chat(url, None, model)[0] == 401
        assert _chat(url, "not-" + key, model)[0] == 401
        status, answer = _chat(url, key, model)
        assert status == 200 and answer["choices"][0]["message"], answer
        base = main.group(1).removesuffix("/v1")
        with urllib.request.urlopen(f"{base}/health", timeout=30) as resp:
            assert resp.status == 200
        address = base.removeprefix("http://").rsplit(":", 1)[0]
        router = next(h for h in sandbox.load_hosts() if h.address == address)
        seen = sandbox.ssh(router, "stat -c '%a %U %n' /etc/k2fleet/api-key /etc/k2fleet/api-front.keys; "
                                   "systemctl is-active k2-api-front.service; "
                                   "for u in k2-api-front k2-sglang-router; do "
                                   "tr '\\0' ' ' < /proc/$(systemctl show -p MainPID --value $u.service)/cmdline; echo; "
                                   "done; systemctl show -p ExecStart --value k2-sglang-router.service; ss -ltnH",
                            timeout=60).stdout
        assert "600 root /etc/k2fleet/api-key\n600 root /etc/k2fleet/api-front.keys\nactive\n" in seen, seen
        assert key not in seen  # not in HAProxy's or the router's argv
        assert "/usr/sbin/haproxy -Ws -f /etc/k2fleet/api-front.cfg" in seen
        # the router renames its process (sglang::router): its address is read from its unit's ExecStart
        assert "--host 127.0.0.1 --port 8001" in seen and "127.0.0.1:8001" in seen, seen
        # another local user (uid 65534) on the router's host: binds none of k2fleet's ports,
        # cannot reach the router behind the front, still reaches the front (which wants the key)
        probe = ("import errno, socket\n"
                 "def go(what, fn):\n"
                 "    try:\n        fn(); print(what, 'ok')\n"
                 "    except OSError as e:\n        print(what, errno.errorcode[e.errno])\n"
                 "for port in (8000, 8001, 29700):\n"
                 "    go(f'bind {port}', lambda: socket.socket().bind(('127.0.0.1', port)))\n"
                 "go('backend', lambda: socket.create_connection(('127.0.0.1', 8001), 5))\n"
                 f"go('front', lambda: socket.create_connection(({address!r}, 8000), 5))\n")
        seen = sandbox.ssh(router, "cat /proc/sys/net/ipv4/ip_unprivileged_port_start /etc/sysctl.d/60-k2fleet-privileged-ports.conf; "
                                   f"setpriv --reuid=65534 --regid=65534 --clear-groups python3 -c {shlex.quote(probe)}",
                           timeout=60).stdout
        assert seen.startswith("29701\n") and "net.ipv4.ip_unprivileged_port_start = 29701\n" in seen, seen
        for line in ("bind 8000 EACCES", "bind 8001 EACCES", "bind 29700 EACCES", "backend ECONNREFUSED", "front ok"):
            assert line in seen.splitlines(), seen
    finally:
        subprocess.run([tool("k2fleet"), "sandbox", "down"], cwd=ROOT, capture_output=True, timeout=300)
    assert sandbox_is_down()
