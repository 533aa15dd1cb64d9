"""The head's side of the decoding loop: its KV history and the drafts it proposes.

The head's cache must hold the pair (h[i], x[i+1]) (trunk hidden state at i, token at i+1) for every
committed position. The prompt's pairs are fed chunk by chunk as the trunk prefills it; later pairs
(the accepted prefix of each verify pass, the tokens of plain decoding steps) are kept and fed in one
batch by the next draft, so a head that did not run while the loop was parked for up to
``HISTORY_WINDOW`` tokens drafts exactly as one fed at every token. After a longer park only the last
``HISTORY_WINDOW`` pairs are fed: the head's history skips the positions before them (its later keys sit
closer to the earlier ones than the tokens do), which can only lower acceptance right after the park,
never change an output token (every draft is verified), and bounds both what the head keeps while parked
and the catch-up pass that resumes drafting (a whole park's pairs through the head would cost a sizeable
share of the plain steps it saved on a small trunk). Draft steps 2..d feed the head its own normed output
and its own draft token (Qwen3-Next / Qwen3.5 MTP wiring, as vLLM's ``qwen3_next_mtp.py``); their cache
rows are dropped once the drafts are verified.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..head import norm_settling

HISTORY_WINDOW = 32  # most pairs kept unfed for the head; older ones are dropped (``PendingPairs``)


class PendingPairs:
    """The pairs (h[i], x[i+1]) committed but not yet fed to the head, oldest first; at most ``window``.

    Args:
        window: the most pairs kept; adding more drops the oldest (the head's history then has a gap).
    """

    def __init__(self, window: int = HISTORY_WINDOW):
        self.window = window
        self.chunks: list[tuple[mx.array, mx.array]] = []  # (hidden (1, n, H), tokens (n,))
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def add(self, hidden: mx.array, tokens: mx.array) -> bool:
        """Keep pairs (hidden (1, n, H), tokens (n,)); True when older pairs were dropped to stay in the window."""
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
        """``peek()``, then forget them (they are being fed)."""
        pairs = self.peek()
        self.chunks, self.count = [], 0
        return pairs


def log_softmax(logits: mx.array) -> mx.array:
    """log-softmax over the last axis, same shape and dtype as ``logits``."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def draft_logits(head_output: mx.array, trunk, vocab=None) -> mx.array:
    """Draft logits (…, V) of head outputs (…, H) (after the head's final norm) through the trunk's ``logits``, or
    (…, k) over the subset of ``vocab`` (a ``draft_vocab.DraftVocabulary``; None: the full vocabulary)."""
    return trunk.logits(head_output) if vocab is None else vocab.logits(head_output)


def propose(logits: mx.array, sampling=None, vocab=None, position: int = 0) -> tuple[mx.array, mx.array | None]:
    """Draft tokens from draft logits (``draft_logits``).

    Args:
        logits: (B, V) draft logits, or (B, k) over the subset of ``vocab``.
        sampling: None for the argmax, else a ``decoding.Sampling``: a sample of q, its distribution; ``coupled``:
            the draw of generated token ``position`` (B = 1), whose noise the target token at that position shares
            (``coupling.GumbelDraws``), and no q; ``keyed`` alone: the argmax.
        vocab: the ``draft_vocab.DraftVocabulary`` the logits are over (indices map back to full-vocabulary ids, q
            is zero outside its subset), or None.

    Returns:
        draft token ids (B,) and, when sampling without ``keyed``, q (B, V) float32 (else None).
    """
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


class Drafter:
    """Drafting with a loaded MTP head.

    Args:
        head: the head module, ``head(hidden (1, S, H), embeddings (1, S, H), cache) -> (1, S, H)``; None for a model
            without one (``stopped`` from the start: the loop drafts from the context only).
        trunk: the trunk's ``embed`` / ``logits`` functions (``decoding.Trunk``).
        cache: the head's empty trimmable KV cache.
        sampling: None for greedy drafts, else a ``decoding.Sampling`` (drafts drawn from q).
        vocab: the head's ``draft_vocab.DraftVocabulary`` (drafts from its subset only), or None.
    """

    def __init__(self, head: nn.Module, trunk, cache, sampling=None, vocab=None):
        self.head, self.trunk, self.cache, self.sampling, self.vocab = head, trunk, cache, sampling, vocab
        self.pending = PendingPairs()
        self.stopped = head is None  # no head: lookup drafts and plain steps only
        self.committed = 0  # pairs committed so far: the next one's hidden is that of token ``committed``

    def feed(self, hidden: mx.array, tokens: mx.array, start: int) -> mx.array:
        """Run the head on pairs (hidden (1, S, H), tokens (S,)) whose first hidden is that of token ``start``
        (counted from the prompt's first), appending them to its cache; (1, S, H)."""
        embeddings, positions = self.trunk.head_inputs(tokens, start)
        return self.head(hidden, embeddings, cache=self.cache, positions=positions)

    def choose(self, g: mx.array, position: int) -> tuple[mx.array, mx.array | None]:
        """Draft token (1,) from head output g (1, 1, H) for generated token ``position``: the argmax, or a sample from
        q (1, V) when sampling (``propose``)."""
        return propose(draft_logits(g[0], self.trunk, self.vocab), self.sampling, self.vocab, position)

    def prefill(self, carry: mx.array | None, hidden: mx.array, tokens: mx.array) -> mx.array:
        """Feed the pairs a prompt chunk completes (``carry``: the previous chunk's last hidden, or None). The first
        pairs of a prompt first settle the head's open norm conventions when they carry enough evidence
        (``norm_settling.on_prompt``).

        Returns the chunk's last hidden state (1, 1, H), the next chunk's carry.
        """
        pairs_hidden = hidden[:, :-1] if carry is None else mx.concatenate([carry, hidden[:, :-1]], axis=1)
        pairs_tokens = tokens[1:] if carry is None else tokens
        if pairs_tokens.size and not self.stopped:
            if self.committed == 0:
                norm_settling.on_prompt(self.head, self.trunk, pairs_hidden, pairs_tokens, self.cache)
            self.feed(pairs_hidden, pairs_tokens, self.committed)
        self.committed += pairs_tokens.size
        return hidden[:, -1:]

    def keep(self, hidden: mx.array, tokens: mx.array) -> None:
        """Committed pairs (hidden (1, n, H), tokens (n,)), fed to the head by the next draft (none once stopped;
        the last ``HISTORY_WINDOW`` at most)."""
        self.committed += tokens.size
        if not self.stopped:
            self.pending.add(hidden, tokens)

    def stop(self) -> None:
        """Draft no more in this generation: kept pairs are dropped and no more are kept."""
        self.stopped, self.pending = True, PendingPairs()

    def catch_up(self, room: int) -> None:
        """Feed the kept pairs now if ``room`` more (a cycle that drafts without the head: a lookup draft) could push
        older ones out of the window; the head's cache update is queued, not waited for."""
        if self.stopped or len(self.pending) + room <= self.pending.window:
            return
        hidden, tokens = self.pending.take()
        mx.async_eval(self.feed(hidden, tokens, self.committed - tokens.size))

    def draft(self, depth: int, position: int = 0) -> tuple[mx.array, mx.array | None, mx.array]:
        """Queue ``depth`` draft steps after feeding every kept pair; the first draft is generated token ``position``.

        Returns:
            draft tokens (depth,); when sampling, the distributions q (depth, V) they were drawn from (else
            None); and ``finite``, a scalar bool: every head output of the cycle is finite (a NaN or Inf in
            the head's weights makes it False; ``decoding.reject_nonfinite`` turns that into a rejection).
        """
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

    def accept(self, depth: int, hidden: mx.array, tokens: mx.array) -> None:
        """After a verify pass at ``depth``: drop the draft steps' rows, keep the accepted pairs
        (hidden (1, a+1, H) of the verified inputs, tokens (a+1,) that follow them)."""
        if depth > 1:
            self.cache.trim(depth - 1)
        self.keep(hidden, tokens)
