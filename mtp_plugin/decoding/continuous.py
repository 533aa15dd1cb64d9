"""A continuous batch decoding with MTP: rows join (``BatchLoop.extend``) and leave (``filter``) between passes; each
``step`` runs one pass of every row, a draft-and-verify cycle or a plain step pipelined as a runtime's own, decided by
the model's scheduler, committed per row and observed. A runtime adapter implements ``Runtime`` and translates its
generation batch's interface to this loop. Design: docs/development.md#the-engines-shape, docs/scheduling.md."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import mlx.core as mx

from .batch import Row, Step
from .batching import BatchingState
from .controller import PLAIN
from .drafter import BatchHeads, PendingPairs
from .grammar import grammar_of
from .lockstep import NONE
from .lookup import lookup_policy
from .options import MTPOptions
from .scheduler import Decision, RowState
from .stats import MTPStats


class Runtime(Protocol):
    """What a runtime adapter gives ``BatchLoop``: its stop rule, its responses, its caches' joining.
    ``batched_verify``: a verify pass over several rows runs as one batched pass (False: row by row, mlx-vlm 0.6;
    there only rows whose request fixed a depth draft, since a B-row pass costs B passes)."""

    batched_verify: bool

    def prepare(self, rows: list[Row]) -> None:
        """Called before every trunk pass over ``rows`` (mlx-vlm: its trunk takes the rows' rope deltas)."""

    def lookup_room(self) -> int | None:
        """The most lookup drafts a row may verify in the next pass (None: no limit but its remaining tokens)."""

    def end(self, row: Row, token: int) -> str | None:
        """Why ``row`` finishes on ``token``, its ``row.emitted``-th emitted token, by the runtime's rules (None: it
        goes on)."""

    def responder(self, loop: BatchLoop, logprobs: mx.array, blocks: list[list[int]]
                  ) -> Callable[[int, int, int, str | None], object]:
        """``make(i, j, token, reason)``: the runtime's response for token j of row i's block (log-probs (B, L, V);
        ``reason``: why the row finishes on it, or None)."""

    def extend_caches(self, caches: list, other: list) -> list:
        """The trunk caches of two batches as one, ``caches``' rows first."""


def new_row(state: BatchingState, uid: int, last: int, carry, options: MTPOptions, sampling, sampler, processors,
            tokens: list[int], max_tokens: int, extra=None) -> Row:
    """The decoding state of a request joining the batch: ``last`` (not yet fed) after ``tokens`` (in its trunk
    cache), ``carry`` its head's last unpaired hidden state (None: none); ``options`` resolved for the request;
    ``sampling`` the sampler's ``sampling.Sampling`` (None: greedy; False: no known distribution, plain steps only);
    ``extra``: the runtime adapter's own per-row state."""
    headless = state.drafter.head is None
    depth, lookup = options.depth, None
    if options.enabled and sampling is not False:
        lookup = lookup_policy(options.lookup, headless, state.scheduler.lookup_prior if sampling is not None else None)
        if lookup is not None:
            lookup.index = state.lookup_index([*tokens, last], lookup.index)
    if not options.enabled or sampling is False:
        depth, sampling = 0, None
    elif headless:
        depth = 0  # lookup drafts (when on) or plain steps
    grammar, processors = grammar_of(processors)
    row = Row(last, sampling=sampling, sampler=sampler, processors=processors,
              history=mx.array(tokens, dtype=mx.uint32) if processors else None, depth=depth,
              stats=MTPStats(depth or None), schedule=RowState(lookup), grammar=grammar, context=len(tokens) + 1,
              uid=uid, tokens=list(tokens), max_tokens=max_tokens, extra=extra)
    if headless:
        row.pending = PendingPairs(window=0)  # no head: no pairs kept
    if carry is not None:
        row.keep(carry, mx.array([last], dtype=mx.uint32))
    return row


class BatchLoop:
    """Rows decoding together over batched trunk caches ``cache`` and the head's ``head_cache``. Between passes a
    row's ``tokens`` are in its trunk cache and its ``last`` is not, except while plain steps are pipelined
    (``ahead``: every row's ``last`` fed, its next token not yet read); the pass that returns to drafting emits the
    queued tokens first. ``queued_heads``: a row joined with a long prompt's head pairs still queued: the next pass is
    a plain step, so its first tokens do not wait for them."""

    def __init__(self, state: BatchingState, runtime: Runtime, rows: list[Row] | None = None,
                 cache: list | None = None, head_cache=None, queued_heads: bool = False):
        self.state, self.runtime = state, runtime
        self.rows, self.cache, self.head_cache = rows or [], cache or [], head_cache
        self.queued_heads = queued_heads
        self.ahead: Step | None = None
        self.asked: list[int] | None = None  # depths asked of the policy for a cycle that has not run yet

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def fed(self) -> bool:
        """Whether every row's ``last`` is in its trunk cache (a queued plain step)."""
        return self.ahead is not None

    def extract_cache(self, i: int) -> list:
        """Row i's trunk caches, unbatched (they hold ``rows[i].tokens``)."""
        return [c.extract(i) for c in self.cache]

    def extend(self, other: BatchLoop) -> None:
        """Append ``other``'s rows (rows joining between passes)."""
        self.rows += other.rows
        if self.ahead is not None:  # pipelined plain steps: the new rows' step is queued to join them
            self.ahead = self.ahead.join(self._feed_last(other.rows, other.cache))
        self.asked = None  # the policy is asked again for the larger batch
        self.queued_heads |= other.queued_heads
        self.cache = self.runtime.extend_caches(self.cache, other.cache)
        if self.head_cache is None:
            self.head_cache = other.head_cache
        elif other.head_cache is not None:
            self.head_cache.extend(other.head_cache)

    def filter(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (finished, cancelled and removed rows leave)."""
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache, self.head_cache, self.ahead, self.asked = [], None, None, None
            return
        if self.ahead is not None:
            self.ahead = self.ahead.rows(keep)
        if self.asked is not None:
            self.asked = [self.asked[i] for i in keep]
        for c in self.cache:
            c.filter(keep)
        self.head_cache.filter(keep)

    def step(self) -> list:
        """One pass of every row: a cycle, or (when no row drafts) one plain step pipelined as the runtime's; the
        runtime's responses, one per token of every row's block; finished rows leave. Raises whatever fails: the
        adapter hands the rows to stock decoding then (``lockstep.LockstepError``: ranks that drifted apart)."""
        if not self.rows:
            return []
        start = time.perf_counter()
        temperature = max((r.sampling.temp for r in self.rows if r.sampling is not None), default=0.0)
        policy = self.state.scheduler.controller(temperature, len(self.rows),
                                                 max(row.context + row.position for row in self.rows))
        depths, decisions = self._decide(policy)
        constrained = any(row.grammar is not None for row in self.rows)  # a mask needs the token before it
        late, self.queued_heads = self.queued_heads, False  # first tokens come before the head's prompt pairs
        if (late or not any(d.drafts for d in decisions)) and not constrained:
            return self._plain(policy, start)
        if self.ahead is not None:  # leave pipelined plain steps: emit the queued tokens, cycle next call
            self.asked = depths
            return self._flush_plain()
        auto = [d for row, d in zip(self.rows, decisions, strict=True) if row.depth is None]
        if auto and all(d.lookup for d in auto):
            self.asked = depths  # the policy's depth did not run: it stands for the next cycle
        return self._cycle(policy, decisions, start)

    def _depths(self, policy, proposed: int) -> list[int]:
        """Each row's head depth this cycle: its own or the policy's; 0 once the head is parked. Ranks in lockstep take
        rank 0's depth after agreeing on rows, position and ``proposed`` lookup tokens (``Lockstep.agree``)."""
        state, parked = self.state, self.state.health.parked
        auto = state.scheduler.next_depth(policy) if not parked and any(r.depth is None for r in self.rows) else None
        if state.lockstep is not None:
            auto = state.lockstep.agree(NONE if auto is None else auto, {
                "rows in the batch": len(self.rows), "tokens emitted": sum(r.emitted for r in self.rows),
                "whether the head is parked": int(bool(parked)), "the rows' lookup proposals": proposed})
            auto = None if auto == NONE else auto
        if parked:
            return [0] * len(self.rows)
        return [auto if r.depth is None else r.depth for r in self.rows]

    def _decide(self, policy) -> tuple[list[int], list[Decision]]:
        """The rows' head depths and every row's decision for this pass (``Scheduler.decide``). Lookup drafts never
        exceed a row's remaining tokens; clocks decide only where no row's tokens depend on its drafts (exact
        sampling) and ranks need not agree. Where the runtime verifies row by row and the batch has several rows,
        only rows whose request fixed a depth draft (at it)."""
        state = self.state
        if not self.runtime.batched_verify and len(self.rows) > 1:
            self.asked = None
            depths = [0 if state.health.parked or row.depth is None else row.depth for row in self.rows]
            return depths, [Decision.head(depth) for depth in depths]
        behind, room = self.ahead is not None, self.runtime.lookup_room()
        asks = [row.schedule.ask(0, _room(row.max_tokens - row.emitted - 1 - behind, room), behind)
                for row in self.rows]
        proposed = sum(len(a.proposal) for a in asks)
        depths, self.asked = self.asked, None
        if depths is None:
            depths = self._depths(policy, proposed)
        elif state.lockstep is not None:  # the depths were agreed before; the proposals are new
            state.lockstep.agree(0, {"rows in the batch": len(self.rows),
                                     "tokens emitted": sum(r.emitted for r in self.rows),
                                     "the rows' lookup proposals": proposed})
        if state.health.parked:
            depths = [0] * len(self.rows)
        for row, a, depth in zip(self.rows, asks, depths, strict=True):
            a.depth, a.head = depth, row.schedule.head.expected(depth)
        exact = any(r.sampling is not None and r.sampling.keyed is None for r in self.rows)
        lookups = [r.schedule.lookup for r in self.rows]
        return depths, state.scheduler.decide(asks, lookups, not exact and state.lockstep is None)

    def end(self, row: Row, token: int) -> str | None:
        """Count ``token`` as emitted by ``row``; why the row finishes on it (``Runtime.end``), or None."""
        row.emitted += 1
        return self.runtime.end(row, token)

    def _cycle(self, policy, decisions: list[Decision], start: float) -> list:
        state, rows = self.state, self.rows
        finished = [None] * len(rows)

        def ends(i: int, token: int) -> bool:
            finished[i] = self.end(rows[i], token)
            return finished[i] is not None

        lookups = [(list(d.lookup), d.match) if d.lookup else None for d in decisions]
        self.runtime.prepare(rows)
        heads = BatchHeads(state.drafter.head, state.drafter.trunk, self.head_cache)
        launched = state.drafter.launch(rows, self.cache, heads, [d.depth for d in decisions], lookups)
        verified = state.drafter.read(launched, ends)
        if verified.nonfinite:
            state.health.nonfinite()
        emitted = [len(block) for block in verified.blocks]
        for i, row in enumerate(rows):
            row.tokens += [row.last, *verified.blocks[i][: emitted[i] - 1]]
        if verified.recorder is not None:
            verified.recorder.commit_rows(self.cache, emitted)
        state.drafter.commit(rows, heads, verified, emitted)
        self._final_calls(finished, [n > a for n, a in zip(emitted, verified.accepted, strict=True)])
        seconds, decided = time.perf_counter() - start, []
        for i, row in enumerate(rows):
            d, a, match = verified.depths[i], verified.accepted[i], verified.matches[i]
            row.schedule.observe(d, match, a)
            if row.schedule.lookup is not None:
                row.schedule.lookup.index.extend(verified.blocks[i])
            row.stats.forced += verified.forced[i]
            row.stats.masked += verified.masked[i]
            if row.grammar is not None:
                row.stats.grammar_seconds = row.grammar.seconds
            if match:
                row.stats.record_lookup(min(a, emitted[i]), emitted[i], d)
                continue
            if d:
                row.stats.record(min(a, emitted[i]), emitted[i], d)
                state.drafted, state.accepted = state.drafted + d, state.accepted + min(a, emitted[i])
                state.health.observe(d, a)
            else:
                row.stats.plain += 1
            if row.depth is None:
                decided.append((d, a))
        # a pass with no head steps: its cost is the verify pass's alone
        width = None if verified.head_width else max(verified.depths) + 1
        state.scheduler.observe(len(rows), width, seconds, policy, decided)
        return self._respond(verified.blocks, verified.logprobs, finished)

    def _plain(self, policy, start: float) -> list:
        """Emit the queued plain step's tokens after queueing the next step on them (the runtime's pipelining)."""
        if self.ahead is None:
            self.ahead = self._feed_last(self.rows, self.cache)
        step = self.ahead
        self.runtime.prepare(self.rows)
        self.ahead = self.state.drafter.plain(self.rows, self.cache, step.tokens)
        tokens = self._take(step)
        for row, token in zip(self.rows, tokens, strict=True):
            row.tokens.append(token)  # fed by the queued step
        seconds = time.perf_counter() - start
        decided = [(PLAIN, 0)] * sum(row.depth is None for row in self.rows)
        self.state.scheduler.observe(len(self.rows), 1, seconds, policy, decided)
        finished = [self.end(row, t) for row, t in zip(self.rows, tokens, strict=True)]
        return self._respond([[t] for t in tokens], step.logprobs[:, None], finished)

    def _flush_plain(self) -> list:
        """Emit the queued plain step's tokens without queueing another: every row's ``last`` is unfed again."""
        step, self.ahead = self.ahead, None
        tokens = self._take(step)
        finished = [self.end(row, t) for row, t in zip(self.rows, tokens, strict=True)]
        self._final_calls(finished, [True] * len(tokens))
        return self._respond([[t] for t in tokens], step.logprobs[:, None], finished)

    def _final_calls(self, finished: list, unfed: list[bool]) -> None:
        """Call the processors on the last token of each finishing row whose token no pass fed (``unfed``), as a
        runtime's plain decoding does (``BatchDrafter.final_call``: one trunk step on a copy of the row's cache)."""
        for i, row in enumerate(self.rows):
            if finished[i] is not None and unfed[i] and row.processors:
                self.state.drafter.final_call(row, self.extract_cache(i))

    def _feed_last(self, rows: list[Row], cache: list) -> Step:
        """Queue a plain step on every row's ``last`` (unfed) of ``rows`` over their trunk ``cache``."""
        for row in rows:
            row.tokens.append(row.last)
        self.runtime.prepare(rows)
        return self.state.drafter.plain(rows, cache, mx.array([row.last for row in rows], dtype=mx.uint32))

    def _take(self, step: Step) -> list[int]:
        """A plain step's tokens: each becomes its row's ``last``, paired with the previous token's hidden state."""
        tokens = step.tokens.tolist()
        for i, row in enumerate(self.rows):
            row.keep(step.hidden[i : i + 1], step.tokens[i : i + 1])
            row.last = tokens[i]
            if row.grammar is not None:  # a row that joined queued plain steps: its first token
                row.grammar.advance([tokens[i]])
                row.grammar.commit()
            row.stats.plain += 1
            row.schedule.observe(0, 0, 0)
            if row.schedule.lookup is not None:
                row.schedule.lookup.index.extend([tokens[i]])
        return tokens

    def _respond(self, blocks: list[list[int]], logprobs: mx.array, finished: list) -> list:
        """The runtime's responses for every row's emitted ``blocks`` (log-probs (B, L, V)); finished rows leave, a
        finished row's head remembered when it holds the pair of every position (``BatchingState.remember``)."""
        make = self.runtime.responder(self, logprobs, blocks)
        responses, keep = [], []
        for i, row in enumerate(self.rows):
            for j, token in enumerate(blocks[i]):
                final = j == len(blocks[i]) - 1 and finished[i] is not None
                responses.append(make(i, j, token, finished[i] if final else None))
            if finished[i] is None:
                keep.append(i)
            elif row.head_whole:
                self.state.remember(row.tokens, self._head_of(i), row.pending)
        self.state.cycles += 1
        self.state.row_cycles += len(self.rows)
        self.state.tokens += len(responses)
        if len(keep) < len(self.rows):
            self.filter(keep)
        return responses

    def _head_of(self, i: int):
        """Row i's head KV cache, unbatched (empty while no row has fed the head a pair: 1- or 2-token prompts
        decoding plain)."""
        return self.state.new_cache() if self.head_cache.keys is None else self.head_cache.extract(i)


def _room(left: int, room: int | None) -> int:
    """The most lookup drafts a row with ``left`` tokens still to emit may verify (``room`` None: no other limit)."""
    return left if room is None else min(left, room)
