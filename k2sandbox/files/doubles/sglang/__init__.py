"""k2fleet-test-double stand-in for the `sglang` package (TEST DOUBLE).

Only `python3 -m sglang.launch_server` is provided; it runs
`k2fleet_doubles.sglang`.  Nothing else of the real package exists here.
"""

__version__ = "0.5.23"
K2FLEET_TEST_DOUBLE = True
