"""k2fleet-test-double stand-in for the `sglang_router` package (TEST DOUBLE).

Only `python3 -m sglang_router.launch_router` is provided; it runs
`k2fleet_doubles.sglang_router`.  Nothing else of the real package exists here.
"""

__version__ = "0.0.0+k2fleet.test.double"
K2FLEET_TEST_DOUBLE = True
