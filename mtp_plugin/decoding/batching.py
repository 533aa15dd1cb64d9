"""One model's batched-MTP state, kept across a runtime's batch generators (``state.ModelState.batching``): its trunk
and head, each waiting request's options, the heads of prompts being processed, finished requests' heads and lookup
indexes kept for requests that extend their prompts, and whether a fault stopped batched MTP. Design:
docs/mlx-lm-server.md."""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from .batch import BatchDrafter
from .drafter import Drafter
from .lockstep import Lockstep
from .lookup import ContextIndex
from .scheduler import Scheduler

log = logging.getLogger("mtp_plugin")
STORED_HEADS = 32  # finished requests whose head caches are kept for requests that reuse their prompt caches
STORED_INDEXES = 4  # latest prompts whose lookup indexes are kept for requests that extend them (a conversation)


@dataclass
class HeadRow:
    """A request's head while its prompt is processed: its KV cache, the last unpaired hidden state (``carry``), and
    whether its cache holds the pair of every context position from the first (``whole``; a long prompt's head holds
    its window only, ``drafter.window``: ``drafter.first`` > 0)."""

    drafter: Drafter
    carry: mx.array | None = None
    whole: bool = True


@dataclass
class BatchingState:
    """What batched MTP keeps for one model: ``trunk`` and ``drafter`` (a ``batch.BatchDrafter``; its head None: lookup
    drafts only), the head's ``health`` (a parked head drafts no more), the model's ``scheduler``, ``new_cache()`` (an
    empty head KV cache of the runtime's kind), the ranks' ``lockstep`` (None on one process); per generator, each
    waiting request's options (``options``, uid -> the adapter's request) and prompt length (``lengths``, tokens its
    prompt passes will process) and each prompt row's head (``heads``)."""

    trunk: object
    drafter: BatchDrafter
    health: object
    scheduler: Scheduler
    new_cache: Callable[[], object]
    lockstep: Lockstep | None = None
    options: dict = field(default_factory=dict)
    heads: dict = field(default_factory=dict)
    lengths: dict = field(default_factory=dict)
    store: OrderedDict = field(default_factory=OrderedDict)  # tokens -> head of a finished request (``remember``)
    indexes: deque = field(default_factory=lambda: deque(maxlen=STORED_INDEXES))  # ``lookup_index``'s copies
    failed: str | None = None  # why batched MTP stopped after a fault of the plugin's (then every batch is stock)
    cycles: int = 0  # batched passes: cycles and plain steps
    row_cycles: int = 0  # rows × passes
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0

    def fail(self, error: Exception) -> None:
        """A fault in the plugin's batched path: every batch of this model decodes stock from now on (one warning)."""
        if self.failed is None:
            self.failed = f"{type(error).__name__}: {error}"
            log.warning("mtp_plugin: batched MTP failed (%s); its requests and later ones decode without the head",
                        self.failed, exc_info=error)

    def restart(self) -> None:
        """A new generator: request ids restart, so the per-generator maps are cleared."""
        self.options.clear()
        self.heads.clear()
        self.lengths.clear()

    def head_row(self, uid: int, prefix: list[int]) -> HeadRow:
        """The head of request ``uid``, created on first use for a row whose trunk cache already holds ``prefix``
        (a reused prompt cache): the head's pairs for that prefix when a finished request left them, else none."""
        if uid not in self.heads:
            row = self.heads[uid] = HeadRow(Drafter(self.drafter.head, self.trunk, self.new_cache()),
                                            whole=not prefix)
            if prefix:
                self.recall(prefix, row)
        return self.heads[uid]

    def remember(self, tokens: list[int], cache, pending) -> None:
        """Keep the head of a finished request whose trunk cache holds ``tokens`` and whose head holds the pair
        of every position from the first: its KV cache and its pairs not yet fed (``Row.pending``)."""
        hidden, following = pending.peek() or (None, None)
        self.store[tuple(tokens)] = (cache, hidden, following)
        self.store.move_to_end(tuple(tokens))
        while len(self.store) > STORED_HEADS:
            self.store.popitem(last=False)

    def recall(self, prefix: list[int], row: HeadRow) -> None:
        """Give ``row`` the pairs of positions 0 … len(prefix)-2 and, as its carry, the hidden state of the last
        position, from the latest remembered request that began with ``prefix``."""
        key = tuple(prefix)
        entry = next((v for k, v in reversed(self.store.items()) if k[: len(key)] == key), None)
        if entry is None:
            return
        cache, hidden, following = entry
        fed, last = cache.offset, len(prefix) - 1  # pairs in the cache; position of the prefix's last token
        keep = min(fed, last)
        if keep:
            row.drafter.cache.update_and_fetch(cache.keys[..., :keep, :], cache.values[..., :keep, :])
        row.drafter.committed = keep
        if last < fed or hidden is None:  # the last position's hidden state is gone: one pair will be missing
            return
        if last > fed:
            row.drafter.feed(hidden[:, : last - fed], following[: last - fed], fed)
        row.carry, row.whole, row.drafter.committed = hidden[:, last - fed : last - fed + 1], True, last

    def lookup_index(self, tokens: list[int], fresh: ContextIndex) -> ContextIndex:
        """A lookup index over a joining row's context ``tokens``: the latest kept one whose tokens ``tokens`` extend,
        taken and extended with the rest, else ``fresh`` extended with all; a copy is kept for a later request that
        extends these (a conversation's next turn), so that one indexes only its new tokens."""
        index = next((i for i in reversed(self.indexes) if (i.n_min, i.n_max) == (fresh.n_min, fresh.n_max)
                      and len(i.tokens) <= len(tokens) and tokens[: len(i.tokens)] == i.tokens), None)
        if index is None:
            index = fresh
        else:
            self.indexes.remove(index)
        index.extend(tokens[len(index.tokens):])
        self.indexes.append(index.copy())
        return index

    def summary(self) -> str | None:
        """One line on the batched passes decoded so far (None before the first)."""
        if not self.cycles:
            return None
        return (f"batched MTP: {self.cycles} passes (cycles and plain steps) emitted {self.tokens} tokens, "
                f"{self.tokens / max(self.row_cycles, 1):.2f} per row and pass; drafted {self.drafted}, accepted "
                f"{self.accepted} (acceptance {self.accepted / max(self.drafted, 1):.3f})")
