"""mlx-vlm adapter, decoding side: ``generate_step`` wrapped so text, image and video prompts decode through the MTP
loop (mlx-vlm's own prompt pass and positions; its samplers' distributions), ``generate`` to print the MTP line, and
``python -m mlx_vlm generate`` given the MTP flags. What decodes stock: ``_stock_reason``. Design: docs/mlx-vlm.md."""

from __future__ import annotations

import argparse
import functools
import inspect
import logging
import types

import mlx.core as mx

from mtp_plugin.decoding.options import MTPOptions, generation_options
from mtp_plugin.decoding.state import state_of
from mtp_plugin.decoding.trunk import PromptInputs, multimodal
from mtp_plugin.plugins import hook

from .capture import rollback_ready
from .mlx_lm_decoding import add_mtp_arguments, announce, warn_headless
from .mlx_vlm_sampling import sampling
from .patching import release

log = logging.getLogger("mtp_plugin")
# Plain prefill of a prompt of T tokens: mlx-vlm 0.7 runs all but the last token in chunks whenever T > 1; 0.6 only
# when T > prefill_step_size. Logits processors see the tokens of the last pass and every generated token.
CHUNKS_EVERY_PROMPT = release("mlx-vlm") >= (0, 7, 0)
# Prompt tokens continuing a non-empty prompt cache: mlx-vlm 0.7 continues their mRoPE positions; 0.6 restarts them
# at 0, which MTP does not reproduce.
CONTINUES_CACHED_POSITIONS = release("mlx-vlm") >= (0, 7, 0)
# Prompt-pass keywords: mlx-vlm 0.7 lets the caller's position metadata (a reused cache's, for the whole prompt)
# override what ``get_input_embeddings`` derives from the uncached suffix; 0.6 lets the derived ones win.
CALLER_POSITIONS_WIN = release("mlx-vlm") >= (0, 7, 0)
# Options that decode stock, with the warning given once per process.
WARNINGS = {
    "sampler": "a custom sampler passed to mlx-vlm has no known distribution; decoding without MTP.",
    "kv cache": "mlx-vlm's rotating or quantized KV cache (max_kv_size, kv_bits, kv_key_bits, kv_value_bits) "
                "decodes without MTP.",
}
KV_CACHE_OPTIONS = ("max_kv_size", "kv_bits", "kv_key_bits", "kv_value_bits")
POSITION_KWARGS = ("position_ids", "rope_deltas")  # a reused prompt cache's mRoPE metadata: no media
_warned: set[str] = set()


def _model_inputs(extra: dict) -> set[str]:
    """Keywords carrying arrays for the model (``pixel_values_videos``, ``image_grid_thw``, ``inputs_embeds`` …)."""
    return {k for k, v in extra.items()
            if isinstance(v, mx.array) or (isinstance(v, list | tuple) and any(isinstance(x, mx.array) for x in v))}


def _stock_reason(model, args: dict, extra: dict) -> str | None:
    """Why these ``generate_step`` arguments must decode stock, or None when the MTP loop reproduces them."""
    media = args["pixel_values"] is not None or _model_inputs(extra) - set(POSITION_KWARGS)
    if media and not multimodal(model):
        return "media"
    if args["input_ids"].ndim != 2 or args["input_ids"].shape[0] != 1 or args["input_ids"].size == 0:
        return "batch"
    if args.get("draft_model") is not None:
        return "drafter"
    cache = args.get("prompt_cache")
    if not CONTINUES_CACHED_POSITIONS and cache and any(getattr(c, "offset", 0) for c in cache):
        return "cached prefix"
    if args.get("prompt_cache_checkpoint") is not None:
        return "checkpoint"
    if extra.get("thinking_budget_criteria") is not None:
        return "thinking budget"  # forces tokens into the plain loop
    if args.get("sampler") is not None:
        return "sampler"
    if any(args.get(option) is not None for option in KV_CACHE_OPTIONS):
        return "kv cache"
    return None


def prompt_inputs(model, args: dict, extra: dict) -> PromptInputs:
    """The prompt pass as mlx-vlm's ``generate_step`` runs it: ``model.get_input_embeddings`` (media merged,
    multimodal positions), its fields joining the caller's keywords (``CALLER_POSITIONS_WIN``)."""
    run = functools.partial(_language_model_pass, model.language_model)
    explicit = {k: extra[k] for k in POSITION_KWARGS if k in extra} if CALLER_POSITIONS_WIN else {}
    output = model.get_input_embeddings(args["input_ids"], args["pixel_values"], mask=args["mask"], **extra)
    fields = {k: v for k, v in output.to_dict().items() if k != "inputs_embeds" and v is not None}
    return PromptInputs(output.inputs_embeds, run, {**extra, **fields, **explicit})


def _language_model_pass(language_model, tokens: mx.array, cache: list, keywords: dict) -> mx.array:
    """mlx-vlm's language model on ``tokens`` (1, S): hidden states (1, S, H) after its final norm, no logits
    (``trunk.PromptInputs.run``); it derives each pass's positions as in ``generate_step``."""
    return language_model(tokens, cache=cache, return_hidden=True, skip_logits=True, **keywords).hidden_states[-1]


def _sampling_parameters(ar, model, args: dict) -> tuple[float, float | None, int | None]:
    """``(temperature, top_p, top_k)`` as ``generate_step`` will use them (mlx-vlm ≥ 0.7 falls back on the
    checkpoint's generation defaults for unset ones); temperature 0: greedy."""
    resolve = getattr(ar, "resolve_sampling_defaults", None)
    temperature, top_p, top_k = args.get("temperature"), args.get("top_p"), args.get("top_k")
    if resolve is not None:
        temperature, top_p, top_k = resolve(getattr(model, "config", None), temperature=temperature,
                                            top_p=top_p, top_k=top_k)
    return temperature or 0.0, top_p, top_k


def _processors(ar, args: dict) -> list:
    """The logits processors ``generate_step`` builds (penalties, logit bias) plus the caller's own."""
    make = ar.make_logits_processors
    processors = make(**{name: args[name] for name in inspect.signature(make).parameters if name in args})
    return processors + list(args.get("logits_processors") or [])


def decoding_options(ar, model, loaded, depth, args: dict, extra: dict, lookup=None) -> dict | None:
    """Options for ``mtp_generate_step`` from ``step_arguments``' ``args`` / ``extra``, or None for stock decoding.

    Args:
        ar: the module defining mlx-vlm's ``generate_step`` (its sampling and processor helpers).
        loaded: the model's ``LoadedHead``; ``loaded.stats`` is set to fresh counters when MTP decodes.
        depth: draft depth 1-8 or a depth policy; 0 or None: adaptive (``options.depth_policy``).
        lookup: the ``mtp_lookup`` option (``lookup.lookup_policy``: None is on).

    Raises:
        ValueError: a bad depth or ``lookup``.
    """
    reason = _stock_reason(model, args, extra)
    if reason is not None:
        if reason in WARNINGS and reason not in _warned:
            _warned.add(reason)
            log.warning("mtp_plugin: %s", WARNINGS[reason])
        return None
    from mlx_vlm.models.cache import KVCache, make_prompt_cache

    temperature, top_p, top_k = _sampling_parameters(ar, model, args)
    sampled = sampling(ar, args, temperature, top_p, top_k) if temperature > 0 else None

    prompt_size = args["input_ids"].size
    step = args.get("prefill_step_size")
    chunked = step is not None and (prompt_size > 1 if CHUNKS_EVERY_PROMPT else prompt_size > step)
    options = generation_options(depth, lookup, state_of(model.language_model, loaded).scheduler, sampled,
                                 prompt_size)
    loaded.stats = options["stats"]
    cache = args.get("prompt_cache")
    return {
        **options,
        "cache": make_prompt_cache(model.language_model) if cache is None else cache,
        "head_cache": KVCache(),
        "max_tokens": args["max_tokens"],
        "logits_processors": _processors(ar, args),
        "prefill_step_size": step or prompt_size,
        "prefill_history": not chunked,
        "one_pass": not chunked,
        "cut_window": False,  # its GatedDeltaNet may scan a multi-token pass in chunks of its own
        "prompt_progress_callback": prefill_bar() if chunked and args.get("verbose") else None,
        # a trunk without multimodal positions (Qwen3-Next) takes text only: its plain token pass is mlx-vlm's own
        "prompt_inputs": prompt_inputs(model, args, extra) if multimodal(model) else None,
    }


def prefill_bar():
    """``callback(processed, total)`` showing mlx-vlm's chunked-prefill bar (tqdm, ``Prefill``) as stock does: it ends
    at total - 1, the last prompt token running with the first decoding step."""
    from tqdm import tqdm

    bar = None

    def callback(processed: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc="Prefill", unit="tok")
        if processed < total:
            bar.update(processed - bar.n)
        else:
            bar.close()

    return callback


def step_arguments(generate_step, *args, **kwargs) -> tuple[dict, dict]:
    """``(args, extra)``: ``generate_step``'s named arguments with defaults, and its other keywords (passed on to the
    model) without None values. Raises TypeError for arguments ``generate_step`` does not take."""
    signature = inspect.signature(generate_step)
    var_keyword = next(p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    named = dict(bound.arguments)
    return named, {k: v for k, v in named.pop(var_keyword).items() if v is not None}


def mtp_generate_step(generate_step, ar, captured: dict[str, bool]):
    """Wrap mlx-vlm's ``generate_step(input_ids, model, pixel_values, mask, **kwargs)``: MTP for a model with a loaded
    head whose trunk can be rolled back. Added keywords ``enable_mtp``, ``mtp_depth`` (1-8; None: adaptive) and
    ``mtp_lookup`` (the CLI passes its flags as these: ``mlx_lm_decoding.with_cli_options``); the plugin's defaults
    where not given."""
    @functools.wraps(generate_step)
    def wrapper(input_ids, model, pixel_values, mask, *, mtp_depth=None, enable_mtp=None, mtp_lookup=None, **kwargs):
        asked = MTPOptions().over(enable_mtp, mtp_depth, mtp_lookup)
        enable_mtp, mtp_depth, mtp_lookup = asked.enabled, asked.depth, asked.lookup
        loaded = getattr(model, "mtp_head", None)
        model_type = loaded.location.model_type if loaded is not None else None
        if loaded is not None:
            loaded.stats = None
        if enable_mtp and loaded is None:
            warn_headless(model, mtp_depth)
        if enable_mtp and loaded is not None and rollback_ready(captured, model_type):
            named, extra = step_arguments(generate_step, input_ids, model, pixel_values, mask, **kwargs)
            options = decoding_options(ar, model, loaded, mtp_depth, named, extra, lookup=mtp_lookup)
            if options is not None:
                generator = hook().mtp_generate_step(prompt=input_ids[0], model=model, options=options)
                if generator is not None:
                    if named.get("verbose"):
                        announce(loaded, loaded.stats.depth)
                    return generator
            loaded.stats = None
        return generate_step(input_ids, model, pixel_values, mask, **kwargs)

    return wrapper


class _ParserWithMTPFlags(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` that carries the MTP flags from its construction."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        add_mtp_arguments(self)


def cli_argparse(module):
    """The ``argparse`` module as mlx-vlm's generate CLI (``generate/dispatch.py``, which builds and parses its parser
    in ``parse_arguments``) sees it: its ``ArgumentParser`` carries the MTP flags."""
    return types.SimpleNamespace(**{**vars(module), "ArgumentParser": _ParserWithMTPFlags})


def print_summary(generate):
    """Wrap mlx-vlm's ``generate``: with ``verbose``, print the MTP line of this generation after its figures."""
    signature = inspect.signature(generate)

    @functools.wraps(generate)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        result = generate(*args, **kwargs)
        loaded = getattr(bound.arguments.get("model"), "mtp_head", None)
        if bound.arguments.get("verbose") and loaded is not None and loaded.stats is not None:
            print(loaded.stats.summary())
        return result

    return wrapper
