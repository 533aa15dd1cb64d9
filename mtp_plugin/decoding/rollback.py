"""Roll back caches that cannot be trimmed (GatedDeltaNet conv + recurrent state) after a verify pass.

During a verify pass of S tokens, a runtime adapter's capture points (wired inside the runtime's
GatedDeltaNet layer) report to the active ``Recorder``: the layer's cache keeps its whole conv
input window (K-1+S rows instead of K-1), and the recurrence leaves what restores any prefix, in one of two ways:

* **capture**: its state after each token (S states per layer);
* **replay**: nothing per token. The recorder keeps the state before the pass and the update's inputs for the S
  tokens; a commit to fewer than S tokens runs the runtime's own update once over the accepted prefix from that
  state (the "replay" of vLLM's ReplaySSM, vllm#49887, and SGLang's #12892), rows of a batch with different
  prefixes in one masked call (a masked step leaves a row's state as it was, as the runtime's own padding masks do).
  A cycle that accepts everything costs nothing more than its verify pass.

``Recorder.commit(keep)`` then sets every captured cache to its state after the first ``keep``
tokens and trims every trimmable (KV) cache by ``S - keep``: no token is run through the trunk
again, and the memory held is independent of context length.

Which way a verify pass takes: ``mode()``, "auto" unless ``force`` or ``$MTP_PLUGIN_ROLLBACK`` (``capture`` /
``replay``) says otherwise; in "auto" the runtime adapter captures where its runtime gives every token's state from
one update call and replays where it cannot (``mtp_plugin.adapters.capture``: mlx-lm's fused Metal kernel).
"""

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
    """Make every later verify pass, on every thread, roll back by ``way`` (``"capture"``, ``"replay"``, ``"auto"``);
    None: back to ``$MTP_PLUGIN_ROLLBACK`` or "auto" (the bench measures each way this way).

    Raises:
        ValueError: ``way`` not one of ``MODES`` or None.
    """
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


@dataclass
class LayerRecord:
    """One captured linear-attention cache: conv window width ``window`` (K-1), its K-1+S conv input rows, and either
    the per-token states (capture) or the state after the pass and its replay (replay).

    ``replay(length, rows)``: the recurrent state after the first ``length`` verified tokens, from the state before the
    pass, in one update call; ``rows`` (B, length) bool, or None for every row: the tokens each row takes (a row's state
    stays where its mask is False)."""

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
    """Collects, for one verify pass of ``tokens`` tokens, what each non-trimmable cache needs to roll back.

    ``way``: "capture", "replay" or "auto" (``mode()`` when None), read by the capture points."""

    def __init__(self, tokens: int, way: str | None = None):
        self.tokens = self.kept = tokens
        self.way = way or mode()
        self.layers: dict[int, LayerRecord] = {}
        self.current: LayerRecord | None = None

    @contextmanager
    def layer(self, cache, window: int):
        """Scope of one layer call: capture points inside it report to this layer's record."""
        self.current = self.layers.setdefault(id(cache), LayerRecord(cache, window))
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
        """Set row b of every batched cache to its state after its first ``keep[b]`` verified tokens.

        Captured caches gather each row's conv window and recurrent state (replayed: one masked update over the longest
        kept prefix, nothing when every row keeps all S tokens); a KV cache is trimmed by what no
        row keeps, then each row is shifted right by what it drops beyond that, which becomes left padding
        (the cache's own ``prepare(right_padding=…)`` / ``finalize()``, as the runtime pads batched prompts).

        Args:
            caches: the trunk's batched caches (B rows each).
            keep: per row, 1 ≤ keep[b] ≤ S.

        Raises:
            RollbackError: a cache that was neither captured nor can be trimmed per row.
        """
        import mlx.core as mx

        rows, most = mx.arange(len(keep)), max(keep)
        kept = mx.array(keep)
        for cache in caches:
            record = self.layers.get(id(cache))
            if record is not None:
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
        """Set every cache to its state after the first ``keep`` (1 ≤ keep ≤ S) verified tokens.

        May be called again with a smaller ``keep`` (generation stopped inside the accepted block).

        Raises:
            RollbackError: a cache that was neither captured nor is trimmable.
        """
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


    def missed(self, caches: list) -> bool:
        """Whether a cache that cannot be trimmed was not captured (the capture points were removed, e.g. by
        ``mtp_plugin.unpatch()`` on another thread, before or during the pass): ``commit`` would raise."""
        return any(id(c) not in self.layers and not c.is_trimmable() for c in caches)


def _copy(state):
    """A cache state whose lists are copies (layers assign into them), arrays shared (they are immutable)."""
    if isinstance(state, list):
        return list(state)
    return tuple(_copy(s) for s in state) if isinstance(state, tuple) else state


def snapshot(caches: list):
    """Remember ``caches`` before a pass; the returned ``undo(tokens)`` puts them back as they were: every
    cache that cannot be trimmed gets its remembered state again, every other one is trimmed by ``tokens``."""
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
