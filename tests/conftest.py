"""Shared pytest configuration for k2fleet's tests."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Register the markers k2fleet's tests use."""
    config.addinivalue_line(
        "markers",
        "sandbox: boots the real nspawn sandbox fleet (root; hold /tmp/k2sb.lock)",
    )
