"""The head's side of the decoding loop: its KV history, the pairs (h[i], x[i+1]) (trunk hidden state at i, token at
i+1) of every committed position, and the drafts it proposes. Design: docs/decoding.md#a-cycle."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from ..head import norm_settling
from .grammar import constrain

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


@dataclass
class GrammarDraft:
    """``Drafter.draft_under``'s drafts: tokens (1,) each, q (1, V) each when sampling exactly (None when forced or not
    sampling exactly), ``allowed``
    the grammar's mask before each draft and after the last (n+1 of them), the drafts it ``forced``, the head drafts it
    ``masked`` (the head's top token forbidden), and ``finite``: every head output finite."""

    allowed: list
    drafts: list = field(default_factory=list)
    qs: list = field(default_factory=list)
    forced: int = 0
    masked: int = 0
    finite: mx.array | None = None

    def q(self, width: int) -> mx.array:
        """q (n, ``width``) of the drafts, a forced draft's a point mass at it (exact sampling only)."""
        return mx.concatenate([q if q is not None else (mx.arange(width) == x)[None].astype(mx.float32)
                               for x, q in zip(self.drafts, self.qs, strict=True)])


class Drafter:
    """Drafting with an MTP head ``head(hidden (1, S, H), embeddings (1, S, H), cache) -> (1, S, H)``, or None
    (``stopped`` from the start: context drafts only); ``cache``: its empty trimmable KV cache."""

    def __init__(self, head: nn.Module | None, trunk, cache, sampling=None, vocab=None,
                 context: int | None = HEAD_CONTEXT):
        self.head, self.trunk, self.cache, self.sampling, self.vocab = head, trunk, cache, sampling, vocab
        self.context = context  # most prompt pairs fed to the head (None: all)
        self.pending = PendingPairs()
        self.stopped = head is None  # no head: lookup drafts and plain steps only
        self.committed = 0  # pairs committed so far: the next one's hidden is that of token ``committed``
        self.first = 0  # the head's first pair (its cache holds pairs ``first`` … in order, none missing)

    def feed(self, hidden: mx.array, tokens: mx.array, start: int) -> mx.array:
        """Run the head on pairs (hidden (1, S, H), tokens (S,)) whose first hidden is that of token ``start``
        (counted from the prompt's first), appending them to its cache; (1, S, H)."""
        embeddings, positions = self.trunk.head_inputs(tokens, start)
        return self.head(hidden, embeddings, cache=self.cache, positions=positions)

    def choose(self, g: mx.array, position: int) -> tuple[mx.array, mx.array | None]:
        """Draft token (1,) from head output g (1, 1, H) for generated token ``position``, and q (``propose``)."""
        return propose(draft_logits(g[0], self.trunk, self.vocab), self.sampling, self.vocab, position)

    def bound(self, pairs: int, context: int | None = None) -> None:
        """``pairs`` more prompt pairs are coming, after which the trunk's cache holds ``context`` positions (None:
        ``committed + pairs + 1``): feed the head only the last ``window(context)`` (at most ``context`` of the
        constructor) of the history; when that skips some, the head starts over from its first kept pair (its
        cache emptied)."""
        if self.context is None:
            return
        kept = min(self.context, window(self.committed + pairs + 1 if context is None else context))
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

    def keep(self, hidden: mx.array, tokens: mx.array) -> None:
        """Committed pairs (hidden (1, n, H), tokens (n,)) for the next draft to feed (none once stopped)."""
        self.committed += tokens.size
        if not self.stopped:
            self.pending.add(hidden, tokens)

    def stop(self) -> None:
        """Draft no more in this generation: kept pairs are dropped and no more are kept."""
        self.stopped, self.pending = True, PendingPairs()

    def catch_up(self, room: int) -> None:
        """Feed the kept pairs now (queued) if ``room`` more from a cycle without the head could overflow them."""
        if self.stopped or len(self.pending) + room <= self.pending.window:
            return
        hidden, tokens = self.pending.take()
        mx.async_eval(self.feed(hidden, tokens, self.committed - tokens.size))

    def draft(self, depth: int, position: int = 0) -> tuple[mx.array, mx.array | None, mx.array]:
        """Queue ``depth`` draft steps after feeding every kept pair, the first for generated token ``position``:
        drafts (depth,), q (depth, V) when sampling (else None), and scalar ``finite``: every head output finite."""
        hidden, tokens = self.pending.take()
        g = self.feed(hidden, tokens, self.committed - tokens.size)[:, -1:]
        drafts, qs, outputs = [], [], []
        for k in range(depth):
            x, q = self.choose(g, position + k)
            drafts.append(x)
            qs.append(q)
            outputs.append(g)
            if k < depth - 1:
                g = self.feed(g, x, self.committed + k)
        finite = mx.isfinite(mx.concatenate(outputs, axis=1) if depth > 1 else g).all()
        if depth == 1:
            return drafts[0], qs[0], finite
        return mx.concatenate(drafts), None if qs[0] is None else mx.concatenate(qs), finite

    def draft_under(self, grammar, depth: int, position: int = 0) -> GrammarDraft:
        """``draft`` under ``grammar`` (``grammar.Grammar``), which consumes the drafts: each step's draft is the token
        the grammar forces (the head's choice skipped) or the head's best allowed token, read on the host; drafting
        stops once the grammar is complete. The draft vocabulary is not used."""
        hidden, tokens = self.pending.take()
        g = self.feed(hidden, tokens, self.committed - tokens.size)[:, -1:]
        out = GrammarDraft([grammar.allowed()])
        outputs = []
        for k in range(depth):
            if grammar.stopped:
                break
            token, allowed = grammar.forced(), out.allowed[-1]
            if token is None:
                logits = draft_logits(g[0], self.trunk)
                x, q = propose(constrain(logits, allowed), self.sampling, None, position + k)
                top = mx.argmax(logits, axis=-1)
                mx.eval(x, top)
                token, top = x.item(), top.item()
                out.masked += top >= allowed.shape[0] or not allowed[top].item()
            else:
                x, q = mx.array([token], dtype=mx.uint32), None  # q: a point mass (``GrammarDraft.q``)
                out.forced += 1
            grammar.advance([token])
            out.allowed.append(grammar.allowed())
            out.drafts.append(x.astype(mx.uint32))
            out.qs.append(q)
            outputs.append(g)
            if k < depth - 1:
                g = self.feed(g, x, self.committed + k)
        out.finite = mx.isfinite(mx.concatenate(outputs, axis=1)).all() if outputs else mx.array(True)
        return out

    def accept(self, depth: int, hidden: mx.array, tokens: mx.array) -> None:
        """After a verify pass at ``depth``: drop the draft steps' cache rows, keep the accepted pairs."""
        if depth > 1:
            self.cache.trim(depth - 1)
        self.keep(hidden, tokens)
