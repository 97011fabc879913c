"""Defaults for every k2fleet inventory in this directory (pyinfra group ``all``).

Every ``k2_*`` key is documented in docs/inventory-keys.md and by ``k2fleet keys``.
"""

k2_model_dir = "/srv/k2fleet/models"
k2_mesh_port = 2233
