"""Structured output at MTP speed: tokens/s of JSON under a schema decoded plain and with MTP (drafts made under the
grammar), beside free text with MTP, on several schemas; tokens per cycle, forced and masked drafts, the grammar's host
time per cycle.

    python benchmarks/structured.py --model build/deep48 [--dtype bfloat16] [--max-tokens 128] [--repeats 3]
        [--out benchmarks/results]

Each schema comes with a prompt asking for it (the tiny checkpoints follow no instruction; the grammar makes their
answer JSON). Candidates, decoded greedily through mlx-lm's ``generate_step`` as patched, interleaved
(``measure.candidates``): ``plain`` (the schema, MTP off: constrained plain decoding, the reference), ``MTP`` (the
schema, the default: adaptive depth, lookup drafts), ``free MTP`` (no schema, the default) and ``free plain``. Each
figure is the median over repeats; ``vs plain`` is the median of per-repeat ratios to ``plain``. Every ``MTP`` run's
tokens are checked against ``plain``'s.
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

from mtp_plugin import response_format_processor, tuning
from mtp_plugin.commands import measure

REPO = Path(__file__).resolve().parents[1]
STRING = {"type": "string", "maxLength": 40}
SCHEMAS = {
    "flat object": ("Return the person described above as JSON with name, age and email.",
                    {"type": "object", "properties": {"name": STRING, "age": {"type": "integer", "maximum": 150},
                                                      "email": STRING}, "required": ["name", "age", "email"],
                     "additionalProperties": False}),
    "nested": ("Return the order above as JSON: its customer and shipping address.",
               {"type": "object", "properties": {
                   "customer": {"type": "object", "properties": {"id": {"type": "integer"}, "name": STRING},
                                "required": ["id", "name"], "additionalProperties": False},
                   "address": {"type": "object", "properties": {"street": STRING, "city": STRING,
                                                                "zip": {"type": "string", "maxLength": 10}},
                               "required": ["street", "city", "zip"], "additionalProperties": False}},
                "required": ["customer", "address"], "additionalProperties": False}),
    "array of objects": ("List every function defined above as JSON: its name and line count.",
                         {"type": "object", "properties": {"functions": {"type": "array", "minItems": 3,
                                                                         "maxItems": 8, "items": {
                             "type": "object", "properties": {"name": STRING, "lines": {"type": "integer"}},
                             "required": ["name", "lines"], "additionalProperties": False}}},
                          "required": ["functions"], "additionalProperties": False}),
    "enums": ("Classify the code above as JSON: language, kind and quality.",
              {"type": "object", "properties": {
                  "language": {"enum": ["python", "javascript", "rust", "go", "other"]},
                  "kind": {"enum": ["library", "script", "test", "config"]},
                  "quality": {"enum": ["low", "medium", "high"]}, "reasons": {"type": "array", "maxItems": 3,
                                                                                 "items": STRING}},
               "required": ["language", "kind", "quality", "reasons"], "additionalProperties": False}),
    "tool call": ("Call one tool to fix the bug above, as JSON.",
                  {"type": "object", "properties": {
                      "tool": {"enum": ["read_file", "write_file", "run_tests", "search"]},
                      "arguments": {"type": "object", "properties": {"path": STRING, "line": {"type": "integer"},
                                                                     "text": STRING},
                                    "required": ["path", "line", "text"], "additionalProperties": False}},
                   "required": ["tool", "arguments"], "additionalProperties": False}),
}
CANDIDATES = {"plain": {"enable_mtp": False}, "MTP": {}, "free MTP": {}, "free plain": {"enable_mtp": False}}
CONSTRAINED = ("plain", "MTP")


def run(model, tokenizer, prompt: list[int], schema: dict, max_tokens: int, repeats: int, label: str) -> dict:
    """``measure.Result`` per candidate on one prompt and schema; MTP's tokens checked against plain's."""
    generate_step = importlib.import_module("mlx_lm.generate").generate_step
    response_format = {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}
    reference = {}

    def decode(prompt, max_tokens, name):
        processors = [response_format_processor(tokenizer, response_format)] if name in CONSTRAINED else None
        tokens = []
        for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, logits_processors=processors,
                                      **CANDIDATES[name]):
            tokens.append(token)
            yield token
        if name in CONSTRAINED and reference.setdefault(max_tokens, tokens) != tokens:
            raise SystemExit(f"{name} decoded other tokens than constrained plain decoding: a bug, please report it")

    names = {name: name for name in CANDIDATES}
    return measure.candidates(decode, lambda: model.mtp_head.stats, [prompt], names, max_tokens, repeats, label)


def table(results: dict) -> list[str]:
    """One line per candidate: tok/s, ratio to constrained plain, tokens per cycle, drafts, grammar host time."""
    lines = ["candidate     tok/s  vs plain  tok/cycle  forced  masked  grammar ms/cycle"]
    plain = results["plain"].runs
    for name, r in results.items():
        ratio = statistics.median(a / b for a, b in zip(r.runs, plain, strict=True))
        s = r.stats if name in ("MTP", "free MTP") else None
        passes = (s.cycles + s.lookup_cycles) if s else 0
        per_cycle = f"{s.tokens_per_cycle:9.2f}" if s and s.cycles else "        -"
        host = f"{1000 * s.grammar_seconds / passes:16.2f}" if s and passes and name == "MTP" else "               -"
        lines.append(f"{name:<11} {r.tokens_per_second:7.1f}  {ratio:8.3f}  {per_cycle}  {s.forced if s else '-':>6}  "
                     f"{s.masked if s else '-':>6}  {host}")
    return lines


def main() -> None:
    """Parse arguments, load, measure every schema, print (and write with ``--out``)."""
    parser = decoding_args.parser(__doc__)
    args = parser.parse_args()
    model, tokenizer = decoding_args.with_head(parser, args, load(str(args.model)))
    context = measure.code_prompts()[0]
    shown = os.path.relpath(args.model.resolve(), REPO)
    lines = [f"structured output: model {args.model.name} ({shown}), dtype {args.dtype}, greedy, {args.max_tokens} "
             f"tokens at most per answer, median of {args.repeats} runs",
             f"date: {datetime.datetime.now().isoformat(timespec='seconds')}",
             f"machine: {json.dumps(tuning.machine())}, {os.cpu_count()} CPUs",
             f"versions: {json.dumps(tuning.versions())}",
             "candidates: plain (the schema, MTP off: the reference), MTP (the schema, the default), free MTP (no "
             "schema, the default), free plain (no schema, MTP off)"]
    pooled: dict[str, list[float]] = {}
    for name, (ask, schema) in SCHEMAS.items():
        prompt = tokenizer.encode(f"{context}\n\n# {ask}\n")
        results = run(model, tokenizer, prompt, schema, args.max_tokens, args.repeats, f"structured: {name}")
        for candidate, r in results.items():
            pooled.setdefault(candidate, []).extend(a / b for a, b in zip(r.runs, results["plain"].runs,
                                                                          strict=True))
        lines += ["", f"{name}: prompt of {len(prompt)} tokens", *table(results)]
    lines += ["", "pooled over the schemas, median of per-run ratios to constrained plain decoding: "
              + ", ".join(f"{c} {statistics.median(v):.3f}" for c, v in pooled.items())]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        path = measure.write_result(args.out, f"structured-{args.model.name}-{args.dtype}", text)
        print(f"written to {os.path.relpath(path, REPO)}")


if __name__ == "__main__":
    main()
