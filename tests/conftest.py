"""Shared fixtures: the plugin patched into the real runtimes for every test."""

import pytest

import mtp_plugin


@pytest.fixture(autouse=True)
def patched():
    """Every test starts with the runtimes patched, and leaves them so."""
    mtp_plugin.patch()
    yield
    mtp_plugin.patch()
