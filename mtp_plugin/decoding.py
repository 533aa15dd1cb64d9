"""The MTP decoding loop: draft → verify → accept/reject → commit, one verify pass of the trunk per cycle.

Each cycle the head drafts ``depth`` tokens (``drafter.py``: its first step consumes the trunk hidden
states of every token committed since its last step, so its KV cache holds the pair (h[i], x[i+1]) for
the whole context), the trunk verifies ``[last token, drafts…]`` in one batched pass, and caches are
rolled back to the accepted prefix (``rollback.py``) without running any token through the trunk again.

Acceptance. Greedy: a draft is accepted iff it equals the trunk's argmax at its position, so the
output is the trunk's own greedy output. Sampling: exact speculative sampling (Leviathan et al. 2023,
"Fast Inference from Transformers via Speculative Decoding", Algorithm 1; Chen et al. 2023): accept
draft d with probability min(1, p(d)/q(d)), on the first rejection sample the residual distribution
norm(max(p − q, 0)), and sample a bonus token from p when every draft is accepted; p is the trunk's
distribution after the runtime's logits processors and sampler filters, q the head's after the same
filters, so the output distribution is exactly the trunk's. A runtime that keys each token's randomness
by its position (mlx-vlm's seeded sampler) has its own draws used instead (``Sampling.keyed``): every emitted
token is the one the runtime would draw there, and a draft is accepted iff it equals it.

A broken head never reaches the output: a cycle whose head output is not finite (NaN/Inf) counts as
rejected inside the acceptance computation (q taken as 0, so the residual is p itself) and its accepted
count is read back as ``NONFINITE`` in the same host sync (``reject_nonfinite``); the head's
``health.HeadHealth`` then parks it, as it does a head that accepts (almost) nothing over its first
cycles, and the rest of the generation is plain decoding.

Depth: fixed, or chosen per cycle by a policy (``controller.DepthController``: adaptive depth, which
may also "park" on plain decoding steps when no depth is predicted to beat plain decoding). The policy
is fed each cycle's accepted count and its cost: the seconds spent in this loop queueing it (draft,
verify), waiting for it and on its bookkeeping (the consumer's time between yields excluded).

Host synchronisation: one per cycle (the accepted count and the block of tokens), where plain
decoding syncs once per token. Like mlx-lm's plain loop, each block's successor is queued before the
block is yielded, so the consumer's time overlaps the next pass; after a plain step (or the prompt pass)
the successor, plain step or cycle, is built on the lazy token before it is read. A cycle's successor
depends on its accepted count, so it is built after that count is read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

from . import rollback
from .controller import PLAIN, FixedDepth
from .drafter import Drafter
from .drafter import log_softmax as _log_softmax
from .health import HeadHealth
from .stats import MTPStats

DEFAULT_DEPTH = 2
MAX_DEPTH = 8
log = logging.getLogger("mtp_plugin")


class Trunk(Protocol):
    """What the loop needs of a trunk; a family builds it from the runtime's model."""

    def hidden(self, tokens: mx.array, cache: list) -> mx.array:
        """Hidden states (1, S, H) of ``tokens`` (1, S), in the head contract's variant, advancing ``cache``."""

    def embed(self, tokens: mx.array) -> mx.array:
        """Input embeddings (…, H) of integer ``tokens`` (…)."""

    def head_inputs(self, tokens: mx.array, start: int) -> tuple[mx.array, mx.array | None]:
        """The head's inputs with the pairs (h[start+i], x[start+i+1]) of tokens x (S,), positions counted from
        the prompt's first token: embeddings (1, S, H) and the positions its layer takes (None: its cache
        offset)."""

    def logits(self, hidden: mx.array) -> mx.array:
        """Vocabulary logits (…, V) of head outputs (…, H) (the head applies its own final norm)."""

    def trunk_logits(self, hidden: mx.array) -> mx.array:
        """The trunk's own vocabulary logits (…, V) from hidden states (…, H) as ``hidden`` returned them
        (a ``pre_norm`` contract applies the trunk's final norm first)."""


@dataclass(frozen=True)
class Sampling:
    """Temperature sampling exactly as the runtime's sampler does it.

    Attributes:
        temp: temperature > 0.
        filters: functions log-probs (…, V) → filtered log-probs (-inf where excluded), in the
            runtime sampler's order (e.g. mlx-lm's ``apply_top_p``, ``apply_min_p``, ``apply_top_k``).
        keyed: the runtime's own draws when it keys each token's randomness by the token's position
            (mlx-vlm's seeded sampler): ``keyed(logprobs (k, V), first) -> tokens (k,)`` for the generated
            tokens ``first .. first+k-1`` (0: the first token after the prompt). The loop then draws every
            emitted token with it and accepts a draft iff it equals that token (``accept_matching``), so a
            seed gives the runtime's own tokens at any depth; None: exact speculative sampling.
    """

    temp: float
    filters: tuple[Callable[[mx.array], mx.array], ...] = ()
    keyed: Callable[[mx.array, int], mx.array] | None = None

    def probs(self, logprobs: mx.array) -> mx.array:
        """Sampling distribution (…, V), float32: softmax(filters(logprobs) / temp)."""
        for f in self.filters:
            logprobs = f(logprobs)
        return mx.softmax(logprobs.astype(mx.float32) / self.temp, axis=-1)


def _categorical(probs: mx.array) -> mx.array:
    return mx.random.categorical(mx.log(probs))


def accept_greedy(logprobs: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array]:
    """Greedy acceptance.

    Args:
        logprobs: trunk log-probs (D+1, V) at the verified positions.
        drafts: draft tokens (D,).

    Returns:
        ``(accepted, block)``: scalar count a of leading drafts equal to the trunk's argmax, and the
        (D+1,) trunk argmax tokens, of which the first a+1 are emitted.
    """
    return accept_matching(mx.argmax(logprobs, axis=-1), drafts)


def accept_matching(targets: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array]:
    """Acceptance against tokens already chosen at the verified positions: the trunk's argmax (greedy), or the
    runtime's own position-keyed samples (``Sampling.keyed``). Exact for sampling because each target token is
    drawn from the trunk's distribution whatever the drafts are (a coupling: the drafts only decide how many
    of them one verify pass confirms).

    Args:
        targets: (D+1,) tokens at the verified positions.
        drafts: draft tokens (D,).

    Returns:
        ``(accepted, targets)``: scalar count a of leading drafts equal to their target; the first a+1 targets
        are emitted.
    """
    accepted = mx.cumprod(targets[:-1] == drafts).sum()
    return accepted, targets


def accept_sampled(p: mx.array, q: mx.array, drafts: mx.array,
                   finite: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """Exact speculative sampling (Leviathan et al. 2023, Algorithm 1).

    Args:
        p: trunk sampling distribution (D+1, V) at the verified positions.
        q: head sampling distribution (D, V) each draft was drawn from.
        drafts: draft tokens (D,).
        finite: scalar bool, False when the head's output was not finite: every draft is then rejected
            and q counts as 0, so the token sampled in place of the first draft comes from p itself.

    Returns:
        ``(accepted, block)``: scalar count a of accepted drafts and (D+1,) tokens whose first a+1
        are emitted: the drafts, then a residual sample max(p − q, 0) at the first rejection, or a
        bonus sample from p[D] when every draft is accepted.
    """
    rows = mx.arange(drafts.shape[0])
    if finite is not None:
        q = mx.where(finite, q, 0.0)  # NaN never reaches the test or the residual
    p_d, q_d = p[rows, drafts], q[rows, drafts]
    u = mx.random.uniform(shape=drafts.shape)
    ok = u * q_d < p_d
    accepted = mx.cumprod(ok if finite is None else ok & finite).sum()
    residual = mx.maximum(p[:-1] - q, 0.0)
    residual = residual / mx.maximum(residual.sum(axis=-1, keepdims=True), 1e-30)
    fallback = _categorical(mx.concatenate([residual, p[-1:]], axis=0))
    index = mx.arange(drafts.shape[0] + 1)
    block = mx.where(index < accepted, mx.concatenate([drafts, drafts[:1]]), fallback)
    return accepted, block


NONFINITE = -1  # the accepted count read back for a cycle whose head output was not finite


def reject_nonfinite(accepted: mx.array, finite: mx.array) -> mx.array:
    """The cycle's outcome as one scalar the loop reads in its one host sync: the accepted count, or
    ``NONFINITE`` when the head's output was not finite (NaN/Inf weights or activations).

    Args:
        accepted: scalar int count from ``accept_greedy`` / ``accept_sampled`` (0 when not finite: those
            functions must be given ``finite`` or see drafts that fail the test).
        finite: scalar bool from ``Drafter.draft``.
    """
    return mx.where(finite, accepted, NONFINITE)


def processed_logprobs(logits: mx.array, inputs: mx.array, past: mx.array | None, processors) -> mx.array:
    """Log-probs (S, V) of ``logits`` (S, V) after mlx-lm style ``processors`` (``processor(tokens, logits)``),
    position i seeing the tokens ``past`` (None: none) + ``inputs[:i+1]``, as mlx-lm applies them per step."""
    if processors:
        rows = []
        for i in range(inputs.size):
            seen = mx.concatenate([past, inputs[: i + 1]]) if past is not None else inputs[: i + 1]
            row = logits[i : i + 1]
            for processor in processors:
                row = processor(seen, row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    return _log_softmax(logits)


class DepthPolicy(Protocol):
    """Chooses each cycle's draft depth (``controller.DepthController``, ``controller.FixedDepth``).

    The loop asks once per cycle and reports every cycle it ran, both in order; the question for a cycle
    may come before the previous cycle is reported (each block's successor is queued before the block is
    yielded), and the last question of a generation goes unreported when the consumer stops before its
    cycle's tokens (that queued cycle is discarded).
    """

    def next_depth(self) -> int:
        """Draft depth of the next cycle, 1..8, or 0 (``controller.PLAIN``) for one plain decoding step."""

    def observe(self, depth: int, accepted: int, seconds: float) -> None:
        """The cycle that ran: its depth (0: plain step), drafts accepted, seconds spent in the loop."""


class _Stopwatch:
    """Seconds spent inside the loop, the consumer's time between yields excluded."""

    def __init__(self):
        self.mark, self.busy = time.perf_counter(), 0.0

    def pause(self) -> None:
        self.busy += time.perf_counter() - self.mark

    def resume(self) -> None:
        self.mark = time.perf_counter()

    def lap(self) -> float:
        """Busy seconds since the previous lap."""
        now = time.perf_counter()
        busy, self.busy, self.mark = self.busy + now - self.mark, 0.0, now
        return busy


@dataclass
class _Cycle:
    """One queued cycle: its drafts, verify pass and acceptance (read once computed)."""

    depth: int
    inputs: mx.array  # (d+1,): the newest token, then the drafts
    hidden: mx.array  # (1, d+1, H) trunk hidden states of ``inputs``
    logprobs: mx.array  # (d+1, V)
    accepted: mx.array  # scalar
    tokens: mx.array  # (d+1,): the first accepted+1 are emitted
    recorder: rollback.Recorder


class _Loop:
    """The state one generation's cycles change, and the steps that change it.

    ``last`` is the newest token (1,), which the next plain step or cycle feeds to the trunk first;
    ``history`` the tokens the logits processors have seen (None without processors).
    """

    def __init__(self, trunk, cache, drafter, sampling, processors, history, cache_step=None):
        self.trunk, self.cache, self.drafter = trunk, cache, drafter
        self.sampling, self.processors = sampling, processors
        self.last, self.history = None, history
        self.cache_step = cache_step
        self.uncaptured = False  # the capture points were found gone: plain steps only
        self.position = 0  # generated tokens drawn for good so far: the next one's position (``Sampling.keyed``)

    def after_pass(self) -> int | None:
        """Run the runtime's cache step on the committed cache (e.g. KV quantization); the most tokens the
        next trunk pass may feed (None: no limit)."""
        return None if self.cache_step is None else self.cache_step(self.cache)

    def logprobs_at(self, logits: mx.array, inputs: mx.array, past: mx.array | None) -> mx.array:
        """Log-probs (S, V) after the processors, position i seeing ``past`` + ``inputs[:i+1]``."""
        return processed_logprobs(logits, inputs, past, self.processors)

    def pick(self, logprobs: mx.array) -> mx.array:
        """The next token (1,) from log-probs (1, V): argmax, the runtime's keyed draw, or a sample of the
        sampling distribution."""
        if self.sampling is None:
            return mx.argmax(logprobs, axis=-1)
        self.position += 1
        if self.sampling.keyed is not None:
            return self.sampling.keyed(logprobs, self.position - 1)
        return _categorical(self.sampling.probs(logprobs))

    def plain_step(self) -> tuple[mx.array, mx.array, mx.array]:
        """Queue one plain step on ``last``: its hidden state (1, 1, H), log-probs (1, V), next token (1,)."""
        hidden = self.trunk.hidden(self.last[None], self.cache)
        logprobs = self.logprobs_at(self.trunk.trunk_logits(hidden[0]), self.last, self.history)
        if self.processors:
            self.history = mx.concatenate([self.history, self.last])
        following = self.pick(logprobs)
        mx.async_eval(following, logprobs)
        return hidden, logprobs, following

    def take_plain(self, step) -> None:
        """A plain step's token becomes ``last``; its pair is kept for the head."""
        hidden, _, following = step
        self.drafter.keep(hidden, following)
        self.last = following

    def launch(self, depth: int) -> _Cycle | None:
        """Queue a cycle at ``depth``: draft, verify ``[last, drafts…]`` in one trunk pass, accept.

        None, with every cache as it was, when the runtime's capture points were gone during the pass
        (``mtp_plugin.unpatch()`` on another thread): the cycle could not be rolled back; from then on
        the generation goes on in plain steps (``uncaptured``)."""
        drafts, q, finite = self.drafter.draft(depth)
        mx.async_eval(drafts)  # the head runs while the verify pass is built
        inputs = mx.concatenate([self.last, drafts])
        undo = rollback.snapshot(self.cache)
        with rollback.capturing(inputs.size) as recorder:
            hidden = self.trunk.hidden(inputs[None], self.cache)
        if recorder.missed(self.cache):
            undo(inputs.size)
            self.uncaptured = True
            log.warning("mtp_plugin: the runtime was unpatched during this generation; it goes on with plain "
                        "decoding steps (the same tokens).")
            return None
        logprobs = self.logprobs_at(self.trunk.trunk_logits(hidden[0]), inputs, self.history)
        if self.sampling is None:
            accepted, tokens = accept_greedy(logprobs, drafts)
        elif self.sampling.keyed is not None:
            accepted, tokens = accept_matching(self.sampling.keyed(logprobs, self.position), drafts)
        else:
            accepted, tokens = accept_sampled(self.sampling.probs(logprobs), q, drafts, finite)
        accepted = reject_nonfinite(accepted, finite)  # greedy: tokens are the trunk's argmax either way
        mx.async_eval(accepted, tokens)
        return _Cycle(depth, inputs, hidden, logprobs, accepted, tokens, recorder)

    def commit(self, cycle: _Cycle, accepted: int) -> None:
        """Keep the verified prefix: caches rolled back to ``inputs[:accepted+1]``, the head given the
        accepted pairs, ``last`` the cycle's correction or bonus token."""
        cycle.recorder.commit(self.cache, accepted + 1)
        self.position += accepted + 1
        self.drafter.accept(cycle.depth, cycle.hidden[:, : accepted + 1], cycle.tokens[: accepted + 1])
        if self.processors:
            self.history = mx.concatenate([self.history, cycle.inputs[: accepted + 1]])
        self.last = cycle.tokens[accepted : accepted + 1]


def generate(
    prompt: mx.array,
    trunk: Trunk,
    head: nn.Module,
    *,
    cache: list,
    head_cache,
    depth: int | DepthPolicy = DEFAULT_DEPTH,
    max_tokens: int = 256,
    sampling: Sampling | None = None,
    logits_processors: Sequence[Callable] | None = None,
    prefill_step_size: int = 2048,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
    prefill_history: bool = True,
    one_pass: bool = False,
    stats: MTPStats | None = None,
    health: HeadHealth | None = None,
    cache_step: Callable[[list], int | None] | None = None,
    draft_vocab=None,
) -> Generator[tuple[int, mx.array], None, None]:
    """Generate tokens with the head as drafter and the trunk as verifier (mlx-lm ``generate_step`` contract).

    Each cycle runs at the depth the policy chooses; depth 0 is a plain decoding step (the trunk on the
    last token, no drafting). Consecutive plain steps are pipelined as in mlx-lm (the next step is queued
    before the current token is yielded). The head is not run during plain steps: the trunk hidden states
    of those tokens are kept and fed to the head in one batch when drafting resumes, so its cache holds the
    same pairs (h[i], x[i+1]) as if it had drafted all along (after a park longer than
    ``drafter.HISTORY_WINDOW`` tokens, only the last that many: its history skips the rest).

    Args:
        prompt: prompt token ids (T,), T ≥ 1.
        trunk: the trunk's hidden/embed/logits functions.
        head: the loaded MTP head module.
        cache: the trunk's per-layer caches (updated in place; after the generator ends or is closed
            it holds the prompt and every yielded token, as plain decoding leaves it).
        head_cache: an empty trimmable KV cache for the head.
        depth: a fixed draft depth d, 1 ≤ d ≤ 8, or a policy choosing it per cycle (adaptive depth).
        max_tokens: tokens to generate (-1: no limit).
        sampling: None for greedy, else the runtime sampler's temperature and filters.
        logits_processors: mlx-lm style ``processor(tokens, logits) -> logits``, applied per verified position.
        prefill_step_size: prompt tokens per trunk pass while prefilling.
        prompt_progress_callback: ``callback(processed, total)`` during prefill.
        prefill_history: whether logits processors see the whole prompt (mlx-lm ≥ 0.32) or only the
            tokens after the chunked prefill, i.e. the last prompt token (earlier mlx-lm).
        one_pass: the prompt is fed in one trunk pass, as mlx-vlm 0.6 runs a prompt no longer than its prefill
            step; otherwise all but the last token (in chunks of ``prefill_step_size``), then the last, as mlx-lm
            and mlx-vlm 0.7 do. A runtime's multi-token and single-token passes may round differently (mlx-vlm
            0.6's GatedDeltaNet scans a multi-token pass in chunks), so the split follows the runtime's.
        stats: counters to fill (a fresh ``MTPStats`` if None).
        health: the loaded head's ``HeadHealth`` (a fresh one if None): a cycle whose head output is not
            finite counts as rejected and parks the head, as does acceptance under 2 % over its first
            draft tokens; a parked head drafts no more (the rest of the generation is plain decoding).
        cache_step: called with ``cache`` after every trunk pass, once the pass is committed (each prefill
            chunk, the prompt pass, each plain step and cycle, and when the generator ends), where the
            runtime's own loop calls it after each step (mlx-lm: KV cache quantization); it returns the
            most tokens the next pass may feed without changing what the runtime would compute (None: no
            limit; 1: a plain step), and the loop drafts at most that many tokens minus one.
        draft_vocab: the head's ``draft_vocab.DraftVocabulary``: drafts come from its subset only (the trunk still
            verifies over the full vocabulary; q is zero outside the subset); None: the full vocabulary.

    Yields:
        ``(token, logprobs)``: token id (int) and the trunk's log-probs (V,) at its position.

    Raises:
        ValueError: a fixed depth outside 1..8, a policy's depth outside 0..8, or an empty prompt.
        rollback.RollbackError: a cache that can neither be trimmed nor rolled back.
    """
    if isinstance(depth, int) and not 1 <= depth <= MAX_DEPTH:
        raise ValueError(f"draft depth must be 1..{MAX_DEPTH}, got {depth}")
    if prompt.size == 0:
        raise ValueError("MTP decoding needs at least one prompt token")
    policy = FixedDepth(depth) if isinstance(depth, int) else depth
    stats = stats if stats is not None else MTPStats(depth if isinstance(depth, int) else None)
    processors = list(logits_processors or [])
    callback = prompt_progress_callback or (lambda *_: None)
    history = (prompt if prefill_history else prompt[-1:]) if processors else None
    drafter = Drafter(head, trunk, head_cache, None if sampling is None or sampling.keyed else sampling, draft_vocab)
    loop = _Loop(trunk, cache, drafter, sampling, processors, history, cache_step)
    health = health if health is not None else HeadHealth("given to decoding.generate")
    if health.parked:
        drafter.stop()

    # Prefill exactly as plain decoding chunks it: all but the last prompt token, then the last (or all in one).
    total, done, carry = prompt.size, 0, None
    callback(0, total)
    while total - done > 1 and not one_pass:
        chunk = prompt[done : done + min(prefill_step_size, total - done - 1)]
        carry = drafter.prefill(carry, trunk.hidden(chunk[None], cache), chunk)
        loop.after_pass()
        mx.eval([c.state for c in cache], head_cache.state if head_cache.offset else [])  # an empty cache: no state
        done += chunk.size
        callback(done, total)
    chunk = prompt[done:]
    hidden = trunk.hidden(chunk[None], cache)
    drafter.prefill(carry, hidden, chunk)
    first = loop.logprobs_at(trunk.trunk_logits(hidden[0, -1:]), chunk[-1:], history[:-1] if processors else None)
    loop.last = loop.pick(first)
    callback(total, total)
    drafter.keep(hidden[:, -1:], loop.last)

    n = emitted = accepted = 0

    def ask(block: int) -> int | None:
        """Depth of the cycle after a block of at least ``block`` tokens (the committed cache's step run
        first); None if that block ends generation."""
        span = loop.after_pass()
        if max_tokens >= 0 and n + block >= max_tokens:
            return None
        if drafter.stopped:
            return PLAIN
        d = policy.next_depth()
        if not 0 <= d <= MAX_DEPTH:
            raise ValueError(f"depth policy chose depth {d}; it must be 0..{MAX_DEPTH}")
        return d if span is None else min(d, span - 1)

    def queue(d: int | None):
        """What produces the next block, queued now: ``("plain", step)``, ``("cycle", started cycle)`` or None;
        and the seconds queueing took (part of that block's cost, not of the block being read)."""
        start = time.perf_counter()
        if d is None:
            return None, 0.0
        cycle = None if d == PLAIN or loop.uncaptured else loop.launch(d)
        queued = ("plain", loop.plain_step()) if cycle is None else ("cycle", cycle)
        return queued, time.perf_counter() - start

    # Each block's successor is queued before the block is yielded (and, after a plain step or the prompt
    # pass, before its token is read), as mlx-lm queues step t+1 before reading token t.
    kind, cycle, block_logprobs = "first", None, first
    following, launch = queue(ask(1))
    block = loop.last.tolist()
    clock = _Stopwatch()
    try:
        while True:
            for tok in block:
                if n == max_tokens:
                    return
                emitted, n = emitted + 1, n + 1  # counted before the yield: the consumer may stop there
                clock.pause()
                yield tok, block_logprobs[emitted - 1]
                clock.resume()
                if n == max_tokens:
                    return
            if kind == "cycle":
                stats.record(accepted, len(block), cycle.depth)
            elif kind == "plain":
                stats.plain += 1
            emitted = 0
            kind, item = following
            own_launch = launch
            if kind == "plain":
                loop.take_plain(item)
                block_logprobs = item[1]
                following, launch = queue(ask(1))
                block = loop.last.tolist()
                policy.observe(PLAIN, 0, clock.lap() - launch + own_launch)
                continue
            cycle = item
            accepted = cycle.accepted.item()
            if _parks(health, cycle.depth, accepted):
                drafter.stop()
            accepted = max(accepted, 0)
            block, block_logprobs = cycle.tokens[: accepted + 1].tolist(), cycle.logprobs
            loop.commit(cycle, accepted)
            following, launch = queue(ask(accepted + 1))
            policy.observe(cycle.depth, accepted, clock.lap() - launch + own_launch)
    finally:
        _settle(loop, kind, cycle, accepted, following, emitted, stats)


def _parks(health: HeadHealth, depth: int, outcome: int) -> bool:
    """Count a cycle's outcome (an accepted count or ``NONFINITE``) on ``health``; True when the head is parked."""
    if outcome == NONFINITE:
        health.nonfinite()
        return True
    return health.observe(depth, outcome)


def _settle(loop: _Loop, kind: str, cycle: _Cycle | None, accepted: int, following, emitted: int, stats) -> None:
    """Leave the trunk cache holding exactly the prompt and every yielded token, as plain decoding does.

    The block being yielded came from the prompt pass or a plain step (``kind`` "first" / "plain": one
    token) or from ``cycle``, committed to its first accepted+1 inputs; ``following`` (queued plain step,
    started cycle or None) has fed the block's last token to the trunk already.
    """
    if emitted == 0:  # raised between blocks: the previous block's last token is the cycle's first input
        if kind == "cycle":
            cycle.recorder.commit(loop.cache, 1)
            loop.after_pass()
            mx.eval([c.state for c in loop.cache])
        return
    if kind == "plain":
        stats.plain += 1
    elif kind == "cycle":
        stats.record(min(accepted, emitted), emitted, cycle.depth)
    if kind != "cycle" or emitted == accepted + 1:  # the newest token was yielded: it must be in the cache
        if following is None:
            loop.trunk.hidden(loop.last[None], loop.cache)
        elif following[0] == "cycle":
            following[1].recorder.commit(loop.cache, 1)
    else:  # stopped inside the accepted drafts: undo what the successor fed, roll back within the cycle
        if following is not None:
            fed = 1 if following[0] == "plain" else following[1].inputs.size
            for c in loop.cache:
                if id(c) not in cycle.recorder.layers and c.is_trimmable():
                    c.trim(fed)
        cycle.recorder.commit(loop.cache, emitted + 1)
    loop.after_pass()
    mx.eval([c.state for c in loop.cache])
