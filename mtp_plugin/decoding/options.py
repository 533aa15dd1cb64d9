"""A generation's MTP options, resolved by one rule: the request's value, else the command line's (``--mtp-depth``,
``--no-mtp``, ``--[no-]mtp-lookup``, also a server's), else the plugin's default."""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

from .. import tuning
from .controller import DepthController
from .single import DEFAULT_DEPTH, MAX_DEPTH

CONTEXT_BAND = 2048  # tokens: generations whose contexts share a band (doubling from here) share a depth controller


@dataclass(frozen=True)
class MTPOptions:
    """What a generation asks of MTP: ``enabled``; ``depth`` a fixed draft depth 1..8, a depth policy
    (``single.DepthPolicy``) or None (automatic); ``lookup`` None (on with a head, off without), True, False or a
    ``lookup.LookupSettings``."""

    enabled: bool = True
    depth: object = None
    lookup: object = None

    def over(self, enabled=None, depth=None, lookup=None) -> MTPOptions:
        """These options with a request's own values where it gives them (None, and depth 0, give none)."""
        given = {"enabled": enabled, "lookup": lookup, "depth": None if type(depth) is int and depth == 0 else depth}
        return dataclasses.replace(self, **{k: v for k, v in given.items() if v is not None})


_command_line = MTPOptions()


def command_line() -> MTPOptions:
    """The command line's options (the plugin's defaults where it gave none)."""
    return _command_line


def set_command_line(**values) -> None:
    """Record the command line's options (``MTPOptions`` fields; depth 0: automatic)."""
    global _command_line
    _command_line = MTPOptions().over(**values)


def resolve(enabled=None, depth=None, lookup=None) -> MTPOptions:
    """A generation's options: the request's values over the command line's."""
    return _command_line.over(enabled, depth, lookup)


def context_band(context: int) -> int:
    """The band of a generation whose trunk context starts with ``context`` tokens: 0 below ``CONTEXT_BAND``, then
    one more each time the context doubles (1: 2-4k tokens, 2: 4-8k, …)."""
    return (max(context, 0) // CONTEXT_BAND).bit_length()


def depth_policy(depth, loaded, temperature: float = 0.0, context: int = 0):
    """The loop's ``depth`` option: a fixed depth 1..8 or a policy (``next_depth()``, ``observe()``) as given; 0 or
    None: the adaptive ``DepthController`` of ``loaded`` (a ``loading.loader.LoadedHead``) for the sampling
    ``temperature`` rounded to 0.1 (0.0: greedy) and the ``context_band`` of the prompt's ``context`` tokens, kept
    across generations. A new one starts at the choice of the same temperature's nearest shorter band (a verify
    pass costs more, and drafts are accepted less, as the context grows), else at the tuned depth (else the
    default). Raises ValueError for any other ``depth`` (bool, str and float included)."""
    policy = hasattr(depth, "next_depth") and hasattr(depth, "observe")
    integer = isinstance(depth, numbers.Integral) and not isinstance(depth, bool)
    if not (depth is None or policy or (integer and 0 <= depth <= MAX_DEPTH)):
        raise ValueError(f"mtp_depth must be an integer from 0 (adaptive) to {MAX_DEPTH}, None (adaptive) or a "
                         f"depth policy with next_depth() and observe(); got {depth!r}")
    if depth:
        return depth if policy else int(depth)
    key = (round(float(temperature), 1), context_band(context))
    if key not in loaded.controllers:
        shorter = [k for k in loaded.controllers if k[0] == key[0] and k[1] < key[1]]
        start = (loaded.controllers[max(shorter)].choice if shorter
                 else tuning.start_depth(loaded.location.model_dir, DEFAULT_DEPTH, MAX_DEPTH))
        loaded.controllers[key] = DepthController(start)
    return loaded.controllers[key]
