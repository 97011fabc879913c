"""k2fleet-test-double stand-in for the ``ktransformers`` package (TEST DOUBLE).

Only what the legacy 0.3.x server's launch needs: ``python -m ktransformers.server.main``
and the optimize rule files (``optimize/optimize_rules/*.yaml``, copied verbatim from
kvcache-ai/ktransformers v0.3.2) the plan names with ``--optimize_config_path``.
"""
