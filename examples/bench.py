"""Benchmark MTP decoding on the bundled tiny checkpoint (or any model directory) and keep a dated result file.

    python examples/bench.py [--model DIR] [--dtype bfloat16] [--depths 3] [--max-tokens 128] [--repeats 3]
                             [--context 0 | --context 1024,8192,32768] [--prompts 4] [--no-references]
                             [--out benchmarks/results]

A thin wrapper around ``mtp-plugin bench`` (``mtp_plugin.commands.bench``): prints the report, preceded by the
machine and versions; with ``--out`` also writes it to ``DIR/<date>-<device>-<model>-<dtype>[-<shape>].txt``
(the shape names ``--max-tokens`` and ``--context`` where they are not the defaults). Several ``--context`` lengths:
the long-context sweep (``mtp_plugin.commands.sweep``).
"""

import argparse
import datetime
import json
import os
from pathlib import Path

from mtp_plugin import tuning
from mtp_plugin.commands import measure, sweep
from mtp_plugin.commands.bench import bench, render

DEFAULT_MODEL = Path(__file__).resolve().parent / "tiny-qwen3_5" / "hf"


def main() -> None:
    """Parse arguments, run the bench, print it and maybe write the dated result file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16", "none"])
    parser.add_argument("--depths", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--context", default="0", help="N or N,N,... tokens per prompt (see mtp-plugin bench)")
    parser.add_argument("--prompts", type=int, default=4, help="the suite's first K code prompts")
    parser.add_argument("--no-references", action="store_true", help="skip other runtimes' own MTP decoders")
    parser.add_argument("--out", type=Path, help="directory for the dated result file")
    args = parser.parse_args()

    machine, versions = tuning.machine(), tuning.versions()
    dtype = None if args.dtype == "none" else args.dtype
    contexts = [int(n) for n in args.context.split(",")]
    if len(contexts) > 1:
        report = sweep.sweep(args.model, contexts, args.depths, args.max_tokens, args.repeats, dtype, args.prompts)
        body = sweep.render(report)
    else:
        body = render(bench(args.model, args.depths, args.max_tokens, args.repeats, dtype, contexts[0],
                            not args.no_references, args.prompts))
    shown = os.path.relpath(args.model.resolve(), Path(__file__).resolve().parents[1])  # no absolute path in results
    header = [f"mtp-plugin bench {args.model.name} ({shown}), dtype {args.dtype}, greedy, code prompts, "
              f"{args.max_tokens} tokens per prompt, median of {args.repeats} runs"
              + (f", contexts of {args.context} tokens" if args.context != "0" else "")
              + (f", the first {args.prompts} prompts" if args.prompts != 4 else ""),
              f"date: {datetime.datetime.now().isoformat(timespec='seconds')}",
              f"machine: {json.dumps(machine)}, {os.cpu_count()} CPUs",
              f"versions: {json.dumps(versions)}", ""]
    text = "\n".join(header) + body + "\n"
    print(text, end="")
    if args.out:
        shape = (f"-{args.max_tokens}-tokens" if args.max_tokens != 128 else "") + (
            f"-context-{args.context.replace(',', '-')}" if args.context != "0" else "")
        path = measure.write_result(args.out, f"{args.model.name}-{args.dtype}{shape}", text)
        print(f"written to {path}")


if __name__ == "__main__":
    main()
