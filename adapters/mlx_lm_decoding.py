"""mlx-lm adapter, decoding side: the generate-step override, samplers, CLI flags.

* ``generate_step`` is wrapped: a model with a loaded head decodes through ``mtp_generate_step``;
  anything else (no head, ``enable_mtp=False``, input embeddings, a custom sampler) is stock.
  ``mtp_depth`` 1..8 fixes the draft depth; 0 / None (automatic) runs the adaptive controller, starting
  from the depth ``mtp-plugin tune`` recorded for the model (``tuning.py``); a depth policy object is used
  as given.
* ``make_sampler`` is wrapped to describe the samplers it makes (temperature and filters, mlx-lm's
  own ``apply_*`` functions in mlx-lm's order) so that rejection sampling uses exactly that distribution.
* ``generate`` is wrapped to print which head is used (stderr) and the MTP summary line after
  mlx-lm's own figures; ``setup_arg_parser`` gains ``--mtp-depth N`` (0 = automatic) and ``--no-mtp``.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import logging
import sys
import weakref

from mtp_plugin.decoding import MAX_DEPTH, Sampling
from mtp_plugin.plugins import hook
from mtp_plugin.stats import MTPStats
from mtp_plugin.tuning import depth_policy

from .patching import release

log = logging.getLogger("mtp_plugin")
CAPTURE_POINTS = {"qwen3_5": "GatedDeltaNet", "qwen3_next": "Qwen3NextGatedDeltaNet"}  # module: layer class
LINEAR_ATTENTION_MODULE = {"qwen3_5": "qwen3_5", "qwen3_5_moe": "qwen3_5", "qwen3_next": "qwen3_next"}
# mlx-lm < 0.32 shows logits processors only the tokens after the chunked prefill (measured on 0.31.3).
PREFILL_IN_HISTORY = release("mlx-lm") >= (0, 32, 0)
CLI = {"depth": 0, "enabled": True}  # set by --mtp-depth / --no-mtp; 0 = automatic
CAPTURED: set[str] = set()  # linear-attention modules whose layers have capture points (set when patched)
SAMPLINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # sampler -> Sampling, None when greedy


class MTPUnsupported(ValueError):
    """A generation option the MTP loop cannot honour; the message names it and the fix."""


def describe_samplers(make_sampler):
    """Wrap ``make_sampler`` so that ``SAMPLINGS`` describes every sampler it returns (None: greedy)."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    signature = inspect.signature(make_sampler)

    @functools.wraps(make_sampler)
    def wrapper(*args, **kwargs):
        sampler = make_sampler(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        s = bound.arguments
        if s["temp"] == 0:
            SAMPLINGS[sampler] = None
        if s["temp"] == 0 or s.get("xtc_probability", 0.0) > 0.0:
            return sampler
        filters = []
        if 0 < s["top_p"] < 1.0:
            filters.append(functools.partial(apply_top_p, top_p=s["top_p"]))
        if s["min_p"] != 0.0:
            filters.append(functools.partial(apply_min_p, min_p=s["min_p"],
                                             min_tokens_to_keep=s["min_tokens_to_keep"]))
        if s["top_k"] > 0:
            filters.append(functools.partial(apply_top_k, top_k=s["top_k"]))
        SAMPLINGS[sampler] = Sampling(s["temp"], tuple(filters))
        return sampler

    return wrapper


def decoding_options(model, loaded, depth, kwargs) -> dict | None:
    """Options for ``mtp_generate_step`` from ``generate_step`` keyword arguments, or None for stock decoding.

    Raises:
        MTPUnsupported: ``max_kv_size`` (a rotating cache cannot be rolled back) or ``kv_bits``.
    """
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    if kwargs.get("input_embeddings") is not None:
        return None
    for option, why in (("max_kv_size", "a rotating KV cache cannot be rolled back after a rejected draft"),
                        ("kv_bits", "the MTP loop does not quantize the KV cache")):
        if kwargs.get(option) is not None:
            raise MTPUnsupported(f"MTP decoding cannot honour {option}={kwargs[option]}: {why}; "
                                 "drop the option or disable MTP (--no-mtp / enable_mtp=False)")
    sampler = kwargs.get("sampler")
    if sampler is not None and sampler not in SAMPLINGS:
        log.warning("mtp_plugin: a custom sampler has no known distribution; decoding without MTP.")
        return None
    depth = depth or CLI["depth"]  # 0 / None: automatic (adaptive); a depth policy object is used as given
    loaded.stats = MTPStats(depth if isinstance(depth, int) and depth else None)
    cache = kwargs.get("prompt_cache")
    return {
        "cache": make_prompt_cache(model) if cache is None else cache,
        "head_cache": KVCache(),
        "depth": depth_policy(depth, loaded),
        "max_tokens": kwargs.get("max_tokens", 256),
        "sampling": None if sampler is None else SAMPLINGS[sampler],
        "logits_processors": kwargs.get("logits_processors"),
        "prefill_step_size": kwargs.get("prefill_step_size", 2048),
        "prompt_progress_callback": kwargs.get("prompt_progress_callback"),
        "prefill_history": PREFILL_IN_HISTORY,
        "stats": loaded.stats,
    }


def mtp_generate_step(generate_step, captured: set[str]):
    """Wrap ``generate_step``: MTP for a model with a loaded head whose runtime layers have capture points."""

    @functools.wraps(generate_step)
    def wrapper(prompt, model, *args, mtp_depth=None, enable_mtp=None, **kwargs):
        loaded = getattr(model, "mtp_head", None)
        model_type = loaded.location.model_type if loaded is not None else None
        enable_mtp = CLI["enabled"] if enable_mtp is None else enable_mtp
        if enable_mtp and LINEAR_ATTENTION_MODULE.get(model_type) in captured:
            options = decoding_options(model, loaded, mtp_depth, kwargs)
            if options is not None:
                generator = hook().mtp_generate_step(prompt=prompt, model=model, options=options)
                if generator is not None:
                    return generator
        return generate_step(prompt, model, *args, **kwargs)

    return wrapper


def print_summary(generate):
    """Wrap ``generate``: with ``verbose``, say on stderr which head decodes at what depth, and print the
    MTP line of this generation after mlx-lm's own figures."""

    @functools.wraps(generate)
    def wrapper(model, tokenizer, prompt, *args, **kwargs):
        loaded = getattr(model, "mtp_head", None)
        if loaded is not None:
            loaded.stats = None
            enabled = kwargs.get("enable_mtp", CLI["enabled"])
            if kwargs.get("verbose") and enabled:
                announce(loaded, kwargs.get("mtp_depth") or CLI["depth"])
        text = generate(model, tokenizer, prompt, *args, **kwargs)
        if kwargs.get("verbose") and loaded is not None and loaded.stats is not None:
            print(loaded.stats.summary())
        return text

    return wrapper


class _SetCLI(argparse.Action):
    """Store the option's value (or ``const`` for a flag) in the namespace and in ``CLI``."""

    def __call__(self, parser, namespace, values, option_string=None):
        value = self.const if self.nargs == 0 else values
        setattr(namespace, self.dest, value)
        CLI[self.dest] = value


def add_cli_flags(setup_arg_parser):
    """Wrap ``setup_arg_parser``: add ``--mtp-depth`` and ``--no-mtp`` (they set ``CLI``)."""

    @functools.wraps(setup_arg_parser)
    def wrapper(*args, **kwargs):
        parser = setup_arg_parser(*args, **kwargs)
        parser.add_argument("--mtp-depth", dest="depth", type=int, default=0, action=_SetCLI, metavar="N",
                            choices=range(MAX_DEPTH + 1),
                            help=f"MTP draft depth 1-{MAX_DEPTH} (0: adaptive). Needs a checkpoint with an MTP head.")
        parser.add_argument("--no-mtp", dest="enabled", action=_SetCLI, nargs=0, const=False, default=True,
                            help="Decode without the MTP head even if the checkpoint has one.")
        return parser

    return wrapper


def announce(loaded, depth: int) -> None:
    """One line on stderr: MTP is on, which head from where, at what depth (0: adaptive)."""
    print(f"MTP on: {loaded.summary()}, depth {depth or 'adaptive'}", file=sys.stderr)
