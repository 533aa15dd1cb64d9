"""The MTP cycle over rows, for a continuous batch and for one stream alike (a one-row batch): the head drafts, one
trunk verify pass checks every row's drafts, each row accepts and rolls back to its own prefix. Between cycles a row's
trunk cache holds every token before ``last``, and its pending head pairs end with the pair whose token is ``last``.
Design: docs/decoding.md#batched-decoding, docs/development.md#the-engines-shape."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from . import rollback
from .acceptance import (
    NONFINITE,
    Walk,
    accept_greedy,
    accept_matching,
    accept_sampled,
    processed_logprobs,
    reject_nonfinite,
)
from .drafter import Heads, PendingPairs, draft_logits, log_softmax, propose
from .grammar import Grammar, constrain
from .sampling import Sampling
from .scheduler import RowState
from .stats import MTPStats


@dataclass
class Row:
    """One request's decoding state between cycles.

    Attributes:
        last: the newest token, not yet fed; one stream's may be an array (1,) not read yet.
        sampling: the row's ``sampling.Sampling`` (None: greedy); processors: its logits processors; stats: its
            counters.
        pending: head pairs not yet fed (the last ``drafter.HISTORY_WINDOW`` at most).
        sampler: the runtime's sampler, for plain steps of a row that cannot draft (None: argmax).
        history: token ids (N,) the processors have seen (None without processors).
        depth: 0 never drafts (MTP off, or a sampler with no known distribution); 1..8 fixed; None: the batch's policy.
        head_whole: the head's cache holds a pair for every context position (a runtime may reuse it for later
            requests); False once a park longer than ``drafter.HISTORY_WINDOW`` dropped pairs.
        schedule: the scheduler's ``RowState`` of the row (its lookup index holds every token up to ``last``).
        position: tokens drawn for good so far, ``last`` included: the next one's index among the generated tokens
            (``Sampling.keyed`` draws).
        grammar: the row's ``grammar.Grammar`` (no processors then), which has consumed every generated token up to
            ``last`` and, during a cycle, the row's drafts; None: unconstrained.
        context: tokens in the row's trunk cache when it joined, ``last`` included (its prompt, a reused prefix too).
        uid: the runtime's request id.
        tokens: the token ids in the row's trunk cache (``continuous.BatchLoop``: ``last`` not among them).
        max_tokens: the most tokens the row may emit; ``emitted``: tokens it has emitted.
        extra: the runtime adapter's own per-row state (its stop rule, what its responses need).
    """

    last: int | mx.array
    pending: PendingPairs = field(default_factory=PendingPairs)
    sampling: Sampling | None = None
    sampler: Callable | None = None
    processors: list = field(default_factory=list)
    history: mx.array | None = None
    depth: int | None = None
    stats: MTPStats = field(default_factory=MTPStats)
    head_whole: bool = True
    schedule: RowState = field(default_factory=RowState)
    position: int = 0
    grammar: Grammar | None = None
    context: int = 0
    uid: int = 0
    tokens: list[int] = field(default_factory=list)
    max_tokens: int = 0
    emitted: int = 0
    extra: object = None

    def keep(self, hidden: mx.array, tokens: mx.array) -> None:
        """Committed pairs (hidden (1, n, H), tokens (n,)) for the head's next feed (``pending``)."""
        if self.pending.add(hidden, tokens):
            self.head_whole = False


@dataclass
class Verified:
    """A cycle's outcome, read on the host: per row the accepted count, its block and the log-probs."""

    depths: list[int]  # per row, the drafts verified (0: a plain step)
    matches: list[int]  # per row, the match length of its lookup drafts (0: drafts from the head, or none)
    head_width: int  # draft steps the head ran for every row (its cache rows to drop)
    accepted: list[int]  # per row (a row with processors whose block was cut on an accepted draft: len(block))
    blocks: list[list[int]]  # per row: its accepted drafts, then the correction or bonus token, cut where it ends
    logprobs: mx.array  # (B, D+1, V) trunk log-probs after each row's processors
    hidden: mx.array  # (B, D+1, H) trunk hidden states of the inputs
    inputs: mx.array  # (B, D+1) ``[last, drafts…]``
    recorder: rollback.Recorder | None  # None for an all-plain step (nothing to roll back)
    nonfinite: bool = False  # some row's head output was NaN/Inf: its drafts were rejected
    forced: list[int] | None = None  # per row, drafts its grammar forced
    masked: list[int] | None = None  # per row, head drafts its grammar changed


@dataclass
class Drafted:
    """The head's drafts of a cycle: per draft step its tokens (B,) and per row q (1, V) (None: greedy, keyed, or a
    token a grammar forced), the steps run (``width``), every row's output finite so far (B,), per row the drafts its
    grammar forced or changed."""

    forced: list[int]
    masked: list[int]
    tokens: list[mx.array] = field(default_factory=list)
    qs: list[list] = field(default_factory=list)
    width: int = 0
    finite: mx.array = field(default_factory=lambda: mx.array(True))


@dataclass
class Launched:
    """A cycle queued by ``BatchDrafter.launch``, not read yet; fields as ``Verified``'s. ``logprobs``: per row (D+1,
    V), None for a row read position by position (its ``walks`` entry); ``accepted`` (B,) and ``tokens`` (B, D+1)
    lazy (a walk's row: zeros)."""

    depths: list[int]
    matches: list[int]
    head_width: int
    inputs: mx.array
    hidden: mx.array
    recorder: rollback.Recorder | None
    forced: list[int]
    masked: list[int]
    logprobs: list = field(default_factory=list)
    accepted: mx.array | None = None
    tokens: mx.array | None = None
    walks: dict[int, Walk] = field(default_factory=dict)


@dataclass
class Step:
    """A queued plain step of every row: the fed tokens' hidden states, the log-probs after them, the next tokens."""

    hidden: mx.array  # (B, 1, H)
    logprobs: mx.array  # (B, V)
    tokens: mx.array  # (B,) uint32, lazy until read

    def rows(self, keep: list[int]) -> Step:
        """The step of rows ``keep`` only."""
        index = mx.array(keep)
        return Step(self.hidden[index], self.logprobs[index], self.tokens[index])

    def join(self, other: Step) -> Step:
        """This step's rows, then ``other``'s."""
        return Step(*(mx.concatenate([a, b]) for a, b in ((self.hidden, other.hidden),
                                                          (self.logprobs, other.logprobs),
                                                          (self.tokens, other.tokens))))


class BatchDrafter:
    """Runs cycles (``launch``, ``read``, ``commit``) and plain steps over rows; ``trunk`` takes batched inputs (B, S);
    ``head`` None: lookup drafts only. ``vocab``: the head's ``head.draft_vocab.DraftVocabulary`` or None (a runtime
    adapter sets it before each batch)."""

    def __init__(self, trunk, head: nn.Module | None):
        self.trunk, self.head, self.vocab = trunk, head, None

    def _choose(self, rows: list[Row], g: mx.array, depths: list[int], k: int, allowed: mx.array | None = None
                ) -> tuple[mx.array, list, mx.array | None]:
        """Draft tokens (B,) of draft step ``k`` from head outputs g (B, 1, H), per sampled row its q (1, V), and,
        under ``allowed`` (B, T) grammar masks (full vocabulary then), the head's unmasked top tokens (B,)."""
        vocab = self.vocab if allowed is None else None
        logits = draft_logits(g[:, 0], self.trunk, vocab)
        top = None if allowed is None else mx.argmax(logits, axis=-1)
        logits = logits if allowed is None else constrain(logits, allowed)
        if all(r.sampling is None for r in rows):
            return propose(logits, vocab=vocab)[0], [None] * len(rows), top
        tokens, qs = [], []
        for i, row in enumerate(rows):
            token, q = propose(logits[i : i + 1], row.sampling if depths[i] else None, vocab, row.position + k)
            tokens.append(token)
            qs.append(q)
        return mx.concatenate(tokens), qs, top

    def pick(self, row: Row, logprobs: mx.array) -> mx.array:
        """Plain tokens (N,) from log-probs (N, V) of the row's next N positions: its keyed draws, else its own
        sampler, else argmax."""
        if row.sampling is not None and row.sampling.keyed is not None:
            return row.sampling.keyed(logprobs, row.position)
        if row.sampler is None:
            return mx.argmax(logprobs, axis=-1)
        return row.sampler(logprobs).reshape(-1)

    def plain(self, rows: list[Row], cache: list, inputs: mx.array) -> Step:
        """Queue one plain step of every row, as mlx-lm's ``GenerationBatch``: feed ``inputs`` (B), apply each
        row's processors (its history grows by its input) or grammar mask (its state as it stands: the token it
        takes is consumed by the caller) and sampler; the ``Step``, evaluated asynchronously."""
        hidden = self.trunk.hidden(inputs[:, None], cache)
        logits = self.trunk.trunk_logits(hidden)[:, -1]
        if any(row.grammar is not None for row in rows):
            logits = constrain(logits, _stack([row.grammar and row.grammar.allowed() for row in rows]))
        if any(row.processors for row in rows):
            rows_logprobs = []
            for i, row in enumerate(rows):
                fed = inputs[i : i + 1]
                rows_logprobs.append(processed_logprobs(logits[i : i + 1], fed, row.history, row.processors))
                if row.processors:
                    row.history = mx.concatenate([row.history, inputs[i : i + 1]])
            logprobs = mx.concatenate(rows_logprobs)
        else:
            logprobs = log_softmax(logits)
        samplers = {id(row.sampler) for row in rows}
        if len(samplers) == 1 and not any(row.sampling is not None and row.sampling.keyed is not None for row in rows):
            tokens = self.pick(rows[0], logprobs)
        else:
            tokens = mx.concatenate([self.pick(row, logprobs[i : i + 1]) for i, row in enumerate(rows)])
        for row in rows:
            row.position += 1
        step = Step(hidden, logprobs, tokens.astype(mx.uint32))
        mx.async_eval(step.tokens, step.logprobs)
        return step

    def launch(self, rows: list[Row], cache: list, heads: Heads, depths: list[int],
               lookups: list[tuple[list[int], int] | None] | None = None, walk_first: bool = True,
               drafts_only: bool = False) -> Launched | None:
        """Queue one cycle, evaluated asynchronously: draft, verify in one trunk pass, accept per row; ``read`` reads
        it, ``commit`` keeps it. A grammar consumes its row's drafts.

        Args:
            heads: the head's side (``drafter.BatchHeads``; one stream's: ``drafter.Drafter``).
            depths: per row, the drafts wanted (0..8); a row with no pending pair decodes plain.
            lookups: per row, ``(drafts, match)``: context token ids verified instead of the head's drafts (its depth
                ignored) and the match length; None: the head's.
            walk_first: a row with processors has their call for its ``last`` made now (``acceptance.Walk.process``);
                False: by whoever reads its walk.
            drafts_only: None, nothing queued, when no row has a draft to verify.

        Raises:
            rollback.CaptureMissed: the capture points were removed during the pass (caches restored).
        """
        lookups, allowed = self._cut_lookups(rows, heads, list(lookups or [None] * len(rows)))
        depths = [0 if looked is not None or not len(row.pending) or (row.grammar and row.grammar.stopped) else d
                  for row, d, looked in zip(rows, depths, lookups, strict=True)]
        if drafts_only and not any(depths) and not any(lookups):
            return None
        drafted = self._draft(rows, heads, depths, allowed)
        if drafted.width:  # queued now: the head runs while the verify pass is built, and every rank of a sharded
            mx.async_eval(drafted.tokens)  # trunk meets the collectives in its pairs' graph before the pass's own
        matches = [0 if looked is None else looked[1] for looked in lookups]
        depths = [d if looked is None else len(looked[0]) for d, looked in zip(depths, lookups, strict=True)]
        width = max(depths)
        last = _lasts(rows)
        inputs = last
        if width:
            head = mx.stack(drafted.tokens, axis=1).astype(mx.uint32) if drafted.width else None
            inputs = mx.concatenate([last, mx.stack([
                mx.array(looked[0] + [0] * (width - len(looked[0])), dtype=mx.uint32) if looked is not None
                else mx.pad(head[i], [(0, width - drafted.width)]) if drafted.width
                else mx.zeros((width,), mx.uint32) for i, looked in enumerate(lookups)])], axis=1)
        recorder = None
        if width:
            undo = rollback.snapshot(cache)
            with rollback.capturing(width + 1) as recorder:
                hidden = self.trunk.hidden(inputs, cache)
            if recorder.missed(cache, len(rows)):
                undo(width + 1)
                for row in rows:  # the drafts it consumed are undone too
                    if row.grammar is not None:
                        row.grammar.restore()
                raise rollback.CaptureMissed("the runtime's capture points were removed during the verify pass")
        else:
            hidden = self.trunk.hidden(inputs, cache)
        launched = Launched(depths, matches, drafted.width, inputs, hidden, recorder, drafted.forced, drafted.masked)
        self._accept(rows, launched, drafted, allowed, walk_first)
        return launched

    def _cut_lookups(self, rows: list[Row], heads: Heads, lookups: list) -> tuple[list, dict[int, list]]:
        """Lookup drafts cut at the first token a row's grammar forbids (None when that is the first: the row drafts
        with the head), the head told of each lookup cycle (``Heads.room``); per constrained row its grammar's masks
        before each draft and after the last (lookup drafts consumed by it)."""
        allowed = {}
        for i, row in enumerate(rows):
            if row.grammar is not None and lookups[i] is not None:
                cut = lookups[i][0][: row.grammar.valid_prefix(lookups[i][0])]
                lookups[i] = (cut, lookups[i][1]) if cut else None
                allowed[i] = row.grammar.walk(cut)
            elif row.grammar is not None:
                allowed[i] = [row.grammar.allowed()]
            if lookups[i] is not None:
                heads.room(row, len(lookups[i][0]) + 1)
        return lookups, allowed

    def _draft(self, rows: list[Row], heads: Heads, depths: list[int], allowed: dict[int, list]) -> Drafted:
        """Run the head's draft steps for rows' ``depths`` (cut where a row's grammar completes); rows with no head
        depth keep their pairs for later."""
        drafted = Drafted(forced=[0] * len(rows), masked=[0] * len(rows))
        head_width = max(depths)
        g = heads.open(rows) if head_width else None
        for k in range(head_width):
            drafted.finite = drafted.finite & mx.all(mx.isfinite(g), axis=(1, 2))  # (B,) once a row's output is seen
            steering = {i for i in allowed if depths[i] > k}  # constrained rows drafting at this step
            masks = _stack([allowed[i][-1] if i in steering else None for i in range(len(rows))]) if steering else None
            x, q, top = self._choose(rows, g, depths, k, masks)
            if steering:
                x = self._steer(rows, steering, x, q, top, allowed, depths, k, drafted.forced, drafted.masked)
            drafted.tokens.append(x)
            drafted.qs.append(q)
            drafted.width = k + 1
            if k + 1 >= max(depths):  # constrained rows may stop early: no further head step
                break
            g = heads.advance(g, x)
        return drafted

    def _accept(self, rows: list[Row], launched: Launched, drafted: Drafted, allowed: dict[int, list],
                walk_first: bool) -> None:
        """Queue each row's acceptance of its verified drafts on ``launched`` (a row with processors: its walk)."""
        depths, matches, inputs, width = launched.depths, launched.matches, launched.inputs, max(launched.depths)
        logits = self.trunk.trunk_logits(launched.hidden)
        accepted, tokens = [], []
        for i, row in enumerate(rows):
            d = depths[i]
            q, row_finite = None, drafted.finite[i] if drafted.width else drafted.finite
            keyed = row.sampling is not None and row.sampling.keyed is not None
            row_logits = logits[i, : d + 1] if i not in allowed else constrain(logits[i, : d + 1],
                                                                                  mx.stack(allowed[i][: d + 1]))
            if d and row.sampling is not None and not keyed:
                point = (mx.arange(logits.shape[-1])[None] == inputs[i, 1 : d + 1, None]).astype(mx.float32)
                if matches[i]:  # a lookup row: a point mass at each draft
                    q, row_finite = point, mx.array(True)
                else:  # a draft its grammar forced has no q: a point mass too
                    q = mx.concatenate([point[k : k + 1] if drafted.qs[k][i] is None else drafted.qs[k][i]
                                        for k in range(d)])
            if d and row.processors:  # read position by position (``read``, or the caller)
                walk = launched.walks[i] = Walk(logits[i, : d + 1], inputs[i, : d + 1], row.history, row.processors,
                                                row.sampling, q, row_finite, row.position)
                if walk_first:
                    walk.process()
                else:
                    mx.async_eval(logits)
                launched.logprobs.append(None)
                accepted.append(mx.array(0))
                tokens.append(mx.zeros((width + 1,), mx.uint32))
                continue
            lp = processed_logprobs(row_logits, inputs[i, : d + 1], row.history, row.processors)
            launched.logprobs.append(_pad(lp, width - d))
            if d == 0:
                accepted.append(mx.array(0))
                tokens.append(_pad(self.pick(row, lp).astype(mx.uint32), width))
                continue
            row_drafts = inputs[i, 1 : d + 1]
            if row.sampling is None:  # greedy: the block is the trunk's argmax whatever the drafts
                a, block = accept_greedy(lp, row_drafts)
            elif keyed:  # keyed draws do not depend on the drafts: a draft is accepted iff it equals its draw
                a, block = accept_matching(row.sampling.keyed(lp, row.position), row_drafts)
            else:
                a, block = accept_sampled(row.sampling.probs(lp), q, row_drafts, row_finite)
            accepted.append(reject_nonfinite(a, row_finite))
            tokens.append(_pad(block.astype(mx.uint32), width - d))
        launched.accepted, launched.tokens = _rows(accepted), _rows(tokens)
        mx.async_eval(launched.accepted, launched.tokens)

    def read(self, launched: Launched, ends=None, walked: dict[int, tuple[list[int], int]] | None = None
             ) -> Verified:
        """Read a launched cycle on the host (one sync, and one per position for rows with processors): its
        ``Verified`` outcome, caches not yet committed (``commit``). A row's processors have seen its block's last
        token iff ``len(block) <= accepted``; else ``final_call`` makes that call.

        Args:
            ends: ``ends(i, token) -> bool``, called once per token of row i's block in order: True cuts the block there
                (the row finishes on it). None: no row finishes inside a block.
            walked: per row with processors, ``(block, outcome)`` its walk gave the caller (None: walks read here).
        """
        walks, width = launched.walks, max(launched.depths)
        mx.eval(launched.accepted, launched.tokens, [w.outcomes[-1] for w in walks.values() if w.outcomes])
        outcomes, table = launched.accepted.tolist(), launched.tokens.tolist()
        counts = [max(a, 0) for a in outcomes]
        blocks = [table[i][: a + 1] for i, a in enumerate(counts)]
        for i, block in enumerate(blocks):
            if i not in walks and ends is not None:
                blocks[i] = _cut(block, functools.partial(ends, i))
        logprobs = list(launched.logprobs)
        for i, (block, outcome) in (_read(walks, ends) if walked is None else walked).items():
            blocks[i], counts[i], outcomes[i] = block, max(outcome, 0), outcome
            lp = mx.stack(walks[i].logprobs)
            logprobs[i] = _pad(lp, width + 1 - lp.shape[0])
        return Verified(launched.depths, launched.matches, launched.head_width, counts, blocks, _rows(logprobs),
                        launched.hidden, launched.inputs, launched.recorder, NONFINITE in outcomes, launched.forced,
                        launched.masked)

    @staticmethod
    def _steer(rows: list[Row], steering: set[int], x: mx.array, qs: list, top: mx.array, allowed: dict,
               depths: list[int], k: int, forced: list[int], masked: list[int]) -> mx.array:
        """Draft step ``k`` of the ``steering`` rows under their grammars (one host read): the token a grammar forces
        replaces the head's (its q None), the grammar consumes the draft and gives the next mask; a row whose grammar
        is complete drafts no more (``depths`` cut). Returns the step's tokens (B,)."""
        tokens, tops = x.tolist(), top.tolist()
        for i in steering:
            grammar, mask = rows[i].grammar, allowed[i][-1]
            token = grammar.forced()
            if token is None:
                token = tokens[i]
                masked[i] += tops[i] >= mask.shape[0] or not mask[tops[i]].item()
            else:
                tokens[i], qs[i] = token, None
                forced[i] += 1
            grammar.advance([token])
            allowed[i].append(grammar.allowed())
            if grammar.stopped:
                depths[i] = k + 1
        return mx.array(tokens, dtype=x.dtype)

    def final_call(self, row: Row, cache: list) -> None:
        """The processors' call for a finishing row's ``last``, which no pass fed: one trunk step over
        ``cache``, a copy of the row's own cache (the batch's are untouched), as ``GenerationBatch`` makes that call."""
        fed = mx.array([row.last], dtype=mx.uint32)
        hidden = self.trunk.hidden(fed[None], cache)
        mx.async_eval(processed_logprobs(self.trunk.trunk_logits(hidden)[0, -1:], fed, row.history, row.processors))

    def commit(self, rows: list[Row], heads: Heads, verified: Verified, keep: list[int]) -> None:
        """Keep each row's first ``keep[b]`` (1..accepted+1) verified inputs: the head's draft steps undone, its pairs
        kept; each row's ``last``, position, processors' history and grammar moved on. The trunk's caches are the
        caller's to roll back (``verified.recorder``)."""
        heads.rewind(verified.head_width)
        for i, row in enumerate(rows):
            k = keep[i]
            block = mx.array(verified.blocks[i][:k], dtype=mx.uint32)
            heads.keep(row, verified.hidden[i : i + 1, :k], block)
            if row.processors:
                row.history = mx.concatenate([row.history, verified.inputs[i, :k]])
            row.last = verified.blocks[i][k - 1]
            row.position += k
            if row.grammar is not None:  # it consumed the drafts: keep the k - 1 committed, then ``last``
                row.grammar.keep(k - 1)
                row.grammar.advance([row.last])
                row.grammar.commit()


def _lasts(rows: list[Row]) -> mx.array:
    """Every row's ``last`` (B, 1) uint32; a row's may be an array (1,) not read yet (one stream's, after a plain
    step: its cycle is queued before that token is read)."""
    if all(isinstance(row.last, int) for row in rows):
        return mx.array([row.last for row in rows], dtype=mx.uint32)[:, None]
    return mx.stack([row.last.astype(mx.uint32) if isinstance(row.last, mx.array)
                     else mx.array([row.last], dtype=mx.uint32) for row in rows])


def _pad(x: mx.array, n: int) -> mx.array:
    """``x`` (S, …) with ``n`` zero rows appended (``x`` itself when n is 0)."""
    return x if n == 0 else mx.pad(x, [(0, n)] + [(0, 0)] * (x.ndim - 1))


def _rows(arrays: list[mx.array]) -> mx.array:
    """``arrays`` stacked as rows (B, …); one without a copy."""
    return arrays[0][None] if len(arrays) == 1 else mx.stack(arrays)


def _stack(masks: list[mx.array | None]) -> mx.array:
    """Grammar masks (T,) per row as one (B, T) bool array; a row without one (None) allows every token."""
    width = max(m.shape[0] for m in masks if m is not None)
    return mx.stack([mx.ones((width,), mx.bool_) if m is None else mx.pad(m, [(0, width - m.shape[0])])
                     for m in masks])


def _cut(block: list[int], ends) -> list[int]:
    """``block`` up to and including the first token for which ``ends(token)`` is True (all of it if none)."""
    for j, token in enumerate(block):
        if ends(token):
            return block[: j + 1]
    return block


def _read(walks: dict[int, Walk], ends) -> dict[int, tuple[list[int], int]]:
    """Read the rows' walks in lockstep (one host read per position for all), until each row's block ends (a
    rejection, the bonus token, or the token it finishes on); per row its block and outcome (accepted count or
    ``NONFINITE``)."""
    blocks, outcomes, active = {i: [] for i in walks}, {}, dict(walks)
    while active:
        mx.eval([w.outcomes[-1] for w in active.values()])
        for i, walk in list(active.items()):
            token, ok = walk.read()
            blocks[i].append(token)
            finished = ends is not None and ends(i, token)
            if ok:
                walk.process()
            if finished or not ok:
                del active[i]
                outcomes[i] = len(blocks[i]) - (not ok) if walk.finite_read else NONFINITE
    return {i: (blocks[i], outcomes[i]) for i in walks}
