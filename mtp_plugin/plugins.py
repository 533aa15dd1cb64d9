"""The process-wide pluggy PluginManager: built-ins, then third-party plugins of the ``mtp_plugin`` entry-point group.
A faulty third-party plugin is disabled alone with one warning; a faulty built-in raises. Guide: docs/plugins.md.
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
import types
from importlib import metadata

import pluggy

from . import hookspecs

BUILTIN_PLUGINS = (
    "mtp_plugin.loading.checkpoint",
    "mtp_plugin.decoding.trunk",
    "mtp_plugin.families.qwen3_5",
    "mtp_plugin.families.nextn",
    "mtp_plugin.adapters.mlx_lm",
    "mtp_plugin.adapters.mlx_vlm",
    "mtp_plugin.adapters.mlx_vlm_native",
)
GROUP = "mtp_plugin"

log = logging.getLogger("mtp_plugin")
_lock = threading.Lock()
_pm: pluggy.PluginManager | None = None
_disabled: set[str] = set()


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide PluginManager, created on first use with built-ins and entry-point plugins loaded."""
    global _pm
    with _lock:
        if _pm is None:
            pm = pluggy.PluginManager(GROUP)
            pm.add_hookspecs(hookspecs)
            for name in BUILTIN_PLUGINS:
                pm.register(importlib.import_module(name), name=name)
            pm.check_pending()
            for entry_point in metadata.entry_points(group=GROUP):
                _register_third_party(pm, entry_point)
            _pm = pm
        return _pm


def hook():
    """Shorthand for ``get_plugin_manager().hook``."""
    return get_plugin_manager().hook


def _register_third_party(pm: pluggy.PluginManager, entry_point) -> None:
    """Register ``entry_point``'s plugin, guarded; one that cannot be loaded is left out with one warning."""
    name = entry_point.name
    if pm.get_plugin(name) is not None or pm.is_blocked(name):
        return
    try:
        plugin = entry_point.load()
        pm.register(_guarded(name, plugin), name=name)
        pm.check_pending()
    except Exception as e:  # noqa: BLE001 - a broken third-party plugin must not turn MTP off for everyone
        if pm.get_plugin(name) is not None:
            pm.unregister(name=name)
        _disable(name, f"cannot be loaded ({type(e).__name__}: {e})")


def _guarded(name: str, plugin) -> types.SimpleNamespace:
    """``plugin``'s hook implementations, returning None once ``name`` is disabled, and disabling it if they raise."""

    def guard(function):
        @functools.wraps(function)
        def call(*args, **kwargs):
            if name in _disabled:
                return None
            try:
                return function(*args, **kwargs)
            except Exception as e:  # noqa: BLE001
                _disable(name, f"raised from {function.__name__} ({type(e).__name__}: {e})")
                return None

        return call

    marker = f"{GROUP}_impl"
    found = {k: getattr(plugin, k, None) for k in dir(plugin)}
    return types.SimpleNamespace(**{k: guard(v) for k, v in found.items() if callable(v) and hasattr(v, marker)})


def _disable(name: str, why: str) -> None:
    """Disable third-party plugin ``name`` for this process, with one warning."""
    if name not in _disabled:
        _disabled.add(name)
        log.warning("mtp_plugin: plugin %r %s; it is disabled, MTP goes on without it", name, why)
