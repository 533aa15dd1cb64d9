"""A generation's MTP options, resolved once where its request is read, by one rule: the request's value, else the
command line's (``--mtp-depth``, ``--no-mtp``, ``--[no-]mtp-lookup``, also a server's), else the plugin's default
(``MTPOptions.over``)."""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

from .lookup import lookup_policy
from .single import MAX_DEPTH
from .stats import MTPStats


@dataclass(frozen=True)
class MTPOptions:
    """What a generation asks of MTP: ``enabled``; ``depth`` a fixed draft depth 1..8, a depth policy
    (``single.DepthPolicy``) or None (automatic); ``lookup`` None (on with a head, off without), True, False or a
    ``lookup.LookupSettings``."""

    enabled: bool = True
    depth: object = None
    lookup: object = None

    def keywords(self) -> dict:
        """These options as a runtime's generation keywords (``enable_mtp``, ``mtp_depth``, ``mtp_lookup``)."""
        return {"enable_mtp": self.enabled, "mtp_depth": self.depth, "mtp_lookup": self.lookup}

    def over(self, enabled=None, depth=None, lookup=None) -> MTPOptions:
        """These options with a request's own values where it gives them (None, and depth 0, give none).
        ``MTPOptions().over(...)``: a request's options over the plugin's defaults."""
        given = {"enabled": enabled, "lookup": lookup, "depth": None if type(depth) is int and depth == 0 else depth}
        return dataclasses.replace(self, **{k: v for k, v in given.items() if v is not None})


def depth_policy(depth, scheduler, temperature: float = 0.0, context: int = 0):
    """The loop's ``depth`` option: a fixed depth 1..8 or a policy (``next_depth()``, ``observe()``) as given; 0 or
    None: ``scheduler``'s adaptive controller of one-row passes at the sampling ``temperature`` (0.0: greedy) and a
    prompt of ``context`` tokens (``scheduler.Scheduler.controller``). Raises ValueError for any other ``depth``
    (bool, str and float included)."""
    policy = hasattr(depth, "next_depth") and hasattr(depth, "observe")
    integer = isinstance(depth, numbers.Integral) and not isinstance(depth, bool)
    if not (depth is None or policy or (integer and 0 <= depth <= MAX_DEPTH)):
        raise ValueError(f"mtp_depth must be an integer from 0 (adaptive) to {MAX_DEPTH}, None (adaptive) or a "
                         f"depth policy with next_depth() and observe(); got {depth!r}")
    if depth:
        return depth if policy else int(depth)
    return scheduler.controller(temperature, 1, context)


def generation_options(depth, lookup, scheduler, sampling, context: int, headless: bool = False) -> dict:
    """``single.generate``'s ``depth``, ``lookup``, ``sampling``, ``stats`` and ``scheduler`` keywords for one
    generation, from its ``mtp_depth`` and ``mtp_lookup`` and the model's ``scheduler`` (``ModelState``): the depth by
    ``depth_policy`` at the sampling's temperature and a prompt of ``context`` tokens (``headless``: 1, never asked),
    lookup drafts by ``lookup.lookup_policy`` (the scheduler's prior when sampled), draws position-keyed
    (``Sampling.with_coupling``) unless the runtime keys its own. Raises ValueError for a bad depth or lookup."""
    if sampling is not None and sampling.keyed is None:
        sampling = sampling.with_coupling()
    policy = 1 if headless else depth_policy(depth, scheduler, 0.0 if sampling is None else sampling.temp, context)
    fixed = None if headless else policy if isinstance(policy, int) else getattr(policy, "depth", None)
    return {"depth": policy, "sampling": sampling, "scheduler": scheduler, "stats": MTPStats(fixed, headless=headless),
            "lookup": lookup_policy(lookup, headless, None if sampling is None else scheduler.lookup_prior)}
