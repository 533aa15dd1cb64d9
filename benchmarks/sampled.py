"""Sampled decoding beside greedy: tokens/s of plain decoding, fixed draft depths (the head alone) and the default
(adaptive depth, lookup drafts on), greedy and at each temperature asked.

    python benchmarks/sampled.py --model build/deep48 [--dtype bfloat16] [--temperatures 0,0.7,1.0] [--max-tokens 96]
        [--repeats 3] [--prompts 3] [--candidates "plain,depth 2,depth 3,default"] [--out benchmarks/results]

Candidates are decoded through mlx-lm's ``generate_step`` as patched, interleaved (``measure.candidates``), on the code
suite (``measure.code_prompts``). Sampled runs are paired: the n-th run of a prompt takes seed n for every candidate.
Each figure is the median over repeats, ``x plain`` the median of the per-repeat ratios, ``default / best fixed`` the
default's tokens/s pooled over all its generations (total tokens over total seconds) over that of the fixed depth
fastest so pooled, and ``default / depth d`` the median (and quartiles) of the two's ratios generation by generation
(paired: the same prompt and seed, run one after the other). Every MTP candidate must decode the same tokens for a
seed (greedy: plain decoding's tokens), whatever it drafts: a run that does not stops the benchmark.
"""

import datetime
import importlib
import json
import os
import statistics
from pathlib import Path

import decoding_args
import mlx.core as mx
from mlx_lm import load
from mlx_lm.sample_utils import make_sampler

from mtp_plugin import tuning
from mtp_plugin.commands import measure

REPO = Path(__file__).resolve().parents[1]
FIXED = (1, 2, 3)
CANDIDATES = {"plain": {"enable_mtp": False}, **{f"depth {d}": {"mtp_depth": d, "mtp_lookup": False} for d in FIXED},
              "default": {}, "no lookup": {"mtp_lookup": False}}


def run(model, prompts: list[list[int]], max_tokens: int, repeats: int, temperature: float,
        chosen: list[str]) -> dict:
    """``measure.Result`` per candidate named in ``chosen`` (plain among them) at ``temperature`` (0: greedy).

    Raises:
        SystemExit: an MTP candidate decoded other tokens than the others for a prompt and seed.
    """
    generate_step = importlib.import_module("mlx_lm.generate").generate_step
    sampler = make_sampler(temperature) if temperature > 0 else None
    reference, calls = {}, {}

    def decode(prompt, max_tokens, name):
        key = (tuple(prompt), max_tokens)
        calls[key, name] = calls.get((key, name), -1) + 1
        mx.random.seed(calls[key, name])  # the n-th run of a prompt: one seed for every candidate
        tokens = []
        for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=sampler,
                                      **CANDIDATES[name or "plain"]):
            tokens.append(token)
            yield token
        if name is not None or sampler is None:  # sampled plain decoding draws with mlx-lm's own sampler
            if reference.setdefault((key, calls[key, name]), tokens) != tokens:
                raise SystemExit(f"{name} decoded other tokens than the other candidates for the same seed: a bug, "
                                 "please report it")

    names = {name: (None if name == "plain" else name) for name in chosen}
    label = f"sampled bench: T={temperature:g}" if temperature else "sampled bench: greedy"
    return measure.candidates(decode, lambda: model.mtp_head.stats, prompts, names, max_tokens, repeats, label)


def table(results: dict) -> list[str]:
    """One line per candidate (tok/s, x plain, acceptance, tokens per cycle), then the default's ratio over the best
    fixed depth's and its paired ratios over each fixed depth's, generation by generation (where both ran)."""
    plain = results["plain"].runs
    ratios = {name: statistics.median(a / b for a, b in zip(r.runs, plain, strict=True))
              for name, r in results.items()}
    lines = ["candidate   tok/s  x plain  acceptance  tok/cycle  lookup cycles"]
    for name, r in results.items():
        s = r.stats
        acceptance = f"{s.acceptance:.3f}" if s is not None and s.drafted else "-"
        per_cycle = f"{s.tokens_per_cycle:.2f}" if s is not None and s.cycles else "-"
        lookup = str(s.lookup_cycles) if s is not None else "-"
        lines.append(f"{name:<9} {r.tokens_per_second:7.1f}  {ratios[name]:7.3f}  {acceptance:>10}  {per_cycle:>9}  "
                     f"{lookup:>13}")
    fixed = [name for name in results if name.startswith("depth")]
    if "default" not in results or not fixed:
        return lines
    pooled = {name: statistics.harmonic_mean(r.generations) for name, r in results.items()}  # equal-length runs
    best = max(fixed, key=pooled.get)
    lines.append(f"default / best fixed ({best}, by tokens/s pooled over all generations): pooled "
                 f"{pooled['default'] / pooled[best]:.3f}")
    for name in fixed:
        paired = [a / b for a, b in zip(results["default"].generations, results[name].generations, strict=True)]
        low, median, high = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
        lines.append(f"default / {name} (paired, {len(paired)} generations): median {median:.3f}, "
                     f"quartiles {low:.3f}-{high:.3f}")
    return lines


def main() -> None:
    """Parse arguments, load, measure greedy and each temperature, print (and write with ``--out``)."""
    parser = decoding_args.parser(__doc__, max_tokens=96)
    parser.add_argument("--temperatures", default="0,0.7,1.0", help="comma-separated, each >= 0 (0: greedy)")
    parser.add_argument("--prompts", type=int, default=3, help="prompts of the code suite used")
    parser.add_argument("--candidates", default=",".join(CANDIDATES),
                        help=f"comma-separated, among: {', '.join(CANDIDATES)} (plain always runs: the reference)")
    args = parser.parse_args()
    try:
        temperatures = [float(t) for t in args.temperatures.split(",")]
    except ValueError:
        parser.error(f"--temperatures: not numbers: {args.temperatures}")
    chosen = ["plain", *(name for name in args.candidates.split(",") if name != "plain")]
    if args.prompts < 1 or min(temperatures) < 0:
        parser.error("--prompts must be >= 1 and every temperature >= 0")
    if unknown := set(chosen) - set(CANDIDATES):
        parser.error(f"--candidates: unknown {', '.join(sorted(unknown))}; choose among {', '.join(CANDIDATES)}")
    model, tokenizer = decoding_args.with_head(parser, args, load(str(args.model)))
    prompts = [tokenizer.encode(p) for p in measure.code_prompts()[: args.prompts]]
    shown = os.path.relpath(args.model.resolve(), REPO)
    lines = [f"sampled decoding: model {args.model.name} ({shown}), dtype {args.dtype}, code prompts of "
             f"{', '.join(str(len(p)) for p in prompts)} tokens, {args.max_tokens} tokens per prompt, median of "
             f"{args.repeats} paired runs",
             f"date: {datetime.datetime.now().isoformat(timespec='seconds')}",
             f"machine: {json.dumps(tuning.machine())}, {os.cpu_count()} CPUs",
             f"versions: {json.dumps(tuning.versions())}",
             f"candidates: {', '.join(chosen)} (plain: MTP off; depth d: the head alone at a fixed depth; default: "
             "adaptive depth, lookup drafts on; no lookup: adaptive depth, the head alone)"]
    for temperature in temperatures:
        rows = table(run(model, prompts, args.max_tokens, args.repeats, temperature, chosen))
        lines += ["", f"temperature {temperature:g}" if temperature else "greedy", *rows]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        path = measure.write_result(args.out, f"sampled-{args.model.name}-{args.dtype}", text)
        print(f"written to {os.path.relpath(path, REPO)}")


if __name__ == "__main__":
    main()
