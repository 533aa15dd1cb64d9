"""mlx-lm adapter, continuous batching: MTP cycles inside mlx-lm's own ``BatchGenerator`` (``batching_model``). Its
prompt batches also feed each row's head; its generation batch is an ``MTPGenerationBatch``, mlx-lm's
``GenerationBatch`` interface over the engine's ``decoding.continuous.BatchLoop`` (or, after a fault, over a stock
batch of the same rows). Design: docs/mlx-lm-server.md."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import deque
from dataclasses import dataclass

import mlx.core as mx

from mtp_plugin.decoding.batch import BatchDrafter, Row
from mtp_plugin.decoding.batching import BatchingState
from mtp_plugin.decoding.continuous import BatchLoop, new_row
from mtp_plugin.decoding.grammar import GrammarProcessor
from mtp_plugin.decoding.lockstep import Lockstep, group_of
from mtp_plugin.decoding.options import MTPOptions
from mtp_plugin.decoding.state import state_of
from mtp_plugin.decoding.trunk import LogitsTrunk
from mtp_plugin.head.health import HeadHealth
from mtp_plugin.plugins import hook

from .capture import rollback_ready
from .loop_batch import LoopBatch, context_of
from .mlx_lm_decoding import CAPTURED, generation_stream
from .mlx_lm_fallback import Resume, stock_batch
from .mlx_lm_sampling import SAMPLINGS

log = logging.getLogger("mtp_plugin")


class BatchingModel:
    """The model as an MTP ``BatchGenerator`` sees it: calls and attributes go to the model; ``mtp_batching``
    is the context, so only this generator's prompt and generation batches decode with MTP."""

    def __init__(self, model, ctx: BatchingState):
        self.model, self.mtp_batching = model, ctx

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def batching_model(model) -> BatchingModel | None:
    """``model`` wrapped for MTP batching, or None when it has no head whose trunk layers can be rolled back (nor, for a
    model without a head, lookup drafts: ``headless_context``)."""
    from mlx_lm.models.cache import KVCache

    loaded = getattr(model, "mtp_head", None)
    if loaded is None:
        ctx = headless_context(model)
        return None if ctx is None else BatchingModel(model, ctx)
    if not rollback_ready(CAPTURED, loaded.location.model_type):
        return None
    trunk = hook().mtp_trunk(model=model, contract=loaded.module.contract)
    if trunk is None:
        return None
    state = state_of(model, loaded)
    ctx = state.batching
    if ctx is not None and ctx.failed:
        return None
    if ctx is None:
        group = group_of(model)
        ctx = state.batching = BatchingState(trunk, BatchDrafter(trunk, loaded.module), loaded.health,
                                             state.scheduler, KVCache, None if group is None else Lockstep(group))
    if ctx.lockstep is not None:  # every rank batches with MTP here; the ranks' draft vocabularies must match
        stream = generation_stream()  # after whatever a previous batch left queued there
        with mx.stream(stream) if stream is not None else contextlib.nullcontext():
            ctx.lockstep.start(loaded, True, {})
    ctx.drafter.vocab = loaded.draft_vocab
    ctx.restart()
    return BatchingModel(model, ctx)


def headless_context(model) -> BatchingState | None:
    """The batching state of a model without a head when the server serving it runs with ``--mtp-lookup``
    (``ModelState.serving``) on one process and its trunk can be rolled back (kept in its ``state.ModelState``; a
    failed one is replaced). None: stock batching (one warning when the model's caches cannot be made here)."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    state = state_of(model, None)
    if state.serving is None or not state.serving.lookup or group_of(model) is not None:
        return None
    model_type = getattr(model, "model_type", None)
    try:
        trims = all(c.is_trimmable() for c in make_prompt_cache(model))
    except Exception as error:  # a model of another runtime's making: served as stock serves it
        log.warning("mtp_plugin: no lookup drafts for this model's batches (%s: %s)", type(error).__name__, error)
        return None
    if not (CAPTURED.get(model_type) or trims):
        return None
    ctx = state.batching
    if ctx is None or ctx.failed:
        trunk = LogitsTrunk(model)
        ctx = state.batching = BatchingState(trunk, BatchDrafter(trunk, None), HeadHealth("no head"),
                                             state.scheduler, KVCache)
    ctx.restart()
    return ctx


class _Capture:
    """Stands in for the model during ``PromptProcessingBatch.prompt``: runs the trunk for its hidden states
    and feeds each row's valid positions (right padding excluded) to that row's head. A chunk is cut where a row's
    head window starts (``Drafter.split``), so the trunk's last layer runs only for the windows."""

    def __init__(self, ctx: BatchingState, uids: list[int], prefixes: list[list[int]], tokens: list[list[int]]):
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
            batch = MTPGenerationBatch.of_prompts(self, [t[-1] for t in tokens], ctx)
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


@dataclass
class LMRow:
    """What mlx-lm's side of a row keeps (``Row.extra``): its stop rule as mlx-lm gave it and its matcher."""

    stops: object
    matcher: _Matcher


class LMRuntime:
    """mlx-lm's side of ``decoding.continuous.Runtime``: its stop rule (``max_tokens``, then stop sequences), its
    ``GenerationBatch.Response``, its caches' ``_extend_cache``."""

    batched_verify = True

    def __init__(self):
        from mlx_lm.generate import GenerationBatch, _extend_cache

        self.response, self._extend = GenerationBatch.Response, _extend_cache

    def prepare(self, rows: list[Row]) -> None:
        """Nothing: mlx-lm's trunk positions come from its caches."""

    def lookup_room(self) -> None:
        return None

    def end(self, row: Row, token: int) -> str | None:
        """"length" at ``max_tokens``, then "stop" when ``token`` completes a stop sequence (mlx-lm's order)."""
        reason = "length" if row.emitted >= row.max_tokens else None
        if row.extra.matcher.advance(token):
            reason = "stop"
        return reason

    def responder(self, loop: BatchLoop, logprobs: mx.array, blocks: list[list[int]]):
        def make(i: int, j: int, token: int, reason: str | None):
            row = loop.rows[i]
            return self.response(uid=row.uid, token=token, logprobs=logprobs[i, j], finish_reason=reason,
                                 prompt_cache=loop.extract_cache(i) if reason else None,
                                 all_tokens=row.tokens if reason else None, **row.extra.matcher.fields())

        return make

    def extend_caches(self, caches: list, other: list) -> list:
        return self._extend(caches, other)


class MTPGenerationBatch(LoopBatch):
    """mlx-lm's ``GenerationBatch`` interface (``uids``, ``prompt_cache``, ``tokens``, ``extend``, ``filter``,
    ``extract_cache``, ``next``) over the engine's ``BatchLoop``, or after a fault over mlx-lm's own
    ``GenerationBatch`` of the same rows (``LoopBatch``)."""

    def __init__(self, model, fallback_sampler, loop: BatchLoop | None = None):
        super().__init__(model, loop if loop is not None else BatchLoop(model.mtp_batching, LMRuntime()))
        self.fallback_sampler = fallback_sampler

    @classmethod
    def empty(cls, model, fallback_sampler) -> MTPGenerationBatch:
        """A batch with no rows."""
        return cls(model, fallback_sampler)

    @classmethod
    def of_prompts(cls, prompts, last: list[int], ctx: BatchingState) -> MTPGenerationBatch:
        """The rows of prompt batch ``prompts`` (their trunk caches hold each prompt but its last token, ``last``)
        with the heads their prompts fed."""
        stops = getattr(prompts, _stops_attribute(prompts))
        count = len(prompts.uids)
        samplers = list(prompts.samplers) or [None] * count
        processors = list(prompts.logits_processors) or [[]] * count
        rows, heads, queued = [], [], False
        for i, uid in enumerate(prompts.uids):
            head = ctx.head_row(uid, prompts.tokens[i])
            del ctx.heads[uid]
            ctx.lengths.pop(uid, None)
            heads.append(head.drafter.cache)
            request = ctx.options.pop(uid, None)
            options = request.resolved() if request is not None else MTPOptions()
            sampling = SAMPLINGS.get(samplers[i], False) if samplers[i] is not None else None
            row = new_row(ctx, uid, last[i], head.carry, options, sampling, samplers[i], processors[i],
                          prompts.tokens[i], prompts.max_tokens[i], LMRow(stops[i], _Matcher(stops[i])))
            if request is not None and options.enabled:
                request.stats = row.stats
            row.head_whole = head.whole and not head.drafter.first and ctx.drafter.head is not None
            queued |= bool(head.drafter.first)
            rows.append(row)
        loop = BatchLoop(ctx, LMRuntime(), rows, prompts.prompt_cache, type(heads[0]).merge(heads), queued)
        log.debug("mtp_plugin: %d rows join MTP decoding", count)
        return cls(prompts.model, prompts.fallback_sampler, loop)

    @property
    def tokens(self) -> list[list[int]]:
        """Per row the tokens in its trunk cache."""
        return self.stock.tokens if self.stock is not None else [row.tokens for row in self.loop.rows]

    def extract_cache(self, idx: int) -> list:
        """Row ``idx``'s trunk caches, unbatched (they hold ``tokens[idx]``)."""
        return (self.stock if self.stock is not None else self.loop).extract_cache(idx)

    def _resume(self) -> list[Resume]:
        """Every row as stock decoding would resume it now (O(rows): contexts are read only on a fault)."""
        fed = self.loop.fed  # a queued plain step holds each row's ``last`` in the trunk cache
        return [Resume(row.uid, row.tokens, len(row.tokens) - fed, row.last, row.emitted, row.sampler,
                       row.processors if row.grammar is None else [GrammarProcessor.continuing(row.grammar)],
                       row.extra.stops, row.max_tokens)
                for row in self.loop.rows]

    def _stock(self, rows: list[Resume]):
        return stock_batch(self.model.model, self.fallback_sampler, rows)


def log_summary(ctx: BatchingState) -> None:
    """One INFO line on the batched passes decoded with a head (when the server stops)."""
    summary = ctx.summary()
    if summary is not None:
        log.info("mtp_plugin: %s", summary)


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

