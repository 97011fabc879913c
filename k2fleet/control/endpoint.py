"""One real chat completion from the control machine through the fleet's endpoint (what a
client sees: the router or API front when there is one), for ``k2fleet status --completion``.
The API key (``k2_api_key_file``) is sent as ``Authorization: Bearer``, never printed, and only
to a server that is not another local user's (:func:`k2fleet.hostprogs.health.check_server`); an
``https://`` endpoint (``k2_tls_cert_file``) is verified against ``k2_tls_ca_file`` alone, for
the address it is called by, before the key is sent."""

from __future__ import annotations

from k2fleet.hostprogs import health


def endpoint_completion(base: str, model: str, key: bytes | None = None,
                        ca_file: str | None = None) -> tuple[bool, str]:
    """(answered, one line): a chat completion to ``base`` (``http://ADDRESS:PORT``, or
    ``https://`` verified against ``ca_file``) and what came back (the first words of the
    answer, or why there was none)."""
    tls = (ca_file, None) if base.startswith("https://") else None
    try:
        answer = health.chat(base, model, None if key is None else key.decode("ascii").strip(), tls=tls)
    except health.Impostor as exc:  # a port of this machine held by another local user: no key was sent
        return False, " ".join(str(exc).split())[:300]
    except (OSError, ValueError, KeyError, IndexError, TypeError, health.Untrusted) as exc:
        return False, " ".join(f"chat completion failed: {exc}".split())[:200]
    if not answer:
        return False, "chat completion returned an empty answer"
    return True, f"completion: {answer[:60]!r}"
