"""2 × 8 H200 in a company network: Kimi-K2-Instruct on vLLM DP16 + expert parallel,
reached through a bastion as a sudo user, hosts by DNS name.

The GPU hosts sit on a network the control machine cannot route to. ``corp.ssh_config``
(beside this file) sends every ``*.fleet.corp.example`` connection through
``bastion.corp.example`` (ProxyJump); their sshd listens on 2222 and refuses root; ``ops``
has passwordless sudo. k2fleet resolves the names once per run and plans with the
addresses. Fleet data: ``group_data/corp-dp-ep.py``. ``k2fleet rehearse`` builds this
network in the sandbox (a bastion, an unroutable fleet subnet, a resolver for the names)
and keeps every connection setting as written.
"""

gpu_nodes = [
    ("gpu-0", {"ssh_hostname": "gpu-0.fleet.corp.example"}),
    ("gpu-1", {"ssh_hostname": "gpu-1.fleet.corp.example"}),
]
