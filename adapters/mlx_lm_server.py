"""mlx-lm adapter, server side: ``mlx_lm.server --plugin mtp [--mtp-depth N] [--no-mtp] [--[no-]mtp-lookup]``; the
request options ``enable_mtp`` / ``mtp_depth`` / ``mtp_lookup`` and ``response_format``, resolved against the server's
flags where the request is parsed and carried with it (the request, its ``GenerationArguments.mtp``, its logits
processors: ``RequestProcessors``) to the generation thread; batched MTP rows; ``timings`` counters. Design:
docs/mlx-lm-server.md."""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import logging
from dataclasses import dataclass, field

from mtp_plugin.decoding.grammar import GrammarError, GrammarProcessor, response_format_grammar, tokenizer_of
from mtp_plugin.decoding.options import MTPOptions
from mtp_plugin.decoding.single import MAX_DEPTH
from mtp_plugin.decoding.state import state_of
from mtp_plugin.decoding.stats import MTPStats

from .mlx_lm_batching import (
    MTPGenerationBatch,
    batching_model,
    capture_prompt,
    context_of,
    log_summary,
    start_generation,
)
from .mlx_lm_decoding import add_mtp_arguments, command_line_options, lookup_stats

log = logging.getLogger("mtp_plugin")
PLUGIN_NAMES = ("mtp",)
SERVING = "mtp_serving"  # set on the server's own LRUPromptCache (``serving_cache``)


class MTPRequestError(ValueError):
    """A request's MTP option has a bad value, or its prompt is empty; answered with HTTP 400 and this message."""


@dataclass
class MTPRequest:
    """A request's ``enable_mtp`` / ``mtp_depth`` / ``mtp_lookup`` (None, and depth 0: the server's ``defaults``, its
    command line's options), the grammar its ``response_format`` asks for (llguidance text, None: free text), once
    tokenized its grammar's processor (``start``) and, once served, its counters (``stats``: None when it did not
    decode with MTP)."""

    enabled: bool | None = None
    depth: int | None = None
    lookup: bool | None = None
    stats: MTPStats | None = None
    grammar: str | None = None
    defaults: MTPOptions = field(default_factory=MTPOptions)
    processor: GrammarProcessor | None = None

    def start(self, tokenizer) -> None:
        """The request is tokenized by ``tokenizer``: a fresh ``grammar.GrammarProcessor`` of its grammar over it."""
        if self.grammar is not None:
            self.processor = GrammarProcessor(tokenizer_of(tokenizer), self.grammar)

    def resolved(self) -> MTPOptions:
        """The request's options over the server's (``MTPOptions.over``)."""
        return self.defaults.over(self.enabled, self.depth, self.lookup)


class RequestProcessors(list):
    """A request's logits processors as the server makes them (its ``response_format``'s grammar processor last),
    carrying the request's ``MTPRequest`` (``mtp``) wherever the server hands them: a plain list to mlx-lm."""

    mtp: MTPRequest | None = None


def parse_request(body: dict, defaults: MTPOptions | None = None) -> MTPRequest:
    """The MTP options and ``response_format`` grammar of a request body, over the server's ``defaults`` (None: the
    plugin's).

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
    return MTPRequest(enabled, depth, lookup, grammar=grammar, defaults=defaults or MTPOptions())


SERVER_HELP = {  # mlx-lm's server decodes with MTP by default
    "plugin": "Enable a plugin; 'mtp' decodes with the checkpoint's MTP head (on by default).",
    "depth": f"MTP draft depth 1-{MAX_DEPTH} (0: automatic).",
    "off": "Serve without the MTP head.",
    "lookup": "Draft from the context too (prompt lookup), also for a model without an MTP head. Default: on with a "
              "head, off without.",
    "no_lookup": "Draft from the MTP head only.",
}


def with_mtp_flags(main, helps: dict = SERVER_HELP, parsed=None):
    """Wrap a server's ``main`` (``mlx_lm.server``, ``mlx_vlm.server``): the parser it builds and parses first gets an
    "MTP" group (``--plugin``, and ``add_mtp_arguments``' flags with ``helps``, keys ``plugin``, ``depth``, ``off``,
    ``lookup``, ``no_lookup``) just before parsing, so ``--help`` prints one usage block; the parsed namespace holds
    them (``mlx_lm_decoding.command_line_options``) and is given to ``parsed(namespace)`` (None: nothing)."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        parse_args = argparse.ArgumentParser.parse_args

        def with_group(parser, *a, **k):
            argparse.ArgumentParser.parse_args = parse_args  # the server's own parser only
            group = parser.add_argument_group("MTP (mtp_plugin)")
            group.add_argument("--plugin", action="append", choices=PLUGIN_NAMES, default=[], help=helps["plugin"])
            add_mtp_arguments(group, helps, server=True)
            namespace = parse_args(parser, *a, **k)
            if parsed is not None:
                parsed(namespace)
            return namespace

        argparse.ArgumentParser.parse_args = with_group
        try:
            return main(*args, **kwargs)
        finally:
            if argparse.ArgumentParser.parse_args is with_group:  # main ended before parsing
                argparse.ArgumentParser.parse_args = parse_args

    return wrapper


def read_request_options(validate):
    """Wrap ``APIHandler.validate_model_parameters``: also read and validate the request's MTP options over the server's
    flags, and refuse an empty completion prompt (mlx-lm's generation thread dies on one, and every later request
    with it)."""

    @functools.wraps(validate)
    def wrapper(self, *args, **kwargs):
        validate(self, *args, **kwargs)
        prompt = self.body.get("prompt")
        if isinstance(prompt, (str, list)) and not prompt:
            raise MTPRequestError("prompt is empty: send at least one token")
        defaults = command_line_options(self.response_generator.model_provider.cli_args)
        self.mtp_request = parse_request(self.body, defaults)

    return wrapper


def carry_from_handler(handle_completion):
    """Wrap ``APIHandler.handle_completion(request, ...)``: the request it hands the generation thread carries its MTP
    options (``mtp``)."""

    @functools.wraps(handle_completion)
    def wrapper(self, request, *args, **kwargs):
        request.mtp = getattr(self, "mtp_request", None)
        return handle_completion(self, request, *args, **kwargs)

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
    """Wrap ``ResponseGenerator.generate(request, generation_args, ...)``: the request's MTP options ride on
    ``generation_args`` (``mtp``; a request no handler parsed gets the server's defaults)."""

    @functools.wraps(generate)
    def wrapper(self, request, *args, **kwargs):
        generation_args = kwargs.get("generation_args", args[0] if args else None)
        if generation_args is not None:
            generation_args.mtp = getattr(request, "mtp", None) or MTPRequest(
                defaults=command_line_options(self.model_provider.cli_args))
        return generate(self, request, *args, **kwargs)

    return wrapper


def start_request(tokenize):
    """Wrap ``ResponseGenerator._tokenize(tokenizer, request, args)``: the request's grammar processor is made for the
    tokenizer that tokenized it (``MTPRequest.start``)."""

    @functools.wraps(tokenize)
    def wrapper(self, tokenizer, request, args, *rest, **kwargs):
        options = getattr(args, "mtp", None)
        if options is not None:
            options.start(tokenizer)
        return tokenize(self, tokenizer, request, args, *rest, **kwargs)

    return wrapper


def request_processors(make_logits_processors):
    """Wrap the server's ``_make_logits_processors(args)``: a ``RequestProcessors`` carrying the request's MTP options,
    its ``response_format`` grammar processor after mlx-lm's own (MTP or not)."""

    @functools.wraps(make_logits_processors)
    def wrapper(args, *rest, **kwargs):
        processors = RequestProcessors(make_logits_processors(args, *rest, **kwargs) or [])
        processors.mtp = getattr(args, "mtp", None)
        if processors.mtp is not None and processors.mtp.processor is not None:
            processors.append(processors.mtp.processor)
        return processors

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
        return generator

    return make


def summarize_on_stop(generation_loop):
    """Wrap ``ResponseGenerator._generate`` (the generation thread): when the server stops, log one INFO line on the
    batched cycles of the model it served last."""

    @functools.wraps(generation_loop)
    def wrapper(self, *args, **kwargs):
        try:
            return generation_loop(self, *args, **kwargs)
        finally:
            state = getattr(getattr(self.model_provider, "model", None), "mtp_state", None)
            if state is not None and state.batching is not None:
                log_summary(state.batching)

    return wrapper


def attach_options(insert_segments):
    """Wrap ``BatchGenerator.insert_segments``: an MTP generator keeps each new row's request options (carried by its
    ``RequestProcessors``) and prompt length."""
    signature = inspect.signature(insert_segments)

    @functools.wraps(insert_segments)
    def wrapper(self, *args, **kwargs):
        uids = insert_segments(self, *args, **kwargs)
        ctx = context_of(self)
        if ctx is not None:
            bound = signature.bind(self, *args, **kwargs).arguments
            processors = bound.get("logits_processors") or [None] * len(uids)
            for uid, parts, carried in zip(uids, bound["segments"], processors, strict=True):
                ctx.options[uid] = getattr(carried, "mtp", None)
                ctx.lengths[uid] = sum(map(len, parts))
        return uids

    return wrapper


def pass_options(stream_generate):
    """Wrap the server's ``stream_generate``: pass the request's MTP options (carried by its ``RequestProcessors``) to
    ``generate_step`` and keep the counters of its generation on the request (a model without a head: when it drafts
    from the context)."""

    @functools.wraps(stream_generate)
    def wrapper(model, tokenizer, prompt, *args, **kwargs):
        request = getattr(kwargs.get("logits_processors"), "mtp", None)
        options = None if request is None else request.resolved()
        loaded = getattr(model, "mtp_head", None)
        headless_off = loaded is None and not (options is not None and options.lookup)
        if options is None or headless_off or kwargs.get("draft_model") is not None:
            yield from stream_generate(model, tokenizer, prompt, *args, **kwargs)  # a draft model: stock
            return
        if loaded is not None:
            loaded.stats = None
        kwargs.update(enable_mtp=options.enabled, mtp_depth=options.depth or None, mtp_lookup=options.lookup)
        for response in stream_generate(model, tokenizer, prompt, *args, **kwargs):
            request.stats = loaded.stats if loaded is not None else lookup_stats(model)
            yield response

    return wrapper


def serve_defaults(load):
    """Wrap ``ModelProvider.load``: the model it loads is served with the server's flags (``ModelState.serving``: a
    model without a head batches lookup drafts under ``--mtp-lookup``)."""

    @functools.wraps(load)
    def wrapper(self, *args, **kwargs):
        result = load(self, *args, **kwargs)
        model = getattr(self, "model", None)
        if model is not None:
            state_of(model, getattr(model, "mtp_head", None)).serving = command_line_options(self.cli_args)
        return result

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
    patches.wrap(server.APIHandler, "handle_completion", carry_from_handler)
    patches.wrap(server.ResponseGenerator, "generate", carry_request_options)
    patches.wrap(server.ResponseGenerator, "_tokenize", start_request)
    patches.wrap(server, "_make_logits_processors", request_processors)
    patches.wrap(server.ModelProvider, "load", serve_defaults)
    patches.wrap(server.BatchGenerator, "insert_segments", attach_options)
    generate = importlib.import_module("mlx_lm.generate")  # ``mlx_lm.generate`` is also a function
    patches.wrap(generate.PromptProcessingBatch, "prompt", capture_prompt)
    patches.wrap(generate.PromptProcessingBatch, "generate", start_generation)
    patches.wrap(server, "BatchGenerator", batch_with_mtp)
    patches.wrap(server.ResponseGenerator, "_generate", summarize_on_stop)
