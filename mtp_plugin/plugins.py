"""The one PluginManager: built-in plugins are registered exactly like third-party ones.

Third-party plugins are found through the ``mtp_plugin`` entry-point group
(``[project.entry-points.mtp_plugin] name = "module"``).
"""

from __future__ import annotations

import importlib
import threading

import pluggy

from . import hookspecs

BUILTIN_PLUGINS = (
    "mtp_plugin.checkpoint",
    "mtp_plugin.trunk",
    "mtp_plugin.families.qwen3_5",
    "mtp_plugin.families.nextn",
    "mtp_plugin.adapters.mlx_lm",
    "mtp_plugin.adapters.mlx_vlm",
    "mtp_plugin.adapters.mlx_vlm_native",
)

_lock = threading.Lock()
_pm: pluggy.PluginManager | None = None


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide PluginManager, created on first use with built-ins and entry-point plugins loaded."""
    global _pm
    with _lock:
        if _pm is None:
            pm = pluggy.PluginManager("mtp_plugin")
            pm.add_hookspecs(hookspecs)
            for name in BUILTIN_PLUGINS:
                pm.register(importlib.import_module(name), name=name)
            pm.load_setuptools_entrypoints("mtp_plugin")
            _pm = pm
        return _pm


def hook():
    """Shorthand for ``get_plugin_manager().hook``."""
    return get_plugin_manager().hook
