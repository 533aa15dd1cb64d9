"""What logits processors cost with MTP, now that they see exactly what they see in stock mlx-lm.

``python benchmarks/processor_cost.py [--model DIR] [--depths 1 3] [--runs N] [--max-tokens M]``

With processors, a verify pass is read position by position (``decoding.Walk``: one host read per processed position,
where a pass without processors is read once), and the end of a generation computes the step past the last token
(its processor call), as stock's loop does. Paired, interleaved rounds (order reversed every round; round r generates
M + r tokens, so that generations end at different points of a cycle) of stock mlx-lm (the plugin unpatched) and MTP
at each depth, with no processor, with an identity processor (the same tokens as none: the difference is what
processors cost in themselves: the position-by-position reads and the step past the last token) and with mlx-lm's
repetition penalty (what ``--repetition-penalty`` builds). Prints per row: tokens/s from the first token on, the
median over rounds of its ratio to the same round's stock run with the same processors, and the end of a generation
(ms from the last token to the generator's end: MTP runs the trunk on the last token there for the cache, with
processors also the output projection and their call); for each depth, identity against none. Then the server's
batched rows (mlx-lm's ``BatchGenerator`` as the server builds it, 4 requests with the penalty): ms of each finishing
row's extra step (``BatchDrafter.final_call``: one trunk step on a copy of the row's cache, for a row that finishes on
a token no pass fed), against the median ms of the batch's ``next()``.

Default model: the bundled tiny checkpoint in bf16 (``examples/tiny-qwen3_5/hf``).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from pathlib import Path

import mlx.core as mx
from tqdm import tqdm

import mtp_plugin

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the command line and run.\"\"\"\n"
BATCH_PROMPTS = ["def fib(n):", "class Config:\n    def __init__(self, path", "for i in range(", "import json\n"]


def run(model, prompt, max_tokens: int, processors, depth) -> tuple[float, float]:
    """(tokens/s from the first token on, ms from the last token to the generator's end); ``depth`` None: stock (the
    plugin unpatched)."""
    if depth is None:
        mtp_plugin.unpatch()
    try:
        options = {} if depth is None else {"mtp_depth": depth}
        generate_step = importlib.import_module("mlx_lm.generate").generate_step  # as patched now
        tokens = generate_step(prompt, model, max_tokens=max_tokens, logits_processors=processors, **options)
        next(tokens)
        start = time.perf_counter()
        for _ in range(max_tokens - 1):
            next(tokens)
        last = time.perf_counter()
        for _ in tokens:  # the generator's end: nothing more is yielded
            pass
        return (max_tokens - 1) / (last - start), (time.perf_counter() - last) * 1e3
    finally:
        mtp_plugin.patch()


def batched(model, tokenizer, processors_for, max_tokens: int, depth: int) -> tuple[list[float], list[float]]:
    """(ms of each ``final_call``, ms of each ``next()``) of the server's batch decoding ``BATCH_PROMPTS``."""
    from mlx_lm.sample_utils import make_sampler
    from mtp_plugin.adapters import mlx_lm_server

    from mtp_plugin.decoding.batch import BatchDrafter

    finals, steps, original = [], [], BatchDrafter.final_call

    def timed(self, row, cache):
        start = time.perf_counter()
        original(self, row, cache)
        finals.append((time.perf_counter() - start) * 1e3)

    BatchDrafter.final_call = timed
    try:
        generator = importlib.import_module("mlx_lm.server").BatchGenerator(model, completion_batch_size=8)
        for i, text in enumerate(BATCH_PROMPTS):  # options carried by the processors, as the server carries them
            carried = mlx_lm_server.RequestProcessors(processors_for())
            carried.mtp = mlx_lm_server.MTPRequest(True, depth)
            generator.insert([tokenizer.encode(text)], max_tokens=[max_tokens + 3 * i], samplers=[make_sampler(0.0)],
                             logits_processors=[carried])
        while True:
            start = time.perf_counter()
            if not generator.next_generated():
                break
            steps.append((time.perf_counter() - start) * 1e3)
    finally:
        BatchDrafter.final_call = original
    return finals, steps


def identity(tokens, logits):
    """A processor that changes nothing: MTP's tokens stay those of no processor."""
    return logits


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "examples" / "tiny-qwen3_5" / "hf")
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    mtp_plugin.patch()
    from mlx_lm import load
    from mlx_lm.sample_utils import make_logits_processors

    model, tokenizer = load(str(args.model))
    prompt = mx.array(tokenizer.encode(PROMPT))

    def penalty():
        return make_logits_processors(repetition_penalty=1.1)

    kinds = {"no processor": list, "identity": lambda: [identity], "repetition penalty": penalty}
    candidates = {(kind, depth): (make, depth) for kind, make in kinds.items() for depth in (None, *args.depths)}
    for make, depth in candidates.values():  # warm up
        run(model, prompt, 16, make(), depth)
    runs = {name: [] for name in candidates}
    for r in tqdm(range(args.runs), desc="rounds"):
        for name in list(candidates) if r % 2 == 0 else list(reversed(candidates)):
            make, depth = candidates[name]
            runs[name].append(run(model, prompt, args.max_tokens + r, make(), depth))
    print(f"{args.model.name}, {args.max_tokens}-{args.max_tokens + args.runs - 1} tokens, {args.runs} paired rounds; "
          f"{mx.default_device()}")
    for (kind, depth), values in runs.items():
        ratio = statistics.median(v[0] / s[0] for v, s in zip(values, runs[(kind, None)], strict=True))
        print(f"{kind:18s} {'stock' if depth is None else f'MTP depth {depth}':11s} "
              f"{statistics.median(v[0] for v in values):7.1f} tok/s"
              + ("" if depth is None else f"  vs stock: median {ratio:.3f}")
              + f"  end of generation {statistics.median(v[1] for v in values):.2f} ms")
    for depth in args.depths:
        pairs = list(zip(runs[("identity", depth)], runs[("no processor", depth)], strict=True))
        print(f"MTP depth {depth}, identity processor vs none (the same tokens): tokens/s x"
              f"{statistics.median(a[0] / b[0] for a, b in pairs):.3f}, end of generation "
              f"{statistics.median(a[1] - b[1] for a, b in pairs):+.2f} ms (median of paired rounds)")
    finals, steps = batched(model, tokenizer, penalty, 8, args.depths[-1])
    print(f"batched rows with the penalty at depth {args.depths[-1]} ({len(BATCH_PROMPTS)} requests): "
          f"{len(finals)} finishing rows needed the extra step, median {statistics.median(finals or [0]):.2f} ms each; "
          f"the batch's next() median {statistics.median(steps):.2f} ms over {len(steps)} calls")


if __name__ == "__main__":
    main()
