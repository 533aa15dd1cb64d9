"""Reversible wrapping of runtime functions and methods, and the version guard every adapter applies."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import logging
from importlib import metadata
from pathlib import Path

log = logging.getLogger("mtp_plugin")
_MISSING = object()
_warned: set[str] = set()
_claimed: contextvars.ContextVar[frozenset] = contextvars.ContextVar("mtp_plugin_claimed", default=frozenset())


class Patches:
    """The wrappers one adapter installed, so that ``restore`` puts every original back."""

    def __init__(self):
        self._saved: list[tuple[object, str, object]] = []

    @property
    def active(self) -> bool:
        """True while any wrapper is installed."""
        return bool(self._saved)

    def wrap(self, owner, name: str, make_wrapper) -> None:
        """Replace ``owner.name`` by ``make_wrapper(current)``; the original is kept for ``restore``."""
        self._saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
        setattr(owner, name, make_wrapper(getattr(owner, name)))

    def restore(self) -> None:
        """Put back every original, newest first."""
        while self._saved:
            owner, name, original = self._saved.pop()
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def release(distribution: str) -> tuple[int, ...]:
    """The installed release of ``distribution`` as a tuple of ints, () when not installed."""
    try:
        return _release(metadata.version(distribution))
    except metadata.PackageNotFoundError:
        return ()


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def version_in_range(distribution: str, lowest: str, below: str) -> str | None:
    """The installed version of ``distribution`` if ``lowest <= version < below``; else None (one warning per process
    for an installed version outside that range)."""
    try:
        version = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None
    if _release(lowest) <= _release(version) < _release(below):
        return version
    if distribution not in _warned:
        _warned.add(distribution)
        log.warning("mtp_plugin: %s %s is outside the tested range [%s, %s); leaving it stock.",
                    distribution, version, lowest, below)
    return None


@contextlib.contextmanager
def claiming(model_path):
    """While a runtime loads ``model_path``, the wrapped ``sanitize`` (``strip_head_tensors``) strips every head tensor
    our loader finds there. Yields the head's location (``loading.loader.locate_head``), or None; a directory whose head
    cannot be located claims nothing (the loader reports it)."""
    from mtp_plugin.loading.loader import locate_head

    location = locate_head(Path(model_path))
    token = _claimed.set(frozenset(name for _, name in location.claimed()) if location else frozenset())
    try:
        yield location
    finally:
        _claimed.reset(token)


def keep_head(load_model):
    """Wrap a runtime's ``load_model(model_path, ...)`` (mlx-lm's returns ``(model, config)``, mlx-vlm's the model):
    the head is located and its tensors claimed while the runtime loads the trunk (``claiming``), then loaded onto
    the model (``loading.loader.attach_head``). A load that fails after third-party plugins answered the head's
    hooks (tensors they claimed) is tried once more without them (``plugins.retried_without_answerers``)."""
    from mtp_plugin import plugins
    from mtp_plugin.loading.checkpoint import CheckpointError, read_config
    from mtp_plugin.loading.loader import attach_head

    def load(model_path, *args, **kwargs):
        with claiming(model_path) as location:
            return load_model(model_path, *args, **kwargs), location

    @functools.wraps(load_model)
    def wrapper(model_path, *args, **kwargs):
        loaded, location = plugins.retried_without_answerers(f"loading {model_path}",
                                                             lambda: load(model_path, *args, **kwargs))
        try:
            model, config = loaded if isinstance(loaded, tuple) else (loaded, read_config(Path(model_path)))
        except CheckpointError:  # the runtime loaded a config.json the head loader refuses: stock, no head
            loaded.mtp_head = None
            return loaded
        attach_head(model, Path(model_path), config, location)
        return loaded

    return wrapper


def strip_head_tensors(sanitize, model_type: str):
    """Wrap a model class's ``sanitize`` so that it never receives head tensors: any prefixed naming form, and
    whatever the head loader claims in the model being loaded (``claiming``)."""
    from mtp_plugin.plugins import hook

    @functools.wraps(sanitize)
    def wrapper(self, weights):
        claimed = _claimed.get()
        args = getattr(self, "args", None)
        config = vars(args) if hasattr(args, "__dict__") else None
        trunk = {k: v for k, v in weights.items() if k not in claimed
                 and hook().mtp_head_name(name=k, model_type=model_type, sidecar=False, config=config) is None}
        return sanitize(self, trunk)

    return wrapper


def wrap_sanitizers(patches: Patches, package: str) -> None:
    """Wrap ``sanitize`` of ``{package}.models.<type>.Model`` for every model type a plugin handles."""
    from mtp_plugin.plugins import hook

    for model_type in sorted(set(sum(hook().mtp_model_types(), []))):
        try:
            module = importlib.import_module(f"{package}.models.{model_type}")
        except ImportError:
            continue
        patches.wrap(module.Model, "sanitize", functools.partial(strip_head_tensors, model_type=model_type))
