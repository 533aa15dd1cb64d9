"""The MTP decoding loop of one generation: draft, verify in one trunk pass, accept, commit (roll back the rest).

Greedy output is the trunk's own, token for token. Sampled output has the trunk's distribution after the runtime's
logits processors and sampler filters: position-keyed draws that the drafts share (``Sampling.keyed``: a seed fixes
the tokens whatever is drafted), or exact speculative sampling (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding", Algorithm 1; Chen et al. 2023). What each cycle drafts (the
head at a depth, the context, or a plain step) is the scheduler's decision (``scheduler.plan``); a head whose output
is not finite, or that accepts almost nothing, is parked (``health.HeadHealth``). One host synchronisation per cycle
(per position with logits processors: ``Walk``), and each block's successor is queued before the block is yielded,
as in mlx-lm's own loop. How and why: docs/decoding.md.
"""

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
from .drafter import Drafter
from .drafter import log_softmax as _log_softmax
from .lockstep import NONE, Lockstep, LockstepError
from .lookup import LookupPolicy
from .sampling import GumbelDraws
from .scheduler import CostModel, Decision, RowState, plan, pricing
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
        keyed: draws keyed by each token's position (mlx-vlm's seeded sampler, or ``coupling.GumbelDraws``):
            ``keyed(logprobs (k, V), first) -> tokens (k,)`` for the generated
            tokens ``first .. first+k-1`` (0: the first token after the prompt). The loop then draws every
            emitted token with it and accepts a draft iff it equals that token (``accept_matching``), so a
            seed gives the runtime's own tokens at any depth; None: exact speculative sampling.
        coupled: the drafts draw with ``keyed`` too, each at the position it would take (``coupling.GumbelDraws``);
            False: with ``keyed``, the head's argmax.
    """

    temp: float
    filters: tuple[Callable[[mx.array], mx.array], ...] = ()
    keyed: Callable[[mx.array, int], mx.array] | None = None
    coupled: bool = False

    def with_coupling(self) -> Sampling:
        """This distribution drawn by position-keyed Gumbel-max draws (``coupling.GumbelDraws``) that the drafts
        share: the tokens depend on the seed and the trunk only."""
        return dataclasses.replace(self, keyed=GumbelDraws(self.temp, self.filters), coupled=True)

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
    ok, q = _draft_test(p[:-1], q, drafts, finite)
    accepted = mx.cumprod(ok).sum()
    fallback = _categorical(mx.concatenate([_residual(p[:-1], q), p[-1:]], axis=0))
    index = mx.arange(drafts.shape[0] + 1)
    block = mx.where(index < accepted, mx.concatenate([drafts, drafts[:1]]), fallback)
    return accepted, block


def accept_sampled_position(p: mx.array, q: mx.array, draft: mx.array,
                            finite: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """One position of exact speculative sampling (Leviathan et al. 2023, Algorithm 1, one step), for a verify
    pass read position by position (``Walk``): the same test and residual as ``accept_sampled``.

    Args:
        p: trunk sampling distribution (1, V) at the position.
        q: head distribution (1, V) the draft was drawn from.
        draft: the draft token (1,) that follows the position.
        finite: as for ``accept_sampled``.

    Returns:
        ``(ok, token)``: scalar bool, the draft accepted; token (1,): the draft, or a sample of the residual
        max(p − q, 0).
    """
    ok, q = _draft_test(p, q, draft, finite)
    return ok[0], mx.where(ok, draft, _categorical(_residual(p, q)))


def _draft_test(p: mx.array, q: mx.array, drafts: mx.array, finite: mx.array | None) -> tuple[mx.array, mx.array]:
    """Per draft (D,), whether it passes u·q(d) < p(d) (u uniform; False for a head output that is not finite), and
    q with a non-finite head's rows zeroed (so NaN never reaches the test or the residual). p, q: (D, V)."""
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


class Walk:
    """A verify pass read one position at a time, so that logits processors see exactly what they see in plain
    decoding.

    Plain decoding calls the processors once per token it feeds the trunk, with every token up to that one (mlx-lm's
    ``generate_step``, its batched ``GenerationBatch`` and mlx-vlm's ``generate_step``). A verify pass feeds
    ``[last, d1 … dD]``; position j's call sees ``history + inputs[:j+1]``, a sequence plain decoding produces only
    when d1 … dj are all accepted, which depends on the processed log-probs of positions 0 … j-1. So position j is
    processed (``process``) only after ``read`` has shown draft j accepted, and only when the caller needs it: for
    the token at position j, or as the call for draft j itself once it is emitted (plain decoding makes the call for
    a token before yielding it, by queueing the step after it). A rejected draft never reaches a processor, nor does
    any position after the generation's end. One host read per processed position (only with processors).

    Args:
        logits: the trunk's logits (S, V) at the verified positions.
        inputs: the verified inputs (S,): the newest token, then S - 1 drafts.
        history: the tokens (N,) the processors have seen before ``inputs``.
        processors: mlx-lm style ``processor(tokens, logits) -> logits``.
        sampling: None for greedy, else the ``Sampling``.
        q: the head's distributions (S - 1, V) the drafts were drawn from (exact sampling), else None.
        finite: scalar bool, False when the head's output was not finite (every draft rejected).
        first: the index of position 0's token among the generated tokens (``Sampling.keyed``).
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
        """Call the processors at the next position j and queue its token and whether draft j+1 is accepted;
        the outcome (3,) (evaluated asynchronously)."""
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
        """``(token, accepted)`` of the latest processed position: its token id, and whether it equals the draft
        that follows it (that draft is accepted; False at the last position). One host read; it sets ``finite_read``."""
        token, ok, finite = self.outcomes[-1].tolist()
        self.finite_read = bool(finite)
        return token, bool(ok)


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


class Block(enum.Enum):
    """What produced the block of tokens being yielded (and what a queued successor is)."""

    PROMPT = "the prompt pass"
    PLAIN = "a plain trunk step"
    CYCLE = "a draft-and-verify cycle"


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
    """One queued cycle: its drafts, verify pass and acceptance (read once computed).

    With logits processors the acceptance is read position by position (``walk``): ``accepted`` is then None,
    ``logprobs`` the walk's list of processed positions, and ``tokens`` is set once the walk has read the block.
    """

    depth: int
    inputs: mx.array  # (d+1,): the newest token, then the drafts
    hidden: mx.array  # (1, d+1, H) trunk hidden states of ``inputs``
    logprobs: mx.array | list  # (d+1, V)
    accepted: mx.array | None  # scalar
    tokens: mx.array | None  # (d+1,): the first accepted+1 are emitted
    recorder: rollback.Recorder
    walk: Walk | None = None
    match: int = 0  # a lookup draft's match length (``lookup.ContextIndex``); 0: the head drafted


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
        drafts, q, finite = self.drafter.draft(depth, self.position)
        mx.async_eval(drafts)  # the head runs while the verify pass is built
        return self.verify(drafts, q, finite)

    def launch_lookup(self, drafts: list[int], match: int) -> _Cycle | None:
        """Queue a cycle verifying lookup ``drafts`` (token ids from ``lookup.ContextIndex``, found by a match of
        ``match`` tokens), a point-mass proposal: when sampling, q is one-hot at each draft, so exact speculative
        sampling accepts draft d with probability p(d) and its residual is p without d, renormalised. The head does
        not run (its kept pairs are fed first if they would overflow its window: ``Drafter.catch_up``); None as for
        ``launch``."""
        self.drafter.catch_up(len(drafts) + 1)
        return self.verify(mx.array(drafts, dtype=self.last.dtype), None, mx.array(True), match)

    def verify(self, drafts: mx.array, q: mx.array | None, finite: mx.array, match: int = 0) -> _Cycle | None:
        """Queue the verify pass of ``[last, drafts…]`` (drafts (D,); q (D, V) the head's distributions when sampling,
        None for a point-mass proposal or greedy; ``finite`` scalar bool) and its acceptance; ``match`` as
        ``_Cycle.match``. None as for ``launch``."""
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
        if match and self.sampling is not None and self.sampling.keyed is None:
            q = (mx.arange(logits.shape[-1])[None] == drafts[:, None]).astype(mx.float32)  # point mass (D, V)
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
        return _Cycle(depth, inputs, hidden, logprobs, accepted, tokens, recorder, match=match)

    def commit(self, cycle: _Cycle, accepted: int) -> None:
        """Keep the verified prefix: caches rolled back to ``inputs[:accepted+1]``, the head given the
        accepted pairs, ``last`` the cycle's correction or bonus token."""
        cycle.recorder.commit(self.cache, accepted + 1)
        self.position += accepted + 1
        if cycle.match:  # the head drafted nothing: its cache has no draft rows to drop
            self.drafter.keep(cycle.hidden[:, : accepted + 1], cycle.tokens[: accepted + 1])
        else:
            self.drafter.accept(cycle.depth, cycle.hidden[:, : accepted + 1], cycle.tokens[: accepted + 1])
        if self.processors:
            self.history = mx.concatenate([self.history, cycle.inputs[: accepted + 1]])
        self.last = cycle.tokens[accepted : accepted + 1]

    def feed_last(self) -> list[mx.array]:
        """Feed ``last`` to the trunk (its cache then holds every yielded token, as plain decoding leaves it); with
        processors, also their call for it (plain decoding computes the step after the last token it yields). The
        arrays to evaluate with the cache."""
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
    stats: MTPStats | None = None,
    health: HeadHealth | None = None,
    cache_step: Callable[[list], int | None] | None = None,
    draft_vocab=None,
    lockstep: Lockstep | None = None,
    lookup: LookupPolicy | None = None,
    costs: CostModel | None = None,
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
        head: the loaded MTP head module, or None for a model without one (then only ``lookup`` drafts).
        cache: the trunk's per-layer caches (updated in place; after the generator ends or is closed
            it holds the prompt and every yielded token, as plain decoding leaves it).
        head_cache: an empty trimmable KV cache for the head (None without a head).
        depth: a fixed draft depth d, 1 ≤ d ≤ 8, or a policy choosing it per cycle (adaptive depth).
        max_tokens: tokens to generate (-1: no limit).
        sampling: None for greedy, else the runtime sampler's temperature and filters.
        logits_processors: mlx-lm style ``processor(tokens, logits) -> logits``, called as plain decoding calls
            them (``Walk``).
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
        lockstep: for a trunk sharded over ranks (``lockstep.group_of``), the ranks' shared decisions: each cycle's
            depth is rank 0's, the ranks' states are checked before every cycle is queued, and the random state is
            shared at the start of a sampled generation; None on one process.
        lookup: drafts from the context as well (``lookup.LookupPolicy``, a fresh one per generation): before each
            cycle, a lookup draft the scheduler finds worth its verify pass (``scheduler.plan``) replaces the head's
            draft or the plain step, verified and accepted by the same rules (a point-mass proposal when sampling);
            None: the head only.
        costs: the model's ``scheduler.CostModel`` of one-row passes, fed this generation's plain steps and lookup
            cycles (measured costs decide greedy and keyed generations on one process); None: a prior of
            1 + (k − 1).

    Yields:
        ``(token, logprobs)``: token id (int) and the trunk's log-probs (V,) at its position.

    Raises:
        ValueError: a fixed depth outside 1..8, a policy's depth outside 0..8, an empty prompt, or neither a head nor
            ``lookup``.
        rollback.RollbackError: a cache that can neither be trimmed nor rolled back.
        lockstep.LockstepError: the ranks of a sharded trunk disagree (on every rank; the caches are then left as
            they are).
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
    processors = list(logits_processors or [])
    callback = prompt_progress_callback or (lambda *_: None)
    history = (prompt if prefill_history else prompt[-1:]) if processors else None
    drafter = Drafter(head, trunk, head_cache, sampling, draft_vocab)
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
        mx.eval([c.state for c in cache], head_cache.state if head_cache is not None and head_cache.offset else [])
        done += chunk.size
        callback(done, total)
    chunk = prompt[done:]
    hidden = trunk.hidden(chunk[None], cache)
    drafter.prefill(carry, hidden, chunk)
    first = loop.logprobs_at(trunk.trunk_logits(hidden[0, -1:]), chunk[-1:], history[:-1] if processors else None)
    loop.last = loop.pick(first)
    callback(total, total)
    drafter.keep(hidden[:, -1:], loop.last)
    if lookup is not None:
        lookup.index.extend(prompt.tolist())

    n = emitted = accepted = 0
    row = RowState(lookup, MAX_DEPTH)
    costs = costs if costs is not None else CostModel(1.0)
    # clocks decide only where the tokens do not depend on the drafts (greedy, keyed draws) and ranks need not agree
    price = pricing(costs, (sampling is None or sampling.keyed is not None) and lockstep is None, [lookup])
    held = None  # the policy's depth, asked for a cycle that drafted from the context instead

    def ask(block: int, behind: bool = False) -> Decision | None:
        """What follows a block of at least ``block`` tokens (the committed cache's step run first): the scheduler's
        decision (``scheduler.plan``, one row), or None if that block ends generation; ``behind``: the block's token
        is not read yet (``lookup.ContextIndex.propose``). Ranks in lockstep take rank 0's head depth, then plan alike
        (from the static cost prior, on equal contexts)."""
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
                    held = policy.next_depth()
                    if not 0 <= held <= MAX_DEPTH:
                        raise ValueError(f"depth policy chose depth {held}; it must be 0..{MAX_DEPTH}")
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
        decision = plan([question], price)[0]
        if not decision.lookup:
            held = None
        return decision

    def queue(decision: Decision | None):
        """What produces the next block, queued now: ``(Block.PLAIN, step)``, ``(Block.CYCLE, started cycle)`` or None;
        and the seconds queueing took (part of that block's cost, not of the block being read)."""
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
    following, launch = queue(ask(1, behind=True))
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
            emitted = 0
            source, item = following
            own_launch = launch
            if source is Block.PLAIN:
                loop.take_plain(item)
                block_logprobs = item[1]
                following, launch = queue(ask(1, behind=True))
                block = loop.last.tolist()
                seconds = clock.lap() - launch + own_launch
                policy.observe(PLAIN, 0, seconds)
                costs.observe(1, seconds)
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
            if cycle.match:
                costs.observe(cycle.depth + 1, seconds)
            else:
                policy.observe(cycle.depth, accepted, seconds)
    except LockstepError:
        diverged = True  # the ranks no longer match: their caches are left as they are
        raise
    finally:
        if not diverged:
            _close_cache(loop, source, cycle, accepted, following, emitted, stats)
        if sampling is not None and sampling.coupled:  # as the runtime's loop: a draw per token, one queued ahead
            sampling.keyed.release(n + 1)


def _record(stats: MTPStats, cycle: _Cycle, accepted: int, emitted: int) -> None:
    """Count a cycle on ``stats``: a head cycle by its depth, a lookup cycle apart."""
    if cycle.match:
        stats.record_lookup(accepted, emitted, cycle.depth)
    else:
        stats.record(accepted, emitted, cycle.depth)


def _parks(health: HeadHealth, depth: int, outcome: int) -> bool:
    """Count a cycle's outcome (an accepted count or ``NONFINITE``) on ``health``; True when the head is parked."""
    if outcome == NONFINITE:
        health.nonfinite()
        return True
    return health.observe(depth, outcome)


def _close_cache(loop: _Loop, source: Block, cycle: _Cycle | None, accepted: int, following, emitted: int,
                 stats) -> None:
    """Leave the trunk cache holding exactly the prompt and every yielded token, as plain decoding does.

    The block being yielded came from the prompt pass or a plain step (``source`` PROMPT / PLAIN: one
    token) or from ``cycle``, committed to its first accepted+1 inputs; ``following`` (queued plain step,
    started cycle or None) has fed the block's last token to the trunk already.
    """
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
