"""mlx-lm adapter, continuous batching: MTP cycles inside mlx-lm's own ``BatchGenerator`` (``batching_model``). Its
prompt batches also feed each row's head; its generation batch is an ``MTPGenerationBatch`` running batched cycles
(``decoding.batch``, drafts planned by ``decoding.scheduler``). Design: docs/mlx-lm-server.md."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import mlx.core as mx

from mtp_plugin.decoding.batch import BatchDrafter, Row, Step
from mtp_plugin.decoding.controller import PLAIN, DepthController
from mtp_plugin.decoding.drafter import Drafter, PendingPairs
from mtp_plugin.decoding.grammar import GrammarProcessor, grammar_of
from mtp_plugin.decoding.lockstep import NONE, Lockstep, LockstepError, group_of
from mtp_plugin.decoding.lookup import ContextIndex, lookup_policy, sampled_prior
from mtp_plugin.decoding.options import command_line, context_band
from mtp_plugin.decoding.scheduler import Chain, CostTable, Decision, RowState, costs_of, plan, pricing
from mtp_plugin.decoding.single import DEFAULT_DEPTH, MAX_DEPTH
from mtp_plugin.decoding.stats import MTPStats
from mtp_plugin.decoding.trunk import LogitsTrunk
from mtp_plugin.head.health import HeadHealth
from mtp_plugin.plugins import hook
from mtp_plugin.tuning import start_depth

from .capture import rollback_ready
from .mlx_lm_decoding import CAPTURED, generation_stream
from .mlx_lm_fallback import Resume, stock_batch
from .mlx_lm_sampling import SAMPLINGS

log = logging.getLogger("mtp_plugin")
MAX_LOOKUP = 1 << 30  # no limit on a row's lookup drafts but its remaining tokens
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
class BatchContext:
    """What MTP batching keeps for one model: trunk and head functions, a depth policy per batch size class (kept across
    generators), each waiting request's MTP options and each prompt row's head."""

    trunk: object
    drafter: BatchDrafter
    health: object  # the loaded head's ``head.health.HeadHealth``: a parked head drafts no more
    start: int  # the depth a new policy starts at (tuned, else the default)
    policies: dict = field(default_factory=dict)  # (batch size class B.bit_length(), context band) -> DepthController
    options: dict = field(default_factory=dict)  # uid -> the server's MTPRequest (or None)
    heads: dict = field(default_factory=dict)  # uid -> HeadRow
    lengths: dict = field(default_factory=dict)  # uid -> tokens its prompt passes will process (``drafter.bound``)
    store: OrderedDict = field(default_factory=OrderedDict)  # tokens -> head of a finished request (``remember``)
    indexes: deque = field(default_factory=lambda: deque(maxlen=STORED_INDEXES))  # ``lookup_index``'s copies
    lockstep: Lockstep | None = None  # a model sharded over ranks: rank 0 chooses the depth (``decoding.lockstep``)
    costs: CostTable | None = None  # the model's verify costs per batch size (``scheduler.costs_of``)
    lookup_prior: Chain | None = None  # sampled rows' lookup prior (``lookup.sampled_prior``)
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

    def head_row(self, uid: int, prefix: list[int]) -> HeadRow:
        """The head of request ``uid``, created on first use for a row whose trunk cache already holds ``prefix``
        (a reused prompt cache): the head's pairs for that prefix when a finished request left them, else none."""
        from mlx_lm.models.cache import KVCache

        if uid not in self.heads:
            row = self.heads[uid] = HeadRow(Drafter(self.drafter.head, self.trunk, KVCache()), whole=not prefix)
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

    def policy(self, rows: int, context: int = 0) -> DepthController:
        """The depth policy of batches of ``rows`` rows (classes 1, 2-3, 4-7, …) whose longest context holds ``context``
        tokens (``options.context_band``): one row starts at the choice of its nearest shorter band, else at the
        tuned depth; larger batches start parked."""
        key = (rows.bit_length(), context_band(context))
        if key not in self.policies:
            shorter = [k for k in self.policies if k[0] == key[0] and k[1] < key[1]]
            start = self.policies[max(shorter)].choice if shorter else self.start if key[0] == 1 else PLAIN
            self.policies[key] = DepthController(start)
        return self.policies[key]


class BatchingModel:
    """The model as an MTP ``BatchGenerator`` sees it: calls and attributes go to the model; ``mtp_batching``
    is the context, so only this generator's prompt and generation batches decode with MTP."""

    def __init__(self, model, ctx: BatchContext):
        self.model, self.mtp_batching = model, ctx

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def batching_model(model) -> BatchingModel | None:
    """``model`` wrapped for MTP batching, or None when it has no head whose trunk layers can be rolled back (nor, for a
    model without a head, lookup drafts: ``headless_context``)."""
    loaded = getattr(model, "mtp_head", None)
    if loaded is None:
        ctx = headless_context(model)
        return None if ctx is None else BatchingModel(model, ctx)
    if not rollback_ready(CAPTURED, loaded.location.model_type):
        return None
    trunk = hook().mtp_trunk(model=model, contract=loaded.module.contract)
    if trunk is None:
        return None
    ctx = loaded.batching
    if ctx is not None and ctx.failed:
        return None
    if ctx is None:
        start = start_depth(loaded.location.model_dir, DEFAULT_DEPTH, MAX_DEPTH)
        ctx = loaded.batching = BatchContext(trunk, BatchDrafter(trunk, loaded.module), loaded.health, start,
                                             costs=costs_of(model), lookup_prior=sampled_prior(model))
        group = group_of(model)
        ctx.lockstep = None if group is None else Lockstep(group)
    if ctx.lockstep is not None:  # every rank batches with MTP here; the ranks' draft vocabularies must match
        stream = generation_stream()  # after whatever a previous batch left queued there
        with mx.stream(stream) if stream is not None else contextlib.nullcontext():
            ctx.lockstep.start(loaded, True, {})
    ctx.drafter.vocab = loaded.draft_vocab
    ctx.options.clear()  # request ids restart with each generator
    ctx.heads.clear()
    ctx.lengths.clear()
    return BatchingModel(model, ctx)


def headless_context(model) -> BatchContext | None:
    """The batching context of a model without a head when the server runs with ``--mtp-lookup`` on one process and
    its trunk can be rolled back; kept on the model (``mtp_lookup_batching``). None: stock batching (one warning when
    the model's caches cannot be made here)."""
    from mlx_lm.models.cache import make_prompt_cache

    if not command_line().lookup or group_of(model) is not None:
        return None
    model_type = getattr(model, "model_type", None)
    try:
        trims = all(c.is_trimmable() for c in make_prompt_cache(model))
    except Exception as error:  # a model of another runtime's making: served as stock serves it
        log.warning("mtp_plugin: no lookup drafts for this model's batches (%s: %s)", type(error).__name__, error)
        return None
    if not (CAPTURED.get(model_type) or trims):
        return None
    ctx = getattr(model, "mtp_lookup_batching", None)
    if ctx is None or ctx.failed:
        trunk = LogitsTrunk(model)
        ctx = BatchContext(trunk, BatchDrafter(trunk, None), HeadHealth("no head"), PLAIN, costs=costs_of(model),
                           lookup_prior=sampled_prior(model))
        model.mtp_lookup_batching = ctx
    ctx.options.clear()
    ctx.heads.clear()
    ctx.lengths.clear()
    return ctx


def context_of(batch) -> BatchContext | None:
    """The MTP batching context of a batch's model (None: stock batching, also after a fault)."""
    ctx = getattr(batch.model, "mtp_batching", None)
    return None if ctx is None or ctx.failed else ctx


class _Capture:
    """Stands in for the model during ``PromptProcessingBatch.prompt``: runs the trunk for its hidden states
    and feeds each row's valid positions (right padding excluded) to that row's head. A chunk is cut where a row's
    head window starts (``Drafter.split``), so the trunk's last layer runs only for the windows."""

    def __init__(self, ctx: BatchContext, uids: list[int], prefixes: list[list[int]], tokens: list[list[int]]):
        self.ctx, self.uids, self.prefixes, self.tokens, self.done = ctx, uids, prefixes, tokens, 0

    def __call__(self, inputs: mx.array, cache=None):
        n, parts = inputs.shape[1], []
        cuts = self._cuts(n) if not self.ctx.failed else []
        for start, stop in zip([0, *cuts], [*cuts, n], strict=True):
            hidden = self.ctx.trunk.hidden(inputs[:, start:stop], cache)
            if not self.ctx.failed:
                try:
                    self._feed(hidden)
                except Exception as error:  # the head's history only: the trunk's pass above is whole
                    self.ctx.fail(error)
            self.done += stop - start
            parts.append(hidden)
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)

    def _rows(self, n: int):
        """``(i, row, valid)`` of each row with valid positions among the next ``n`` (a new row's head created and
        bounded to the window of its prompt passes, ``drafter.window``)."""
        for i, uid in enumerate(self.uids):
            valid = max(0, min(n, len(self.tokens[i]) - self.done))
            if valid:
                fresh = uid not in self.ctx.heads
                row = self.ctx.head_row(uid, self.prefixes[i])
                if fresh:
                    length = self.ctx.lengths.pop(uid, len(self.tokens[i]))
                    row.drafter.bound(length - 1, len(self.prefixes[i]) + length)
                yield i, row, valid

    def _cuts(self, n: int) -> list[int]:
        """The positions inside the next ``n`` where some row's head window starts, ascending."""
        try:
            return sorted({cut for _, row, valid in self._rows(n) if (cut := row.drafter.split(valid, row.carry
                                                                                                is not None)) < valid})
        except Exception as error:  # the heads only: the trunk's pass goes on uncut
            self.ctx.fail(error)
            return []

    def _feed(self, hidden: mx.array) -> None:
        """Give each row's head its valid positions of this pass's hidden states (B, n, H), those of its window
        only. The head's work stays queued (not evaluated here): the row's first token does not wait for it."""
        for i, row, valid in self._rows(hidden.shape[1]):
            chunk = mx.array(self.tokens[i][self.done : self.done + valid], dtype=mx.uint32)
            row.carry = row.drafter.prefill(row.carry, hidden[i : i + 1, :valid], chunk)


def capture_prompt(prompt):
    """Wrap ``PromptProcessingBatch.prompt``: with MTP batching, each row's head sees its prompt."""

    @functools.wraps(prompt)
    def wrapper(self, tokens, *args, **kwargs):
        ctx = context_of(self)
        if ctx is None or not tokens:
            return prompt(self, tokens, *args, **kwargs)
        prefixes = [list(t) for t in self.tokens]  # what each row's cache held before this call
        model, self.model = self.model, _Capture(ctx, list(self.uids), prefixes, [list(t) for t in tokens])
        try:
            return prompt(self, tokens, *args, **kwargs)
        finally:
            self.model = model

    return wrapper


def start_generation(generate):
    """Wrap ``PromptProcessingBatch.generate``: with MTP batching, an ``MTPGenerationBatch`` of these rows."""

    @functools.wraps(generate)
    def wrapper(self, tokens, *args, **kwargs):
        ctx = context_of(self)
        if ctx is None:
            return generate(self, tokens, *args, **kwargs)
        if any(len(t) > 1 for t in tokens):
            self.prompt([t[:-1] for t in tokens])
        if ctx.failed:  # the head's prompt pass failed: stock rows from the prompt just processed
            return generate(self, [t[-1:] for t in tokens], *args, **kwargs)
        try:
            batch = MTPGenerationBatch.empty(self.model, self.fallback_sampler)
            batch.add_rows(self, [t[-1] for t in tokens], ctx)
        except Exception as error:
            ctx.fail(error)
            return generate(self, [t[-1:] for t in tokens], *args, **kwargs)
        for name in ("uids", "prompt_cache", "tokens", "samplers", "logits_processors", "max_tokens"):
            setattr(self, name, [])
        return batch

    return wrapper


def _stops_attribute(batch) -> str:
    """mlx-lm 0.32 names a batch's stop rules ``stop_sequences``; 0.31 ``state_machines``."""
    return "stop_sequences" if hasattr(batch, "stop_sequences") else "state_machines"


class MTPGenerationBatch:
    """mlx-lm's ``GenerationBatch`` interface (``uids``, ``prompt_cache``, ``tokens``, ``extend``, ``filter``,
    ``extract_cache``, ``next``), decoding every row with MTP cycles.

    ``tokens[i]`` lists the tokens in row i's trunk cache; between cycles ``Row.last`` is not in it. While no row
    drafts, plain steps are pipelined as mlx-lm's (``ahead``); the call that returns to drafting emits them first.
    """

    def __init__(self, model, fallback_sampler):
        from mlx_lm.generate import GenerationBatch

        self.model, self.fallback_sampler = model, fallback_sampler
        self.response = GenerationBatch.Response
        self.uids, self.prompt_cache, self.tokens, self.rows = [], [], [], []
        self.samplers, self.logits_processors, self.max_tokens, self.stops = [], [], [], []
        self.matchers, self.num_tokens = [], []
        self.head_cache = None
        self.ahead: Step | None = None  # queued plain step: every row's ``last`` fed, its next token not yet read
        self.asked: list[int] | None = None  # depths asked of the policy for a cycle that has not run yet
        self.lookup_room = MAX_LOOKUP  # the most lookup drafts a row may verify in the next pass
        self.queued_heads = False  # a row joined with a long prompt's head pairs queued: the next pass is plain

    @classmethod
    def empty(cls, model, fallback_sampler):
        """A batch with no rows."""
        return cls(model, fallback_sampler)

    def __len__(self):
        return len(self.uids)

    def add_rows(self, prompts, last: list[int], ctx: BatchContext) -> None:
        """Take over a prompt batch's rows (their trunk caches hold each prompt but its last token)."""
        from mlx_lm.models.cache import KVCache

        stops = getattr(prompts, _stops_attribute(prompts))
        self.uids += prompts.uids
        self.prompt_cache = prompts.prompt_cache
        self.tokens += prompts.tokens
        self.samplers += list(prompts.samplers) or [None] * len(prompts.uids)
        self.logits_processors += list(prompts.logits_processors) or [[]] * len(prompts.uids)
        self.max_tokens += prompts.max_tokens
        self.stops += stops
        self.matchers += [_Matcher(s) for s in stops]
        self.num_tokens += [0] * len(prompts.uids)
        heads = []
        for i, uid in enumerate(prompts.uids):
            head = ctx.head_row(uid, prompts.tokens[i])
            del ctx.heads[uid]
            ctx.lengths.pop(uid, None)
            heads.append(head.drafter.cache)
            row = join_row(ctx, uid, last[i], head.carry, self.samplers[i], self.logits_processors[i],
                       prompts.tokens[i])
            row.head_whole = head.whole and not head.drafter.first and ctx.drafter.head is not None
            self.queued_heads |= bool(head.drafter.first)
            self.rows.append(row)
        self.head_cache = KVCache.merge(heads)
        log.debug("mtp_plugin: %d rows join MTP decoding", len(prompts.uids))

    def extend(self, batch) -> None:
        """Append another batch's rows (rows joining between cycles); a fault hands every row to stock decoding."""
        rows = self._resume()
        if context_of(self) is None or not isinstance(batch, MTPGenerationBatch):  # batched MTP failed meanwhile
            self._fall_back(rows)
            self.extend(batch)  # stock's own
            return
        rows += batch._resume()
        try:
            self._join(batch)
        except Exception as error:
            self._fall_back(rows, error)

    def _join(self, batch) -> None:
        from mlx_lm.generate import _extend_cache

        for name in ("uids", "tokens", "rows", "samplers", "logits_processors", "max_tokens", "stops",
                     "matchers", "num_tokens"):
            getattr(self, name).extend(getattr(batch, name))
        if self.ahead is not None:  # pipelined plain steps: the new rows' step is queued to join them
            self.ahead = self.ahead.join(self._feed_last(context_of(self), batch))
        self.asked = None  # the policy is asked again for the larger batch
        self.queued_heads |= batch.queued_heads
        self.prompt_cache = _extend_cache(self.prompt_cache, batch.prompt_cache)
        if self.head_cache is None:
            self.head_cache = batch.head_cache
        elif batch.head_cache is not None:
            self.head_cache.extend(batch.head_cache)

    def filter(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (finished, cancelled and removed rows leave)."""
        log.debug("mtp_plugin: MTP batch of %d rows, %d leave", len(self.uids), len(self.uids) - len(keep))
        for name in ("uids", "tokens", "rows", "samplers", "logits_processors", "max_tokens", "stops",
                     "matchers", "num_tokens"):
            values = getattr(self, name)
            setattr(self, name, [values[i] for i in keep])
        if not keep:
            self.prompt_cache, self.head_cache, self.ahead, self.asked = [], None, None, None
            return
        if self.ahead is not None:
            self.ahead = self.ahead.rows(keep)
        if self.asked is not None:
            self.asked = [self.asked[i] for i in keep]
        for c in self.prompt_cache:
            c.filter(keep)
        self.head_cache.filter(keep)

    def _head_of(self, idx: int):
        """Row ``idx``'s head KV cache, unbatched (empty while no row has fed the head a pair: 1- or 2-token
        prompts decoding plain)."""
        from mlx_lm.models.cache import KVCache

        return KVCache() if self.head_cache.keys is None else self.head_cache.extract(idx)

    def extract_cache(self, idx: int) -> list:
        """Row ``idx``'s trunk caches, unbatched (they hold ``tokens[idx]``)."""
        return [c.extract(idx) for c in self.prompt_cache]

    def _depths(self, ctx: BatchContext, policy: DepthController, proposed: int) -> list[int]:
        """Each row's head depth this cycle: its own or the policy's; 0 once the head is parked. Ranks in lockstep take
        rank 0's depth after agreeing on rows, position and ``proposed`` lookup tokens (``Lockstep.agree``)."""
        parked = ctx.health.parked
        auto = policy.next_depth() if not parked and any(r.depth is None for r in self.rows) else None
        if ctx.lockstep is not None:
            auto = ctx.lockstep.agree(NONE if auto is None else auto, {
                "rows in the batch": len(self.rows), "tokens emitted": sum(self.num_tokens),
                "whether the head is parked": int(bool(parked)), "the rows' lookup proposals": proposed})
            auto = None if auto == NONE else auto
        if parked:
            return [0] * len(self.rows)
        return [auto if r.depth is None else r.depth for r in self.rows]

    def _decide(self, ctx: BatchContext, policy: DepthController) -> tuple[list[int], list[Decision]]:
        """The rows' head depths and every row's decision for this pass (``scheduler.plan``). Lookup drafts never
        exceed a row's remaining tokens; ranks in lockstep plan from the static cost prior."""
        behind = self.ahead is not None
        asks = [row.schedule.ask(0, min(self.max_tokens[i] - self.num_tokens[i] - 1 - behind, self.lookup_room),
                                 behind) for i, row in enumerate(self.rows)]
        proposed = sum(len(a.proposal) for a in asks)
        depths, self.asked = self.asked, None
        if depths is None:
            depths = self._depths(ctx, policy, proposed)
        elif ctx.lockstep is not None:  # the depths were agreed before; the proposals are new
            ctx.lockstep.agree(0, {"rows in the batch": len(self.rows), "tokens emitted": sum(self.num_tokens),
                                   "the rows' lookup proposals": proposed})
        if ctx.health.parked:
            depths = [0] * len(self.rows)
        for row, a, depth in zip(self.rows, asks, depths, strict=True):
            a.depth, a.head = depth, row.schedule.head.expected(depth)
        price = pricing(ctx.costs.of(len(self.rows)), ctx.lockstep is None, [r.schedule.lookup for r in self.rows])
        return depths, plan(asks, price)

    def _end(self, i: int, token: int) -> str | None:
        """Why row i finishes on ``token``, its next emitted token (None: it goes on), by mlx-lm's rules:
        ``max_tokens`` ("length"), then the stop sequences ("stop")."""
        self.num_tokens[i] += 1
        reason = "length" if self.num_tokens[i] >= self.max_tokens[i] else None
        if self.matchers[i].advance(token):
            reason = "stop"
        return reason

    def next(self) -> list:
        """One cycle (or, when no row drafts, one plain step pipelined as mlx-lm's): mlx-lm ``Response``s, one per
        token of every row's block. A fault of the plugin's hands the rows to stock decoding (``_fall_back``); ranks
        of a sharded model that have drifted apart raise ``lockstep.LockstepError`` instead (on every rank)."""
        if not self.uids:
            return []
        ctx, start, rows = context_of(self), time.perf_counter(), self._resume()
        if ctx is None:  # batched MTP failed in another batch of this model
            self._fall_back(rows)
            return self.next()
        try:
            policy = ctx.policy(len(self.rows), max(row.context + row.position for row in self.rows))
            depths, decisions = self._decide(ctx, policy)
            constrained = any(row.grammar is not None for row in self.rows)  # a mask needs the token before it
            late, self.queued_heads = self.queued_heads, False  # first tokens come before the head's prompt pairs
            if (late or not any(d.drafts for d in decisions)) and not constrained:
                return self._plain(ctx, policy, start)
            if self.ahead is not None:  # leave pipelined plain steps: emit the queued tokens, cycle next call
                self.asked = depths
                return self._flush_plain(ctx)
            auto = [d for row, d in zip(self.rows, decisions, strict=True) if row.depth is None]
            if auto and all(d.lookup for d in auto):
                self.asked = depths  # the policy's depth did not run: it stands for the next cycle
            return self._cycle(ctx, policy, decisions, start)
        except LockstepError:  # the ranks have drifted apart: stock decoding of their rows would not match either
            raise
        except Exception as error:
            self._fall_back(rows, error)
            return self.next()

    def _resume(self) -> list[Resume]:
        """Every row as stock decoding would resume it now (O(rows): contexts are read only on a fault)."""
        fed = self.ahead is not None  # a queued plain step holds each row's ``last`` in the trunk cache
        return [Resume(uid, tokens, len(tokens) - fed, row.last, emitted, sampler,
                       processors if row.grammar is None else [GrammarProcessor.continuing(row.grammar)], stops, most)
                for uid, tokens, row, emitted, sampler, processors, stops, most in zip(
                    self.uids, self.tokens, self.rows, self.num_tokens, self.samplers, self.logits_processors,
                    self.stops, self.max_tokens, strict=True)]

    def _fall_back(self, rows: list[Resume], error: Exception | None = None) -> None:
        """Become mlx-lm's own ``GenerationBatch`` of ``rows``; ``error`` stops batched MTP for the model."""
        if error is not None:
            self.model.mtp_batching.fail(error)
        stock = stock_batch(self.model.model, self.fallback_sampler, rows)
        self.__class__, self.__dict__ = type(stock), stock.__dict__  # the generator holds this object

    def _cycle(self, ctx: BatchContext, policy, decisions: list[Decision], start: float) -> list:
        finished = [None] * len(self.rows)

        def ends(i: int, token: int) -> bool:
            finished[i] = self._end(i, token)
            return finished[i] is not None

        lookups = [(list(d.lookup), d.match) if d.lookup else None for d in decisions]
        verified = ctx.drafter.cycle(self.rows, self.prompt_cache, self.head_cache, [d.depth for d in decisions],
                                     ends, lookups)
        if verified.nonfinite:
            ctx.health.nonfinite()
        emitted = [len(block) for block in verified.blocks]
        for i, row in enumerate(self.rows):
            self.tokens[i] += [row.last, *verified.blocks[i][: emitted[i] - 1]]
        ctx.drafter.commit(self.rows, self.prompt_cache, self.head_cache, verified, emitted)
        self._final_calls(ctx, finished, [n > a for n, a in zip(emitted, verified.accepted, strict=True)])
        seconds = time.perf_counter() - start
        if not verified.head_width:  # a pass with no head steps: its cost is the verify pass's alone
            ctx.costs.of(len(self.rows)).observe(max(verified.depths) + 1, seconds)
        for i, row in enumerate(self.rows):
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
                ctx.drafted, ctx.accepted = ctx.drafted + d, ctx.accepted + min(a, emitted[i])
                ctx.health.observe(d, a)
            else:
                row.stats.plain += 1
            if row.depth is None:
                policy.observe(d, a, seconds / len(self.rows))
        return self._respond(ctx, verified.blocks, verified.logprobs, finished)

    def _plain(self, ctx: BatchContext, policy, start: float) -> list:
        """Emit the queued plain step's tokens after queueing the next step on them (mlx-lm's pipelining)."""
        if self.ahead is None:
            self.ahead = self._feed_last(ctx, self)
        step = self.ahead
        self.ahead = ctx.drafter.plain(self.rows, self.prompt_cache, step.tokens)
        tokens = self._take(step)
        for i in range(len(self.rows)):
            self.tokens[i].append(tokens[i])  # fed by the queued step
        seconds = time.perf_counter() - start
        ctx.costs.of(len(self.rows)).observe(1, seconds)
        for row in self.rows:
            if row.depth is None:
                policy.observe(0, 0, seconds / len(self.rows))
        finished = [self._end(i, t) for i, t in enumerate(tokens)]
        return self._respond(ctx, [[t] for t in tokens], step.logprobs[:, None], finished)

    def _flush_plain(self, ctx: BatchContext) -> list:
        """Emit the queued plain step's tokens without queueing another: every row's ``last`` is unfed again."""
        step, self.ahead = self.ahead, None
        tokens = self._take(step)
        finished = [self._end(i, t) for i, t in enumerate(tokens)]
        self._final_calls(ctx, finished, [True] * len(tokens))
        return self._respond(ctx, [[t] for t in tokens], step.logprobs[:, None], finished)

    def _final_calls(self, ctx: BatchContext, finished: list, unfed: list[bool]) -> None:
        """Call the processors on the last token of each finishing row whose token no pass fed (``unfed``), as mlx-lm's
        ``GenerationBatch`` does (``BatchDrafter.final_call``: one trunk step on a copy of the row's cache)."""
        for i, row in enumerate(self.rows):
            if finished[i] is not None and unfed[i] and row.processors:
                ctx.drafter.final_call(row, self.extract_cache(i))

    @staticmethod
    def _feed_last(ctx: BatchContext, batch) -> Step:
        """Queue a plain step on every row's ``last`` (unfed) of ``batch``."""
        last = [row.last for row in batch.rows]
        for i, token in enumerate(last):
            batch.tokens[i].append(token)
        return ctx.drafter.plain(batch.rows, batch.prompt_cache, mx.array(last, dtype=mx.uint32))

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

    def _responder(self, logprobs: mx.array, blocks: list[list[int]]):
        """``make(i, j, token, reason)``: mlx-lm's ``Response`` for token j of row i's block (``reason``: why the row
        finishes on it, or None)."""

        def make(i: int, j: int, token: int, reason: str | None):
            return self.response(uid=self.uids[i], token=token, logprobs=logprobs[i, j], finish_reason=reason,
                                 prompt_cache=self.extract_cache(i) if reason else None,
                                 all_tokens=self.tokens[i] if reason else None, **self.matchers[i].fields())

        return make

    def _respond(self, ctx: BatchContext, blocks: list[list[int]], logprobs: mx.array, finished) -> list:
        """The runtime's responses for every row's emitted ``blocks`` (log-probs (B, L, V)); finished rows leave."""
        make = self._responder(logprobs, blocks)
        responses, keep = [], []
        for i in range(len(self.uids)):
            for j, token in enumerate(blocks[i]):
                final = j == len(blocks[i]) - 1 and finished[i] is not None
                responses.append(make(i, j, token, finished[i] if final else None))
            if finished[i] is None:
                keep.append(i)
            elif self.rows[i].head_whole:
                ctx.remember(self.tokens[i], self._head_of(i), self.rows[i].pending)
        ctx.cycles += 1
        ctx.row_cycles += len(self.uids)
        ctx.tokens += len(responses)
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses


def join_row(ctx: BatchContext, uid: int, last: int, carry, sampler, processors, tokens) -> Row:
    """The decoding state of a request joining the batch, from its MTP options and sampler."""
    options = ctx.options.pop(uid, None)
    asked = options.resolved() if options is not None else command_line()
    wanted, depth = asked.enabled, asked.depth
    sampling = SAMPLINGS.get(sampler, False) if sampler is not None else None
    headless = ctx.drafter.head is None
    lookup = None
    if wanted and sampling is not False:
        lookup = lookup_policy(asked.lookup, headless, ctx.lookup_prior if sampling is not None else None)
        if lookup is not None:
            lookup.index = ctx.lookup_index([*tokens, last], lookup.index)
    if not wanted or sampling is False:
        depth, sampling = 0, None
    elif headless:
        depth = 0  # lookup drafts (when on) or plain steps
    stats = MTPStats(depth or None)
    if options is not None and wanted:
        options.stats = stats
    grammar, processors = grammar_of(processors)
    row = Row(last, sampling=sampling, sampler=sampler, processors=processors,
              history=mx.array(tokens, dtype=mx.uint32) if processors else None, depth=depth, stats=stats,
              schedule=RowState(lookup), grammar=grammar, context=len(tokens) + 1)
    if headless:
        row.pending = PendingPairs(window=0)  # no head: no pairs kept
    if carry is not None:
        row.keep(carry, mx.array([last], dtype=mx.uint32))
    return row


def log_summary(ctx: BatchContext) -> None:
    """One INFO line on the batched passes decoded with a head (when the server stops)."""
    if ctx.cycles:
        log.info("mtp_plugin: batched MTP: %d passes (cycles and plain steps) emitted %d tokens, %.2f per row and "
                 "pass; drafted %d, accepted %d (acceptance %.3f)", ctx.cycles, ctx.tokens,
                 ctx.tokens / max(ctx.row_cycles, 1), ctx.drafted, ctx.accepted, ctx.accepted / max(ctx.drafted, 1))


class _Matcher:
    """A row's stop rule, over mlx-lm 0.32's ``StopSequences`` or 0.31's ``SequenceStateMachine``."""

    def __init__(self, stops):
        self.stops = stops
        self.modern = hasattr(stops, "matcher")
        self.state = stops.matcher() if self.modern else stops.make_state()
        self.unsent = deque()  # 0.31: each advanced token's fields, until its Response is made

    def advance(self, token: int) -> bool:
        """Whether ``token`` completes a stop sequence."""
        if self.modern:
            return self.state.advance(token)
        self.state, match, current = self.stops.match(self.state, token)
        self.unsent.append({"current_state": current, "match_sequence": match})
        return match is not None and current is None

    def fields(self) -> dict:
        """The version's extra ``Response`` fields for the oldest advanced token not yet responded to (0.31's server
        files a token's text by its state: a block's tokens keep their own)."""
        return {} if self.modern else self.unsent.popleft()

