"""mlx-lm adapter, server side: ``mlx_lm.server --plugin mtp [--mtp-depth N] [--no-mtp] [--[no-]mtp-lookup]``; the
request options ``enable_mtp`` / ``mtp_depth`` / ``mtp_lookup``, carried on ``GenerationArguments.mtp`` from the HTTP
handler thread to the generation thread; batched MTP rows; ``timings`` counters. Design: docs/mlx-lm-server.md."""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import threading
from dataclasses import dataclass

from mtp_plugin.decoding.grammar import GrammarError, GrammarProcessor, response_format_grammar, tokenizer_of
from mtp_plugin.decoding.options import MTPOptions, resolve
from mtp_plugin.decoding.single import MAX_DEPTH
from mtp_plugin.decoding.stats import MTPStats

from .mlx_lm_batching import (
    MTPGenerationBatch,
    batching_model,
    capture_prompt,
    context_of,
    log_summary,
    start_generation,
)
from .mlx_lm_decoding import add_mtp_arguments

PLUGIN_NAMES = ("mtp",)
SERVING = "mtp_serving"  # set on the server's own LRUPromptCache (``serving_cache``)
_handler = threading.local()  # the MTP options of the request being parsed on this handler thread
_serving = threading.local()  # the MTP options of the request being served on the generation thread
_routing = threading.local()  # the MTP options of the request the generation thread is about to batch


class MTPRequestError(ValueError):
    """A request's MTP option has a bad value, or its prompt is empty; answered with HTTP 400 and this message."""


@dataclass
class MTPRequest:
    """A request's ``enable_mtp`` / ``mtp_depth`` / ``mtp_lookup`` (None, and depth 0: the server's default, resolved by
    ``options.resolve``), the grammar its ``response_format`` asks for (llguidance text, None: free text) and, once
    served, its counters (``stats``: None when it did not decode with MTP)."""

    enabled: bool | None = None
    depth: int | None = None
    lookup: bool | None = None
    stats: MTPStats | None = None
    grammar: str | None = None

    def processor(self, tokenizer) -> GrammarProcessor | None:
        """A fresh ``grammar.GrammarProcessor`` of the request's grammar over ``tokenizer``, or None."""
        return None if self.grammar is None else GrammarProcessor(tokenizer_of(tokenizer), self.grammar)

    @property
    def wanted(self) -> bool:
        """Whether the request asks for MTP (explicitly or by the server default)."""
        return self.resolved().enabled

    def resolved(self) -> MTPOptions:
        """The request's options over the server's (``options.resolve``)."""
        return resolve(self.enabled, self.depth, self.lookup)


def parse_request(body: dict) -> MTPRequest:
    """The MTP options and ``response_format`` grammar of a request body.

    Raises:
        MTPRequestError: ``enable_mtp`` or ``mtp_lookup`` not a boolean, ``mtp_depth`` not an integer in 0..8, or a
            ``response_format`` that cannot constrain decoding (``grammar.response_format_grammar``).
    """
    enabled, depth, lookup = body.get("enable_mtp"), body.get("mtp_depth"), body.get("mtp_lookup")
    for name, value in (("enable_mtp", enabled), ("mtp_lookup", lookup)):
        if value is not None and not isinstance(value, bool):
            raise MTPRequestError(f"{name} must be true or false, got {value!r}")
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= MAX_DEPTH):
        raise MTPRequestError(f"mtp_depth must be an integer from 0 (server default) to {MAX_DEPTH}, got {depth!r}")
    try:
        grammar = response_format_grammar(body.get("response_format"))
    except GrammarError as e:
        raise MTPRequestError(f"response_format: {e}") from None
    return MTPRequest(enabled, depth, lookup, grammar=grammar)


SERVER_HELP = {  # mlx-lm's server decodes with MTP by default
    "plugin": "Enable a plugin; 'mtp' decodes with the checkpoint's MTP head (on by default).",
    "depth": f"MTP draft depth 1-{MAX_DEPTH} (0: automatic).",
    "off": "Serve without the MTP head.",
    "lookup": "Draft from the context too (prompt lookup), also for a model without an MTP head. Default: on with a "
              "head, off without.",
    "no_lookup": "Draft from the MTP head only.",
}


def with_mtp_flags(main, helps: dict = SERVER_HELP):
    """Wrap a server's ``main`` (``mlx_lm.server``, ``mlx_vlm.server``): the parser it builds and parses first gets an
    "MTP" group (``--plugin``, and ``add_mtp_arguments``' flags with ``helps``, keys ``plugin``, ``depth``, ``off``,
    ``lookup``, ``no_lookup``) just before parsing, so ``--help`` prints one usage block and the flags set the
    command line's options (``options.set_command_line``)."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        parse_args = argparse.ArgumentParser.parse_args

        def with_group(parser, *a, **k):
            argparse.ArgumentParser.parse_args = parse_args  # the server's own parser only
            group = parser.add_argument_group("MTP (mtp_plugin)")
            group.add_argument("--plugin", action="append", choices=PLUGIN_NAMES, default=[], help=helps["plugin"])
            add_mtp_arguments(group, helps, server=True)
            return parse_args(parser, *a, **k)

        argparse.ArgumentParser.parse_args = with_group
        try:
            return main(*args, **kwargs)
        finally:
            if argparse.ArgumentParser.parse_args is with_group:  # main ended before parsing
                argparse.ArgumentParser.parse_args = parse_args

    return wrapper


def read_request_options(validate):
    """Wrap ``APIHandler.validate_model_parameters``: also read and validate the request's MTP options, and refuse an
    empty completion prompt (mlx-lm's generation thread dies on one, and every later request with it)."""

    @functools.wraps(validate)
    def wrapper(self, *args, **kwargs):
        validate(self, *args, **kwargs)
        prompt = self.body.get("prompt")
        if isinstance(prompt, (str, list)) and not prompt:
            raise MTPRequestError("prompt is empty: send at least one token")
        self.mtp_request = _handler.request = parse_request(self.body)

    return wrapper


def answer_bad_options(do_post):
    """Wrap ``APIHandler.do_POST``: answer a bad MTP option with 400 where mlx-lm does not catch it (< 0.32)."""

    @functools.wraps(do_post)
    def wrapper(self, *args, **kwargs):
        try:
            return do_post(self, *args, **kwargs)
        except MTPRequestError as e:  # raised while validating, before any response was sent
            self._set_completion_headers(400)
            self.end_headers()
            self.wfile.write(json.dumps({"error": str(e)}).encode())

    return wrapper


def carry_request_options(generate):
    """Wrap ``ResponseGenerator.generate``: attach the handler thread's MTP options to ``generation_args``."""

    @functools.wraps(generate)
    def wrapper(self, *args, **kwargs):
        generation_args = kwargs.get("generation_args", args[1] if len(args) > 1 else None)
        if generation_args is not None:
            generation_args.mtp = getattr(_handler, "request", None) or MTPRequest()
        return generate(self, *args, **kwargs)

    return wrapper


def remember_options(is_batchable):
    """Wrap ``ResponseGenerator._is_batchable``: keep the request's MTP options for the batch row it may become
    (mlx-lm asks this on the generation thread right before it inserts the request)."""

    @functools.wraps(is_batchable)
    def wrapper(self, generation_args, *args, **kwargs):
        _routing.options = getattr(generation_args, "mtp", None)
        _routing.provider = self.model_provider  # its tokenizer, once loaded, for a response_format's grammar
        return is_batchable(self, generation_args, *args, **kwargs)

    return wrapper


def batch_with_mtp(batch_generator):
    """Wrap the server's ``BatchGenerator`` class: for a model with a usable head, a generator that decodes
    every row with batched MTP cycles; otherwise mlx-lm's own."""

    @functools.wraps(batch_generator)
    def make(model, *args, **kwargs):
        wrapped = batching_model(model)
        generator = batch_generator(wrapped or model, *args, **kwargs)
        if wrapped is not None:
            generator._generation_batch = MTPGenerationBatch.empty(wrapped, generator.sampler)
            served = getattr(_routing, "contexts", None)
            if served is not None and not any(ctx is wrapped.mtp_batching for ctx in served):
                served.append(wrapped.mtp_batching)
        return generator

    return make


def summarize_on_stop(generation_loop):
    """Wrap ``ResponseGenerator._generate`` (the generation thread): when the server stops, log one INFO line per
    head that decoded batched cycles."""

    @functools.wraps(generation_loop)
    def wrapper(self, *args, **kwargs):
        _routing.contexts = []
        try:
            return generation_loop(self, *args, **kwargs)
        finally:
            for ctx in _routing.contexts:
                log_summary(ctx)

    return wrapper


def attach_options(insert_segments):
    """Wrap ``BatchGenerator.insert_segments``: a request's ``response_format`` grammar joins its row's logits
    processors (MTP or not), and an MTP generator keeps each new row's request options and prompt length."""

    @functools.wraps(insert_segments)
    def wrapper(self, *args, **kwargs):
        options = getattr(_routing, "options", None)
        if options is not None and options.grammar is not None:  # the server inserts one request at a time
            grammar = options.processor(_routing.provider.tokenizer)
            kwargs["logits_processors"] = [[*(kwargs.get("logits_processors") or [[]])[0], grammar]]
        uids = insert_segments(self, *args, **kwargs)
        ctx = context_of(self)
        if ctx is not None:
            segments = args[0] if args else kwargs["segments"]
            for uid, parts in zip(uids, segments, strict=True):
                ctx.options[uid] = getattr(_routing, "options", None)
                ctx.lengths[uid] = sum(map(len, parts))
        return uids

    return wrapper


def serve_with_options(serve_single):
    """Wrap ``ResponseGenerator._serve_single``: make the request's MTP options current on this thread."""

    @functools.wraps(serve_single)
    def wrapper(self, request, *args, **kwargs):
        _serving.request = getattr(request[2], "mtp", None)
        try:
            return serve_single(self, request, *args, **kwargs)
        finally:
            _serving.request = None

    return wrapper


def pass_options(stream_generate):
    """Wrap the server's ``stream_generate``: pass the current request's MTP options to ``generate_step`` and
    keep the counters of its generation on the request (a model without a head: when it drafts from the context)."""

    @functools.wraps(stream_generate)
    def wrapper(model, tokenizer, prompt, *args, **kwargs):
        options = getattr(_serving, "request", None)
        grammar = None if options is None else options.processor(tokenizer)
        if grammar is not None:
            kwargs["logits_processors"] = [*(kwargs.get("logits_processors") or []), grammar]
        loaded = getattr(model, "mtp_head", None)
        headless_off = loaded is None and not (options is not None and options.resolved().lookup)
        if options is None or headless_off or kwargs.get("draft_model") is not None:
            yield from stream_generate(model, tokenizer, prompt, *args, **kwargs)  # a draft model: stock
            return
        if loaded is not None:
            loaded.stats = None
        kwargs.update(enable_mtp=options.wanted, mtp_depth=options.depth or None, mtp_lookup=options.lookup)
        for response in stream_generate(model, tokenizer, prompt, *args, **kwargs):
            options.stats = loaded.stats if loaded is not None else getattr(model, "mtp_lookup_stats", None)
            yield response

    return wrapper


def keep_a_token_to_run(fetch_nearest_cache):
    """Wrap ``LRUPromptCache.fetch_nearest_cache``: the server's own prompt cache (``serving_cache``) never answers with
    an empty remainder (mlx-lm's generation thread dies on "Sequence N has an empty prompt") but with the cache of the
    prompt without its last token, which is then run. Any other ``LRUPromptCache`` answers as stock."""

    @functools.wraps(fetch_nearest_cache)
    def wrapper(self, model, tokens, *args, **kwargs):
        cache, rest = fetch_nearest_cache(self, model, tokens, *args, **kwargs)
        if rest or not tokens or not getattr(self, SERVING, False):
            return cache, rest
        cache, rest = fetch_nearest_cache(self, model, tokens[:-1], *args, **kwargs)
        return cache, [*rest, tokens[-1]]

    return wrapper


def serving_cache(init):
    """Wrap ``ResponseGenerator.__init__``: the prompt cache it is given is the server's (``keep_a_token_to_run``)."""

    @functools.wraps(init)
    def wrapper(self, model_provider, prompt_cache, *args, **kwargs):
        setattr(prompt_cache, SERVING, True)
        init(self, model_provider, prompt_cache, *args, **kwargs)

    return wrapper


def report_counters(make_response):
    """Wrap ``APIHandler.generate_response`` / ``completion_usage_response``: add ``timings`` with
    ``draft_n`` and ``draft_n_accepted`` to a request's final response when the model has a head (and, for a request
    with a ``response_format`` that decoded with MTP, ``grammar_ms``: host time in its grammar)."""

    @functools.wraps(make_response)
    def wrapper(self, *args, **kwargs):
        response = make_response(self, *args, **kwargs)
        final = "usage" in response or any(c.get("finish_reason") for c in response.get("choices", []))
        options = getattr(self, "mtp_request", None)
        model = self.response_generator.model_provider.model
        stats = None if options is None else options.stats
        if final and options is not None and (getattr(model, "mtp_head", None) is not None or stats is not None):
            response["timings"] = {"draft_n": stats.drafted + stats.lookup_drafted if stats else 0,
                                   "draft_n_accepted": stats.accepted + stats.lookup_accepted if stats else 0}
            if stats is not None and options.grammar is not None:
                response["timings"]["grammar_ms"] = round(1000 * stats.grammar_seconds, 3)
        return response

    return wrapper


def patch_server(patches, server) -> None:
    """Install the server wrappers on the imported ``mlx_lm.server`` module."""
    patches.wrap(server, "main", with_mtp_flags)
    patches.wrap(server, "stream_generate", pass_options)
    patches.wrap(server.APIHandler, "do_POST", answer_bad_options)
    patches.wrap(server.LRUPromptCache, "fetch_nearest_cache", keep_a_token_to_run)
    patches.wrap(server.ResponseGenerator, "__init__", serving_cache)
    patches.wrap(server.APIHandler, "validate_model_parameters", read_request_options)
    patches.wrap(server.APIHandler, "generate_response", report_counters)
    patches.wrap(server.APIHandler, "completion_usage_response", report_counters)
    patches.wrap(server.ResponseGenerator, "generate", carry_request_options)
    patches.wrap(server.ResponseGenerator, "_is_batchable", remember_options)
    patches.wrap(server.BatchGenerator, "insert_segments", attach_options)
    generate = importlib.import_module("mlx_lm.generate")  # ``mlx_lm.generate`` is also a function
    patches.wrap(generate.PromptProcessingBatch, "prompt", capture_prompt)
    patches.wrap(generate.PromptProcessingBatch, "generate", start_generation)
    patches.wrap(server, "BatchGenerator", batch_with_mtp)
    patches.wrap(server.ResponseGenerator, "_generate", summarize_on_stop)
    patches.wrap(server.ResponseGenerator, "_serve_single", serve_with_options)
