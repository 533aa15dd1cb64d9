"""The process-wide pluggy PluginManager: built-ins, then third-party plugins of the ``mtp_plugin`` entry-point group.
A faulty third-party plugin is disabled alone with one warning; a faulty built-in raises. Guide: docs/plugins.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
import itertools
import logging
import threading
import types
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import TypeVar

import pluggy

from . import hook_results, hookspecs
from .files import Terminated

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
HEAD_HOOKS = ("mtp_head_name", "mtp_sidecar_paths", "mtp_read_tensor_names", "mtp_load_sidecar", "mtp_build_head",
              "mtp_sanitize_head", "mtp_norm_roles", "mtp_stored_norm_convention")  # what makes a loaded head
STARTED = ("mtp_generate_step", "mtp_decode")  # hooks returning token iterators: their first item is drawn guarded

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
        names = list(inspect.signature(function).parameters)  # pluggy passes the arguments an impl names, in order

        @functools.wraps(function)
        def call(*args, **kwargs):
            if name in _disabled or name in _left_out.get():
                return None
            try:
                result = function(*args, **kwargs)
                if function.__name__ in STARTED and result is not None:
                    result = _started(result)
            except (KeyboardInterrupt, GeneratorExit, Terminated):
                raise
            except BaseException as e:  # noqa: BLE001 - SystemExit and the like too: a plugin never ends the host
                disable(name, f"raised from {function.__name__} ({type(e).__name__}: {e})")
                return None
            call = {**dict(zip(names, args, strict=False)), **kwargs}
            broken = hook_results.problem(function.__name__, result, call)
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


def third_party(hooks: tuple[str, ...] = HEAD_HOOKS) -> bool:
    """Whether an enabled third-party plugin implements any of ``hooks``."""
    pm = get_plugin_manager()
    return any(impl.plugin_name not in BUILTIN_PLUGINS and impl.plugin_name not in _disabled
               for name in hooks for impl in getattr(pm.hook, name).get_hookimpls())


def _started(tokens) -> Iterator:
    """``tokens`` (an iterable a hook returned) with its first item already drawn, so that a generator that breaks
    at once breaks inside the guard."""
    it = iter(tokens)
    try:
        first = next(it)
    except StopIteration:
        return iter(())
    return itertools.chain([first], it)


def disable(name: str, why: str) -> None:
    """Disable third-party plugin ``name`` for this process, with one warning saying ``why``."""
    if name not in _disabled:
        _disabled.add(name)
        log.warning("mtp_plugin: plugin %r %s; it is disabled, MTP goes on without it", name, why)


def retried_without_answerers(what: str, attempt: Callable[[], T],
                              failure: Callable[[T], str | None] = lambda result: None,
                              hooks: tuple[str, ...] = HEAD_HOOKS) -> T:
    """``attempt()``, noting the third-party plugins that answer ``hooks``; when it raises or ``failure(result)`` names
    a problem and such plugins answered, ``attempt()`` once more with them ``left_out``: if that succeeds, they are
    disabled (one warning each: their answers broke ``what``) and its result is returned; else the first outcome
    stands (result returned or error raised) and they stay."""
    with answers() as answered:
        try:
            result = attempt()
        except Exception as error:
            first, problem = error, (str(error).strip().splitlines() or [type(error).__name__])[0].rstrip(": ")
        else:
            first, problem = None, failure(result)
    culprits = {name for hook, name in answered if hook in hooks}
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
                    used = sorted({hook for hook, who in answered if who == name and hook in hooks})
                    disable(name, f"answered {', '.join(used)} in a way that broke {what} ({shown})")
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
