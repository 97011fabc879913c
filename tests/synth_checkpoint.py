"""Synthetic Kimi-K2-style checkpoint for tests and benches.

The generator lives in :mod:`k2sandbox.synthetic_checkpoint` (the sandbox demo uses it
too); this module keeps the tests' import path.
"""

from k2sandbox.synthetic_checkpoint import (  # noqa: F401
    CONFIG,
    LFS_SUFFIXES,
    SMALL_FILES,
    SynthFile,
    describe_dir,
    describe_file,
    make_checkpoint,
    manifest_for,
    safetensors_header,
    shard_name,
    write_shard,
)
