"""The test's own calls to a rehearsed fleet kept up with ``k2fleet rehearse --keep``: rather
than taking "healthy" from the command's last line, the test asks every endpoint the
rehearsal listed as ``ok`` for ``GET /v1/models`` and the main endpoint for a real chat
completion, over HTTP from the control machine (or, for an endpoint k2fleet's firewall opens
only to the fleet, from inside the first sandbox host, where the fleet's own clients are)."""

from __future__ import annotations

import json
import re
import shlex
import urllib.request

from k2sandbox import nspawn as sandbox

OK_LINE = re.compile(r"^  ok   .+?: (http://\S+/v1)$", re.M)


def _headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def served_model(base: str, key: str | None = None) -> str:
    """The first model ``base``/models lists, asked from the control machine, or from inside the
    first sandbox host when the control machine is not let in (``key``: the fleet's API key)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{base}/models", headers=_headers(key)), timeout=10) as answer:
            return json.load(answer)["data"][0]["id"]
    except OSError:
        code = f"import json, urllib.request; print(json.load(urllib.request.urlopen({base + '/models'!r}, timeout=30))['data'][0]['id'])"
        inside = sandbox.ssh(sandbox.load_hosts()[0], f"python3 -c {shlex.quote(code)}", timeout=60)
        assert inside.returncode == 0, inside.stderr
        return inside.stdout.strip()


def chat(base: str, model: str, timeout: float = 300, key: str | None = None) -> str:
    """The message of a chat completion ``base`` gives ``model`` for "Say hi" (its content, or
    a reasoning model's reasoning when that is all it said)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 32}).encode()
    request = urllib.request.Request(f"{base}/chat/completions", data=body,
                                     headers={"Content-Type": "application/json", **_headers(key)})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        message = json.load(answer)["choices"][0]["message"]
    return (message.get("content") or message.get("reasoning") or message.get("reasoning_content") or "").strip()


def call_kept_fleet(stdout: str, endpoints: int, key: str | None = None) -> list[str]:
    """Call the fleet a ``--keep`` rehearsal printed ``stdout`` for: ``endpoints`` ``ok`` lines,
    each endpoint lists a served model, and the main endpoint (``endpoint:``) answers a chat
    completion for the model of the ``try: curl`` line with a non-empty message (``key``: the
    fleet's API key, sent to every endpoint). The ok bases."""
    ok = OK_LINE.findall(stdout)
    assert len(ok) == endpoints, stdout[-4000:]
    main = re.search(r"^endpoint: (http://\S+/v1)$", stdout, re.M)
    model = re.search(r"^try: curl .* -d '(\{.*\})'$", stdout, re.M)
    assert main and model, stdout[-4000:]
    for base in ok:
        assert served_model(base, key), f"{base}/models lists no model"
    name = json.loads(model.group(1))["model"]
    assert chat(main.group(1), name, key=key), f"{main.group(1)}: an empty chat answer for {name}"
    return ok
