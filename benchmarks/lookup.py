"""Drafts from the context beside the head: tokens/s of plain decoding, MTP with the head only, lookup drafts only (the
head set aside, as on a checkpoint without one) and both (the default), on an edit workload and on the ordinary code
suite; and the host cost of the lookup index.

    python benchmarks/lookup.py --model build/deep48 [--dtype bfloat16] [--max-tokens 128] [--repeats 3]
        [--temperature 1.0] [--out benchmarks/results]

Edit workload: each suite prompt (``measure.code_prompts``: about 1000 characters of standard-library source), then a
blank line and its first lines again, so that a model that copies goes on repeating the source (the tiny checkpoints
do not follow instructions; a real model would be asked to reproduce the text with a change). Ordinary suite: the
prompts as they are, where little repeats. Candidates are decoded greedily through mlx-lm's ``generate_step`` as
patched, interleaved (``measure.candidates``); each figure is the median over repeats, and ``vs MTP`` is the median of
the per-repeat ratios. Every candidate's tokens are checked against plain decoding's. ``--temperature T`` samples
instead (mlx-lm's sampler; every candidate of a prompt and repeat from the same seed: paired runs), where the tokens
follow the trunk's distribution, not plain decoding's draws, and are not compared.
"""

import datetime
import importlib
import json
import os
import statistics
import time
from pathlib import Path

import decoding_args
import mlx.core as mx
from mlx_lm import load
from mlx_lm.sample_utils import make_sampler

from mtp_plugin import tuning
from mtp_plugin.commands import measure
from mtp_plugin.decoding.lookup import ContextIndex
from mtp_plugin.decoding.stats import MTPStats

REPO = Path(__file__).resolve().parents[1]
CANDIDATES = {"plain": {"enable_mtp": False}, "MTP": {"mtp_lookup": False}, "lookup": {"mtp_lookup": True},
              "both": {}}
RESTATED_LINES = 3  # lines of the source restated after it (edit workload)


def edit_prompts(sources: list[str]) -> list[str]:
    """Each source, a blank line, and its first ``RESTATED_LINES`` lines again."""
    return [text + "\n\n" + "".join(text.splitlines(keepends=True)[:RESTATED_LINES]) for text in sources]


def index_cost(tokens: int, repeats: int = 5) -> float:
    """Microseconds of host time per committed token for the lookup index (``ContextIndex.extend`` of the token and
    one ``propose`` of 16), over a context of ``tokens`` synthetic ids whose second half repeats the first (each
    proposal there matches half the context back); median of ``repeats``."""
    ids = [(i * 7919) % (tokens // 2) for i in range(tokens)]
    times = []
    for _ in range(repeats):
        index, start = ContextIndex(), time.perf_counter()
        for token in ids:
            index.extend([token])
            index.propose(16)
        times.append((time.perf_counter() - start) / tokens)
    return statistics.median(times) * 1e6


def run(model, prompts: list[list[int]], max_tokens: int, repeats: int, label: str,
        temperature: float = 0.0) -> tuple[dict, dict]:
    """``(results, totals)``: ``measure.Result`` per candidate, and the summed ``MTPStats`` of each MTP candidate."""
    head = model.mtp_head
    generate_step = importlib.import_module("mlx_lm.generate").generate_step
    reference, calls = {}, {}
    sampler = make_sampler(temperature) if temperature > 0 else None

    def setup(name):
        model.mtp_head = None if name == "lookup" else head

    def decode(prompt, max_tokens, name):
        tokens, key = [], (tuple(prompt), max_tokens)
        calls[key, name] = calls.get((key, name), -1) + 1
        mx.random.seed(calls[key, name])  # the n-th run of a prompt: one seed for every candidate
        for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=sampler,
                                      **CANDIDATES[name or "plain"]):
            tokens.append(token)
            yield token
        if sampler is None and reference.setdefault(key, tokens) != tokens:
            raise SystemExit(f"{name} decoded other tokens than plain decoding: a bug, please report it")

    def stats():
        return head.stats if model.mtp_head is not None else model.mtp_state.lookup_stats

    names = {name: (None if name == "plain" else name) for name in CANDIDATES}
    try:
        results = measure.candidates(decode, stats, prompts, names, max_tokens, repeats, label, setup)
    finally:
        model.mtp_head = head
    return results, {name: r.stats for name, r in results.items() if r.stats is not None}


def table(results: dict, totals: dict) -> list[str]:
    """One line per candidate: tok/s, speedup over plain and over MTP (medians of per-repeat ratios), its drafts."""
    lines = ["candidate   tok/s  vs plain  vs MTP  head: drafted/accepted  lookup: cycles drafted/accepted"]
    plain, mtp = results["plain"].runs, results["MTP"].runs
    for name, r in results.items():
        over_plain = statistics.median(a / b for a, b in zip(r.runs, plain, strict=True))
        over_mtp = statistics.median(a / b for a, b in zip(r.runs, mtp, strict=True))
        s = totals.get(name) or MTPStats()
        head = f"{s.drafted}/{s.accepted}" if s.drafted else "-"
        lookup = f"{s.lookup_cycles} {s.lookup_drafted}/{s.lookup_accepted}" if s.lookup_cycles else "-"
        lines.append(f"{name:<9} {r.tokens_per_second:7.1f}  {over_plain:8.3f}  {over_mtp:6.3f}  {head:>22}  "
                     f"{lookup:>31}")
    return lines


def main() -> None:
    """Parse arguments, load, measure both workloads, print (and write with ``--out``)."""
    parser = decoding_args.parser(__doc__)
    parser.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (0: greedy)")
    args = parser.parse_args()
    if args.temperature < 0:
        parser.error("--temperature must be >= 0")
    model, tokenizer = decoding_args.with_head(parser, args, load(str(args.model)),
                                               " (the bench compares the head with lookup drafts)")
    sources = measure.code_prompts()
    workloads = {"edit": [tokenizer.encode(p) for p in edit_prompts(sources)],
                 "ordinary": [tokenizer.encode(p) for p in sources]}
    shown = os.path.relpath(args.model.resolve(), REPO)
    decoding = f"sampled at temperature {args.temperature:g}" if args.temperature else "greedy"
    lines = [f"prompt lookup beside the head: model {args.model.name} ({shown}), dtype {args.dtype}, {decoding}, "
             f"{args.max_tokens} tokens per prompt, median of {args.repeats} runs",
             f"date: {datetime.datetime.now().isoformat(timespec='seconds')}",
             f"machine: {json.dumps(tuning.machine())}, {os.cpu_count()} CPUs",
             f"versions: {json.dumps(tuning.versions())}",
             "candidates: plain (MTP off), MTP (the head only, adaptive depth), lookup (lookup drafts only: the head "
             "set aside), both (the default: head and lookup drafts)"]
    for name, prompts in workloads.items():
        results, totals = run(model, prompts, args.max_tokens, args.repeats, f"lookup bench: {name}", args.temperature)
        lines += ["", f"{name} workload: prompts of {', '.join(str(len(p)) for p in prompts)} tokens",
                  *table(results, totals)]
    lines += [""] + [f"lookup index host cost: {index_cost(n):.1f} us per committed token (extend + one propose of 16, "
                     f"{n}-token context)" for n in (4096, 32768)]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        sampled = f"-t{args.temperature:g}".replace(".", "") if args.temperature else ""
        path = measure.write_result(args.out, f"lookup-{args.model.name}-{args.dtype}{sampled}", text)
        print(f"written to {os.path.relpath(path, REPO)}")


if __name__ == "__main__":
    main()
