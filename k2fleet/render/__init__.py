"""Engine renderers: a resolved Deployment in, ``(host name, Service)`` pairs out (or
``(host name, {path: content})`` for files a host needs without a service of its own)."""

from __future__ import annotations

from collections.abc import Iterator

from k2fleet.deployment import Deployment
from k2fleet.plan import Service


def render_services(dep: Deployment) -> Iterator[tuple[str, Service | dict[str, str]]]:
    from k2fleet.render import ktransformers, sglang, trtllm, vllm

    renderers = {"vllm": vllm, "sglang": sglang, "trtllm": trtllm, "ktransformers": ktransformers}
    yield from renderers[dep.engine].render(dep)
