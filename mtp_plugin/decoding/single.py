"""The MTP decoding loop of one generation (mlx-lm's ``generate_step`` contract): the prompt pass, then cycles run as a
one-row batch's (``batch.BatchDrafter``: draft, verify in one trunk pass, accept, roll back the rest) or plain steps
pipelined as mlx-lm's; tokens are yielded one at a time and the caches left as plain decoding leaves them wherever the
consumer stops. Greedy output is the trunk's own; sampled output has its distribution (position-keyed draws, or exact
speculative sampling: Leviathan et al. 2023, Algorithm 1). Design: docs/decoding.md."""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Generator, Sequence
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

from ..head.health import HeadHealth
from . import rollback
from .acceptance import NONFINITE, categorical, processed_logprobs
from .batch import BatchDrafter, Launched, Row, Verified
from .controller import PLAIN, FixedDepth
from .drafter import Drafter
from .grammar import constrain, grammar_of
from .lockstep import NONE, Lockstep, LockstepError
from .lookup import LookupPolicy, new_prior
from .sampling import Sampling
from .scheduler import Decision, RowState, Scheduler
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
        """Head inputs for the pairs (h[start+i], x[start+i+1]) of tokens (S,), positions counted from the
        prompt's first token: embeddings (1, S, H) and the positions its layer takes (None: its cache offset)."""

    def logits(self, hidden: mx.array) -> mx.array:
        """Vocabulary logits (…, V) of head outputs (…, H) (the head applies its own final norm)."""

    def trunk_logits(self, hidden: mx.array) -> mx.array:
        """The trunk's own logits (…, V) from ``hidden``'s output (…, H) (``pre_norm``: final norm first)."""


class DepthPolicy(Protocol):
    """Chooses each cycle's draft depth (``controller.DepthController``, ``controller.FixedDepth``). Asked once
    per cycle and told of every cycle run, in order; a question may come before the previous cycle is reported, and a
    generation's last question goes unreported when the consumer stops before that cycle's tokens."""

    def next_depth(self) -> int:
        """Draft depth of the next cycle, 1..8, or 0 (``controller.PLAIN``) for one plain decoding step."""

    def observe(self, depth: int, accepted: int, seconds: float) -> None:
        """The cycle that ran: its depth (0: plain step), drafts accepted, seconds spent in the loop."""


class Block(enum.Enum):
    """What produced the block of tokens being yielded (and what a queued successor is)."""

    PROMPT = "the prompt pass"
    PLAIN = "a plain trunk step"
    CYCLE = "a draft-and-verify cycle"


class _Stopwatch:
    """Seconds spent inside the loop, excluding the consumer's time between yields."""

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


class _Loop:
    """One generation's state: ``last`` (1,), fed first by the next pass; ``row``, the stream as a cycle's row
    (``batch.Row``): its sampling, processors and their ``history``, ``grammar`` (which has consumed every committed
    token and, during a cycle, its drafts), ``position``; its pending pairs are the drafter's. Cycles run through
    ``cycles`` (``batch.BatchDrafter``) with the drafter as the row's head."""

    def __init__(self, trunk, cache, drafter: Drafter, cycles: BatchDrafter, row: Row, cache_step=None):
        self.trunk, self.cache, self.drafter, self.cycles, self.row = trunk, cache, drafter, cycles, row
        self.last = None
        self.cache_step = cache_step
        self.uncaptured = False  # the capture points were found gone: plain steps only

    def set_last(self, token: mx.array) -> None:
        """``token`` (1,) becomes ``last``; the grammar consumes it (a host read) and commits."""
        self.last = token
        if self.row.grammar is not None:
            self.row.grammar.advance(token.tolist())
            self.row.grammar.commit()

    def after_pass(self) -> int | None:
        """Run the runtime's cache step on the committed cache; the most tokens the next pass may feed."""
        return None if self.cache_step is None else self.cache_step(self.cache)

    def logprobs_at(self, logits: mx.array, inputs: mx.array, past: mx.array | None) -> mx.array:
        """Log-probs (S, V) after the processors, position i seeing ``past`` + ``inputs[:i+1]``; under a grammar
        (no processors then) one position, masked by the grammar's current state."""
        if self.row.grammar is not None:
            logits = constrain(logits, self.row.grammar.allowed())
        return processed_logprobs(logits, inputs, past, self.row.processors)

    def pick(self, logprobs: mx.array) -> mx.array:
        """The first token (1,) from the prompt pass's log-probs (1, V) (``BatchDrafter.pick``)."""
        token = self.cycles.pick(self.row, logprobs)
        self.row.position += 1
        return token

    def plain_step(self) -> tuple[mx.array, mx.array, mx.array]:
        """Queue one plain step on ``last`` (``BatchDrafter.plain``): its hidden state (1, 1, H), log-probs (1, V),
        next token (1,)."""
        step = self.cycles.plain([self.row], self.cache, self.last)
        return step.hidden, step.logprobs, step.tokens

    def take_plain(self, step) -> None:
        """A plain step's token becomes ``last``; its pair is kept for the head."""
        hidden, _, following = step
        self.drafter.keep(self.row, hidden, following)
        self.set_last(following)

    def launch(self, depth: int = 0, lookup: tuple[list[int], int] | None = None) -> Launched | None:
        """Queue a cycle (``BatchDrafter.launch``): ``depth`` head drafts, or ``lookup`` (drafts, match) verified
        without the head. None, caches untouched, when there is no draft to verify (a grammar that allows none) or
        when the capture points were removed during the pass (``unpatch()`` on another thread): plain steps from
        then on."""
        self.row.last = self.last  # read later: the cycle is queued first, as mlx-lm queues step t+1 before token t
        try:
            return self.cycles.launch([self.row], self.cache, self.drafter, [depth], [lookup], walk_first=False,
                                      drafts_only=True)
        except rollback.CaptureMissed:
            self.uncaptured = True
            log.warning("mtp_plugin: the runtime was unpatched during this generation; it goes on with plain "
                        "decoding steps (the same tokens).")
            return None

    def commit(self, cycle: Launched, verified: Verified, accepted: int) -> None:
        """Keep ``inputs[:accepted+1]``: caches rolled back, the head given those pairs, ``last`` the next token."""
        cycle.recorder.commit(self.cache, accepted + 1)
        self.cycles.commit([self.row], self.drafter, verified, [accepted + 1])
        self.last = mx.array([self.row.last], dtype=mx.uint32)

    def feed_last(self) -> list[mx.array]:
        """Feed ``last`` to the trunk, plus the processors' call for it; the arrays to evaluate with the cache."""
        hidden = self.trunk.hidden(self.last[None], self.cache)
        if not self.row.processors:
            return []
        return [self.logprobs_at(self.trunk.trunk_logits(hidden[0]), self.last, self.row.history)]


def generate(
    prompt: mx.array,
    trunk: Trunk,
    head: nn.Module | None,
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
    cut_window: bool = True,
    stats: MTPStats | None = None,
    health: HeadHealth | None = None,
    cache_step: Callable[[list], int | None] | None = None,
    draft_vocab=None,
    lockstep: Lockstep | None = None,
    lookup: LookupPolicy | None = None,
    scheduler: Scheduler | None = None,
) -> Generator[tuple[int, mx.array], None, None]:
    """Generate tokens with the head drafting and the trunk verifying (mlx-lm ``generate_step`` contract).

    Yields ``(token, logprobs)``: the token id and the trunk's log-probs (V,) at its position. A policy's depth 0 is one
    plain step, pipelined as mlx-lm's.

    Args:
        head: the MTP head, or None (lookup drafts only).
        cache: the trunk's per-layer caches, updated in place; once the generator ends or is closed they hold the
            prompt and every yielded token, as plain decoding leaves them.
        head_cache: an empty trimmable KV cache for the head (None without a head).
        depth: a fixed draft depth 1..8, or a ``DepthPolicy`` choosing it per cycle.
        max_tokens: -1: no limit.
        logits_processors: mlx-lm style ``processor(tokens, logits) -> logits``; one ``grammar.GrammarProcessor``
            alone is a grammar the drafts are made under (``grammar.grammar_of``).
        prefill_history: the processors see the whole prompt (mlx-lm ≥ 0.32); False: only its last token.
        one_pass: feed the prompt in one trunk pass, as mlx-vlm 0.6 does; else all but its last token, then the last.
        cut_window: cut the prompt pass where the head's window starts (``Drafter.split``); False where a runtime's
            passes must keep its own chunks (mlx-vlm).
        health: the head's ``head.health.HeadHealth``, which parks it on a non-finite output or too little acceptance.
        cache_step: the runtime's per-step cache hook (mlx-lm: KV quantization), run after each committed pass; it
            returns the most tokens the next pass may feed (None: no limit), which caps the depth.
        draft_vocab: a ``head.draft_vocab.DraftVocabulary``: drafts from its subset only.
        lockstep: the ranks of a sharded trunk (rank 0 decides the depth); None on one process.
        lookup: a fresh ``lookup.LookupPolicy`` (context drafts the scheduler finds worth a pass); None: none.
        scheduler: the model's ``scheduler.Scheduler`` (``state.state_of``), which decides each cycle; None: a fresh one
            with a cost prior of 1 + (k − 1).

    Raises:
        ValueError: a fixed depth outside 1..8, a policy's depth outside 0..8, an empty prompt, or no head nor lookup.
        rollback.RollbackError: a cache that can neither be trimmed nor rolled back.
        lockstep.LockstepError: the ranks disagree (on every rank; the caches are left as they are).
    """
    if isinstance(depth, int) and not 1 <= depth <= MAX_DEPTH:
        raise ValueError(f"draft depth must be 1..{MAX_DEPTH}, got {depth}")
    if prompt.size == 0:
        raise ValueError("MTP decoding needs at least one prompt token")
    if head is None and lookup is None:
        raise ValueError("decoding without a head needs lookup drafts (lookup=LookupPolicy())")
    policy = FixedDepth(depth) if isinstance(depth, int) else depth
    if lockstep is not None and sampling is not None:
        lockstep.share_seed()
    stats = stats if stats is not None else MTPStats(depth if isinstance(depth, int) else None)
    grammar, processors = grammar_of(logits_processors)
    callback = prompt_progress_callback or (lambda *_: None)
    history = (prompt if prefill_history else prompt[-1:]) if processors else None
    drafter = Drafter(head, trunk, head_cache)
    drafter.bound(prompt.size - 1)
    cycles = BatchDrafter(trunk, head)
    cycles.vocab = draft_vocab
    exact = sampling is not None and sampling.keyed is None  # a plain token is a sample of its distribution
    row = Row(0, pending=drafter.pending, sampling=sampling, processors=processors, history=history, grammar=grammar,
              schedule=RowState(lookup, MAX_DEPTH), sampler=(lambda lp: categorical(sampling.probs(lp))) if exact
              else None)
    loop = _Loop(trunk, cache, drafter, cycles, row, cache_step)
    health = health if health is not None else HeadHealth("given to single.generate")
    if health.parked:
        drafter.stop()

    # Prefill as plain decoding chunks it (all but the last prompt token, then the last, or all in one), a chunk cut
    # where the head's window starts; not under KV quantization (each pass's end may switch it on) nor where the
    # runtime asks for its own chunks (``cut_window``).
    total, done, carry = prompt.size, 0, None
    callback(0, total)
    while total - done > 1 and not one_pass:
        chunk = prompt[done : done + min(prefill_step_size, total - done - 1)]
        if cut_window and cache_step is None:
            chunk = chunk[: drafter.split(chunk.size, carry is not None)]
        carry = drafter.prefill(carry, trunk.hidden(chunk[None], cache), chunk)
        loop.after_pass()
        mx.eval([c.state for c in cache])  # the head's prefill stays queued: the first token does not wait for it
        done += chunk.size
        callback(done, total)
    chunk = prompt[done:]
    hidden = trunk.hidden(chunk[None], cache)
    drafter.prefill(carry, hidden, chunk)
    first = loop.logprobs_at(trunk.trunk_logits(hidden[0, -1:]), chunk[-1:], history[:-1] if processors else None)
    loop.set_last(loop.pick(first))
    callback(total, total)
    drafter.keep(row, hidden[:, -1:], loop.last)
    if lookup is not None:
        lookup.index.extend(prompt.tolist())

    n = emitted = accepted = 0
    schedule = row.schedule
    scheduler = scheduler if scheduler is not None else Scheduler(1.0, new_prior())
    # clocks decide only where the tokens do not depend on the drafts (greedy, keyed draws) and ranks need not agree
    measured = (sampling is None or sampling.keyed is not None) and lockstep is None
    held = None  # the policy's depth, asked for a cycle that drafted from the context instead

    def ask(block: int, behind: bool = False) -> Decision | None:
        """The scheduler's decision for what follows a block of at least ``block`` tokens, or None if it ends the
        generation; ``behind``: the block's token is not read yet. Ranks in lockstep take rank 0's head depth."""
        nonlocal held
        span = loop.after_pass()
        room = max_tokens - n - block - 1 if max_tokens >= 0 else None  # drafts that could still be emitted
        if span is not None:
            room = span - 1 if room is None else min(room, span - 1)
        room = 0 if loop.uncaptured else room
        depth = None  # None: the block ends generation
        if max_tokens < 0 or n + block < max_tokens:
            depth = PLAIN
            if not (drafter.stopped or loop.uncaptured):
                if held is None:  # the policy is asked once for each depth that runs
                    held = scheduler.next_depth(policy)
                depth = held if span is None else min(held, span - 1)
        question = schedule.ask(depth or 0, room, behind)
        if lockstep is not None:  # equal contexts, tokens left and options give equal proposals
            agreed = lockstep.agree(NONE if depth is None else depth, {
                "tokens emitted": n + block, "whether the generation ends": int(depth is None),
                "the tokens left to generate": max_tokens - n - block if max_tokens >= 0 else -1,
                "whether the head drafts": int(not (drafter.stopped or loop.uncaptured)),
                "the lookup proposal's length": len(question.proposal)})
            if agreed != (NONE if depth is None else depth):
                depth = None if agreed == NONE else agreed
                question = schedule.ask(depth or 0, room, behind)
        if depth is None:
            return None
        decision = scheduler.decide([question], [lookup], measured)[0]
        if not decision.lookup:
            held = None
            if question.proposal and not decision.drafts:
                stats.decline_lookup(scheduler.price(1, measured, [lookup])(2), question.lookup[1])
        return decision

    def queue(decision: Decision | None):
        """Queue the next block's producer: ``(Block, step or cycle)`` or None, and the seconds queueing took."""
        start = time.perf_counter()
        if decision is None:
            return None, 0.0
        if decision.lookup:
            cycle = loop.launch(lookup=(list(decision.lookup), decision.match))
        else:
            cycle = None if decision.drafts == 0 else loop.launch(decision.drafts)
        queued = (Block.PLAIN, loop.plain_step()) if cycle is None else (Block.CYCLE, cycle)
        return queued, time.perf_counter() - start

    # Each block's successor is queued before the block is yielded (and, after a plain step or the prompt
    # pass, before its token is read), as mlx-lm queues step t+1 before reading token t.
    source, cycle, block_logprobs = Block.PROMPT, None, first
    diverged = False
    decision = ask(1, behind=True)
    if decision is not None and drafter.first:  # a long prompt: the head's pairs run behind the first token
        decision = Decision()
    following, launch = queue(decision)
    block = loop.last.tolist()
    if lookup is not None:
        lookup.index.extend(block)
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
            if source is Block.CYCLE:
                _record(stats, cycle, accepted, emitted)
            elif source is Block.PLAIN:
                stats.plain += 1
            if grammar is not None:
                stats.grammar_seconds = grammar.seconds
            emitted = 0
            source, item = following
            own_launch = launch
            if source is Block.PLAIN:
                loop.take_plain(item)
                block_logprobs = item[1]
                following, launch = queue(ask(1, behind=True))
                block = loop.last.tolist()
                seconds = clock.lap() - launch + own_launch
                scheduler.observe(1, 1, seconds, policy, [(PLAIN, 0)])
                schedule.observe(0, 0, 0)
                if lookup is not None:
                    lookup.index.extend(block)
                continue
            cycle, walked = item, None
            depth, match = cycle.depths[0], cycle.matches[0]
            walk = cycle.walks.get(0)
            if walk is not None:  # processors: the accepted drafts are read and yielded one by one, the last below
                following = None
                walk.process()  # position 0: the processors' call for the previous block's last token
                token, ok = walk.read()
                read = [token]
                while ok:  # an accepted draft: their call for it (the pass's next position) comes before its yield
                    walk.process()
                    emitted, n = emitted + 1, n + 1
                    accepted = emitted  # what ``_close_cache`` keeps if the consumer stops here
                    clock.pause()
                    yield token, walk.logprobs[emitted - 1]
                    clock.resume()
                    if n == max_tokens:
                        return
                    token, ok = walk.read()
                    read.append(token)
                walked = {0: (read, emitted if walk.finite_read else NONFINITE)}
            verified = loop.cycles.read(cycle, walked=walked)
            accepted = verified.accepted[0]
            if not match and _parks(health, depth, NONFINITE if verified.nonfinite else accepted):
                drafter.stop()
            committed = verified.blocks[0]
            block, block_logprobs = committed[emitted:], verified.logprobs[0]
            loop.commit(cycle, verified, accepted)
            if lookup is not None:
                lookup.index.extend(committed)
            following, launch = queue(ask(accepted + 1 - emitted))
            seconds = clock.lap() - launch + own_launch
            schedule.observe(depth, match, accepted)
            if match:  # a lookup cycle: no head steps, the verify pass's cost alone
                scheduler.observe(1, depth + 1, seconds)
            else:
                scheduler.observe(1, None, seconds, policy, [(depth, accepted)])
    except LockstepError:
        diverged = True  # the ranks no longer match: their caches are left as they are
        raise
    finally:
        if not diverged:
            _close_cache(loop, source, cycle, accepted, following, emitted, stats)
        if sampling is not None and sampling.coupled:  # as the runtime's loop: a draw per token, one queued ahead
            sampling.keyed.release(n + 1)
        if grammar is not None:
            stats.grammar_seconds = grammar.seconds


def _record(stats: MTPStats, cycle: Launched, accepted: int, emitted: int) -> None:
    """Count a cycle on ``stats``: a head cycle by its depth, a lookup cycle apart; a grammar's forced and masked
    drafts."""
    if cycle.matches[0]:
        stats.record_lookup(accepted, emitted, cycle.depths[0])
    else:
        stats.record(accepted, emitted, cycle.depths[0])
    stats.forced, stats.masked = stats.forced + cycle.forced[0], stats.masked + cycle.masked[0]


def _parks(health: HeadHealth, depth: int, outcome: int) -> bool:
    """Count a cycle's outcome (an accepted count or ``NONFINITE``) on ``health``; True when the head is parked."""
    if outcome == NONFINITE:
        health.nonfinite()
        return True
    return health.observe(depth, outcome)


def _close_cache(loop: _Loop, source: Block, cycle: Launched | None, accepted: int, following, emitted: int,
                 stats) -> None:
    """Leave the trunk cache holding the prompt and every yielded token, as plain decoding does; ``following``
    (queued plain step, started cycle or None) has already fed the block's last token."""
    if emitted == 0:  # raised between blocks: the previous block's last token is the cycle's first input
        if source is Block.CYCLE:
            cycle.recorder.commit(loop.cache, 1)
            loop.after_pass()
            mx.eval([c.state for c in loop.cache])
        return
    if source is Block.PLAIN:
        stats.plain += 1
    elif source is Block.CYCLE:
        _record(stats, cycle, min(accepted, emitted), emitted)
    pending = []  # the processors' call for the newest yielded token, where it was not made yet
    if source is not Block.CYCLE or emitted == accepted + 1:  # the newest token was yielded: it must be in the cache
        if following is None:
            pending = loop.feed_last()
        elif following[0] is Block.CYCLE:
            following[1].recorder.commit(loop.cache, 1)
            if 0 in following[1].walks:
                pending = [following[1].walks[0].process()]
    else:  # stopped inside the accepted drafts: undo what the successor fed, roll back within the cycle
        if following is not None:
            fed = 1 if following[0] is Block.PLAIN else following[1].inputs.size
            for c in loop.cache:
                if id(c) not in cycle.recorder.layers and c.is_trimmable():
                    c.trim(fed)
        cycle.recorder.commit(loop.cache, emitted + 1)
    loop.after_pass()
    mx.eval([c.state for c in loop.cache], pending)
