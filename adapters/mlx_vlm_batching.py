"""mlx-vlm adapter, continuous batching: MTP cycles inside mlx-vlm's own ``BatchGenerator`` on a ``BatchingModel``. Its
prompt batches also feed each row's head (media embeddings and multimodal positions included); the generation
batch they hand over becomes a ``VLMGenerationBatch``, mlx-vlm's ``GenerationBatch`` interface over the engine's
``decoding.continuous.BatchLoop`` with mlx-vlm's caches, rope deltas, stop rule and responses (``VLMRuntime``).
Design: docs/mlx-vlm.md#server."""

from __future__ import annotations

import contextlib
import functools
import importlib
from dataclasses import dataclass, field

import mlx.core as mx

from mtp_plugin.decoding.batch import BatchDrafter, Row
from mtp_plugin.decoding.batching import BatchingState
from mtp_plugin.decoding.continuous import BatchLoop, new_row
from mtp_plugin.decoding.drafter import Drafter
from mtp_plugin.decoding.grammar import GrammarProcessor
from mtp_plugin.decoding.options import MTPOptions
from mtp_plugin.decoding.state import state_of
from mtp_plugin.decoding.trunk import PromptInputs, StackTrunk

from .loop_batch import LoopBatch, context_of
from .mlx_lm_sampling import SAMPLINGS
from .patching import release

# mlx-vlm 0.7 runs a multi-token pass over left-padded caches as one batched pass when asked for captured layers (as its
# own drafter's verify does), else one pass per row on copies of the caches; 0.6 also switches its GatedDeltaNet layers
# to its own verify mode then, so there the passes run per row.
ONE_BATCHED_PASS = release("mlx-vlm") >= (0, 7, 0)


class VLMBatchTrunk(StackTrunk):
    """The trunk of batched passes over mlx-vlm's language model: each pass is the model's own call, positioned by
    the rows' cache offsets and rope ``deltas`` (B, 1) (the batch's ``_rope_deltas``; None: text positions)."""

    def __init__(self, model, contract):
        super().__init__(model, contract)
        self.language_model, self.deltas = model.language_model, None

    def _run(self, tokens, cache):
        keywords = {} if self.deltas is None else {"rope_deltas": self.deltas}
        if ONE_BATCHED_PASS:
            keywords["capture_layer_ids"] = []
        output = self.language_model(tokens, cache=cache, return_hidden=True, skip_logits=True, **keywords)
        return output.hidden_states[-1]

    def batch_head_positions(self, head_cache, length: int) -> mx.array | None:
        """Multimodal positions (3, B, length), int32, of each row's next ``length`` head pairs: pair j sits where the
        trunk put token j, j + the row's rope delta (its cache offset counts its pairs); None without ``deltas``."""
        if self.deltas is None or not self.mrope:
            return None
        offsets = mx.array(head_cache.offset).reshape(-1)[:, None]
        rows = offsets + mx.arange(length)[None] + self.deltas.reshape(-1, 1)
        return mx.broadcast_to(rows[None].astype(mx.int32), (3, *rows.shape))


@dataclass
class PromptHead:
    """A request's head while its prompt is processed: its drafter (trunk view: the request's own embeddings and
    positions), the prompt's token ids, and the last unpaired hidden state (``carry``)."""

    drafter: Drafter
    tokens: list[int]
    keywords: dict  # the prompt's keywords as the server inserted them (``inputs_embeds``, positions, media fields)
    carry: mx.array | None = None


@dataclass
class VLMBatching(BatchingState):
    """``BatchingState`` of an mlx-vlm model: also the server's generator settings each generation batch needs."""

    model: object = None  # the full mlx-vlm model (``language_model``, ``mtp_head``)
    generator: dict = field(default_factory=dict)  # sampler, stop rule, logprob settings of the current generator
    waiting: bool = False  # a prompt waits for its prefill, which mlx-vlm runs after the next pass

    def admit(self, uid: int, tokens: list[int], keywords: dict, options) -> None:
        """Register request ``uid`` before its prompt is processed: its MTP options and its head, fed from the
        prompt's own embeddings (``keywords["inputs_embeds"]`` (1, T, H)) and multimodal positions."""
        from mlx_vlm.models.cache import KVCache

        self.options[uid] = options
        embeddings = keywords.get("inputs_embeds")
        prompt = None
        if embeddings is not None:
            positions = keywords.get("position_ids")
            prompt = PromptInputs(embeddings, None, {} if positions is None else {"position_ids": positions})
        trunk = StackTrunk(self.model, self.drafter.head.contract, prompt)
        self.heads[uid] = PromptHead(Drafter(self.drafter.head, trunk, KVCache()), list(tokens), dict(keywords))

    def forget(self, uid: int) -> None:
        """Drop what ``admit`` registered for ``uid`` (a cancelled request)."""
        self.options.pop(uid, None)
        self.heads.pop(uid, None)


def batching_context(model, loaded) -> VLMBatching | None:
    """The batching context of an mlx-vlm ``model`` with head ``loaded`` (kept on it), or None when its batches decode
    stock: a head whose contract reads pre-norm hidden states (prompt passes give post-norm ones), or after a fault."""
    if loaded.module.contract.hidden != "post_norm":
        return None
    from mlx_vlm.models.cache import KVCache

    state = state_of(model.language_model, loaded)
    ctx = state.batching
    if ctx is None:
        trunk = VLMBatchTrunk(model, loaded.module.contract)
        ctx = state.batching = VLMBatching(trunk, BatchDrafter(trunk, loaded.module), loaded.health, state.scheduler,
                                           KVCache, model=model)
    if ctx.failed:
        return None
    ctx.drafter.vocab = loaded.draft_vocab
    ctx.restart()  # request ids restart with each generator
    return ctx


class _Capture:
    """Stands in for the language model during a prompt batch's passes: the model's own call, whose post-norm hidden
    states also feed each row's head its valid positions (left padding excluded)."""

    def __init__(self, batch, ctx: VLMBatching):
        self.batch, self.ctx, self.model = batch, ctx, batch.model

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, inputs, *args, **kwargs):
        output = self.model(inputs, *args, return_hidden=True, **kwargs)
        if not self.ctx.failed:
            try:
                self._feed(output.hidden_states[-1])
            except Exception as error:  # the heads' history only: the trunk's pass above is whole
                self.ctx.fail(error)
        return output

    def _feed(self, hidden: mx.array) -> None:
        done, n, states = self.batch._processed_prompt_columns, hidden.shape[1], []
        for i, uid in enumerate(self.batch.uids):
            row = self.ctx.heads.get(uid)
            if row is None:
                continue
            skip = max(0, self.batch._left_padding_per_row[i] - done)
            first = done + skip - self.batch._left_padding_per_row[i]  # the chunk's first token of this row
            if skip >= n:
                continue
            chunk = mx.array(row.tokens[first : first + n - skip], dtype=mx.uint32)
            row.carry = row.drafter.prefill(row.carry, hidden[i : i + 1, skip:], chunk)
            cache = row.drafter.cache
            states += [row.carry, *(cache.state if cache.offset else ())]
        mx.eval(states)


@contextlib.contextmanager
def _capturing(batch, ctx: VLMBatching):
    batch.model = _Capture(batch, ctx)
    try:
        yield
    finally:
        batch.model = batch.model.model


def capture_prompt_step(prompt_step):
    """Wrap ``PromptProcessingBatch.prompt_step``: with MTP batching, each row's head sees its prompt chunk."""

    @functools.wraps(prompt_step)
    def wrapper(self, *args, **kwargs):
        ctx = context_of(self)
        if ctx is None:
            return prompt_step(self, *args, **kwargs)
        with _capturing(self, ctx):
            return prompt_step(self, *args, **kwargs)

    return wrapper


def start_generation(generate):
    """Wrap ``PromptProcessingBatch.generate``: with MTP batching, the prompt's last chunk also feeds the heads, and the
    stock generation batch it returns becomes a ``VLMGenerationBatch`` of the same rows (a fault: the stock one)."""

    @functools.wraps(generate)
    def wrapper(self, *args, **kwargs):
        ctx = context_of(self)
        if ctx is None:
            return generate(self, *args, **kwargs)
        uids = list(self.uids)
        with _capturing(self, ctx):
            stock = generate(self, *args, **kwargs)
        stock.model = stock._language_model = self.model  # not the capture it was built with
        heads = [ctx.heads.pop(uid, None) for uid in uids]
        if ctx.failed or any(head is None for head in heads):
            return stock
        try:
            return VLMGenerationBatch.take_over(stock, ctx, heads)
        except Exception as error:
            ctx.fail(error)
            return stock

    return wrapper


def _batched(caches: list) -> list:
    """Caches with a batch dimension each (mlx-vlm gives a one-row prompt batch plain ones), as its ``extend`` does."""
    return [c if callable(getattr(c, "filter", None)) or not hasattr(type(c), "merge") else type(c).merge([c])
            for c in caches]


@dataclass
class VLMRow:
    """What mlx-vlm's side of a row keeps (``Row.extra``): whether its first token, drawn by the prompt batch, is still
    to be emitted (``fresh``) and that token's log-prob and top log-probs (``first``); its prompt keywords; its rope
    delta (1, 1) (None: text positions); its logits processors as mlx-vlm gave them."""

    fresh: bool
    first: tuple
    prompt: dict
    delta: mx.array | None
    processors: list


class VLMRuntime:
    """mlx-vlm's side of ``decoding.continuous.Runtime``: its stop rule, its responses (log-probs read for the whole
    batch at once), its caches' ``_extend_cache``, the rows' rope deltas given to the trunk before each pass; no
    lookup drafts while a prompt waits for its prefill (``VLMBatching.waiting``)."""

    batched_verify = ONE_BATCHED_PASS

    def __init__(self, ctx: VLMBatching, settings: dict):
        self.ctx, self.settings = ctx, settings  # the generator's: sampler, stop_criteria, compute_logprobs, …
        self.ar = importlib.import_module("mlx_vlm.generate.ar")
        self.response = self.ar.GenerationBatch.Response

    def prepare(self, rows: list[Row]) -> None:
        """The trunk takes the rows' rope deltas (B, 1), or None for text positions; ValueError when rows mix both."""
        deltas = [row.extra.delta for row in rows]
        if all(d is None for d in deltas):
            self.ctx.trunk.deltas = None
        elif any(d is None for d in deltas):
            raise ValueError("a batch mixes rows with and without rope deltas")
        else:
            self.ctx.trunk.deltas = mx.concatenate(deltas)

    def lookup_room(self) -> int | None:
        """0 while a prompt waits: its prefill runs after this pass, which lookup drafts must not widen."""
        return 0 if self.ctx.waiting else None

    def end(self, row: Row, token: int) -> str | None:
        """"stop" by the generator's stop rule, then "length" at ``max_tokens`` (mlx-vlm's order)."""
        if self.settings["stop_criteria"](token):
            return "stop"
        return "length" if row.emitted >= row.max_tokens else None

    def responder(self, loop: BatchLoop, logprobs: mx.array, blocks: list[list[int]]):
        chosen, top = _token_logprobs(logprobs, blocks, self.settings)

        def make(i: int, j: int, token: int, reason: str | None):
            return self.response(uid=loop.rows[i].uid, token=token, token_logprob=chosen[i][j], finish_reason=reason,
                                 top_logprobs=None if top is None else top[i][j])

        return make

    def extend_caches(self, caches: list, other: list) -> list:
        return self.ar._extend_cache(caches, other)

    def first_response(self, row: Row, reason: str | None):
        """The response for a fresh row's first token (``row.last``)."""
        logprob, top = row.extra.first
        return self.response(uid=row.uid, token=row.last, token_logprob=logprob, finish_reason=reason,
                             top_logprobs=top)


class VLMGenerationBatch(LoopBatch):
    """mlx-vlm's ``GenerationBatch`` interface (``uids``, ``prompt_cache``, ``logits_processors``, ``extend``,
    ``filter``, ``next``, ``cache_states``) over the engine's ``BatchLoop``, or after a fault over mlx-vlm's own
    ``GenerationBatch`` of the same rows (``LoopBatch``). A row joins with its first token drawn by the prompt batch
    (``VLMRow.fresh``): the next call emits it first."""

    is_speculative = False

    @classmethod
    def take_over(cls, stock, ctx: VLMBatching, heads: list[PromptHead]) -> VLMGenerationBatch:
        """The rows of mlx-vlm's fresh ``GenerationBatch`` ``stock`` (first tokens drawn, not yet fed) with the heads
        their prompts fed."""
        runtime = VLMRuntime(ctx, dict(ctx.generator))
        count = len(stock.uids)
        first = stock._next_tokens.tolist()
        firsts = _first_logprobs(stock, count)
        processors = [list(p or []) for p in (list(stock.logits_processors) or [None] * count)]
        sampler = runtime.settings["described"]  # None when greedy
        keyed = runtime.settings["keyed"]
        deltas = stock._rope_deltas
        rows = []
        for i, uid in enumerate(stock.uids):
            request = ctx.options.pop(uid, None)
            options = request.resolved() if request is not None else MTPOptions()
            sampling = SAMPLINGS.get(sampler, False) if sampler is not None else None
            extra = VLMRow(True, firsts[i], heads[i].keywords, None if deltas is None else deltas[i : i + 1],
                           processors[i])
            row = new_row(ctx, uid, first[i], heads[i].carry, options, sampling, sampler, processors[i],
                          heads[i].tokens, stock.max_tokens[i], extra)
            if request is not None and options.enabled:
                request.stats = row.stats
            row.head_whole, row.position = False, 1  # the prompt batch drew generated token 0
            if row.grammar is not None:  # drawn under it by mlx-vlm's own step
                row.grammar.advance([first[i]])
                row.grammar.commit()
            if row.sampling is None and keyed is not None:  # plain steps keep mlx-vlm's keyed draws
                row.sampling = keyed
            rows.append(row)
        head_cache = type(heads[0].drafter.cache).merge([head.drafter.cache for head in heads])
        return cls(stock.model, BatchLoop(ctx, runtime, rows, _batched(stock.prompt_cache), head_cache))

    @property
    def logits_processors(self) -> list:
        """Per row its logits processors as mlx-vlm gave them."""
        if self.stock is not None:
            return self.stock.logits_processors
        return [row.extra.processors for row in self.loop.rows]

    def cache_states(self) -> list:
        """The trunk caches' states (mlx-vlm evaluates them every few steps)."""
        return [c.state for c in self.prompt_cache if hasattr(c, "state")]

    def _before(self) -> list:
        """The joining rows' first tokens (finished rows leave)."""
        responses, keep, loop = [], [], self.loop
        for i, row in enumerate(loop.rows):
            if row.extra.fresh:
                row.extra.fresh = False
                reason = loop.end(row, row.last)
                responses.append(loop.runtime.first_response(row, reason))
                if reason is not None:
                    continue
            keep.append(i)
        if len(keep) < len(loop):
            loop.filter(keep)
        return responses

    def _resume(self) -> list[Resume]:
        """Every row as stock decoding would resume it now (read before a call changes anything)."""
        fed = self.loop.fed  # a queued plain step holds each row's ``last`` in the trunk cache
        return [Resume(row.uid, row.tokens[: len(row.tokens) - fed], row.last, row.emitted, row.extra.fresh,
                       row.extra.prompt, row.extra.delta, row.max_tokens,
                       row.extra.processors if row.grammar is None else [GrammarProcessor.continuing(row.grammar)])
                for row in self.loop.rows]

    def _stock(self, rows: list[Resume]):
        return stock_batch(self.model.model, self.loop.runtime.settings, rows)


@dataclass
class Resume:
    """One row as stock decoding resumes it: ``tokens`` were in its trunk cache, ``last`` is not yet fed; ``emitted``
    tokens were sent (``fresh``: ``last`` not among them); ``prompt``: its prompt keywords; ``delta`` (1, 1) or None."""

    uid: int
    tokens: list[int]
    last: int
    emitted: int
    fresh: bool
    prompt: dict
    delta: mx.array | None
    max_tokens: int
    processors: list


def stock_batch(model, settings: dict, rows: list[Resume]):
    """mlx-vlm's ``GenerationBatch`` decoding ``rows`` from where they stood, each row's trunk cache rebuilt by a stock
    prompt pass over its tokens (the prompt's own embeddings and positions, then the generated tokens'); a row whose
    ``last`` was emitted already has it fed by one stock step whose emission is dropped. ``model``: the runtime's."""
    ar = importlib.import_module("mlx_vlm.generate.ar")
    stock = None
    for row in rows:
        part = ar.GenerationBatch(
            model, [row.uid], mx.array([row.last], dtype=mx.uint32), _rebuilt_cache(ar, model, settings, row),
            settings["sampler"], settings["stop_criteria"], [row.max_tokens],
            top_logprobs_k=settings["top_logprobs_k"], greedy_sampling=settings["greedy_sampling"],
            token_context=[list(row.tokens)], logits_processors=[row.processors or None],
            thinking_budget_criteria=[None])
        part.compute_logprobs = settings["compute_logprobs"]
        part._rope_deltas = row.delta
        part._num_tokens = [row.emitted - (not row.fresh)]
        if not row.fresh:
            part._step()  # feeds ``last`` and draws the next token at its position; ``last`` is not emitted again
            part._num_tokens = [row.emitted]
        if stock is None:
            stock = part
        else:
            stock.extend(part)
    return stock


def _rebuilt_cache(ar, model, settings: dict, row: Resume) -> list:
    """A fresh trunk cache holding ``row.tokens``: the prompt's embeddings and multimodal positions, then the generated
    tokens' embeddings, token t at position t + the row's rope delta (mlx-vlm's rule after a prompt); the token the
    stock prompt pass samples is dropped."""
    prompt = dict(row.prompt)
    embeddings = prompt.pop("inputs_embeds")
    generated = row.tokens[embeddings.shape[1]:]
    if generated:
        more = model.model.embed_tokens(mx.array([generated], dtype=mx.uint32)).astype(embeddings.dtype)
        embeddings = mx.concatenate([embeddings, more], axis=1)
        positions = prompt.get("position_ids")
        if positions is not None:
            start = positions.shape[-1] + (0 if row.delta is None else row.delta.reshape(-1)[0])
            after = mx.broadcast_to(mx.arange(len(generated)) + start, (*positions.shape[:-1], len(generated)))
            prompt["position_ids"] = mx.concatenate([positions, after.astype(positions.dtype)], axis=-1)
    prompt = {k: v for k, v in prompt.items() if not k.startswith("_")}
    batch = ar.PromptProcessingBatch(model, [0], [list(row.tokens)], [1], embeddings, prompt)
    while batch.needs_processing():
        batch.prompt_step()
    return batch.generate(settings["sampler"], settings["stop_criteria"], compute_logprobs=False).prompt_cache


def _first_logprobs(stock, count: int) -> list[tuple[float, list | None]]:
    """Per row of a fresh stock batch, its first token's log-prob (0.0 when not computed) and top log-probs."""
    chosen = stock._next_lps.tolist() if stock._next_lps is not None else [0.0] * count
    if stock._next_top_idx is None:
        return [(lp, None) for lp in chosen]
    ids, lps = stock._next_top_idx.tolist(), stock._next_top_lp.tolist()
    return [(chosen[i], list(zip(ids[i], lps[i], strict=True))) for i in range(count)]


def _token_logprobs(logprobs: mx.array, blocks: list[list[int]], settings: dict):
    """``(chosen, top)``: per row and emitted token its log-prob (0.0 unless the generator computes them) and, with
    ``top_logprobs_k``, its top-k ``(id, log-prob)`` pairs (else None); one host read for the batch."""
    width = max(len(b) for b in blocks)
    k = settings.get("top_logprobs_k", 0)
    if not settings.get("compute_logprobs") and not k:
        return [[0.0] * len(b) for b in blocks], None
    tokens = mx.array([b + [0] * (width - len(b)) for b in blocks], dtype=mx.uint32)
    window = logprobs[:, :width]
    chosen = mx.take_along_axis(window, tokens[..., None], axis=-1)[..., 0]
    arrays = [chosen]
    if k:
        top_ids = mx.argsort(window, axis=-1)[..., -k:][..., ::-1].astype(mx.int32)
        arrays += [top_ids, mx.take_along_axis(window, top_ids, axis=-1)]
    values = [a.tolist() for a in arrays]
    chosen = values[0] if settings.get("compute_logprobs") else [[0.0] * width for _ in blocks]
    if not k:
        return chosen, None
    return chosen, [[list(zip(values[1][i][j], values[2][i][j], strict=True)) for j in range(width)]
                    for i in range(len(blocks))]
