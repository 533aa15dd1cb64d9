"""mlx-lm's samplers as ``decoding.Sampling``: ``make_sampler`` wrapped to describe the samplers it makes (temperature,
mlx-lm's own ``apply_*`` filters in its order); one it does not describe (XTC, a caller's own) decodes stock."""

from __future__ import annotations

import functools
import inspect
import weakref

from mtp_plugin.decoding.sampling import Sampling

SAMPLINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # sampler -> Sampling, None when greedy


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
