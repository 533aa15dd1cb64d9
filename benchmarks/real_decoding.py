"""Memory and time of decoding at the shapes users run: MTP at fixed depths against plain decoding and stock mlx-lm.

    python benchmarks/real_decoding.py [--shape NAME ...] [--prompt 256] [--tokens 24] [--repeats 2]
        [--part-repeats 3] [--cache DIR] [--out DIR]

On the random-weight checkpoints of ``real_shapes.py`` (built on demand), each run in a fresh process decodes greedily
through mlx-lm's ``generate_step`` from a random prompt: ``stock`` (the plugin disabled), ``plain`` (the plugin loaded,
MTP off), ``d1``-``d3`` (the head alone at that fixed depth, the trunk rolled back from states the verify pass captured)
and ``d3 replay`` (rolled back by replaying the accepted tokens instead: nothing captured). A random head's drafts are
rejected and the head would be parked after its probe; here the probe is off (``health.PROBE_DRAFTS = 0``), for
measurement only, so every cycle drafts, verifies and rolls back. Medians over ``--repeats`` per mode: MLX's peak memory
over the prompt pass and over decoding, milliseconds per cycle (a plain step counts as one) and the main thread's CPU ms
per cycle (host work), and the head's KV cache per context token and at 4k, 16k and 32k. Then, in one more process, the
loop's parts on a warm cache (``measure.component_costs``): t_verify(k)/t(1) and t_draft(d)/t(1), the drafts also over a
draft vocabulary of V/8 tokens (FR-Spec's reduced output projection; which tokens does not change the cost), and a
projection of MTP's speedup at each depth: the bundled checkpoint's tokens per cycle (greedy, code prompts) over the
cycle's cost, E(d) / ((t_draft(d) + t_verify(d+1)) / t(1)), labelled as such (random weights accept nothing). Exit
status 2 on a usage error, 1 when a run fails.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_shapes  # noqa: E402
from real_sizes import REPO, child, report  # noqa: E402

from mtp_plugin.commands import measure  # noqa: E402

GB, MB = 1e9, 1e6
MODES = ("stock", "plain", "d1", "d2", "d3", "d3 replay")
CONTEXTS = (4096, 16384, 32768)
CHILD = """
import importlib, json, sys, time
from pathlib import Path
import mlx.core as mx
from mlx_lm.utils import load_model
model_dir, mode, prompt_len, max_tokens = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if mode != "stock":
    from mtp_plugin.head import health
    from mtp_plugin.decoding import rollback
    health.PROBE_DRAFTS = 0  # a random head is never parked: every cycle drafts (measurement only)
    rollback.force("replay" if mode.endswith("replay") else "capture")
model, config = load_model(model_dir)
vocab = config.get("text_config", config)["vocab_size"]
prompt = mx.random.randint(0, vocab, (prompt_len,), key=mx.random.key(0))
fixed = {"stock": {}, "plain": {"enable_mtp": False}}
options = fixed[mode] if mode in fixed else {"mtp_depth": int(mode[1]), "mtp_lookup": False}
generate_step = importlib.import_module("mlx_lm.generate").generate_step
mx.reset_peak_memory()
tokens = generate_step(prompt, model, max_tokens=max_tokens, **options)
next(tokens)
prompt_peak = mx.get_peak_memory()
mx.reset_peak_memory()
start, cpu, n = time.perf_counter(), time.thread_time(), 0
for _ in tokens:
    n += 1
seconds, cpu = time.perf_counter() - start, time.thread_time() - cpu
head = getattr(model, "mtp_head", None)
stats = None if head is None else head.stats
cycles = n if stats is None or stats.depth is None else stats.cycles + stats.plain
if mode.startswith("d") and (stats is None or stats.cycles == 0):
    raise SystemExit(f"{mode}: the head ran no cycle")
figures = {"prompt_peak": prompt_peak, "decode_peak": mx.get_peak_memory(),
           "ms_per_cycle": 1000 * seconds / cycles, "host_ms_per_cycle": 1000 * cpu / cycles,
           "tokens_per_cycle": n / cycles, "head_kv_per_token": 0}
if head is not None:  # the head's KV cache over 64 positions, per position
    from mtp_plugin.plugins import hook
    _, head_cache = hook().mtp_new_caches(model=model)
    x = mx.zeros((1, 64, config.get("text_config", config)["hidden_size"]), mx.bfloat16)
    head.module(x, x, cache=head_cache)
    mx.eval(head_cache.keys, head_cache.values)
    figures["head_kv_per_token"] = (head_cache.keys.nbytes + head_cache.values.nbytes) / head_cache.keys.shape[2]
print(json.dumps(figures))
"""


PARTS_CHILD = """
import json, sys
from pathlib import Path
import mlx.core as mx
from mlx_lm.utils import load_model
from mtp_plugin.head import draft_vocab
from mtp_plugin.commands.measure import component_costs
from mtp_plugin.plugins import hook
model_dir, prompt_len, repeats = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
model, config = load_model(model_dir)
vocab = config.get("text_config", config)["vocab_size"]
trunk = hook().mtp_trunk(model=model, contract=model.mtp_head.module.contract)
subset = draft_vocab.build(trunk, range(draft_vocab.candidate_sizes(vocab)[1]), "benchmark")  # V/8, rounded up
prompt = mx.random.randint(0, vocab, (prompt_len,), key=mx.random.key(0)).tolist()
costs = component_costs(model, prompt, 3, repeats, subset)
costs["subset"] = subset.size
print(json.dumps(costs))
"""
BUNDLED = REPO / "examples" / "tiny-qwen3_5" / "hf"
DEPTHS = (1, 2, 3)


def bundled_tokens_per_cycle(tokens: int = 96) -> dict[int, float]:
    """E(d) for d in ``DEPTHS``: the bundled checkpoint's tokens per cycle at fixed depth d, greedy, on the code
    prompts (``measure.code_prompts``), ``tokens`` per prompt."""
    from mlx_lm import load

    model, tokenizer = load(str(BUNDLED))
    generate_step = importlib.import_module("mlx_lm.generate").generate_step
    out = {}
    for depth in DEPTHS:
        cycles = emitted = 0
        for prompt in measure.code_prompts():
            for _ in generate_step(mx.array(tokenizer.encode(prompt)), model, max_tokens=tokens, mtp_depth=depth,
                                   mtp_lookup=False):
                pass
            stats = model.mtp_head.stats
            cycles, emitted = cycles + stats.cycles, emitted + stats.tokens_per_cycle * stats.cycles
        out[depth] = emitted / cycles
    return out


def part_lines(model_dir: Path, prompt: int, repeats: int, accepted: dict[int, float], bar) -> list[str]:
    """The loop's parts at this shape (``PARTS_CHILD``) and the projected speedup per depth."""
    bar.set_postfix_str(f"{model_dir.name}, parts")
    costs = child(PARTS_CHILD, [str(model_dir), str(prompt), str(repeats)], stock=False)
    bar.update()
    t1 = costs["plain"]
    verify = {int(k): v / t1 for k, v in costs["verify"].items()}
    draft = {int(d): v / t1 for d, v in costs["draft"].items()}
    subset = {int(d): v / t1 for d, v in costs["draft_subset"].items()}
    lines = [f"  parts (warm cache, median of {repeats}): t(1) = {1000 * t1:.1f} ms; t_verify(k)/t(1): "
             + " ".join(f"k={k}:{c:.2f}" for k, c in sorted(verify.items())),
             "  t_draft(d)/t(1): " + " ".join(f"d={d}:{c:.2f}" for d, c in sorted(draft.items()))
             + f"; over a draft vocabulary of {costs['subset']} tokens: "
             + " ".join(f"d={d}:{c:.2f}" for d, c in sorted(subset.items())),
             "  projection (the bundled checkpoint's greedy tokens per cycle over these costs; not measured here):"]
    for d in DEPTHS:
        full, reduced = draft[d] + verify[d + 1], subset[d] + verify[d + 1]
        lines.append(f"    depth {d}: E={accepted[d]:.2f}  cycle {full:.2f} t(1) -> x{accepted[d] / full:.2f} plain; "
                     f"drafting over the subset {reduced:.2f} t(1) -> x{accepted[d] / reduced:.2f}")
    return lines


def decode_figures(model_dir: Path, prompt: int, tokens: int, repeats: int, bar) -> dict[str, dict[str, float]]:
    """Medians per mode of one run's figures (``CHILD``) over ``repeats`` rounds through every mode in turn."""
    runs = {mode: [] for mode in MODES}
    for _ in range(repeats):
        for mode in runs:
            bar.set_postfix_str(f"{model_dir.name}, {mode}")
            runs[mode].append(child(CHILD, [str(model_dir), mode, str(prompt), str(tokens)], mode == "stock"))
            bar.update()
    return {mode: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for mode, rs in runs.items()}


def lines_of(name: str, figures: dict[str, dict[str, float]]) -> list[str]:
    """The result lines of one shape: a row per mode, the decoding peak also as its excess over stock mlx-lm's (the
    head's weights among it) and over the plugin's plain decoding's (what MTP itself holds: rollback, drafts)."""
    stock, plain = figures["stock"], figures["plain"]
    lines = [f"{name}:", "  mode      prompt peak GB  decode peak GB  over stock GB  over plain GB  ms/cycle  "
             "host ms/cycle  tokens/cycle"]
    for mode, f in figures.items():
        lines.append(f"  {mode:9s} {f['prompt_peak'] / GB:14.3f}  {f['decode_peak'] / GB:14.3f}  "
                     f"{(f['decode_peak'] - stock['decode_peak']) / GB:+13.3f}  "
                     f"{(f['decode_peak'] - plain['decode_peak']) / GB:+13.3f}  {f['ms_per_cycle']:8.1f}  "
                     f"{f['host_ms_per_cycle']:13.2f}  {f['tokens_per_cycle']:12.2f}")
    per_token = figures["d1"]["head_kv_per_token"]
    lines.append(f"  head KV cache: {per_token / 1e3:.1f} kB per context token (measured over 64), "
                 + ", ".join(f"{per_token * n / MB:.0f} MB at {n // 1024}k" for n in CONTEXTS))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", choices=list(real_shapes.SHAPES),
                        help="repeatable; default: every shape")
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=24, help="tokens to decode per run")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--part-repeats", type=int, default=3, help="rounds of the parts' timings")
    parser.add_argument("--cache", type=Path, default=real_shapes.CACHE)
    parser.add_argument("--out", type=Path, help="directory for the dated result file")
    args = parser.parse_args()
    if min(args.prompt, args.tokens, args.repeats, args.part_repeats) < 1:
        parser.error("--prompt, --tokens, --repeats and --part-repeats must be >= 1")
    accepted = bundled_tokens_per_cycle()
    title = (f"decoding at real shapes (random weights; real_shapes.py): a {args.prompt}-token random prompt, "
             f"{args.tokens} tokens greedy, median of {args.repeats} runs per mode, each in a fresh process; "
             "d1-d3: the head at that depth, rollback by capture, every draft rejected (random weights), parking probe "
             "off; d3 replay: rollback by replay; parts: the loop's parts on a warm cache (rollback as auto takes it), "
             "and a projection from the bundled checkpoint's tokens per cycle")
    report(title, args.shape or list(real_shapes.SHAPES), args.cache, len(MODES) * args.repeats + 1, "runs",
           lambda name, model_dir, bar: lines_of(
               name, decode_figures(model_dir, args.prompt, args.tokens, args.repeats, bar))
           + part_lines(model_dir, args.prompt, args.part_repeats, accepted, bar),
           "real-sizes-decoding", args.out)


if __name__ == "__main__":
    main()
