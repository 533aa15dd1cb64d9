"""mlx-vlm's sampling as a ``decoding.Sampling``: the exact distribution its ``generate_step`` (0.6, 0.7) draws from
(``sampling``); a caller's own ``sampler`` has none known (stock decoding). Design: docs/mlx-vlm.md#how-it-works."""

from __future__ import annotations

import dataclasses
import functools
import inspect

import mlx.core as mx

from mtp_plugin.decoding.drafter import log_softmax
from mtp_plugin.decoding.sampling import Sampling

from .patching import release

# mlx-vlm 0.7's server samples with top-k; 0.6's ignores a request's top_k
SERVER_TOP_K = release("mlx-vlm") >= (0, 7, 0)
# The server's ``make_sampler`` options, each with its stock default: any set one picks ``make_sampler``
FILTER_OPTIONS = {"top_n_sigma": 0.0, "p_less": False, "typical_p": 1.0}


def _scaled_log_softmax(logprobs: mx.array, temp: float) -> mx.array:
    """``top_p_sampling``'s first step: log-softmax of the log-probs divided by the temperature, float32."""
    return log_softmax(logprobs.astype(mx.float32) / temp)


def _keyed_draws(sampler, logprobs: mx.array, first: int) -> mx.array:
    """Tokens (k,) the position-keyed ``sampler`` draws for generated tokens ``first .. first+k-1`` of row 0 from
    log-probs (k, V), as ``generate_step`` calls it one token at a time (``Sampling.keyed``)."""
    count = logprobs.shape[0]
    return sampler.sample_target(logprobs, row_ids=[0] * count, positions=list(range(first, first + count)))


def _positioned(ar, args: dict, temp: float) -> bool:
    """Whether ``generate_step`` samples with its position-keyed sampler (its own test, both releases)."""
    plain = (args["min_p"] == ar.DEFAULT_MIN_P and args["top_n_sigma"] == ar.DEFAULT_TOP_N_SIGMA
             and not args["p_less"] and args["typical_p"] == 1.0)
    if not _positioned_top_k(ar):
        plain = plain and args["top_k"] == ar.DEFAULT_TOP_K
    return args.get("seed") is not None and temp > 0 and plain


def _positioned_top_k(ar) -> bool:
    """Whether the position-keyed sampler applies top-k itself (0.7); on 0.6 it is never chosen with top-k."""
    return "top_k" in inspect.signature(ar._PositionedTargetSampler).parameters


def sampling(ar, args: dict, temperature: float, top_p: float | None, top_k: int | None,
             positioned: bool | None = None) -> Sampling:
    """The distribution ``generate_step`` samples from for ``args``, with mlx-vlm's own filters.

    With a seed, temperature > 0 and no filter but top-p (0.7: and top-k), the position-keyed sampler: top-k, then
    ``top_p_sampling``, which divides by the temperature before the nucleus (``log_softmax(x / T)``, ``apply_top_p``,
    a draw at temperature 1), its seeded draws kept as ``Sampling.keyed``. Otherwise ``make_sampler``'s filters in its
    order (top-nσ, p-less, typical-p, top-p, min-p, top-k; ``generate_step`` gives it no XTC), then the temperature.

    Args:
        temperature, top_p, top_k: as ``generate_step`` resolves them (0.7 fills unset ones from the checkpoint's
            generation defaults); temperature > 0.
        positioned: whether the sampler is the position-keyed one (mlx-vlm's server picks it with or without a
            seed); None: ``generate_step``'s own choice. Its draws are keyed only with a seed.
    """
    from mlx_vlm import sample_utils as su

    temp = getattr(su, "clamp_temperature", lambda t: t)(temperature)
    nucleus = top_p is not None and 0 < top_p < 1.0
    top_k = top_k if top_k and top_k > 0 else None
    if _positioned(ar, args, temp) if positioned is None else positioned:
        with_top_k = top_k and _positioned_top_k(ar)
        keyed = None
        if args.get("seed") is not None:
            sampler = ar._PositionedTargetSampler(temperature=temp, top_p=top_p, seed=args["seed"],
                                                  **({"top_k": top_k} if with_top_k else {}))
            keyed = functools.partial(_keyed_draws, sampler)
        filters = [functools.partial(su.apply_top_k, top_k=top_k)] if with_top_k else []
        if nucleus:
            filters += [functools.partial(_scaled_log_softmax, temp=temp),
                        functools.partial(su.apply_top_p, top_p=top_p)]
            return Sampling(1.0, tuple(filters), keyed)
        return Sampling(temp, tuple(filters), keyed)
    filters = []
    if args["top_n_sigma"] > 0.0:
        filters.append(functools.partial(su.apply_top_n_sigma, n_sigma=args["top_n_sigma"]))
    if args["p_less"]:
        filters.append(functools.partial(su.apply_p_less, temp=temp))
    if 0.0 < args["typical_p"] < 1.0:
        filters.append(functools.partial(su.apply_typical_p, typical_p=args["typical_p"]))
    if nucleus:
        filters.append(functools.partial(su.apply_top_p, top_p=top_p))
    if args["min_p"] != 0.0:
        filters.append(functools.partial(su.apply_min_p, min_p=args["min_p"]))
    if top_k:
        filters.append(functools.partial(su.apply_top_k, top_k=top_k))
    return Sampling(temp, tuple(filters))


def server_sampling(ar, args, sampler) -> Sampling:
    """The distribution of ``sampler``, the one mlx-vlm's server ``_make_sampler`` built for request ``args``
    (temperature > 0): its position-keyed sampler's own draws as ``keyed`` (seeded by mlx-vlm's default seed when the
    request gives none), or ``make_sampler``'s filters (top-nσ, p-less, typical-p). mlx-vlm 0.6's server ignores a
    request's top-k (``SERVER_TOP_K``)."""
    positioned = callable(getattr(sampler, "sample_target", None))
    top_k = args.top_k if SERVER_TOP_K else 0
    named = {"min_p": 0.0, "seed": args.seed, "top_k": top_k,
             **{name: getattr(args, name, default) for name, default in FILTER_OPTIONS.items()}}
    described = sampling(ar, named, args.temperature, args.top_p, top_k, positioned)
    if positioned:
        return dataclasses.replace(described, keyed=functools.partial(_keyed_draws, sampler))
    return described
