"""The engines k2fleet serves with, one package each (``k2fleet/planning/engines/<name>/``), by
``k2_engine`` value. Adding an engine is one folder and one line here; nothing outside this
package compares an engine's name (``tests/test_structure.py`` checks).

>>> get("vllm").label, [e.name for e in ENGINES.values() if "rocm" in e.platforms]
('vLLM', ['vllm', 'sglang'])
"""

from __future__ import annotations

from k2fleet.planning.engines.base import Engine
from k2fleet.planning.engines.ktransformers import ENGINE as KTRANSFORMERS
from k2fleet.planning.engines.sglang import ENGINE as SGLANG
from k2fleet.planning.engines.trtllm import ENGINE as TRTLLM
from k2fleet.planning.engines.vllm import ENGINE as VLLM

ENGINES: dict[str, Engine] = {e.name: e for e in (VLLM, SGLANG, TRTLLM, KTRANSFORMERS)}


def get(name: str) -> Engine:
    """The engine ``k2_engine: name`` serves with (KeyError: not one of :data:`ENGINES`)."""
    return ENGINES[name]


def having(attribute: str) -> list[str]:
    """The names of the engines whose ``attribute`` is set (messages that list the alternatives)."""
    return [name for name, e in ENGINES.items() if getattr(e, attribute)]
