"""The plugin is patched into the real runtimes before any test module imports them (as the
post-import hook does for users), and every test starts and ends patched."""

import os
import tempfile

import pytest

import mtp_plugin
import mtp_plugin.health

# Tuning records in the user's cache would change the automatic depth: tests (and their subprocesses) use their own.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="mtp-plugin-tests-cache-")

mtp_plugin.patch()

# The tests' random heads must keep drafting (every cycle exercises rollback); test_broken_heads.py turns the
# parking of heads that accept nothing back on where it tests it.
mtp_plugin.health.PROBE_DRAFTS = 0


@pytest.fixture(autouse=True)
def patched():
    """Tests that unpatch to observe stock behaviour leave the runtimes patched again."""
    mtp_plugin.patch()
    yield
    mtp_plugin.patch()
