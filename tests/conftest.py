"""The plugin is patched into the real runtimes before any test module imports them (as the
post-import hook does for users), and every test starts and ends patched."""

import pytest

import mtp_plugin

mtp_plugin.patch()


@pytest.fixture(autouse=True)
def patched():
    """Tests that unpatch to observe stock behaviour leave the runtimes patched again."""
    mtp_plugin.patch()
    yield
    mtp_plugin.patch()
