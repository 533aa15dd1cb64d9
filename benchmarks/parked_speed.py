"""Speed of the MTP loop's plain steps against stock mlx-lm: paired, interleaved runs, median of ratios.

``python benchmarks/parked_speed.py [--model DIR] [--runs N] [--max-tokens M]`` decodes the same prompt with
stock mlx-lm (the plugin unpatched), with ``enable_mtp=False`` (the plugin's patches in place), through the
MTP loop with a policy that always parks (every token a plain step: the loop's own plain-step path, no
head) and with the adaptive controller started parked (as after ``mtp-plugin tune`` recorded "plain":
its probes included), in an order reversed every round. Prints tokens/s (from the first token on) and the
median over rounds of each one's ratio to the stock run of the same round, and the CPU time of the main
thread per token (graph building and bookkeeping; steadier than wall time on a shared machine).
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
from mtp_plugin.decoding.controller import PLAIN, DepthController

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the command line and run.\"\"\"\n"


class Parked:
    """A depth policy that always decodes plain."""

    def next_depth(self) -> int:
        return PLAIN

    def observe(self, depth: int, accepted: int, seconds: float) -> None:
        pass


def measure(model, prompt, max_tokens: int, options: dict | None) -> tuple[float, float]:
    """(tokens/s, main-thread CPU ms/token) from the first token on; ``options`` None: the plugin unpatched."""
    if options is None:
        mtp_plugin.unpatch()
    try:
        generate_step = importlib.import_module("mlx_lm.generate").generate_step  # as patched now
        tokens = generate_step(prompt, model, max_tokens=max_tokens, **(options or {}))
        next(tokens)  # the prompt pass is the same for all
        start, cpu, n = time.perf_counter(), time.thread_time(), 0
        for _ in tokens:
            n += 1
        return n / (time.perf_counter() - start), (time.thread_time() - cpu) / n * 1000
    finally:
        mtp_plugin.patch()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "examples" / "tiny-qwen3_5" / "hf")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    mtp_plugin.patch()
    from mlx_lm import load

    model, tokenizer = load(str(args.model))
    prompt = mx.array(tokenizer.encode(PROMPT))
    candidates = {
        "stock": lambda: None,
        "enable_mtp=False": lambda: {"enable_mtp": False},
        "parked": lambda: {"mtp_depth": Parked()},
        "tuned plain": lambda: {"mtp_depth": DepthController(start=PLAIN)},
    }
    for make in candidates.values():  # warm up
        measure(model, prompt, 32, make())
    runs = {name: [] for name in candidates}
    for r in tqdm(range(args.runs), desc="rounds"):
        for name in list(candidates) if r % 2 == 0 else list(reversed(candidates)):
            runs[name].append(measure(model, prompt, args.max_tokens, candidates[name]()))
    print(f"{args.model.name}, {args.max_tokens} tokens, {args.runs} paired rounds; {mx.default_device()}")
    for name, values in runs.items():
        ratios = [v[0] / s[0] for v, s in zip(values, runs["stock"], strict=True)]
        print(f"{name:17s} {statistics.median(v[0] for v in values):7.1f} tok/s  vs stock: median "
              f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})  main-thread CPU "
              f"{statistics.median(v[1] for v in values):.3f} ms/token")


if __name__ == "__main__":
    main()
