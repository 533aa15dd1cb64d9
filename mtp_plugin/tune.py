"""``mtp-plugin tune``: measure plain decoding and draft depths 1..N on a code prompt suite, record the fastest.

The recommended depth must beat plain decoding by ``MARGIN`` (speedup: the median over repeated runs of
its tokens per second ÷ plain's in the same run); otherwise plain decoding is recommended (recorded as
depth 0: the adaptive controller then starts parked). The record goes to the user cache (``tuning.py``)
and, with ``write``, to config.json; ``mlx_lm.generate`` with automatic depth starts its adaptive
controller there.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from . import measure, tuning
from .checkpoint import CheckpointError
from .files import check_replaceable
from .plugins import hook
from .usage import check

MARGIN = 0.02  # a depth is recommended only if at least 2 % faster than plain decoding


def summarise(results: dict[str, measure.Result]) -> list[dict]:
    """Per candidate: name, tokens/s (median), speedup vs plain, tokens per cycle, acceptance by depth.

    The speedup is the median over repeats of the candidate's tokens/s ÷ plain's in the same repeat
    (paired, so that a change of machine speed between repeats cancels).
    """
    plain = results["plain"].runs
    rows = []
    for name, r in results.items():
        speedup = statistics.median(mine / theirs for mine, theirs in zip(r.runs, plain, strict=True))
        rows.append({"name": name, "tokens_per_second": r.tokens_per_second, "speedup": speedup,
                     "runs": r.runs,
                     "tokens_per_cycle": r.stats.tokens_per_cycle if r.stats else None,
                     "acceptance_by_depth": r.stats.acceptance_by_depth if r.stats else None,
                     "passes_per_token": r.stats.passes_per_token if r.stats else 1.0})
    return rows


def check_measure_options(depths: int, max_tokens: int, repeats: int) -> None:
    """Refuse out-of-range options of tune and bench (``usage.RANGES``) before anything is loaded.

    Raises:
        UsageError: the option, its range and the value given.
    """
    for option, value in (("depths", depths), ("max_tokens", max_tokens), ("repeats", repeats)):
        check(option, value)


def load(model_dir: Path):
    """``(model, tokenizer)`` through the installed runtime, with a usable head.

    Raises:
        CheckpointError: no usable head.
    """
    model, tokenizer = hook().mtp_load_model(model_dir=model_dir)
    if getattr(model, "mtp_head", None) is None:
        raise CheckpointError(f"{model_dir}: no usable MTP head; run `mtp-plugin inspect {model_dir}`")
    return model, tokenizer


def tune(model_dir: Path, depths: int = 3, max_tokens: int = 128, repeats: int = 3, write: bool = False) -> dict:
    """Measure and record the best depth for ``model_dir`` on this machine.

    Returns:
        ``{"candidates": [...summarise rows], "depth": recommended (0: plain), "cache": path, "written": bool}``.

    Raises:
        UsageError: ``depths``, ``max_tokens`` or ``repeats`` out of range (``usage.RANGES``); ``write`` and
            config.json or its directory read-only (checked before measuring).
        CheckpointError: no usable head.
    """
    check_measure_options(depths, max_tokens, repeats)
    if write:
        check_replaceable(Path(model_dir) / "config.json")
    model, tokenizer = load(model_dir)
    prompts = [tokenizer.encode(p) for p in measure.code_prompts()]
    candidates = {"plain": None, **{f"depth {d}": d for d in range(1, depths + 1)}}
    rows = summarise(measure.candidates(*measure.runtime_decoder(model), prompts, candidates, max_tokens, repeats,
                                        "tune"))
    best = max(rows[1:], key=lambda r: r["speedup"])
    depth = candidates[best["name"]] if best["speedup"] >= 1 + MARGIN else 0
    path = tuning.record(Path(model_dir), depth, {r["name"]: r["tokens_per_second"] for r in rows}, write)
    return {"candidates": rows, "depth": depth, "cache": str(path), "written": write}
