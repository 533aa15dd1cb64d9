"""The MTP decoding loop of one generation: draft, verify in one trunk pass, accept, roll back the rest. Greedy
output is the trunk's own; sampled output has its distribution (position-keyed draws, or exact speculative sampling:
Leviathan et al. 2023, Algorithm 1). Design: docs/decoding.md."""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

from ..head.health import HeadHealth
from . import rollback
from .controller import PLAIN, FixedDepth
from .drafter import Drafter, GrammarDraft
from .drafter import log_softmax as _log_softmax
from .grammar import Grammar, constrain, grammar_of
from .lockstep import NONE, Lockstep, LockstepError
from .lookup import LookupPolicy, new_prior
from .sampling import GumbelDraws
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


@dataclass(frozen=True)
class Sampling:
    """Temperature sampling exactly as the runtime's sampler does it.

    ``filters``: log-probs (…, V) → filtered log-probs (-inf where excluded), in the runtime sampler's order. ``keyed``:
    ``keyed(logprobs (k, V), first) -> tokens (k,)``, draws keyed by generated-token position (0: the first after the
    prompt): every emitted token is drawn with it and a draft accepted iff equal; None: exact speculative sampling.
    ``coupled``: the drafts draw with ``keyed`` too (``sampling.GumbelDraws``); False: the head's argmax.
    """

    temp: float
    filters: tuple[Callable[[mx.array], mx.array], ...] = ()
    keyed: Callable[[mx.array, int], mx.array] | None = None
    coupled: bool = False

    def with_coupling(self) -> Sampling:
        """This distribution by ``sampling.GumbelDraws`` shared with the drafts (tokens: seed and trunk only)."""
        return dataclasses.replace(self, keyed=GumbelDraws(self.temp, self.filters), coupled=True)

    def probs(self, logprobs: mx.array) -> mx.array:
        """Sampling distribution (…, V), float32: softmax(filters(logprobs) / temp)."""
        for f in self.filters:
            logprobs = f(logprobs)
        return mx.softmax(logprobs.astype(mx.float32) / self.temp, axis=-1)


def _categorical(probs: mx.array) -> mx.array:
    return mx.random.categorical(mx.log(probs))


def accept_greedy(logprobs: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array]:
    """Greedy acceptance of drafts (D,) against trunk log-probs (D+1, V): ``(accepted, block)``, the scalar count a
    of leading drafts equal to the argmax and the (D+1,) argmax tokens, whose first a+1 are emitted."""
    return accept_matching(mx.argmax(logprobs, axis=-1), drafts)


def accept_matching(targets: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array]:
    """Acceptance of drafts (D,) against tokens (D+1,) already chosen at the verified positions (argmax, or
    ``Sampling.keyed`` draws: exact, since they do not depend on the drafts); returns as ``accept_greedy``."""
    accepted = mx.cumprod(targets[:-1] == drafts).sum()
    return accepted, targets


def accept_sampled(p: mx.array, q: mx.array, drafts: mx.array,
                   finite: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """Exact speculative sampling (Leviathan et al. 2023, Algorithm 1) of drafts (D,) drawn from q (D, V)
    against p (D+1, V); ``finite`` False (head output not finite) rejects every draft, q taken as 0. Returns
    ``(accepted, block)``: the count a and (D+1,) tokens whose first a+1 are emitted: the drafts, then a sample of
    the residual norm(max(p − q, 0)) at the first rejection, or a bonus sample from p[D]."""
    ok, q = _draft_test(p[:-1], q, drafts, finite)
    accepted = mx.cumprod(ok).sum()
    fallback = _categorical(mx.concatenate([_residual(p[:-1], q), p[-1:]], axis=0))
    index = mx.arange(drafts.shape[0] + 1)
    block = mx.where(index < accepted, mx.concatenate([drafts, drafts[:1]]), fallback)
    return accepted, block


def accept_sampled_position(p: mx.array, q: mx.array, draft: mx.array,
                            finite: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """One position of ``accept_sampled`` (p, q (1, V), draft (1,)) for a pass read position by position
    (``Walk``): ``(ok, token)``, a scalar bool and (1,) the draft or a sample of the residual."""
    ok, q = _draft_test(p, q, draft, finite)
    return ok[0], mx.where(ok, draft, _categorical(_residual(p, q)))


def _draft_test(p: mx.array, q: mx.array, drafts: mx.array, finite: mx.array | None) -> tuple[mx.array, mx.array]:
    """Per draft (D,): u·q(d) < p(d), u uniform (False where not finite); and q with non-finite rows zeroed."""
    rows = mx.arange(drafts.shape[0])
    if finite is not None:
        q = mx.where(finite, q, 0.0)
    ok = mx.random.uniform(shape=drafts.shape) * q[rows, drafts] < p[rows, drafts]
    return (ok if finite is None else ok & finite), q


def _residual(p: mx.array, q: mx.array) -> mx.array:
    """The residual distribution norm(max(p − q, 0)) (…, V)."""
    residual = mx.maximum(p - q, 0.0)
    return residual / mx.maximum(residual.sum(axis=-1, keepdims=True), 1e-30)


NONFINITE = -1  # the accepted count read back for a cycle whose head output was not finite


def reject_nonfinite(accepted: mx.array, finite: mx.array) -> mx.array:
    """The cycle's outcome as one scalar for the host sync: ``accepted``, or ``NONFINITE`` where ``finite`` (from
    ``Drafter.draft``) is False; ``accepted`` must be 0 then (the accept test was given ``finite``)."""
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


class Walk:
    """A verify pass read one position at a time, so logits processors see exactly the calls plain decoding makes:
    position j (seeing ``history + inputs[:j+1]``) is processed only after ``read`` showed draft j accepted, one host
    read per position. ``inputs`` (S,): the newest token, then S - 1 drafts; ``q`` (S - 1, V): the head's distributions
    (exact sampling), else None; ``first``: position 0's index among the generated tokens (``Sampling.keyed``).
    """

    def __init__(self, logits: mx.array, inputs: mx.array, history: mx.array, processors, sampling: Sampling | None,
                 q: mx.array | None, finite: mx.array, first: int = 0):
        self.logits, self.inputs, self.history, self.processors = logits, inputs, history, processors
        self.sampling, self.q, self.finite, self.first = sampling, q, finite, first
        self.logprobs: list[mx.array] = []  # (V,) after the processors, per processed position
        self.tokens: list[mx.array] = []  # (1,) the token drawn at each processed position
        self.outcomes: list[mx.array] = []  # (3,) int32 per processed position: its token, its draft accepted, finite
        self.finite_read = True  # the head's output was finite, as the latest ``read`` showed

    def process(self) -> mx.array:
        """Call the processors at the next position and queue its token and acceptance; the outcome (3,) int32."""
        j = len(self.logprobs)
        seen = mx.concatenate([self.history, self.inputs[: j + 1]])
        row = self.logits[j : j + 1]
        for processor in self.processors:
            row = processor(seen, row)
        logprobs = _log_softmax(row)
        draft = self.inputs[j + 1 : j + 2]
        sampling = self.sampling
        if sampling is not None and sampling.keyed is None:
            p = sampling.probs(logprobs)
            if draft.size:
                ok, token = accept_sampled_position(p, self.q[j : j + 1], draft, self.finite)
            else:
                ok, token = mx.array(False), _categorical(p)  # the bonus token
        else:
            token = mx.argmax(logprobs, axis=-1) if sampling is None else sampling.keyed(logprobs, self.first + j)
            ok = (token[0] == draft[0]) & self.finite if draft.size else mx.array(False)
        outcome = mx.stack([token[0].astype(mx.int32), ok.astype(mx.int32), self.finite.astype(mx.int32)])
        self.logprobs.append(logprobs[0])
        self.tokens.append(token.astype(mx.uint32))
        self.outcomes.append(outcome)
        mx.async_eval(outcome, logprobs)
        return outcome

    def read(self) -> tuple[int, bool]:
        """``(token, accepted)`` of the latest processed position (one host read; sets ``finite_read``)."""
        token, ok, finite = self.outcomes[-1].tolist()
        self.finite_read = bool(finite)
        return token, bool(ok)


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


@dataclass
class _Cycle:
    """One queued cycle; with processors (``walk``) ``accepted`` is None and ``tokens`` set once the walk read them."""

    depth: int
    inputs: mx.array  # (d+1,): the newest token, then the drafts
    hidden: mx.array  # (1, d+1, H) trunk hidden states of ``inputs``
    logprobs: mx.array | list  # (d+1, V)
    accepted: mx.array | None  # scalar
    tokens: mx.array | None  # (d+1,): the first accepted+1 are emitted
    recorder: rollback.Recorder
    walk: Walk | None = None
    match: int = 0  # a lookup draft's match length (``lookup.ContextIndex``); 0: the head drafted
    forced: int = 0  # drafts a grammar forced
    masked: int = 0  # head drafts a grammar changed


class _Loop:
    """One generation's state: ``last`` (1,), fed first by the next pass; ``history``, what the processors saw;
    ``grammar``, which has consumed every committed token (and, during a cycle, its drafts)."""

    def __init__(self, trunk, cache, drafter, sampling, processors, history, cache_step=None,
                 grammar: Grammar | None = None):
        self.trunk, self.cache, self.drafter = trunk, cache, drafter
        self.sampling, self.processors = sampling, processors
        self.last, self.history = None, history
        self.cache_step = cache_step
        self.grammar = grammar
        self.uncaptured = False  # the capture points were found gone: plain steps only
        self.position = 0  # generated tokens drawn for good so far: the next one's position (``Sampling.keyed``)

    def set_last(self, token: mx.array) -> None:
        """``token`` (1,) becomes ``last``; the grammar consumes it (a host read) and commits."""
        self.last = token
        if self.grammar is not None:
            self.grammar.advance(token.tolist())
            self.grammar.commit()

    def after_pass(self) -> int | None:
        """Run the runtime's cache step on the committed cache; the most tokens the next pass may feed."""
        return None if self.cache_step is None else self.cache_step(self.cache)

    def logprobs_at(self, logits: mx.array, inputs: mx.array, past: mx.array | None) -> mx.array:
        """Log-probs (S, V) after the processors, position i seeing ``past`` + ``inputs[:i+1]``; under a grammar
        (no processors then) one position, masked by the grammar's current state."""
        if self.grammar is not None:
            logits = constrain(logits, self.grammar.allowed())
        return processed_logprobs(logits, inputs, past, self.processors)

    def pick(self, logprobs: mx.array) -> mx.array:
        """The next token (1,) from log-probs (1, V): argmax, the keyed draw, or a sample."""
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
        self.set_last(following)

    def launch(self, depth: int) -> _Cycle | None:
        """Queue a cycle at ``depth``: draft, verify ``[last, drafts…]``, accept. None, caches untouched, when the
        capture points were removed during the pass (``unpatch()`` on another thread): plain steps from then on."""
        if self.grammar is not None:  # drafted under the grammar, a host read per step; None: it allows no draft
            drafted = self.drafter.draft_under(self.grammar, depth, self.position)
            if not drafted.drafts:
                return None
            return self.verify(mx.concatenate(drafted.drafts), None, drafted.finite, drafted=drafted)
        drafts, q, finite = self.drafter.draft(depth, self.position)
        mx.async_eval(drafts)  # the head runs while the verify pass is built
        return self.verify(drafts, q, finite)

    def launch_lookup(self, drafts: list[int], match: int) -> _Cycle | None:
        """Queue a cycle verifying lookup ``drafts`` without the head (point-mass q when sampling); as ``launch``.
        Under a grammar they are cut at the first token it forbids (None when that is the first)."""
        allowed = None
        if self.grammar is not None:
            drafts = drafts[: self.grammar.valid_prefix(drafts)]
            if not drafts:
                return None
            allowed = self.grammar.walk(drafts)
        self.drafter.catch_up(len(drafts) + 1)
        drafted = None if allowed is None else GrammarDraft(allowed)
        return self.verify(mx.array(drafts, dtype=self.last.dtype), None, mx.array(True), match, drafted)

    def verify(self, drafts: mx.array, q: mx.array | None, finite: mx.array, match: int = 0,
               drafted: GrammarDraft | None = None) -> _Cycle | None:
        """Queue the verify pass of ``[last, drafts…]`` and its acceptance (q None: greedy or a point mass; ``drafted``:
        a grammar's masks per position, and the q of drafts made under it)."""
        depth = drafts.size
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
        logits = self.trunk.trunk_logits(hidden[0])
        if drafted is not None:
            logits = constrain(logits, mx.stack(drafted.allowed))
        if match and self.sampling is not None and self.sampling.keyed is None:
            q = (mx.arange(logits.shape[-1])[None] == drafts[:, None]).astype(mx.float32)  # point mass (D, V)
        elif drafted is not None and self.sampling is not None and self.sampling.keyed is None:
            q = drafted.q(logits.shape[-1])
        if self.processors:  # acceptance read position by position, as the block is yielded (``Walk``)
            walk = Walk(logits, inputs, self.history, self.processors, self.sampling, q, finite, self.position)
            mx.async_eval(logits)
            return _Cycle(depth, inputs, hidden, walk.logprobs, None, None, recorder, walk, match)
        logprobs = _log_softmax(logits)
        if self.sampling is None:
            accepted, tokens = accept_greedy(logprobs, drafts)
        elif self.sampling.keyed is not None:
            accepted, tokens = accept_matching(self.sampling.keyed(logprobs, self.position), drafts)
        else:
            accepted, tokens = accept_sampled(self.sampling.probs(logprobs), q, drafts, finite)
        accepted = reject_nonfinite(accepted, finite)  # greedy: tokens are the trunk's argmax either way
        mx.async_eval(accepted, tokens)
        counts = (0, 0) if drafted is None else (drafted.forced, drafted.masked)
        return _Cycle(depth, inputs, hidden, logprobs, accepted, tokens, recorder, None, match, *counts)

    def commit(self, cycle: _Cycle, accepted: int) -> None:
        """Keep ``inputs[:accepted+1]``: caches rolled back, the head given those pairs, ``last`` the next token."""
        cycle.recorder.commit(self.cache, accepted + 1)
        self.position += accepted + 1
        if cycle.match:  # the head drafted nothing: its cache has no draft rows to drop
            self.drafter.keep(cycle.hidden[:, : accepted + 1], cycle.tokens[: accepted + 1])
        else:
            self.drafter.accept(cycle.depth, cycle.hidden[:, : accepted + 1], cycle.tokens[: accepted + 1])
        if self.processors:
            self.history = mx.concatenate([self.history, cycle.inputs[: accepted + 1]])
        if self.grammar is not None:
            self.grammar.keep(accepted)  # it consumed the drafts
        self.set_last(cycle.tokens[accepted : accepted + 1])

    def feed_last(self) -> list[mx.array]:
        """Feed ``last`` to the trunk, plus the processors' call for it; the arrays to evaluate with the cache."""
        hidden = self.trunk.hidden(self.last[None], self.cache)
        if not self.processors:
            return []
        return [self.logprobs_at(self.trunk.trunk_logits(hidden[0]), self.last, self.history)]


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
    drafter = Drafter(head, trunk, head_cache, sampling, draft_vocab)
    drafter.bound(prompt.size - 1)
    loop = _Loop(trunk, cache, drafter, sampling, processors, history, cache_step, grammar)
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
    drafter.keep(hidden[:, -1:], loop.last)
    if lookup is not None:
        lookup.index.extend(prompt.tolist())

    n = emitted = accepted = 0
    row = RowState(lookup, MAX_DEPTH)
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
        question = row.ask(depth or 0, room, behind)
        if lockstep is not None:  # equal contexts, tokens left and options give equal proposals
            agreed = lockstep.agree(NONE if depth is None else depth, {
                "tokens emitted": n + block, "whether the generation ends": int(depth is None),
                "the tokens left to generate": max_tokens - n - block if max_tokens >= 0 else -1,
                "whether the head drafts": int(not (drafter.stopped or loop.uncaptured)),
                "the lookup proposal's length": len(question.proposal)})
            if agreed != (NONE if depth is None else depth):
                depth = None if agreed == NONE else agreed
                question = row.ask(depth or 0, room, behind)
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
            cycle = loop.launch_lookup(list(decision.lookup), decision.match)
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
                row.observe(0, 0, 0)
                if lookup is not None:
                    lookup.index.extend(block)
                continue
            cycle = item
            if cycle.walk is None:
                outcome = cycle.accepted.item()
            else:  # processors: the accepted drafts are read and yielded one by one, the block's last token below
                walk, following = cycle.walk, None
                walk.process()  # position 0: the processors' call for the previous block's last token
                token, ok = walk.read()
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
                outcome = emitted if walk.finite_read else NONFINITE
                cycle.tokens = mx.concatenate(walk.tokens)
            if not cycle.match and _parks(health, cycle.depth, outcome):
                drafter.stop()
            accepted = max(outcome, 0)
            committed = cycle.tokens[: accepted + 1].tolist()
            block, block_logprobs = committed[emitted:], cycle.logprobs
            loop.commit(cycle, accepted)
            if lookup is not None:
                lookup.index.extend(committed)
            following, launch = queue(ask(accepted + 1 - emitted))
            seconds = clock.lap() - launch + own_launch
            row.observe(cycle.depth, cycle.match, accepted)
            if cycle.match:  # a lookup cycle: no head steps, the verify pass's cost alone
                scheduler.observe(1, cycle.depth + 1, seconds)
            else:
                scheduler.observe(1, None, seconds, policy, [(cycle.depth, accepted)])
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


def _record(stats: MTPStats, cycle: _Cycle, accepted: int, emitted: int) -> None:
    """Count a cycle on ``stats``: a head cycle by its depth, a lookup cycle apart; a grammar's forced and masked
    drafts."""
    if cycle.match:
        stats.record_lookup(accepted, emitted, cycle.depth)
    else:
        stats.record(accepted, emitted, cycle.depth)
    stats.forced, stats.masked = stats.forced + cycle.forced, stats.masked + cycle.masked


def _parks(health: HeadHealth, depth: int, outcome: int) -> bool:
    """Count a cycle's outcome (an accepted count or ``NONFINITE``) on ``health``; True when the head is parked."""
    if outcome == NONFINITE:
        health.nonfinite()
        return True
    return health.observe(depth, outcome)


def _close_cache(loop: _Loop, source: Block, cycle: _Cycle | None, accepted: int, following, emitted: int,
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
            if following[1].walk is not None:
                pending = [following[1].walk.process()]
    else:  # stopped inside the accepted drafts: undo what the successor fed, roll back within the cycle
        if following is not None:
            fed = 1 if following[0] is Block.PLAIN else following[1].inputs.size
            for c in loop.cache:
                if id(c) not in cycle.recorder.layers and c.is_trimmable():
                    c.trim(fed)
        cycle.recorder.commit(loop.cache, emitted + 1)
    loop.after_pass()
    mx.eval([c.state for c in loop.cache], pending)
