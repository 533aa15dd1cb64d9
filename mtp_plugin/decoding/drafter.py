"""The head's side of the decoding loop: its KV history, the pairs (h[i], x[i+1]) (trunk hidden state at i, token at
i+1) of every committed position, and the drafts it proposes. Design: docs/decoding.md#a-cycle."""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

from ..head import norm_settling

HISTORY_WINDOW = 32  # most pairs kept unfed for the head; older ones are dropped (``PendingPairs``)
HEAD_CONTEXT = 1024  # most prompt pairs fed to the head: a long prompt's earlier ones are skipped (docs/decoding.md)
HEAD_WORK = 128 * 8192  # most window × context of a long prompt: the window's catch-up attends over the context
MIN_WINDOW = 32  # fewest prompt pairs a window keeps however long the context


def window(context: int) -> int:
    """The prompt pairs fed to the head when the trunk's context holds ``context`` positions: ``HEAD_CONTEXT``, fewer
    as the context grows past ``HEAD_WORK / HEAD_CONTEXT`` (the window's cost, window × context query-key products in
    the trunk's last layer, stays bounded), ``MIN_WINDOW`` at least."""
    return min(HEAD_CONTEXT, max(MIN_WINDOW, HEAD_WORK // max(context, 1)))


class PendingPairs:
    """Pairs (h[i], x[i+1]) committed but not yet fed to the head, oldest first; beyond ``window`` the oldest drop."""

    def __init__(self, window: int = HISTORY_WINDOW):
        self.window = window
        self.chunks: list[tuple[mx.array, mx.array]] = []  # (hidden (1, n, H), tokens (n,))
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def add(self, hidden: mx.array, tokens: mx.array) -> bool:
        """Keep pairs (hidden (1, n, H), tokens (n,)); True when older pairs were dropped."""
        self.chunks.append((hidden, tokens))
        self.count += tokens.size
        excess = self.count - self.window
        if excess <= 0:
            return False
        self.count = self.window
        while self.chunks and self.chunks[0][1].size <= excess:  # a window of 0 keeps nothing
            excess -= self.chunks.pop(0)[1].size
        if excess:
            hidden, tokens = self.chunks[0]
            self.chunks[0] = (hidden[:, excess:], tokens[excess:])
        return True

    def peek(self) -> tuple[mx.array, mx.array] | None:
        """All kept pairs as one (hidden (1, n, H), tokens (n,)), or None when there is none."""
        if not self.chunks:
            return None
        if len(self.chunks) == 1:
            return self.chunks[0]
        return (mx.concatenate([h for h, _ in self.chunks], axis=1), mx.concatenate([t for _, t in self.chunks]))

    def take(self) -> tuple[mx.array, mx.array] | None:
        """``peek()``, then forget them."""
        pairs = self.peek()
        self.chunks, self.count = [], 0
        return pairs


def log_softmax(logits: mx.array) -> mx.array:
    """log-softmax over the last axis, same shape and dtype as ``logits``."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def draft_logits(head_output: mx.array, trunk, vocab=None) -> mx.array:
    """Draft logits (…, V) of head outputs (…, H) (after the head's final norm), or (…, k) over the subset of
    ``vocab`` (a ``head.draft_vocab.DraftVocabulary``; None: the full vocabulary)."""
    return trunk.logits(head_output) if vocab is None else vocab.logits(head_output)


def propose(logits: mx.array, sampling=None, vocab=None, position: int = 0) -> tuple[mx.array, mx.array | None]:
    """Draft tokens (B,) from draft logits (B, V), or (B, k) over the subset of ``vocab`` (ids mapped back, q zero
    outside it). ``sampling`` None or ``keyed`` alone: the argmax; ``coupled``: the keyed draw of generated token
    ``position`` (B = 1); else a sample of q. Returns the tokens and q (B, V) float32 when sampling without ``keyed``,
    else None."""
    if sampling is not None and sampling.coupled:
        logprobs = log_softmax(logits)
        if vocab is not None:
            logprobs = mx.full((1, vocab.vocab_size), -mx.inf, logprobs.dtype).at[:, vocab.ids].maximum(logprobs)
        return sampling.keyed(logprobs, position), None
    if sampling is None or sampling.keyed is not None:
        index = mx.argmax(logits, axis=-1)
        return (index, None) if vocab is None else (vocab.tokens(index), None)
    q = sampling.probs(log_softmax(logits.astype(mx.float32)))
    index = mx.random.categorical(mx.log(q))
    return (index, q) if vocab is None else (vocab.tokens(index), vocab.spread(q))


class Heads(Protocol):
    """The head's side of a cycle over rows (``batch.BatchDrafter.launch``): ``BatchHeads``, a batch's head KV cache;
    ``Drafter``, one stream's."""

    def open(self, rows: list) -> mx.array | None:
        """Feed every row's kept pairs (``Row.pending``); the head's last output per row (B, 1, H), or None when no
        row kept one."""

    def advance(self, g: mx.array, x: mx.array) -> mx.array:
        """One draft step: the head on its outputs g (B, 1, H) and the drafts x (B,) they proposed; (B, 1, H)."""

    def rewind(self, steps: int) -> None:
        """Undo a cycle's ``steps`` draft steps (the cache rows of all but the last, whose output was not fed)."""

    def keep(self, row, hidden: mx.array, tokens: mx.array) -> None:
        """Committed pairs (hidden (1, n, H), tokens (n,)) of ``row`` for its next ``open``."""

    def room(self, row, drafts: int) -> None:
        """A cycle verifying ``drafts`` tokens without the head is coming for ``row``."""


class Drafter:
    """One stream's MTP head ``head(hidden (1, S, H), embeddings (1, S, H), cache) -> (1, S, H)``, or None
    (``stopped`` from the start: context drafts only); ``cache``: its empty trimmable KV cache. It feeds the prompt's
    pairs (``prefill``) and is the ``Heads`` of a one-row cycle."""

    def __init__(self, head: nn.Module | None, trunk, cache):
        self.head, self.trunk, self.cache = head, trunk, cache
        self.pending = PendingPairs()
        self.stopped = head is None  # no head: lookup drafts and plain steps only
        self.committed = 0  # pairs committed so far: the next one's hidden is that of token ``committed``
        self.first = 0  # the head's first pair (its cache holds pairs ``first`` … in order, none missing)
        self.steps = 0  # draft steps fed since the last ``open``

    def feed(self, hidden: mx.array, tokens: mx.array, start: int) -> mx.array:
        """Run the head on pairs (hidden (1, S, H), tokens (S,)) whose first hidden is that of token ``start``
        (counted from the prompt's first), appending them to its cache; (1, S, H)."""
        embeddings, positions = self.trunk.head_inputs(tokens, start)
        return self.head(hidden, embeddings, cache=self.cache, positions=positions)

    def bound(self, pairs: int, context: int | None = None) -> None:
        """``pairs`` more prompt pairs are coming, after which the trunk's cache holds ``context`` positions (None:
        ``committed + pairs + 1``): feed the head only the last ``window(context)`` of the history; when that skips
        some, the head starts over from its first kept pair (its cache emptied)."""
        kept = window(self.committed + pairs + 1 if context is None else context)
        if self.committed + pairs - kept <= self.first:
            return
        self.first = self.committed + pairs - kept
        if self.cache is not None:  # None: no head
            self.cache.trim(self.cache.offset)

    def split(self, size: int, carried: bool) -> int:
        """Where the next prompt chunk of ``size`` tokens (``carried``: a previous chunk's last hidden state is
        pending) is best cut in two passes so the trunk's last layer runs only for the head's window: the index of
        the window's first token when it lies inside the chunk, else ``size`` (no cut). Re-chunking a prompt leaves
        the trunk's caches bit-identical on MLX's CPU backend (tests/test_long_context.py)."""
        start = self.first - self.committed - carried
        return start if 0 < start < size and not self.stopped else size

    def prefill(self, carry: mx.array | None, hidden: mx.array, tokens: mx.array) -> mx.array:
        """Feed the pairs a prompt chunk completes (``carry``: the previous chunk's last hidden or None; returns
        the new one), those before ``first`` skipped (``bound``): their hidden states are left unevaluated, so the
        trunk's last layer is not run for them. The first pairs fed settle the head's open norm conventions
        (``norm_settling.on_prompt``)."""
        shift = 0 if carry is None else 1  # pair j is (hidden[j - shift] or carry, tokens[j + 1 - shift])
        size = tokens.size - 1 + shift
        skip = min(size, max(0, self.first - self.committed))
        if size > skip and not self.stopped:
            pairs_tokens = tokens[skip + 1 - shift :]
            pairs_hidden = hidden[:, skip - shift : -1] if skip >= shift else mx.concatenate([carry, hidden[:, :-1]], 1)
            if self.committed + skip == self.first:
                norm_settling.on_prompt(self.head, self.trunk, pairs_hidden, pairs_tokens, self.cache)
            self.feed(pairs_hidden, pairs_tokens, self.committed + skip)
        self.committed += size
        return hidden[:, -1:]

    def keep(self, row, hidden: mx.array, tokens: mx.array) -> None:
        """Committed pairs (hidden (1, n, H), tokens (n,)) for the next draft to feed (none once stopped); ``row``:
        the stream's (``Heads``), whose ``pending`` are this drafter's."""
        self.committed += tokens.size
        if not self.stopped:
            self.pending.add(hidden, tokens)

    def stop(self) -> None:
        """Draft no more in this generation: kept pairs are dropped and no more are kept."""
        self.stopped = True
        self.pending.take()

    def room(self, row, drafts: int) -> None:
        """Feed the kept pairs now (queued) if ``drafts`` more from a cycle without the head could overflow them."""
        if self.stopped or len(self.pending) + drafts <= self.pending.window:
            return
        hidden, tokens = self.pending.take()
        mx.async_eval(self.feed(hidden, tokens, self.committed - tokens.size))

    def open(self, rows: list) -> mx.array | None:
        """Feed every kept pair; the head's output at the last (1, 1, H), or None when none is kept."""
        pairs = self.pending.take()
        if pairs is None:
            return None
        hidden, tokens = pairs
        self.steps = 0
        return self.feed(hidden, tokens, self.committed - tokens.size)[:, -1:]

    def advance(self, g: mx.array, x: mx.array) -> mx.array:
        """One draft step on the head's output g (1, 1, H) and its draft x (1,); (1, 1, H)."""
        g = self.feed(g, x, self.committed + self.steps)
        self.steps += 1
        return g

    def rewind(self, steps: int) -> None:
        """Drop the cache rows of a cycle's draft steps."""
        if steps > 1:
            self.cache.trim(steps - 1)


class BatchHeads:
    """A batch's ``Heads``: ``head`` over ``cache``, a batched KV cache with a row per batch row; positions from the
    trunk's ``batch_head_positions(cache, length)`` (e.g. multimodal ones (3, B, length)) where it has one, else the
    head's layer derives them from its cache offset. Pairs are kept on each ``Row``; beyond its window the oldest drop
    (``Row.head_whole``)."""

    def __init__(self, head: nn.Module, trunk, cache):
        self.head, self.trunk, self.cache = head, trunk, cache

    def open(self, rows: list) -> mx.array | None:
        """Feed every row's pending pairs in one right-padded pass; the last output per row (B, 1, H), or None."""
        counts = [len(r.pending) for r in rows]
        width = max(counts)
        if width == 0:
            return None
        pairs = [row.pending.take() for row in rows]
        like = next(p[0] for p in pairs if p is not None)  # (1, n, H): shape and dtype of a pair
        hidden, tokens = [], []
        for p, n in zip(pairs, counts, strict=True):
            h, t = p if p is not None else (mx.zeros((1, 0, like.shape[2]), like.dtype), mx.zeros((0,), mx.uint32))
            hidden.append(mx.pad(h, [(0, 0), (0, width - n), (0, 0)]))
            tokens.append(mx.pad(t.astype(mx.uint32), [(0, width - n)]))
        hidden, tokens = mx.concatenate(hidden), mx.stack(tokens)
        padding = [width - n for n in counts]
        if max(padding):
            self.cache.prepare(right_padding=padding)
        out = self._run(hidden, tokens)
        self.cache.finalize()
        last = mx.array([max(n - 1, 0) for n in counts])[:, None, None]
        return mx.take_along_axis(out, last, axis=1)

    def advance(self, g: mx.array, x: mx.array) -> mx.array:
        """One draft step of every row: (B, 1, H)."""
        return self._run(g, x[:, None])

    def _run(self, hidden: mx.array, tokens: mx.array) -> mx.array:
        """The head on pairs hidden (B, S, H), tokens (B, S), appended to its cache."""
        positions = getattr(self.trunk, "batch_head_positions", None)
        length = tokens.shape[1]
        return self.head(hidden, self.trunk.embed(tokens), cache=self.cache, mask=self.cache.make_mask(length),
                         positions=None if positions is None else positions(self.cache, length))

    def rewind(self, steps: int) -> None:
        """Drop the cache rows of a cycle's draft steps."""
        if steps > 1:
            self.cache.trim(steps - 1)

    def keep(self, row, hidden: mx.array, tokens: mx.array) -> None:
        """Committed pairs of ``row`` (``Row.keep``)."""
        row.keep(hidden, tokens)

    def room(self, row, drafts: int) -> None:
        """Nothing: a row keeps its latest pairs only."""
