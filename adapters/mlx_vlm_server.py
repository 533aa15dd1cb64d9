"""mlx-vlm adapter, server: for a model with a loaded head the server's ``BatchGenerator`` is wrapped in ``Lanes``: a
request that asks for MTP decodes in a lane (the single-stream loop of ``mlx_vlm_decoding`` on the embeddings,
positions and processors the server computed for it), every other one in mlx-vlm's batch. Design: docs/mlx-vlm.md."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
import threading
import time
from dataclasses import dataclass

import mlx.core as mx

from mtp_plugin.decoding.single import MAX_DEPTH
from mtp_plugin.plugins import hook

from .capture import rollback_ready
from .mlx_lm_server import MTPRequest, MTPRequestError, parse_request, strip_cli_flags
from .mlx_vlm_decoding import KV_CACHE_OPTIONS, decoding_options, step_arguments
from .patching import release

log = logging.getLogger("mtp_plugin")
_serving = threading.local()  # the server and request the generation thread is about to insert
# mlx-vlm 0.7's server samples with top-k; 0.6's ignores a request's top_k
SERVER_TOP_K = release("mlx-vlm") >= (0, 7, 0)
# The server's ``make_sampler`` options, each with its stock default: any set one picks ``make_sampler``
FILTER_OPTIONS = {"top_n_sigma": 0.0, "p_less": False, "typical_p": 1.0}
SERVER_HELP = {  # a request decodes with MTP when it asks, or with --mtp-depth N
    "plugin": "Enable a plugin; 'mtp' loads the checkpoint's MTP head (on by default); requests decode with it "
              "when they ask (enable_mtp, mtp_depth).",
    "depth": f"Decode every request that names no MTP option with MTP at draft depth 1-{MAX_DEPTH} (0, the "
             "default: only requests that ask).",
    "off": "Decode with MTP only requests with \"enable_mtp\": true.",
    "lookup": "An MTP request drafts from its context too (prompt lookup; the default).",
    "no_lookup": "An MTP request drafts from the head only (a request's \"mtp_lookup\" decides for itself).",
}


def read_request_options(build_gen_args):
    """Wrap ``request_normalization._build_gen_args``: the request's MTP options ride on the
    returned ``GenerationArguments`` as ``mtp`` (an ``MTPRequest``); a bad value is answered with HTTP 400 and the
    ``MTPRequestError`` message (every endpoint passes a FastAPI ``HTTPException`` through)."""

    @functools.wraps(build_gen_args)
    def wrapper(request, *args, **kwargs):
        try:
            options = parse_request(getattr(request, "model_extra", None) or {})
        except MTPRequestError as e:
            raise _bad_option()(status_code=400, detail=str(e)) from e
        gen_args = build_gen_args(request, *args, **kwargs)
        gen_args.mtp = options
        return gen_args

    return wrapper


@functools.cache
def _bad_option() -> type:
    """FastAPI's ``HTTPException`` whose text is its message alone: endpoints that wrap an error's text in a 400 of
    their own then show the message, not "400: message" (FastAPI is imported only once a server runs)."""
    from fastapi import HTTPException

    class MTPOptionError(HTTPException):
        def __str__(self) -> str:
            return str(self.detail)

    return MTPOptionError


def note_request(log_prefill_started):
    """Wrap ``ResponseGenerator._log_prefill_started``, called on the generation thread just before a request is
    embedded and inserted: ``Lanes`` reads which server and request the next ``insert`` is for."""

    @functools.wraps(log_prefill_started)
    def wrapper(self, request, *args, **kwargs):
        _serving.current = (self, request)
        return log_prefill_started(self, request, *args, **kwargs)

    return wrapper


def with_lanes(batch_generator, captured: dict[str, bool]):
    """Replace the server's ``BatchGenerator``: mlx-vlm's own, in ``Lanes`` when the model has a head whose trunk can
    be rolled back (``captured``: ``capture.install``'s answer) and no drafter of mlx-vlm's own was asked for."""

    @functools.wraps(batch_generator)
    def make(model, *args, **kwargs):
        stock = batch_generator(model, *args, **kwargs)
        server, _ = getattr(_serving, "current", (None, None))
        full = getattr(server, "model", None)
        loaded = getattr(full, "mtp_head", None)
        if loaded is None or full.language_model is not model or kwargs.get("draft_model") is not None:
            return stock  # no head, or mlx-vlm's own drafter asked for (``--draft-model``)
        if not rollback_ready(captured, loaded.location.model_type):
            return stock
        return Lanes(stock, full, kwargs)

    return make


def report_counters(step):
    """Wrap ``ResponseGenerator._step`` (mlx-vlm ≥ 0.7): a lane's request reports its draft counters through the
    server's speculative fields (``speculative_stats_since`` reads its ``LaneCounters``)."""

    @functools.wraps(step)
    def wrapper(self, batch_gen, active, *args, **kwargs):
        for uid, lane in getattr(batch_gen, "lanes", {}).items():
            if uid in active and active[uid].get("spec_snapshot") is None:
                active[uid]["spec_snapshot"] = LaneCounters(lane.stats)
        return step(self, batch_gen, active, *args, **kwargs)

    return wrapper


@dataclass
class LaneCounters:
    """A lane's draft counters, standing where the server keeps a drafter's snapshot (``spec_snapshot``)."""

    stats: object  # the lane's ``MTPStats``


def lane_counters(stats_since):
    """Wrap ``speculative_stats_since(draft_model, snapshot) -> (rounds, accepted, drafted)``: a lane's counters."""

    @functools.wraps(stats_since)
    def wrapper(draft_model, snapshot, *args, **kwargs):
        if isinstance(snapshot, LaneCounters):
            stats = snapshot.stats
            return stats.cycles, stats.accepted, stats.drafted
        return stats_since(draft_model, snapshot, *args, **kwargs)

    return wrapper


class OwnPositions:
    """A lane's language-model pass (``trunk.PromptInputs.run``) with the lane's own multimodal position state
    (``STATE``, kept on the model by mlx-vlm's Qwen language models): each pass sees what this lane's earlier passes
    left (none before its prompt) and leaves the model's state as it found it."""

    STATE = ("_rope_deltas", "_position_ids")

    def __init__(self, run, language_model):
        self.run, self.language_model = run, language_model
        self.state = {name: None for name in self.STATE if hasattr(language_model, name)}

    def __call__(self, tokens: mx.array, cache: list, keywords: dict) -> mx.array:
        others = {name: getattr(self.language_model, name) for name in self.state}
        for name, value in self.state.items():
            setattr(self.language_model, name, value)
        try:
            return self.run(tokens, cache, keywords)
        finally:
            self.state = {name: getattr(self.language_model, name) for name in self.state}
            for name, value in others.items():
                setattr(self.language_model, name, value)


@dataclass
class PromptDone:
    """A lane's prompt response, read by the server as mlx-vlm's own (``uid``, ``prompt_tps`` …)."""

    uid: int
    prompt_tokens: int
    prompt_time: float
    prompt_tps: float
    cached_tokens: int = 0


class Lane:
    """One request decoding with MTP. ``tokens``: the loop's ``(token, logprobs)`` generator (its first draw runs the
    prompt pass); ``stop``: mlx-vlm's stop test of a token id; ``answers``: the request's response queue."""

    def __init__(self, uid: int, tokens, stats, max_tokens: int, stop, prompt_tokens: int, answers):
        self.uid, self.tokens, self.stats, self.max_tokens, self.stop = uid, tokens, stats, max_tokens, stop
        self.prompt_tokens, self.emitted, self.answers = prompt_tokens, 0, answers

    def step(self, response) -> tuple[list, list]:
        """Draw one token: ``(prompt responses, responses)`` as mlx-vlm's ``BatchGenerator.next`` returns them
        (``response``: its response class), the stop test before the length limit as in its ``GenerationBatch``."""
        start = time.perf_counter()
        drawn = next(self.tokens, None)  # (token, logprobs)
        prompts = []
        if not self.emitted:
            seconds = time.perf_counter() - start
            prompts.append(PromptDone(self.uid, self.prompt_tokens, seconds, self.prompt_tokens / max(seconds, 1e-9)))
        if drawn is None:  # the loop ended at its own limit
            return prompts, [response(uid=self.uid, token=None, token_logprob=0.0, finish_reason="length")]
        token = int(drawn[0])
        self.emitted += 1
        reason = "stop" if self.stop(token) else "length" if self.emitted >= self.max_tokens else None
        if reason is not None:
            self.close()
        return prompts, [response(uid=self.uid, token=token, token_logprob=0.0, finish_reason=reason)]

    def fail(self, error: Exception, response) -> list:
        """The loop raised ``error``: the request gets it (as the server hands a batch's errors to every request
        of the batch), then a final response so that the server forgets it; the generator is dropped."""
        log.error("mtp_plugin: MTP lane of request %s failed: %s", self.uid, error, exc_info=error)
        self.answers.put(error)
        return [response(uid=self.uid, token=None, token_logprob=0.0, finish_reason="stop")]

    def close(self) -> None:
        """Stop the generator (its caches are released)."""
        self.tokens.close()


class Lanes:
    """mlx-vlm's server ``BatchGenerator`` (``stock``) with MTP lanes beside it: ``insert`` gives a request asking for
    MTP a lane, ``next`` steps the batch and then every lane by one token; the rest is the wrapped generator's.
    ``settings``: the keywords the server built the generator with (KV quantization, prefill step, prefix cache)."""

    def __init__(self, stock, model, settings: dict):
        self.stock, self.model, self.settings = stock, model, settings
        self.lanes: dict[int, Lane] = {}
        self.ar = importlib.import_module("mlx_vlm.generate.ar")
        self.response = self.ar.GenerationBatch.Response

    def __getattr__(self, name):
        return getattr(self.stock, name)

    @property
    def has_work(self) -> bool:
        """Whether the batch or a lane has anything left to decode."""
        return bool(self.lanes) or self.stock.has_work

    def insert(self, prompts, max_tokens=None, prompt_kwargs=None, logits_processors=None,
               thinking_budget_criteria=None):
        """mlx-vlm's ``insert``; a single request that decodes with MTP takes a lane (its uid from the same count)."""
        _, request = getattr(_serving, "current", (None, None))
        _serving.current = None
        lane = None
        if request is not None and len(prompts) == 1:
            try:
                lane = self._lane(request, prompts[0], max_tokens, (prompt_kwargs or [{}])[0],
                                  (logits_processors or [None])[0], (thinking_budget_criteria or [None])[0])
            except Exception as error:  # the plugin's fault: the request decodes in mlx-vlm's batch
                log.warning("mtp_plugin: no MTP lane for a request (%s: %s); it decodes in mlx-vlm's batch",
                            type(error).__name__, error, exc_info=error)
        if lane is None:
            return self.stock.insert(prompts, max_tokens, prompt_kwargs=prompt_kwargs,
                                     logits_processors=logits_processors,
                                     thinking_budget_criteria=thinking_budget_criteria)
        self.lanes[lane.uid] = lane
        return [lane.uid]

    @staticmethod
    def _wanted(args) -> bool:
        """Whether a request asks for MTP: its ``enable_mtp``, else a depth (its own ``mtp_depth`` or the server's
        ``--mtp-depth N``) unless the server runs with ``--no-mtp``."""
        options = getattr(args, "mtp", None) or MTPRequest()
        if options.enabled is not None:
            return options.enabled
        asked = options.resolved()
        return asked.enabled and asked.depth is not None

    def _stock_reason(self, args, thinking) -> str | None:
        """Why a request that wants MTP joins the batch, or None."""
        if args.logprobs:
            return "log-probs"
        if thinking is not None:
            return "thinking budget"
        if args.logits_processors:  # structured output: a grammar matcher that cannot see rejected drafts
            return "response format"
        if self.settings.get("apc_manager") is not None:
            return "prefix cache"
        if any(self.settings.get(option) is not None for option in KV_CACHE_OPTIONS):
            return "quantized KV cache"
        return None

    def _lane(self, request, prompt: list[int], max_tokens, keywords: dict, processors, thinking) -> Lane | None:
        args = request.args
        if not self._wanted(args):
            return None
        reason = self._stock_reason(args, thinking)
        if reason is not None:
            log.debug("mtp_plugin: server request with %s decodes in mlx-vlm's batch", reason)
            return None
        loaded = self.model.mtp_head
        options = getattr(args, "mtp", None) or MTPRequest()
        asked = options.resolved()
        limit = max_tokens[0] if isinstance(max_tokens, list) else max_tokens or self.stock.max_tokens
        named, extra, positioned = self._arguments(args, limit, processors or [], keywords)
        input_ids = mx.array([prompt])
        known = {k: v for k, v in named.items() if k in inspect.signature(self.ar.generate_step).parameters}
        arguments, _ = step_arguments(self.ar.generate_step, input_ids, self.model, None, None, **known)
        decoding = decoding_options(self.ar, self.model, loaded, asked.depth, arguments, extra, positioned,
                                    asked.lookup)
        if decoding is None:
            return None
        decoding["prefill_history"] = True  # the batch's processors see the whole prompt (its token context)
        prompt_pass = decoding["prompt_inputs"]
        if prompt_pass is not None:
            own = OwnPositions(prompt_pass.run, self.model.language_model)
            decoding["prompt_inputs"] = dataclasses.replace(prompt_pass, run=own)
        tokens = hook().mtp_generate_step(prompt=input_ids[0], model=self.model, options=decoding)
        if tokens is None:
            return None
        uid = self.stock.uid_count
        self.stock.uid_count += 1
        return Lane(uid, tokens, decoding["stats"], limit, self.stock.tokenizer.stopping_criteria, len(prompt),
                    request.rqueue)

    def _arguments(self, args, limit: int, processors: list, keywords: dict) -> tuple[dict, dict, bool]:
        """``(named, extra, positioned)``: ``generate_step`` arguments reproducing the server's sampler
        (``_make_sampler``; ``positioned``: the position-keyed one) and its logits processors (penalties included)."""
        filters = {name: getattr(args, name, default) for name, default in FILTER_OPTIONS.items()}
        positioned = all(value == FILTER_OPTIONS[name] for name, value in filters.items())
        named = {"max_tokens": limit, "temperature": args.temperature, "top_p": args.top_p,
                 "top_k": args.top_k if SERVER_TOP_K else 0, "seed": args.seed, "logits_processors": processors,
                 "prefill_step_size": self.settings.get("prefill_step_size"), **filters}
        extra = {k: v for k, v in keywords.items() if v is not None and not k.startswith("_")}
        return named, extra, positioned

    def next(self, **kwargs) -> tuple[list, list]:
        """One step of the batch (when it has work), then one token of every lane."""
        prompts, responses = self.stock.next(**kwargs) if self.stock.has_work else ([], [])
        prompts, responses = list(prompts), list(responses)
        for uid, lane in list(self.lanes.items()):
            try:
                done, tokens = lane.step(self.response)
            except Exception as error:  # this request's failure, not the batch's
                done, tokens = [], lane.fail(error, self.response)
            prompts += done
            responses += tokens
            if tokens[-1].finish_reason is not None:
                del self.lanes[uid]
        return prompts, responses

    def remove(self, uid) -> bool:
        """Cancel a request: its lane, or mlx-vlm's ``remove``."""
        lane = self.lanes.pop(uid, None)
        if lane is None:
            return self.stock.remove(uid)
        lane.close()
        return True

    def close(self) -> None:
        """Close every lane and the batch."""
        for lane in self.lanes.values():
            lane.close()
        self.lanes.clear()
        self.stock.close()


def patch_server(patches, captured: dict[str, bool]) -> None:
    """Install the server wrappers on the imported ``mlx_vlm.server.generation`` and ``request_normalization``."""
    server = importlib.import_module("mlx_vlm.server")
    patches.wrap(server, "main", functools.partial(strip_cli_flags, prog="mlx_vlm.server", helps=SERVER_HELP))
    generation = importlib.import_module("mlx_vlm.server.generation")
    normalization = importlib.import_module("mlx_vlm.server.request_normalization")
    patches.wrap(normalization, "_build_gen_args", read_request_options)
    patches.wrap(generation.ResponseGenerator, "_log_prefill_started", note_request)
    patches.wrap(generation, "BatchGenerator", functools.partial(with_lanes, captured=captured))
    if hasattr(generation, "speculative_stats_since"):
        patches.wrap(generation, "speculative_stats_since", lane_counters)
        patches.wrap(generation.ResponseGenerator, "_step", report_counters)
