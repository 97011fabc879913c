"""k2fleet-test-double stand-in for ``ktransformers.server`` (TEST DOUBLE)."""
