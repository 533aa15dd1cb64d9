"""Speed of the MTP loop's plain steps against stock mlx-lm: paired, interleaved runs, median of ratios.

``python benchmarks/parked_speed.py [--model DIR] [--runs N] [--max-tokens M]`` decodes the same prompt with
stock ``generate_step`` (``enable_mtp=False``) and through the MTP loop with a policy that always parks
(every token a plain step: the loop's own plain-step path, no head) and with the adaptive controller
started parked (as after ``mtp-plugin tune`` recorded "plain": probes included), alternating the order
in every round. Prints tokens/s of each and the median over rounds of each one's ratio to the stock run
of the same round. Default model: the bundled tiny checkpoint in bf16 (``examples/tiny-qwen3_5/hf``).
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
from mtp_plugin.controller import PLAIN, DepthController

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the command line and run.\"\"\"\n"


class Parked:
    """A depth policy that always decodes plain."""

    def next_depth(self) -> int:
        return PLAIN

    def observe(self, depth: int, accepted: int, seconds: float) -> None:
        pass


def tokens_per_second(model, prompt, max_tokens: int, **options) -> float:
    generate_step = importlib.import_module("mlx_lm.generate").generate_step  # as patched
    start, n = None, 0
    for _ in generate_step(prompt, model, max_tokens=max_tokens, **options):
        if start is None:
            start = time.perf_counter()  # from the first token: the prompt pass is the same for all
        n += 1
    return (n - 1) / (time.perf_counter() - start)


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
        "stock": lambda: {"enable_mtp": False},
        "parked": lambda: {"mtp_depth": Parked()},
        "tuned plain": lambda: {"mtp_depth": DepthController(start=PLAIN)},
    }
    for make in candidates.values():  # warm up
        tokens_per_second(model, prompt, 32, **make())
    rates = {name: [] for name in candidates}
    for r in tqdm(range(args.runs), desc="rounds"):
        names = list(candidates) if r % 2 == 0 else list(reversed(candidates))
        for name in names:
            rates[name].append(tokens_per_second(model, prompt, args.max_tokens, **candidates[name]()))
    print(f"{args.model.name}, {args.max_tokens} tokens, {args.runs} paired rounds; {mx.default_device()}")
    for name, values in rates.items():
        ratios = [v / s for v, s in zip(values, rates["stock"], strict=True)]
        print(f"{name:12s} {statistics.median(values):8.1f} tok/s   vs stock: median {statistics.median(ratios):.3f}"
              f"  (min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
