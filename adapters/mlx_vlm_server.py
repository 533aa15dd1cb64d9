"""mlx-vlm adapter, server: for a model with a loaded head the server's ``BatchGenerator`` is a ``SplitGenerator``:
mlx-vlm's own generator on a ``BatchingModel``, whose rows decode with MTP in one batch (``mlx_vlm_batching``), and a
stock one beside it, built when a request needs it (thinking budgets, ``response_format``). Design: docs/mlx-vlm.md."""

from __future__ import annotations

import functools
import importlib
import json
import logging
import os
from dataclasses import dataclass

from mtp_plugin.decoding.grammar import GrammarProcessor
from mtp_plugin.decoding.options import MTPOptions
from mtp_plugin.decoding.single import MAX_DEPTH
from mtp_plugin.decoding.state import state_of

from .capture import rollback_ready
from .mlx_lm_batching import BatchingModel
from .mlx_lm_decoding import command_line_options
from .mlx_lm_sampling import SAMPLINGS
from .mlx_lm_server import MTPRequest, MTPRequestError, RequestProcessors, parse_request, with_mtp_flags
from .mlx_vlm_batching import batching_context, capture_prompt_step, start_generation
from .mlx_vlm_decoding import KV_CACHE_OPTIONS
from .mlx_vlm_sampling import server_sampling

log = logging.getLogger("mtp_plugin")
SERVER_OPTIONS = "MLX_VLM_MTP_OPTIONS"  # the server's MTP flags, passed as mlx-vlm passes its own (the environment)
SERVER_HELP = {  # mlx-vlm's server decodes with MTP by default, as mlx-lm's
    "plugin": "Enable a plugin; 'mtp' decodes with the checkpoint's MTP head (on by default).",
    "depth": f"MTP draft depth 1-{MAX_DEPTH} (0: automatic).",
    "off": "Serve without the MTP head (a request's \"enable_mtp\": true still drafts).",
    "lookup": "Draft from the context too (prompt lookup; the default).",
    "no_lookup": "Draft from the MTP head only (a request's \"mtp_lookup\" decides for itself).",
}


def read_request_options(build_gen_args):
    """Wrap ``request_normalization._build_gen_args``: the request's MTP options ride on the
    returned ``GenerationArguments`` as ``mtp`` (an ``MTPRequest``); a bad value is answered with HTTP 400 and the
    ``MTPRequestError`` message (every endpoint passes a FastAPI ``HTTPException`` through)."""

    @functools.wraps(build_gen_args)
    def wrapper(request, *args, **kwargs):
        try:
            options = parse_request(getattr(request, "model_extra", None) or {}, server_options())
        except MTPRequestError as e:
            raise _bad_option()(status_code=400, detail=str(e)) from e
        gen_args = build_gen_args(request, *args, **kwargs)
        gen_args.mtp = options
        return gen_args

    return wrapper


def record_flags(namespace) -> None:
    """Keep the server command line's MTP options where mlx-vlm keeps its own server settings: the environment
    (``SERVER_OPTIONS``, JSON), which its app reads in this process or a worker's."""
    options = command_line_options(namespace)
    os.environ[SERVER_OPTIONS] = json.dumps({"enabled": options.enabled, "depth": options.depth,
                                             "lookup": options.lookup})


def server_options() -> MTPOptions:
    """The server command line's MTP options (``record_flags``); the plugin's defaults where none were recorded or
    the record cannot be read."""
    try:
        values = json.loads(os.environ.get(SERVER_OPTIONS) or "{}")
        return MTPOptions().over(values.get("enabled"), values.get("depth"), values.get("lookup"))
    except (ValueError, AttributeError):
        return MTPOptions()


@functools.cache
def _bad_option() -> type:
    """FastAPI's ``HTTPException`` whose text is its message alone: endpoints that wrap an error's text in a 400 of
    their own then show the message, not "400: message" (FastAPI is imported only once a server runs)."""
    from fastapi import HTTPException

    class MTPOptionError(HTTPException):
        def __str__(self) -> str:
            return str(self.detail)

    return MTPOptionError


def served_sampler(make_sampler):
    """Wrap ``ResponseGenerator._make_sampler(args)``, which the server calls for the request that starts a batch
    generator, as its ``sampler`` (None: greedy): the server's model owns its language model's state
    (``ModelState.owner``: the ``BatchGenerator`` about to be built on the language model finds the head there), and
    the sampler's distribution for the request's arguments is recorded (``SAMPLINGS``)."""

    @functools.wraps(make_sampler)
    def wrapper(self, args, *rest, **kwargs):
        sampler = make_sampler(self, args, *rest, **kwargs)
        full = getattr(self, "model", None)
        loaded = getattr(full, "mtp_head", None)
        if loaded is not None:
            state_of(full.language_model, loaded).owner = full
        if sampler is not None:
            SAMPLINGS[sampler] = server_sampling(importlib.import_module("mlx_vlm.generate.ar"), args, sampler)
        return sampler

    return wrapper


def request_processors(make_logits_processors):
    """Wrap ``ResponseGenerator._make_logits_processors(args, ...)``: a ``RequestProcessors`` carrying the request's
    MTP options (``args.mtp``) to ``SplitGenerator.insert``."""

    @functools.wraps(make_logits_processors)
    def wrapper(self, args, *rest, **kwargs):
        processors = RequestProcessors(make_logits_processors(self, args, *rest, **kwargs) or [])
        processors.mtp = getattr(args, "mtp", None)
        return processors

    return wrapper


def with_mtp_batching(batch_generator, captured: dict[str, bool]):
    """Replace the server's ``BatchGenerator``: a ``SplitGenerator`` when the model has a head whose trunk can be rolled
    back (``captured``: ``capture.install``'s answer) and the server runs none of the options batched MTP does not
    reproduce (mlx-vlm's own drafter, its prefix cache, quantized KV caches); else mlx-vlm's own."""

    @functools.wraps(batch_generator)
    def make(model, *args, **kwargs):
        state = getattr(model, "mtp_state", None)
        full = None if state is None else state.owner
        loaded = getattr(full, "mtp_head", None)
        if (loaded is None or full.language_model is not model or kwargs.get("draft_model") is not None
                or kwargs.get("apc_manager") is not None
                or any(kwargs.get(option) is not None for option in KV_CACHE_OPTIONS)
                or not rollback_ready(captured, loaded.location.model_type)):
            return batch_generator(model, *args, **kwargs)
        ctx = batching_context(full, loaded)
        if ctx is None:
            return batch_generator(model, *args, **kwargs)
        mtp = batch_generator(BatchingModel(model, ctx), *args, **kwargs)
        described = kwargs.get("sampler")
        sampling = None if described is None else SAMPLINGS.get(described)
        ctx.generator = {"sampler": mtp.sampler, "described": described,
                         "stop_criteria": mtp.tokenizer.stopping_criteria,
                         "keyed": sampling if sampling is not None and sampling.keyed is not None else None,
                         "compute_logprobs": mtp.compute_logprobs, "top_logprobs_k": mtp.top_logprobs_k,
                         "greedy_sampling": getattr(mtp, "greedy_sampling", described is None)}
        return SplitGenerator(mtp, functools.partial(batch_generator, model, *args, **kwargs), ctx)

    return make


def report_counters(step):
    """Wrap ``ResponseGenerator._step`` (mlx-vlm ≥ 0.7): a request decoded with MTP reports its draft counters
    through the server's speculative fields (``speculative_stats_since`` reads its ``MTPCounters``)."""

    @functools.wraps(step)
    def wrapper(self, batch_gen, active, *args, **kwargs):
        for uid, options in getattr(batch_gen, "requests", {}).items():
            if uid in active and active[uid].get("spec_snapshot") is None:
                active[uid]["spec_snapshot"] = MTPCounters(options)
        return step(self, batch_gen, active, *args, **kwargs)

    return wrapper


@dataclass
class MTPCounters:
    """A request's MTP options, standing where the server keeps a drafter's snapshot (``spec_snapshot``); their
    ``stats`` are set once the request's row joins the MTP batch (None: it decoded without MTP)."""

    options: MTPRequest


def mtp_counters(stats_since):
    """Wrap ``speculative_stats_since(draft_model, snapshot) -> (rounds, accepted, drafted)``: an MTP request's
    counters, head and lookup drafts together as mlx-lm's server counts them (all None when it decoded without
    MTP)."""

    @functools.wraps(stats_since)
    def wrapper(draft_model, snapshot, *args, **kwargs):
        if isinstance(snapshot, MTPCounters):
            s = snapshot.options.stats
            return (None, None, None) if s is None else (s.cycles + s.lookup_cycles, s.accepted + s.lookup_accepted,
                                                         s.drafted + s.lookup_drafted)
        return stats_since(draft_model, snapshot, *args, **kwargs)

    return wrapper


class SplitGenerator:
    """The server's generator: ``mtp`` (mlx-vlm's ``BatchGenerator`` on a ``BatchingModel``) for every request it can
    serve, a stock one (``make_stock()``, built on first need) for the others; one uid count for both. ``requests``:
    uid -> the ``MTPRequest`` of each request in ``mtp`` (its counters)."""

    def __init__(self, mtp, make_stock, ctx):
        self.mtp, self.make_stock, self.ctx, self.stock = mtp, make_stock, ctx, None
        self.requests: dict[int, MTPRequest] = {}

    def __getattr__(self, name):
        return getattr(self.mtp, name)

    def _generators(self) -> list:
        return [self.mtp] if self.stock is None else [self.mtp, self.stock]

    @property
    def has_work(self) -> bool:
        return any(g.has_work for g in self._generators())

    @property
    def has_pending_prompts(self) -> bool:
        return any(g.has_pending_prompts for g in self._generators())

    @property
    def unprocessed_prompts(self) -> list:
        return [s for g in self._generators() for s in g.unprocessed_prompts]

    @staticmethod
    def stock_reason(thinking) -> str | None:
        """Why a request decodes in the stock generator: a thinking budget (it forces tokens between steps)."""
        return None if thinking is None else "thinking budget"

    def insert(self, prompts, max_tokens=None, prompt_kwargs=None, logits_processors=None,
               thinking_budget_criteria=None, **kwargs):
        """mlx-vlm's ``insert``: a request into the MTP generator, or the stock one (``stock_reason``); its MTP options
        come with its logits processors (``RequestProcessors``; none: the server's)."""
        request = getattr((logits_processors or [None])[0], "mtp", None)
        thinking = (thinking_budget_criteria or [None])[0]
        reason = self.stock_reason(thinking) if len(prompts) == 1 else "batched prompts"
        if reason is not None:
            log.debug("mtp_plugin: server request with %s decodes in mlx-vlm's own batch", reason)
            if self.stock is None:
                self.stock = self.make_stock()
            target = self.stock
        else:
            target = self.mtp
            logits_processors = [[portable(p) for p in row or []] for row in logits_processors or []] or None
        target.uid_count = max(g.uid_count for g in self._generators())
        uids = target.insert(prompts, max_tokens, prompt_kwargs=prompt_kwargs, logits_processors=logits_processors,
                             thinking_budget_criteria=thinking_budget_criteria, **kwargs)
        if target is self.mtp:
            options = request or MTPRequest(defaults=server_options())
            self.requests[uids[0]] = options
            self.ctx.admit(uids[0], prompts[0], (prompt_kwargs or [{}])[0], options)
        return uids

    def next(self, **kwargs) -> tuple[list, list]:
        """One step of each generator with work."""
        prompts, responses = [], []
        self.ctx.waiting = self.mtp.has_pending_prompts
        for generator in self._generators():
            if generator.has_work:
                done, tokens = generator.next(**kwargs)
                prompts += list(done)
                responses += list(tokens)
        for r in responses:
            if r.finish_reason is not None:
                self.requests.pop(r.uid, None)
        return prompts, responses

    def remove(self, uid) -> bool:
        """Cancel a request in whichever generator holds it."""
        self.requests.pop(uid, None)
        self.ctx.forget(uid)
        return any(g.remove(uid) for g in self._generators())

    def close(self) -> None:
        for generator in self._generators():
            generator.close()


def portable(processor):
    """``processor``, with mlx-vlm's ``LLGuidanceLogitsProcessor`` (its mask kernel needs Metal) replaced, also inside a
    ``ThinkingAwareLogitsProcessor``, by a ``grammar.GrammarProcessor`` of its grammar: masks on every device, and
    drafts under the grammar in the MTP batch."""
    structured = importlib.import_module("mlx_vlm.structured")
    if isinstance(processor, structured.LLGuidanceLogitsProcessor):
        return GrammarProcessor(processor.llg_tokenizer, processor.grammar)
    inner = getattr(processor, "processor", None)
    if isinstance(processor, getattr(structured, "ThinkingAwareLogitsProcessor", ())) and inner is not None:
        processor.processor = portable(inner)
    return processor


def patch_server(patches, captured: dict[str, bool]) -> None:
    """Install the server wrappers on the imported ``mlx_vlm.server.generation`` and ``request_normalization``."""
    server = importlib.import_module("mlx_vlm.server")
    patches.wrap(server, "main", functools.partial(with_mtp_flags, helps=SERVER_HELP, parsed=record_flags))
    generation = importlib.import_module("mlx_vlm.server.generation")
    normalization = importlib.import_module("mlx_vlm.server.request_normalization")
    patches.wrap(normalization, "_build_gen_args", read_request_options)
    patches.wrap(generation.ResponseGenerator, "_make_sampler", served_sampler)
    patches.wrap(generation.ResponseGenerator, "_make_logits_processors", request_processors)
    patches.wrap(generation, "BatchGenerator", functools.partial(with_mtp_batching, captured=captured))
    ar = importlib.import_module("mlx_vlm.generate.ar")
    patches.wrap(ar.PromptProcessingBatch, "prompt_step", capture_prompt_step)
    patches.wrap(ar.PromptProcessingBatch, "generate", start_generation)
    if hasattr(generation, "speculative_stats_since"):
        patches.wrap(generation, "speculative_stats_since", mtp_counters)
        patches.wrap(generation.ResponseGenerator, "_step", report_counters)
