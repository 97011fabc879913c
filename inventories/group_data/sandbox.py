"""Sandbox fleet data (inventories/sandbox.py): the keys every sandbox inventory shares
(k2sandbox/inventory_data.py: simulated GPUs, engine test doubles, the synthetic checkpoint
from the control machine, packages from an offline bundle), served by vLLM TP8 per host."""

from k2sandbox.inventory_data import *  # noqa: F403 - the shared sandbox keys (its __all__)

k2_engine = "vllm"
k2_tp = 8
