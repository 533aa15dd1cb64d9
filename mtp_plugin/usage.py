"""``UsageError`` (exit 2) and the ranges of the commands' numeric options, shared by argparse and the Python
functions behind the command line."""

from __future__ import annotations

import argparse

RANGES = {  # option: (lowest, highest or None)
    "depths": (1, 8),  # draft depths measured: 1..N
    "max_tokens": (2, None),  # tokens per prompt; speeds count the tokens after the first
    "repeats": (1, None),  # runs of the prompt suite (medians)
}
GROUP_SIZES = (32, 64, 128)  # what mx.quantize accepts
HEAD_BITS = (4, 8, 16)  # extract, graft: 4/8-bit affine quantization, 16: bfloat16
DEFAULT_BITS, DEFAULT_GROUP_SIZE = 4, 64  # the head's default quantization: docs/checkpoints.md#head-quantization


class UsageError(ValueError):
    """An argument the command cannot honour (a value out of range, an output that would touch user data);
    the message names the option or file and the fix. Nothing was written."""


def check_quantization(bits: int, group_size: int) -> None:
    """Raise ``UsageError`` unless ``bits`` is one of ``HEAD_BITS`` and ``group_size`` one of ``GROUP_SIZES``."""
    if bits not in HEAD_BITS or group_size not in GROUP_SIZES:
        raise UsageError(f"--bits must be one of {HEAD_BITS} and --group-size one of {GROUP_SIZES}, "
                         f"got {bits} and {group_size}")


def describe(option: str) -> str:
    """The range of ``option`` as ``--help`` shows it: ``1-8`` or ``>= 2``."""
    low, high = RANGES[option]
    return f"{low}-{high}" if high is not None else f">= {low}"


def within(option: str, value: int) -> bool:
    """Whether ``value`` lies in the range of ``option`` (a key of ``RANGES``)."""
    low, high = RANGES[option]
    return value >= low and (high is None or value <= high)


def check(option: str, value: int) -> int:
    """``value`` if within the range of ``option`` (a key of ``RANGES``), else ``UsageError`` naming the range."""
    if not within(option, value):
        raise UsageError(f"--{option.replace('_', '-')} must be {describe(option)}, got {value}")
    return value


def int_in(option: str):
    """An argparse ``type`` for ``option``: an int within its range, else argparse's usage error (exit 2)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not within(option, value):
            raise argparse.ArgumentTypeError(f"must be {describe(option)}, got {value}")
        return value

    parse.__name__ = option  # argparse names the type in its messages
    return parse
