"""``mtp-plugin bench --context N,N…``: the long-context sweep. Tokens/s of plain decoding, each fixed depth and the
default (adaptive) decoding at each context length, and the default's ratio to the best fixed depth and to plain.
Method: docs/commands.md#bench.
"""

from __future__ import annotations

from pathlib import Path

from ..decoding import drafter
from ..usage import UsageError
from . import measure
from .bench import DTYPES, cast, check_options
from .tune import load, summarise


def check_contexts(contexts: list[int]) -> None:
    """Raise ``UsageError`` unless ``contexts`` are positive token counts."""
    if not contexts or any(n < 1 for n in contexts):
        raise UsageError(f"--context takes positive token counts, got {','.join(map(str, contexts)) or 'none'}")


def sweep(model_dir: Path, contexts: list[int], depths: int = 3, max_tokens: int = 128, repeats: int = 3,
          dtype: str | None = None, prompt_count: int = 4) -> dict:
    """Measure plain, depths 1..``depths`` and the default on the suite's first ``prompt_count`` code prompts, each
    padded with earlier source to every length of ``contexts`` (``measure.with_context``); one model load, warm-ups
    on the unpadded first prompt.

    Returns:
        ``{"dtype", "contexts": [{"context": N, "prompt_tokens": [...], "window": the head's prompt pairs at N
        (``drafter.window``), "candidates": rows (``tune.summarise``, ``differs`` counting prompts whose greedy tokens
        differ from plain's; the default is named ``default``),
        "default_vs_best": its tokens/s ÷ the best fixed depth's, "default_vs_plain": its speedup}, ...]}``.

    Raises:
        UsageError: an option out of range (``usage.RANGES``), a context below 1, ``prompt_count`` outside 1..4, an
            unknown dtype.
        CheckpointError: no usable head.
    """
    suite = check_options(depths, max_tokens, repeats, dtype, prompt_count)
    check_contexts(contexts)
    model, tokenizer = load(model_dir)
    if dtype is not None:
        cast(model, DTYPES[dtype])
    base = [tokenizer.encode(p) for p in suite[:prompt_count]]
    candidates = {"plain": None, **{f"depth {d}": d for d in range(1, depths + 1)}, "default": 0}
    decode, stats = measure.runtime_decoder(model)
    out = []
    for n in contexts:
        padded = measure.with_context(base, n, tokenizer.encode)
        rows = summarise(measure.candidates(decode, stats, padded, candidates, max_tokens, repeats,
                                            f"bench: context {n}", warm=base[0]))
        fixed = [r for r in rows if r["name"].startswith("depth ")]
        default = rows[-1]
        out.append({"context": n, "prompt_tokens": [len(p) for p in padded], "window": drafter.window(n),
                    "candidates": rows,
                    "default_vs_best": default["tokens_per_second"] / max(r["tokens_per_second"] for r in fixed),
                    "default_vs_plain": default["speedup"]})
    return {"dtype": dtype, "contexts": out}


def render(report: dict) -> str:
    """The sweep as text: per context length, the candidates' tokens/s, speedups, tokens per cycle and whether their
    greedy tokens equal plain decoding's, then the default's two ratios."""
    lines = []
    for c in report["contexts"]:
        lines.append(f"context {c['context']} (prompts of {', '.join(map(str, c['prompt_tokens']))} tokens; the "
                     f"head is fed the last {c['window']} prompt pairs)")
        lines.append(f"  {'candidate':<10} {'tok/s':>8} {'speedup':>8} {'tok/cycle':>9}  same tokens as plain")
        for r in c["candidates"]:
            cycle = f"{r['tokens_per_cycle']:9.2f}" if r["tokens_per_cycle"] is not None else f"{'-':>9}"
            same = "yes" if not r["differs"] else f"NO ({r['differs']} of {len(c['prompt_tokens'])} prompts differ)"
            lines.append(f"  {r['name']:<10} {r['tokens_per_second']:>8.1f} {r['speedup']:>8.3f} {cycle}  {same}")
        lines.append(f"  default / best fixed depth: {c['default_vs_best']:.3f}; default / plain: "
                     f"{c['default_vs_plain']:.3f}")
    return "\n".join(lines)
