"""Test doubles and harness shared by k2fleet's tests and benches (never imported by
the deploy itself):

- :mod:`k2fleet.testing.hub_double`: a loopback Hugging Face Hub HTTP API TEST DOUBLE;
- :mod:`k2fleet.testing.fleet`: the sandbox fleet harness (the one lock, booting it bare,
  running the real pyinfra CLI and reading its ``--json`` results).
"""
