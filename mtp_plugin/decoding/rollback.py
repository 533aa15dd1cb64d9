"""Roll back the caches a verify pass cannot trim (GatedDeltaNet conv and recurrent state) to the accepted prefix,
by capture (each token's state) or replay (the runtime's update rerun from the state before the pass), as ``mode()``
says. Design: docs/decoding.md#rollback."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

_local = threading.local()
log = logging.getLogger("mtp_plugin")
MODES = ("auto", "capture", "replay")
MODE_ENV = "MTP_PLUGIN_ROLLBACK"
_forced: str | None = None
_warned: set = set()


def force(way: str | None) -> None:
    """Make every later verify pass, on every thread, roll back by ``way`` (one of ``MODES``); None: back to
    ``$MTP_PLUGIN_ROLLBACK`` or "auto". Raises ValueError for any other ``way``."""
    global _forced
    if way is not None and way not in MODES:
        raise ValueError(f"rollback way must be one of {', '.join(MODES)}, got {way!r}")
    _forced = way


def mode() -> str:
    """The way the next verify pass rolls back: ``force``'s, else ``$MTP_PLUGIN_ROLLBACK``'s, else "auto" (an unknown
    value of the variable is ignored, with one warning)."""
    if _forced is not None:
        return _forced
    way = os.environ.get(MODE_ENV, "") or "auto"
    if way not in MODES:
        if way not in _warned:
            _warned.add(way)
            log.warning("mtp_plugin: %s=%r is not one of %s; using auto", MODE_ENV, way, ", ".join(MODES))
        return "auto"
    return way


class RollbackError(RuntimeError):
    """A cache that can neither be trimmed nor was captured; rolling back would give wrong output."""


class CaptureMissed(RollbackError):
    """A verify pass missed a cache's capture points (``Recorder.missed``: removed before or during it, e.g. by
    ``mtp_plugin.unpatch()`` on another thread); the caches were restored to their state before it."""


@dataclass
class LayerRecord:
    """One captured linear-attention cache: conv window width ``window`` (K-1), its K-1+S conv input ``rows``, and
    either the per-token ``states`` (capture) or ``final`` and ``replay(length, rows)`` (replay: the state after the
    first ``length`` tokens in one update call; ``rows`` (B, length) bool selects each row's tokens, None: all)."""

    cache: object
    window: int
    rows: object = None
    states: list = field(default_factory=list)
    final: object = None
    replay: Callable | None = None

    def state(self, keep: int, tokens: int):
        """The recurrent state after the first ``keep`` of the pass's ``tokens`` tokens."""
        if self.replay is None:
            return self.states[keep - 1]
        return self.final if keep == tokens else self.replay(keep, None)


class Recorder:
    """What each non-trimmable cache needs to roll back a verify pass of ``tokens`` tokens; ``way`` None: ``mode()``."""

    def __init__(self, tokens: int, way: str | None = None):
        self.tokens = self.kept = tokens
        self.way = way or mode()
        self.layers: dict[int, LayerRecord] = {}
        self.owners: dict[int, list[LayerRecord]] = {}  # per layer module, in call order: its records in call order
        self.current: LayerRecord | None = None

    @contextmanager
    def layer(self, cache, window: int, owner=None):
        """Scope of one layer call of module ``owner``: capture points inside it report to this call's record."""
        self.current = self.layers.setdefault(id(cache), LayerRecord(cache, window))
        if owner is not None:
            self.owners.setdefault(id(owner), []).append(self.current)
        try:
            yield self.current
        finally:
            self.current.rows = cache[0]
            self.current = None

    def record_states(self, states: list) -> None:
        """Per-token recurrent states of the layer being called (list of S arrays)."""
        if self.current is not None:
            self.current.states = list(states)

    def record_replay(self, final, replay: Callable) -> None:
        """The layer being called rolls back by replay: its state after the pass, and ``LayerRecord.replay``."""
        if self.current is not None:
            self.current.final, self.current.replay = final, replay

    def commit_rows(self, caches: list, keep: list[int]) -> None:
        """Set row b of every batched cache to its state after its first ``keep[b]`` (1..S) verified tokens:
        captured caches gather each row's window and state (replay: one masked update); a KV cache is trimmed by what no
        row keeps, and what a row drops beyond that becomes its left padding (``prepare(right_padding=…)``,
        ``finalize()``). Raises RollbackError for a cache neither captured nor trimmable per row."""
        import mlx.core as mx

        rows, most = mx.arange(len(keep)), max(keep)
        kept = mx.array(keep)
        per_layer = iter(self.owners.values())
        for cache in caches:
            record = self.layers.get(id(cache))
            calls = next(per_layer, None) if not cache.is_trimmable() else None
            if record is None and calls is not None and len(calls) == len(keep):
                # the runtime ran each row alone on its own copy of the cache, then merged the copies into a new one
                cache[0] = mx.concatenate([c.rows[:, k : k + c.window] for c, k in zip(calls, keep, strict=True)])
                cache[1] = mx.concatenate([c.state(k, self.tokens) for c, k in zip(calls, keep, strict=True)])
            elif record is not None:
                window = kept[:, None] + mx.arange(record.window)[None]
                cache[0] = mx.take_along_axis(record.rows, window[..., None], axis=1)
                if record.replay is None:
                    cache[1] = mx.stack(record.states)[kept - 1, rows]
                elif min(keep) == most:
                    cache[1] = record.state(most, self.tokens)
                else:
                    cache[1] = record.replay(most, mx.arange(most)[None] < kept[:, None])
            elif not (cache.is_trimmable() and hasattr(cache, "finalize")):
                raise RollbackError(f"{type(cache).__name__} cannot be rolled back per row")
            else:
                cache.trim(self.kept - most)
                if most > min(keep):
                    cache.prepare(right_padding=[most - k for k in keep])
                    cache.finalize()
        self.kept = most

    def commit(self, caches: list, keep: int) -> None:
        """Set every cache to its state after the first ``keep`` (1..S) verified tokens; may be called again with
        a smaller ``keep``. Raises RollbackError for a cache neither captured nor trimmable."""
        drop, self.kept = self.kept - keep, keep
        for cache in caches:
            record = self.layers.get(id(cache))
            if record is not None:
                cache[0] = record.rows[:, keep : keep + record.window]
                cache[1] = record.state(keep, self.tokens)
            elif drop and cache.is_trimmable():
                cache.trim(drop)
            elif drop:
                raise RollbackError(f"{type(cache).__name__} cannot be rolled back by {drop} tokens")


    def missed(self, caches: list, rows: int = 1) -> bool:
        """Whether a non-trimmable cache was not captured (capture points removed before or during the pass, e.g.
        by ``mtp_plugin.unpatch()`` on another thread): rolling back would raise. A runtime that ran each of ``rows``
        rows alone on copies of the caches (mlx-vlm 0.6's batch) captured every layer through its copies
        (``commit_rows``)."""
        stateful = [c for c in caches if not c.is_trimmable()]
        captured = [id(c) in self.layers for c in stateful]
        if all(captured):
            return False
        copies = list(self.owners.values())
        return any(captured) or len(copies) != len(stateful) or any(len(calls) != rows for calls in copies)


def _copy(state):
    """A cache state whose lists are copies (layers assign into them), arrays shared (they are immutable)."""
    if isinstance(state, list):
        return list(state)
    return tuple(_copy(s) for s in state) if isinstance(state, tuple) else state


def snapshot(caches: list):
    """Remember ``caches`` before a pass; ``undo(tokens)`` restores the non-trimmable ones and trims the others by
    ``tokens``."""
    saved = [(c, _copy(c.state)) for c in caches if not c.is_trimmable()]

    def undo(tokens: int) -> None:
        for c, state in saved:
            c.state = state
        for c in caches:
            if c.is_trimmable():
                c.trim(tokens)

    return undo


def active() -> Recorder | None:
    """The recorder of the verify pass running on this thread, if any (called by capture points)."""
    return getattr(_local, "recorder", None)


@contextmanager
def capturing(tokens: int):
    """Activate a ``Recorder`` for a verify pass of ``tokens`` tokens on this thread (rolling back by ``mode()``)."""
    recorder = Recorder(tokens)
    _local.recorder = recorder
    try:
        yield recorder
    finally:
        _local.recorder = None
