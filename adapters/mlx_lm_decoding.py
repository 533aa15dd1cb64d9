"""mlx-lm adapter, decoding side: ``generate_step`` wrapped to decode through ``mtp_generate_step`` (a loaded head, or
lookup drafts), ``generate`` to print the MTP line, ``setup_arg_parser`` given ``--mtp-depth N`` (0: adaptive),
``--no-mtp`` and ``--[no-]mtp-lookup``. Design: docs/decoding.md."""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import logging
import sys

from mtp_plugin.decoding.grammar import response_format_processor
from mtp_plugin.decoding.lockstep import Lockstep, group_of
from mtp_plugin.decoding.lookup import MAX_LOOKUP
from mtp_plugin.decoding.options import MTPOptions, generation_options
from mtp_plugin.decoding.single import MAX_DEPTH
from mtp_plugin.decoding.state import state_of
from mtp_plugin.plugins import hook

from .capture import rollback_ready
from .mlx_lm_sampling import SAMPLINGS
from .patching import release

log = logging.getLogger("mtp_plugin")
# mlx-lm < 0.32 shows logits processors only the tokens after the chunked prefill (0.31.3).
PREFILL_IN_HISTORY = release("mlx-lm") >= (0, 32, 0)
CAPTURED: dict[str, bool] = {}  # model type -> its layers needing capture points got them (``capture.install``)
TOLD_HEADLESS: set[int] = set()  # ids of models told why an explicit depth decodes stock (``warn_headless``)


def decoding_options(model, loaded, prompt, depth, kwargs, lookup=None, captured: bool = False) -> dict | None:
    """Options for ``mtp_generate_step`` from ``generate_step``'s keywords (defaults filled in), or None for stock.

    ``loaded`` None: a model without a head, decoded with lookup drafts only when asked and its trunk can be rolled
    back (``captured``: its model type got capture points; or every cache trimmable). ``max_kv_size`` acts through
    ``make_prompt_cache``, KV quantization through ``kv_quantizer``; a ``RotatingKVCache`` that could wrap during this
    generation decodes stock (one warning). Sampling draws position-keyed (``Sampling.with_coupling``).

    Raises:
        ValueError: a bad ``mtp_depth`` (``options.depth_policy``) or ``mtp_lookup`` (``lookup.lookup_policy``).
    """
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    if kwargs["input_embeddings"] is not None:
        return None
    sampler = kwargs["sampler"]
    if sampler is not None and sampler not in SAMPLINGS:
        log.warning("mtp_plugin: a custom sampler has no known distribution; decoding without MTP.")
        return None
    cache = kwargs["prompt_cache"]
    cache = make_prompt_cache(model, max_kv_size=kwargs["max_kv_size"]) if cache is None else cache
    max_tokens = kwargs["max_tokens"]
    context = len(prompt) + max((c.offset for c in cache if hasattr(c, "offset")), default=0)
    sampling = None if sampler is None else SAMPLINGS[sampler]  # None: greedy (also mlx-lm's temp=0 sampler)
    options = generation_options(depth, lookup, state_of(model, loaded).scheduler, sampling, context,
                                 headless=loaded is None)
    if loaded is None and (options["lookup"] is None or not (captured or all(c.is_trimmable() for c in cache))):
        return None
    for c in cache:
        if isinstance(c, RotatingKVCache) and (max_tokens < 0 or c.offset + len(prompt) + max_tokens + MAX_LOOKUP
                                               >= c.max_size):
            log.warning("mtp_plugin: a rotating KV cache of %d tokens could wrap during this generation and "
                        "cannot be rolled back after a rejected draft; decoding without MTP.", c.max_size)
            return None
    if loaded is not None:
        loaded.stats = options["stats"]
    return {
        **options,
        "cache": cache,
        "head_cache": KVCache(),
        "max_tokens": max_tokens,
        "logits_processors": kwargs["logits_processors"],
        "prefill_step_size": kwargs["prefill_step_size"],
        "prompt_progress_callback": kwargs["prompt_progress_callback"],
        "prefill_history": PREFILL_IN_HISTORY,
        "cache_step": kv_quantizer(kwargs["kv_bits"], kwargs["kv_group_size"], kwargs["quantized_kv_start"]),
    }


def kv_quantizer(bits: int | None, group_size: int, start: int):
    """The loop's ``cache_step`` for mlx-lm's KV quantization (None without ``kv_bits``): after each committed pass,
    mlx-lm's ``maybe_quantize_kv_cache``; until every cache is quantized it returns how many tokens the next pass may
    feed so that none passes ``start - 1`` (the token reaching ``start`` is a plain step, as in mlx-lm's loop)."""
    if bits is None:
        return None
    from mlx_lm.generate import maybe_quantize_kv_cache

    def step(cache: list) -> int | None:
        maybe_quantize_kv_cache(cache, start, group_size, bits)
        pending = [c.offset for c in cache if hasattr(c, "to_quantized")]
        return max(start - 1 - min(pending), 1) if pending else None

    return step


def on_stream(tokens, stream):
    """Run the generator ``tokens`` on mlx-lm's generation ``stream`` (None: the default stream) and free MLX's
    buffer cache every 256 tokens, as mlx-lm's own ``generate_step`` loop does."""
    import mlx.core as mx

    with mx.stream(stream) if stream is not None else contextlib.nullcontext():
        try:
            for n, item in enumerate(tokens):
                yield item
                if n % 256 == 0:
                    mx.clear_cache()
        finally:
            tokens.close()  # the loop leaves its caches as plain decoding would, on this stream


def mtp_generate_step(generate_step, captured: dict[str, bool]):
    """Wrap ``generate_step``: MTP for a model with a loaded head whose trunk can be rolled back (``rollback_ready``),
    on the stream the call names (mlx-lm ≥ 0.32: ``generate_step``'s ``stream``; earlier: ``generation_stream``)."""

    defaults = {name: p.default for name, p in inspect.signature(generate_step).parameters.items()
                if p.kind is p.KEYWORD_ONLY}

    @functools.wraps(generate_step)
    def wrapper(prompt, model, *args, mtp_depth=None, enable_mtp=None, mtp_lookup=None, **kwargs):
        loaded = getattr(model, "mtp_head", None)
        model_type = loaded.location.model_type if loaded is not None else getattr(model, "model_type", None)
        if loaded is not None:
            loaded.stats = None  # this generation's counters, None unless it decodes with MTP
        asked = MTPOptions().over(enable_mtp, mtp_depth, mtp_lookup)
        if asked.enabled and loaded is None and not asked.lookup:
            warn_headless(model, asked.depth)
        options = None
        stream = args[0] if args else kwargs.get("stream", generation_stream())
        if asked.enabled and (loaded is not None or group_of(model) is None) and rollback_ready(captured, model_type):
            options = decoding_options(model, loaded, prompt, asked.depth, {**defaults, **kwargs}, asked.lookup,
                                       captured.get(model_type, False))
        if loaded is None and (options is not None or hasattr(model, "mtp_state")):
            state_of(model, None).lookup_stats = None if options is None else options["stats"]  # a model without a head
        if loaded is not None and not agreed(model, loaded, prompt, options, kwargs.get("sampler"), stream):
            options = loaded.stats = None
        if options is not None:
            generator = hook().mtp_generate_step(prompt=prompt, model=model, options=options)
            if generator is not None:
                return on_stream(generator, stream)
        return generate_step(prompt, model, *args, **kwargs)

    return wrapper


def agreed(model, loaded, prompt, options: dict | None, sampler, stream) -> bool:
    """Whether this generation may decode with MTP (``options`` not None) as far as other ranks go: on a model sharded
    over ranks (``lockstep.group_of``), only when every rank chose MTP with the same prompt length and sampling
    (``Lockstep.start``, run on ``stream``).

    Raises:
        lockstep.LockstepError: on every rank, when the prompts' lengths or the sampling differ between ranks.
    """
    import mlx.core as mx

    group = group_of(model)
    if group is None:
        return options is not None
    sampled = sampler is not None and SAMPLINGS.get(sampler) is not None
    state = {"the prompt's length": len(prompt), "whether the generation samples": int(sampled)}
    with mx.stream(stream) if stream is not None else contextlib.nullcontext():
        return Lockstep(group).start(loaded, options is not None, state)


def warn_headless(model, depth) -> None:
    """Warn once per model that an explicit draft ``depth`` (not None or 0) decodes stock: no usable MTP head."""
    if depth is None or (type(depth) is int and depth == 0) or id(model) in TOLD_HEADLESS:
        return
    TOLD_HEADLESS.add(id(model))
    log.warning("mtp_plugin: MTP draft depth %s was asked, but this model has no usable MTP head (its checkpoint "
                "has none, or the head was refused at load with a warning; `mtp-plugin inspect MODEL_DIR` says "
                "which); decoding without MTP.", depth)


def generation_stream():
    """mlx-lm's generation stream (None if this version has none)."""
    return getattr(sys.modules.get("mlx_lm.generate"), "generation_stream", None)


def print_summary(generate):
    """Wrap ``generate``: with ``verbose``, say on stderr which head decodes at what depth, and print the
    MTP line of this generation after mlx-lm's own figures."""

    @functools.wraps(generate)
    def wrapper(model, tokenizer, prompt, *args, **kwargs):
        loaded = getattr(model, "mtp_head", None)
        if loaded is not None:
            loaded.stats = None
            # a draft model: mlx-lm's speculative decoding, stock
            asked = MTPOptions().over(kwargs.get("enable_mtp"), kwargs.get("mtp_depth"))
            enabled = asked.enabled and kwargs.get("draft_model") is None
            if kwargs.get("verbose") and enabled:
                announce(loaded, asked.depth)
        text = generate(model, tokenizer, prompt, *args, **kwargs)
        stats = loaded.stats if loaded is not None else lookup_stats(model)
        if kwargs.get("verbose") and stats is not None:
            print(stats.summary())
        return text

    return wrapper


def structured_output(stream_generate):
    """Wrap ``stream_generate(model, tokenizer, prompt, ...)``: a ``response_format`` keyword (an OpenAI response
    format) becomes a ``grammar.GrammarProcessor`` after the caller's ``logits_processors``; MTP drafts under it, stock
    decoding (``enable_mtp=False``) is constrained by it."""

    @functools.wraps(stream_generate)
    def wrapper(model, tokenizer, prompt, *args, response_format=None, **kwargs):
        processor = response_format_processor(tokenizer, response_format)
        if processor is not None:
            kwargs["logits_processors"] = [*(kwargs.get("logits_processors") or []), processor]
        return stream_generate(model, tokenizer, prompt, *args, **kwargs)

    return wrapper


def stock_with_draft_model(stream_generate):
    """Wrap ``stream_generate``: with a ``draft_model`` (mlx-lm's own speculative decoding, stock) the MTP keywords
    (``enable_mtp``, ``mtp_depth``, ``mtp_lookup``, which the command line passes as its flags) are not passed on."""

    @functools.wraps(stream_generate)
    def wrapper(*args, **kwargs):
        if kwargs.get("draft_model") is not None:
            for name in MTPOptions().keywords():
                kwargs.pop(name, None)
        return stream_generate(*args, **kwargs)

    return wrapper


GENERATE_HELP = {
    "depth": f"MTP draft depth 1-{MAX_DEPTH} (0: adaptive). Needs a checkpoint with an MTP head.",
    "off": "Decode without the MTP head even if the checkpoint has one.",
    "lookup": "Draft from the context too (prompt lookup), also on a model without an MTP head. Default: on with a "
              "head, off without.",
    "no_lookup": "Draft from the MTP head only.",
}


class _SetCLI(argparse.Action):
    """Store the option's value (or ``const`` for a flag) in the namespace; warn once when ``--no-mtp`` makes another
    MTP flag moot (``conflict``); ``server``: the parser is a server's."""

    def __init__(self, *args, server: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.server = server

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        problem = conflict(command_line_options(namespace), self.server)
        if problem and not getattr(namespace, "mtp_conflict_told", False):
            namespace.mtp_conflict_told = True
            print(f"mtp_plugin: {problem}", file=sys.stderr)


def command_line_options(namespace) -> MTPOptions:
    """The MTP options of a parsed command line (``add_mtp_arguments``' flags; the plugin's defaults where it has
    none of them)."""
    return MTPOptions().over(getattr(namespace, "enable_mtp", None), getattr(namespace, "mtp_depth", None),
                             getattr(namespace, "mtp_lookup", None))


def with_cli_options(main, module, calls: tuple[str, ...]):
    """Wrap a runtime CLI's ``main``: the MTP options its command line parses (``command_line_options``) reach the
    generation calls it makes through ``module``'s functions ``calls`` as their keywords (a call's own win)."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        parse_args, parsed = argparse.ArgumentParser.parse_args, []
        originals = {name: getattr(module, name) for name in calls if hasattr(module, name)}

        def recording(parser, *a, **k):
            namespace = parse_args(parser, *a, **k)
            if hasattr(namespace, "enable_mtp"):  # the parser with the MTP flags
                parsed.append(command_line_options(namespace))
            return namespace

        def keyworded(call):
            @functools.wraps(call)
            def with_options(*a, **k):
                return call(*a, **{**(parsed[-1].keywords() if parsed else {}), **k})

            return with_options

        argparse.ArgumentParser.parse_args = recording
        for name, call in originals.items():
            setattr(module, name, keyworded(call))
        try:
            return main(*args, **kwargs)
        finally:
            argparse.ArgumentParser.parse_args = parse_args
            for name, call in originals.items():
                setattr(module, name, call)

    return wrapper


def conflict(options: MTPOptions, server: bool) -> str | None:
    """Why the command line's ``options`` contradict each other (``--no-mtp`` beside a depth or ``--mtp-lookup``), or
    None; a ``server`` still applies them to requests that ask for MTP."""
    moot = [f"--mtp-depth {options.depth}"] * bool(options.depth) + ["--mtp-lookup"] * (options.lookup is True)
    if options.enabled or not moot:
        return None
    flags, one = " and ".join(moot), len(moot) == 1
    if server:
        return (f"--no-mtp serves requests without MTP: {flags} {'applies' if one else 'apply'} only to requests that "
                'ask for it ("enable_mtp": true)')
    return f"--no-mtp decodes without MTP: {flags} {'has' if one else 'have'} no effect"


def add_mtp_arguments(parser, helps: dict = GENERATE_HELP, server: bool = False) -> None:
    """Add ``--mtp-depth N``, ``--no-mtp``, ``--mtp-lookup`` and ``--no-mtp-lookup`` to a runtime's parser (or an
    argument group of it), with ``helps`` (keys ``depth``, ``off``, ``lookup``, ``no_lookup``); the namespace holds them
    as ``mtp_depth``, ``enable_mtp``, ``mtp_lookup`` (``command_line_options``); ``server``: a server's parser
    (``conflict``)."""
    parser.add_argument("--mtp-depth", dest="mtp_depth", type=int, default=0, action=_SetCLI, metavar="N",
                        choices=range(MAX_DEPTH + 1), help=helps["depth"], server=server)
    parser.add_argument("--no-mtp", dest="enable_mtp", action=_SetCLI, nargs=0, const=False, default=True,
                        help=helps["off"], server=server)
    parser.add_argument("--mtp-lookup", dest="mtp_lookup", action=_SetCLI, nargs=0, const=True, default=None,
                        help=helps["lookup"], server=server)
    parser.add_argument("--no-mtp-lookup", dest="mtp_lookup", action=_SetCLI, nargs=0, const=False, default=None,
                        help=helps["no_lookup"], server=server)


def add_cli_flags(setup_arg_parser):
    """Wrap ``setup_arg_parser``: add the MTP flags (``add_mtp_arguments``)."""

    @functools.wraps(setup_arg_parser)
    def wrapper(*args, **kwargs):
        parser = setup_arg_parser(*args, **kwargs)
        add_mtp_arguments(parser)
        return parser

    return wrapper


def lookup_stats(model):
    """The counters of the latest generation of a model without a head that drafted from the context (else None)."""
    state = getattr(model, "mtp_state", None)
    return None if state is None else state.lookup_stats


def announce(loaded, depth: int) -> None:
    """One line on stderr: MTP is on, which head from where, at what depth (None or 0: adaptive)."""
    print(f"MTP on: {loaded.summary()}, depth {depth or 'adaptive'}", file=sys.stderr)
