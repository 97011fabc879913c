"""lm-eval, the client ``k2fleet eval`` runs, in a cached venv of its own for the tests that run it.

Not in the test extras: lm-eval[api]'s dependency tree (pyarrow, scipy, pandas, scikit-learn,
nltk, ~700 MB) made most of ``./dev.sh``'s install on every clean checkout (pip install of the
test extras into a fresh venv: ~90 s with lm-eval, ~41 s without, on this 2-core machine, 2026-11-28),
for two tests. :func:`ensure_lm_eval_venv` installs :data:`REQUIREMENT` with pip, from pip's
configured index, into a venv under :data:`VENVS` once (a venv is not relocatable: made in place,
under a lock, marked complete last; an unmarked one is made anew), keyed by the requirement and
this Python's version.

    python -m k2sandbox.lm_eval_client   # install (once), print the lm-eval executable
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from k2sandbox.vllm_cpu import CACHE, venv_once

VERSION = "0.4.13"
REQUIREMENT = f"lm-eval[api]=={VERSION}"  # no torch: `k2fleet eval` runs local-completions over HTTP
VENVS = CACHE / "lm-eval-venvs"
DONE = "k2sandbox-lm-eval-venv.json"
INSTALL_TIMEOUT_S = 1800


def venv_dir(venvs: Path = VENVS) -> Path:
    """Where the venv for :data:`REQUIREMENT` on this Python lives.

    >>> venv_dir(Path("/c")).parent, len(venv_dir(Path("/c")).name)
    (PosixPath('/c'), 16)
    """
    key = f"{REQUIREMENT} python{sys.version_info[0]}.{sys.version_info[1]}"
    return venvs / hashlib.sha256(key.encode()).hexdigest()[:16]


def ensure_lm_eval_venv(venvs: Path = VENVS) -> Path:
    """The venv with :data:`REQUIREMENT` installed (installed the first time)."""
    venv = venv_dir(venvs)
    return venv_once(venv, sys.executable, [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                                            REQUIREMENT],
                     f"pip install {REQUIREMENT}", DONE, {"requirement": REQUIREMENT}, timeout=INSTALL_TIMEOUT_S)


def lm_eval_executable(venvs: Path = VENVS) -> Path:
    """The ``lm-eval`` console script of :func:`ensure_lm_eval_venv`'s venv."""
    return ensure_lm_eval_venv(venvs) / "bin" / "lm-eval"


def lm_eval_package(venvs: Path = VENVS) -> Path:
    """The installed ``lm_eval`` package directory (its task YAML files), without importing it."""
    venv = ensure_lm_eval_venv(venvs)
    (package,) = venv.glob("lib/python3*/site-packages/lm_eval")
    return package


if __name__ == "__main__":
    print(lm_eval_executable())
