"""MTP across ranks: tokens/s with and without MTP on a model that mlx-lm shards over ranks, and what keeping the ranks
in lockstep costs. Run it under ``mlx.launch``; rank 0 prints the report (and writes it with ``--out``):

    mlx.launch --backend ring -n 2 -- python benchmarks/distributed.py --model build/deep48 [--pipeline]
        [--dtype bfloat16] [--depths 2] [--max-tokens 64] [--repeats 1] [--out benchmarks/results]

The model is loaded by mlx-lm's ``sharded_load`` (tensor parallel, or pipeline parallel with ``--pipeline``) and
decoded greedily through the runtime's own ``generate_step`` (``mtp_decode`` hook) on the bench's code prompts
(``measure.candidates``: plain, fixed depths 1..``--depths``, adaptive; interleaved; speedups paired per repeat).
The lockstep collective (``lockstep.Lockstep.agree``: one ``all_gather`` of 6 int32 per rank, once per cycle or
plain step) is timed alone, 200 times, and set against a plain step.
"""

import datetime
import json
import os
import statistics
import time
from pathlib import Path

import decoding_args
import mlx.core as mx
from mlx_lm.utils import sharded_load

from mtp_plugin import tuning
from mtp_plugin.commands import measure
from mtp_plugin.commands.tune import summarise
from mtp_plugin.decoding.lockstep import Lockstep
from mtp_plugin.usage import int_in

REPO = Path(__file__).resolve().parents[1]


def collective_seconds(group, repeats: int = 200) -> float:
    """Median seconds of one lockstep agreement (the loop's per-cycle collective) on ``group``."""
    lockstep, times = Lockstep(group), []
    for _ in range(repeats):
        start = time.perf_counter()
        lockstep.agree(2, {"tokens emitted": 1, "whether the generation ends": 0, "the tokens left to generate": 8,
                           "whether the head drafts": 1, "the lookup draft's length": 0})
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    """Parse arguments, load the sharded model, measure, and print (rank 0)."""
    parser = decoding_args.parser(__doc__, max_tokens=64, repeats=1)  # --out: written by rank 0
    parser.add_argument("--pipeline", action="store_true", help="pipeline parallel (default: tensor parallel)")
    parser.add_argument("--depths", type=int_in("depths"), default=2)
    args = parser.parse_args()

    group = mx.distributed.init()
    if group.size() < 2:
        parser.exit(2, "run it under mlx.launch with at least 2 ranks\n")
    sharding = "pipeline" if args.pipeline else "tensor"
    loaded = sharded_load(str(args.model), group if args.pipeline else None, None if args.pipeline else group)
    model, tokenizer = decoding_args.with_head(parser, args, loaded)
    prompts = [tokenizer.encode(p) for p in measure.code_prompts()]
    depths = {"plain": None, **{f"depth {d}": d for d in range(1, args.depths + 1)}, "adaptive": 0}
    rows = summarise(measure.candidates(*measure.runtime_decoder(model), prompts, depths, args.max_tokens,
                                        args.repeats, f"rank {group.rank()}"))
    collective = collective_seconds(group)
    if group.rank() != 0:
        return
    plain_step = 1 / next(r for r in rows if r["name"] == "plain")["tokens_per_second"]
    shown = os.path.relpath(args.model.resolve(), REPO)
    lines = [f"MTP across {group.size()} ranks ({sharding} parallel, mlx.launch), model {args.model.name} ({shown}), "
             f"dtype {args.dtype}, greedy, code prompts, {args.max_tokens} tokens per prompt, "
             f"median of {args.repeats} runs",
             f"date: {datetime.datetime.now().isoformat(timespec='seconds')}",
             f"machine: {json.dumps(tuning.machine())}, {os.cpu_count()} CPUs (shared by the ranks)",
             f"versions: {json.dumps(tuning.versions())}", "",
             "candidate     tok/s  speedup  tok/cycle"]
    for r in rows:
        per_cycle = f"{r['tokens_per_cycle']:.2f}" if r["tokens_per_cycle"] else "-"
        lines.append(f"{r['name']:<12} {r['tokens_per_second']:6.1f}  {r['speedup']:7.3f}  {per_cycle:>9}")
    lines += ["", f"lockstep: one all_gather of int32 per rank per cycle or plain step, median "
              f"{collective * 1e6:.0f} us on this backend = {100 * collective / plain_step:.2f} % of a plain step "
              f"({plain_step * 1e3:.1f} ms)"]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        path = measure.write_result(args.out, f"distributed-{sharding}-{group.size()}-{args.model.name}-{args.dtype}",
                                    text)
        print(f"written to {os.path.relpath(path, REPO)}")


if __name__ == "__main__":
    main()
