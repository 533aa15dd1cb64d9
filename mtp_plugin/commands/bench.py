"""``mtp-plugin bench``: tokens/s of plain, fixed-depth and adaptive decoding, component costs relative to a plain
step, ideal speedup and efficiency, rollback ways, and other runtimes' own MTP decoders. Usage and formulas:
docs/commands.md#bench.
"""

from __future__ import annotations

import gc
import statistics
from pathlib import Path
from typing import Protocol

import mlx.core as mx
from mlx.utils import tree_map

from .. import tuning
from ..decoding.scheduler import context_band
from ..decoding.single import DEFAULT_DEPTH, MAX_DEPTH
from ..decoding.state import state_of
from ..decoding.stats import MTPStats
from ..head import draft_vocab
from ..plugins import hook
from ..usage import UsageError
from . import measure
from .tune import check_measure_options, load, summarise

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
MEASURABLE = 32  # tokens per prompt below which a speed measures start-up and a few cycles, not decoding


def few_tokens(max_tokens: int) -> str | None:
    """The warning for ``max_tokens`` below ``MEASURABLE``, else None."""
    if max_tokens >= MEASURABLE:
        return None
    return (f"--max-tokens {max_tokens} is below {MEASURABLE}: so few tokens per prompt measure start-up and a handful "
            "of cycles, not decoding; speeds, speedups and efficiencies are noise (the default is 128)")


class ReferenceDecoder(Protocol):
    """Another runtime's own MTP decoding, run beside ours."""

    name: str

    def stream(self, prompt: list[int], max_tokens: int, depth: int | None):
        """Greedy token ids (iterator of int); ``depth`` None: that runtime's plain decoding."""

    def stats(self) -> MTPStats | None:
        """Counters of the last stream (None if the runtime keeps none)."""


def cast(model, dtype) -> None:
    """Cast every floating parameter of ``model`` and its head to ``dtype`` (quantized weights stay; a draft
    vocabulary is rebuilt from the cast output projection)."""
    def convert(a):
        return a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a

    model.update(tree_map(convert, model.parameters()))
    head = getattr(model, "mtp_head", None)
    if head is not None:
        head.module.update(tree_map(convert, head.module.parameters()))
        vocab = head.draft_vocab
        if vocab is not None:  # its rows are a copy: copy them again from the cast projection
            trunk = hook().mtp_trunk(model=model, contract=head.module.contract)
            head.draft_vocab = draft_vocab.build(trunk, vocab.ids.tolist(), vocab.source)


def efficiency(rows: list[dict], costs: dict, draft: str = "draft") -> None:
    """Add ``ideal`` and ``efficiency`` (speedup / ideal) to each ``depth N`` row in place, with draft costs
    ``costs[draft]``: ideal(d) = tokens_per_cycle / ((t_draft(d) + t_verify(d + 1)) / t(1)) (Leviathan et al. 2023,
    §3.1)."""
    t1 = costs["plain"]
    for row in rows:
        if row["name"].startswith("depth "):
            d = int(row["name"].split()[1])
            relative = (costs[draft][d] + costs["verify"][d + 1]) / t1
            row["ideal"] = row["tokens_per_cycle"] / relative
            row["efficiency"] = row["speedup"] / row["ideal"] if row["ideal"] else None  # no cycle ran


def notes(max_tokens: int, rows: list[dict]) -> list[str]:
    """What makes a report's figures unreliable, a line each: too few tokens (``few_tokens``), a candidate whose
    tokens differ from plain decoding's, an efficiency above 1 (marked ``*`` in its row)."""
    out = [few_tokens(max_tokens)] if few_tokens(max_tokens) else []
    out += [f"{r['name']}: greedy tokens differ from plain decoding's on {r['differs']} prompt(s): not lossless here"
            for r in rows if r.get("differs")]
    if any(_above_ideal(r) for r in rows):
        out.append("* an efficiency above 1: the run beat the ideal its measured costs predict, which only noise or "
                   "costs that moved between their measurement and the run explain; measure longer (--max-tokens, "
                   "--repeats)")
    return out


def _above_ideal(row: dict) -> bool:
    """Whether ``row``'s efficiency, as printed (3 decimals), exceeds 1."""
    return round(row.get("efficiency") or 0, 3) > 1


def _reference(decoder: ReferenceDecoder, prompts, depths: int, max_tokens: int, repeats: int) -> dict | str:
    """The reference's rows, or one line saying why it failed (another runtime's failure is never raised)."""
    candidates = {"plain": None, **{f"depth {d}": d for d in range(1, depths + 1)}}
    try:
        results = measure.candidates(decoder.stream, decoder.stats, prompts, candidates, max_tokens, repeats,
                                     f"bench: {decoder.name}")
    except Exception as e:  # the other runtime's own bug must not end our benchmark
        reason = (str(e).strip().splitlines() or [""])[0]
        return f"{decoder.name} failed while decoding: {type(e).__name__}: {reason}"
    return {"name": decoder.name, "candidates": summarise(results)}


def check_options(depths: int, max_tokens: int, repeats: int, dtype: str | None, prompt_count: int) -> list[str]:
    """The suite's code prompts, after raising ``UsageError`` for an option of bench out of range (``usage.RANGES``),
    an unknown dtype or a ``prompt_count`` outside 1..4."""
    check_measure_options(depths, max_tokens, repeats)
    if dtype is not None and dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype}")
    suite = measure.code_prompts()
    if not 1 <= prompt_count <= len(suite):
        raise UsageError(f"--prompts must be 1-{len(suite)}, got {prompt_count}")
    return suite


def bench(model_dir: Path, depths: int = 3, max_tokens: int = 128, repeats: int = 3, dtype: str | None = None,
          prompt_tokens: int = 0, references: bool = True, prompt_count: int = 4) -> dict:
    """Run the benchmark on ``model_dir``.

    Args:
        depths: fixed depths 1..depths are measured (1..8).
        max_tokens: tokens per prompt; repeats: runs of the suite (medians).
        dtype: ``float32`` / ``float16`` / ``bfloat16`` to cast floating weights to after loading, or None.
        prompt_tokens: 0, else each prompt padded with earlier source up to this many tokens
            (``measure.with_context``).
        references: also measure other runtimes' own MTP decoders (``mtp_reference_decoders``).
        prompt_count: the suite's first ``prompt_count`` code prompts are measured (1..4).

    Returns:
        ``{"candidates": rows (``tune.summarise`` plus ``ideal``/``efficiency``), "costs": {"plain_seconds": t(1),
        "verify": {k: t_verify(k)/t(1)}, "draft": {d: t_draft(d)/t(1)}, "host": {d: seconds building a cycle's graph;
        0: a plain step's}, "layers": N, "draft_subset", "subset_size" (only for a trunk that can project onto a
        subset), "subset_tuned"},
        "rollback": ``measure.rollback_ways`` at the best fixed depth, "references": [rows or a reason], "notes":
        [what makes the figures unreliable: too few tokens (``MEASURABLE``), an efficiency above 1], ...}``.

    Raises:
        UsageError: ``depths``, ``max_tokens`` or ``repeats`` out of range (``usage.RANGES``), an unknown dtype, a
            negative ``prompt_tokens`` or ``prompt_count`` outside 1..4.
        CheckpointError: no usable head.
    """
    suite = check_options(depths, max_tokens, repeats, dtype, prompt_count)
    if prompt_tokens < 0:
        raise UsageError(f"--context must be >= 0, got {prompt_tokens}")
    model, tokenizer = load(model_dir)
    if dtype is not None:
        cast(model, DTYPES[dtype])
    prompts = [tokenizer.encode(p) for p in suite[:prompt_count]]
    if prompt_tokens:
        prompts = measure.with_context(prompts, prompt_tokens, tokenizer.encode)
    candidates = {"plain": None, **{f"depth {d}": d for d in range(1, depths + 1)}, "adaptive": 0}
    rows = summarise(measure.candidates(*measure.runtime_decoder(model), prompts, candidates, max_tokens, repeats,
                                        "bench"))
    band = context_band(max(len(p) for p in prompts))
    controllers = state_of(model, model.mtp_head).scheduler.controllers
    controller = controllers.get((0.0, 1, band))  # the adaptive (greedy) row's, kept across generations
    adaptive = controller.report() if hasattr(controller, "report") else None
    tuned = model.mtp_head.draft_vocab
    subset = tuned or _cost_subset(model)
    costs = measure.component_costs(model, prompts[0], depths, vocab=subset)
    best = int(max((r for r in rows if r["name"].startswith("depth ")), key=lambda r: r["tokens_per_second"])
               ["name"].split()[1])
    ways = {"depth": best, **measure.rollback_ways(model, prompts, best, max_tokens, repeats)}
    efficiency(rows, costs, "draft" if tuned is None else "draft_subset")
    del model  # free it before another runtime loads the checkpoint
    gc.collect()
    mx.clear_cache()
    others = hook().mtp_reference_decoders(model_dir=Path(model_dir), dtype=DTYPES.get(dtype)) if references else []
    references = [decoder if isinstance(decoder, str) else _reference(decoder, prompts, depths, max_tokens, repeats)
                  for item in others for decoder in item]
    t1 = costs["plain"]
    return {"candidates": rows, "references": references, "notes": notes(max_tokens, rows), "dtype": dtype,
            "adaptive": adaptive, "rollback": ways,
            "prompt_tokens": [len(p) for p in prompts],
            "adaptive_start": tuning.start_depth(Path(model_dir), DEFAULT_DEPTH, MAX_DEPTH),
            "adaptive_tuned": tuning.recorded_depth(Path(model_dir)) is not None,
            "costs": {"plain_seconds": t1, "verify": {k: v / t1 for k, v in costs["verify"].items()},
                      "draft": {d: v / t1 for d, v in costs["draft"].items()}, "host": costs["host"],
                      "layers": costs["layers"],
                      **({"draft_subset": {d: v / t1 for d, v in costs["draft_subset"].items()},
                          "subset_size": subset.size} if subset is not None else {}),
                      "subset_tuned": tuned is not None}}


def _cost_subset(model):
    """An untuned draft vocabulary of the middle candidate size (lowest ids), to time draft steps only; None when
    the trunk cannot project onto a subset."""
    trunk = hook().mtp_trunk(model=model, contract=model.mtp_head.module.contract)
    if not hasattr(trunk, "logits_over"):
        return None
    size = draft_vocab.candidate_sizes(trunk.vocab_size())[1]
    return draft_vocab.build(trunk, range(size), "bench (cost only)")


def render(report: dict) -> str:
    """The bench report as text: one table of candidates, the cost ratios, the references; the same for a report
    read back from ``--json`` (whose depth keys are strings)."""
    lines = [f"prompts of {', '.join(map(str, report['prompt_tokens']))} tokens",
             f"{'candidate':<10} {'tok/s':>8} {'speedup':>8} {'tok/cycle':>9} {'passes/tok':>10} "
             f"{'ideal':>6} {'effic.':>6}  acceptance by depth"]
    for r in report["candidates"]:
        lines.append(_row(r))
    start, tuned = report["adaptive_start"], report["adaptive_tuned"]
    lines.append(f"adaptive started {'parked (plain)' if start == 0 else f'at depth {start}'} "
                 f"({'recorded by mtp-plugin tune' if tuned else 'default: no tuning record'})")
    c = {k: _depth_keys(v) if k in ("verify", "draft", "host", "draft_subset") else v
         for k, v in report["costs"].items()}
    if report.get("adaptive"):
        lines += _adaptive_lines(report["adaptive"], c["plain_seconds"])
    lines.append(f"plain step t(1) = {c['plain_seconds'] * 1e3:.2f} ms; "
                 + "t_verify(k)/t(1): " + " ".join(f"k={k}:{v:.2f}" for k, v in c["verify"].items())
                 + "; t_draft(d)/t(1): " + " ".join(f"d={d}:{v:.2f}" for d, v in c["draft"].items()))
    pipelined = 1 / report["candidates"][0]["tokens_per_second"] / c["plain_seconds"]
    lines.append(f"plain decoding's own loop spends {pipelined:.2f} t(1) per token (it builds step t+1 while step t "
                 "computes; a cycle's successor waits for its accepted count)")
    layers = c["layers"]
    lines.append(f"host ms per cycle (building its graph and its commit, not evaluating them; per trunk layer of "
                 f"{layers}): " + " ".join(f"d={d}:{v * 1e3:.2f} ({v * 1e3 / layers:.3f})"
                                            for d, v in c["host"].items() if d)
                 + f"; a plain step's graph: {c['host'][0] * 1e3:.2f} ({c['host'][0] * 1e3 / layers:.3f})")
    lines.append(_ways(report["rollback"]))
    if "draft_subset" in c:
        lines.append(f"t_draft(d)/t(1) over a draft vocabulary of {c['subset_size']} tokens "
                     f"({'tuned: the rows above drafted over it' if c['subset_tuned'] else 'none tuned: cost only'}): "
                     + " ".join(f"d={d}:{v:.2f}" for d, v in c["draft_subset"].items()))
    for ref in report["references"]:
        if isinstance(ref, str):
            lines.append(ref)
            continue
        ratio = ref["candidates"][0]["tokens_per_second"] / report["candidates"][0]["tokens_per_second"]
        lines.append(f"{ref['name']} (speedup vs its own plain decoding; its plain vs the plain above: "
                     f"x{ratio:.3f}, measured at another time):")
        lines += ["  " + _row(r) for r in ref["candidates"]]
    return "\n".join(lines + [f"note: {n}" for n in report["notes"]])


def _adaptive_lines(adaptive: dict, t1: float) -> list[str]:
    """Where the adaptive row spent its cycles (warm-up included) and the estimates it decided on, costs in t(1)."""
    depths = _depth_keys(adaptive["depths"])

    def name(d):
        return "plain" if d == 0 else f"d{d}"

    spent = " ".join(f"{name(d)}:{v['cycles']}/{v['tokens']}" for d, v in depths.items())
    explored = " ".join(f"{name(d)}:{v['explored']}" for d, v in depths.items() if v["explored"]) or "none"
    estimates = " ".join(f"{name(d)}:{v['tokens_per_cycle']:.2f}/{v['cost'] / t1:.2f}={v['rate'] * t1:.2f}"
                         for d, v in depths.items())
    return [f"adaptive spent (cycles/tokens per depth, warm-up included): {spent}; of which exploration cycles: "
            f"{explored}; {adaptive['rounds']} exploration rounds, {adaptive['switches']} switches, final choice "
            f"{name(adaptive['choice'])}",
            f"adaptive's estimates at the end (tokens per cycle / cycle cost in t(1) = rate in tokens per t(1)): "
            f"{estimates}"]


def _depth_keys(by_depth: dict) -> dict:
    """``by_depth`` keyed by int depths (or pass lengths), also once JSON has made its keys strings."""
    return {int(k): v for k, v in by_depth.items()}


def _ways(ways: dict) -> str:
    """One line: replay against capture (``decoding/rollback.py``), tokens/s and host ms per cycle."""
    if ways["auto"] is None:
        return "rollback: every trunk cache is trimmed (no recurrent layer: no way to choose)"
    capture, replay = ways["capture"], ways["replay"]
    ratio = statistics.median(r / c for r, c in zip(replay["runs"], capture["runs"], strict=True))
    return (f"rollback at depth {ways['depth']} (auto takes {ways['auto']} here): "
            f"capture {capture['tokens_per_second']:.1f} tok/s, host {capture['host'] * 1e3:.2f} ms/cycle; "
            f"replay {replay['tokens_per_second']:.1f} tok/s (x{ratio:.3f} of capture), "
            f"host {replay['host'] * 1e3:.2f} ms/cycle (a cycle with a rejection: its graph and its commit)")


def _row(r: dict) -> str:
    def num(key, fmt, width):
        return (format(r[key], fmt) if r.get(key) is not None else "-").rjust(width)

    acceptance = " ".join(f"{p:.2f}" for p in r["acceptance_by_depth"]) if r.get("acceptance_by_depth") else "-"
    above = "*" if _above_ideal(r) else " "  # explained by a note
    return (f"{r['name']:<10} {r['tokens_per_second']:>8.1f} {r['speedup']:>8.3f} "
            f"{num('tokens_per_cycle', '.2f', 9)} {num('passes_per_token', '.3f', 10)} {num('ideal', '.3f', 6)} "
            f"{num('efficiency', '.3f', 6)}{above} {acceptance}")
