"""The process-wide pluggy PluginManager: built-ins, then third-party plugins of the ``mtp_plugin`` entry-point group.
A faulty third-party plugin is disabled alone with one warning; a faulty built-in raises. Guide: docs/plugins.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import logging
import threading
import types
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import TypeVar

import pluggy

from . import hook_results, hookspecs

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
T = TypeVar("T")

log = logging.getLogger("mtp_plugin")
_lock = threading.Lock()
_pm: pluggy.PluginManager | None = None
_disabled: set[str] = set()
_answers: contextvars.ContextVar[set | None] = contextvars.ContextVar("mtp_plugin_answers", default=None)
_left_out: contextvars.ContextVar[frozenset] = contextvars.ContextVar("mtp_plugin_left_out", default=frozenset())


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
    except (Exception, SystemExit) as e:  # noqa: BLE001 - a broken third-party plugin must not turn MTP off for all
        if pm.get_plugin(name) is not None:
            pm.unregister(name=name)
        how = "exited at import" if isinstance(e, SystemExit) else "cannot be loaded"
        disable(name, f"{how} ({type(e).__name__}: {e})")


def _guarded(name: str, plugin) -> types.SimpleNamespace:
    """``plugin``'s hook implementations, returning None once ``name`` is disabled or while it is ``left_out``, and
    disabling it if they raise, exit or return what their hookspec forbids (``hook_results``)."""

    def guard(function):
        @functools.wraps(function)
        def call(*args, **kwargs):
            if name in _disabled or name in _left_out.get():
                return None
            try:
                result = function(*args, **kwargs)
            except (Exception, SystemExit) as e:  # noqa: BLE001
                disable(name, f"raised from {function.__name__} ({type(e).__name__}: {e})")
                return None
            broken = hook_results.problem(function.__name__, result)
            if broken is not None:
                disable(name, broken)
                return None
            if result is not None and (answered := _answers.get()) is not None:
                answered.add((function.__name__, name))
            return result

        return call

    marker = f"{GROUP}_impl"
    found = {k: getattr(plugin, k, None) for k in dir(plugin)}
    return types.SimpleNamespace(**{k: guard(v) for k, v in found.items() if callable(v) and hasattr(v, marker)})


def disable(name: str, why: str) -> None:
    """Disable third-party plugin ``name`` for this process, with one warning saying ``why``."""
    if name not in _disabled:
        _disabled.add(name)
        log.warning("mtp_plugin: plugin %r %s; it is disabled, MTP goes on without it", name, why)


def retried_without_answerers(hook_name: str, what: str, attempt: Callable[[], T],
                              failure: Callable[[T], str | None] = lambda result: None) -> T:
    """``attempt()``, noting the third-party plugins that answer ``hook_name``; when it raises or ``failure(result)``
    names a problem and such plugins answered, ``attempt()`` once more with them ``left_out``: if that succeeds, they
    are disabled (one warning each: their answers broke ``what``) and its result is returned; else the first outcome
    stands (result returned or error raised) and they stay."""
    with answers() as answered:
        try:
            result = attempt()
        except Exception as error:
            first, problem = error, (str(error).strip().splitlines() or [type(error).__name__])[0].rstrip(": ")
        else:
            first, problem = None, failure(result)
    culprits = {name for hook, name in answered if hook == hook_name}
    if problem is not None and culprits:
        try:
            with left_out(culprits):
                retried = attempt()
        except Exception:
            retried = None
        else:
            if failure(retried) is None:
                for name in sorted(culprits):
                    shown = problem if len(problem) <= 160 else problem[:160] + "…"
                    disable(name, f"answered {hook_name} in a way that broke {what} ({shown})")
                return retried
    if first is not None:
        raise first
    return result


@contextlib.contextmanager
def answers() -> Iterator[set[tuple[str, str]]]:
    """While active (this thread or task): ``(hook, plugin)`` of each non-None answer a third-party plugin gives."""
    token = _answers.set(set())
    try:
        yield _answers.get()
    finally:
        _answers.reset(token)


@contextlib.contextmanager
def left_out(names: set[str]) -> Iterator[None]:
    """While active (this thread or task), third-party plugins ``names`` answer nothing, as if disabled."""
    token = _left_out.set(_left_out.get() | frozenset(names))
    try:
        yield
    finally:
        _left_out.reset(token)
