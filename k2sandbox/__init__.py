"""Test doubles and harness shared by k2fleet's tests and benches (never imported by
the deploy itself):

- :mod:`k2sandbox.hub_double`: a loopback Hugging Face Hub HTTP API TEST DOUBLE;
- :mod:`k2sandbox.harness`: the sandbox fleet harness (the one lock, booting it bare,
  running the real pyinfra CLI and reading its ``--json`` results).
"""

from pathlib import Path

FILES = Path(__file__).resolve().parent / "files"  # sources that run on sandbox hosts only
DOUBLES = FILES / "doubles"  # the engine and GPU-stack TEST DOUBLES' own sources
