"""pyinfra config for ``pyinfra inventories/NAME.py deploys/kimi.py`` (run from this directory).

pyinfra executes this file before it loads the inventory and long before it connects;
it installs k2fleet's inventory gate, so a bad inventory ends the run with one line
naming the key and the fix (exit 2) and no host is contacted.
"""

from pyinfra.context import ctx_state

from k2fleet.deploy.gate import install_pyinfra_gate

install_pyinfra_gate(ctx_state.get())
