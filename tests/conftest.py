"""The plugin is patched into the real runtimes before any test module imports them (as the
post-import hook does for users), and every test starts and ends patched."""

import os
import tempfile

import pytest

import mtp_plugin
import mtp_plugin.head.health

# Tuning records in the user's cache would change the automatic depth: tests (and their subprocesses) use their own.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="mtp-plugin-tests-cache-")

mtp_plugin.patch()

# The tests' random heads must keep drafting (every cycle exercises rollback); test_broken_heads.py turns the
# parking of heads that accept nothing back on where it tests it.
mtp_plugin.head.health.PROBE_DRAFTS = 0


# The longest modules first: CI runs a module per worker (``--dist loadfile``), in this order, so that no long module
# starts last on one worker while the other worker idles.
LONGEST_FIRST = ("test_distributed.py", "test_sampling.py", "test_vlm_sampling.py", "test_server_batching.py",
                 "test_batching.py", "test_docs.py", "test_fresh_venv.py", "test_vlm_server.py")


def pytest_collection_modifyitems(items):
    """Order the modules longest first (``LONGEST_FIRST``), the rest as collected."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(autouse=True)
def patched():
    """Tests that unpatch to observe stock behaviour leave the runtimes patched again."""
    mtp_plugin.patch()
    yield
    mtp_plugin.patch()
