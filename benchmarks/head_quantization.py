"""Depth-1 acceptance of a head kept in bfloat16 and quantized to 8 and 4 bits, the measurement behind extract's and
graft's default ``--bits``.

    python benchmarks/head_quantization.py [MODEL_DIR ...] [--files 8] [--out DIR]

For each model (default: the bundled ``examples/tiny-qwen3_5/hf`` and the 48-layer ``build/deep48``, both bf16 with the
head inside the checkpoint): a head-less copy of it (its weights without ``mtp.*``) is the recipient, the head is
extracted at every quantization (``extract``: bf16, 8 and 4 bits at group sizes 64 and 32) and grafted onto the
recipient (``graft``, mlx-lm layout), and each graft is loaded with mlx-lm and measured by ``verify``'s teacher-forced
pass: the share of positions where the head's draft of token t+2 equals the trunk's greedy token (the wiring the loader
decided), over the first ``verify.MAX_TOKENS`` tokens of ``--files`` standard-library modules, pooled over positions.
Prints a table (acceptance, change against bf16, head MB) and writes it to a dated file in ``--out``. Exit status 2 on a
usage error, 1 when a model cannot be measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import tempfile
from pathlib import Path

import mlx.core as mx
from tqdm import tqdm

from mtp_plugin.commands import measure
from mtp_plugin.commands.extract import extract
from mtp_plugin.commands.graft import graft
from mtp_plugin.commands.verify import MAX_TOKENS
from mtp_plugin.head import norm_settling
from mtp_plugin.plugins import hook

REPO = Path(__file__).resolve().parent.parent
MODELS = (REPO / "examples/tiny-qwen3_5/hf", REPO / "build/deep48")
VARIANTS = ((16, 64), (8, 64), (8, 32), (4, 64), (4, 32))  # (bits, group size); 16: bfloat16
MODULES = ("textwrap.py", "shlex.py", "string.py", "fractions.py", "argparse.py", "csv.py", "difflib.py", "heapq.py",
           "json/decoder.py", "pprint.py", "calendar.py", "dataclasses.py")


def headless(model_dir: Path, out: Path) -> Path:
    """A copy of ``model_dir`` in ``out`` without ``mtp.*`` tensors (weights rewritten, index filtered, other files
    linked); returns ``out``."""
    out.mkdir()
    for path in model_dir.iterdir():
        if path.suffix == ".safetensors":
            weights, metadata = mx.load(str(path), return_metadata=True)
            mx.save_safetensors(str(out / path.name), {k: v for k, v in weights.items() if not k.startswith("mtp.")},
                                metadata)
        elif path.name == "model.safetensors.index.json":
            index = json.loads(path.read_text())
            index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("mtp.")}
            (out / path.name).write_text(json.dumps(index))
        elif path.is_file():
            (out / path.name).hardlink_to(path)
    return out


def acceptance(model_dir: Path, texts: list[str]) -> tuple[float, int]:
    """Depth-1 greedy acceptance of the head of ``model_dir`` as the loader wires it (``verify``'s pass for the
    loader's wiring alone: norms the files leave open settled on each text first), pooled over the positions of
    ``texts``, and the positions measured."""
    model, tokenizer = hook().mtp_load_model(model_dir=model_dir)
    head = model.mtp_head.module
    trunk = hook().mtp_trunk(model=model, contract=head.contract)
    original = dict(head.parameters())
    accepted = positions = 0
    for text in texts:
        tokens = mx.array(tokenizer.encode(text)[:MAX_TOKENS])
        hidden = trunk.hidden(tokens[None], None)
        target = mx.argmax(trunk.trunk_logits(hidden), axis=-1)[0, 1:]
        _, head_cache = hook().mtp_new_caches(model=model)
        norm_settling.on_prompt(head, trunk, hidden[:, :-1], tokens[1:], head_cache)
        draft = mx.argmax(trunk.logits(head(hidden[:, :-1], trunk.embed(tokens[None, 1:]))), axis=-1)[0]
        accepted += (draft == target).sum().item()
        positions += target.size
        head.update(original)
    return accepted / positions, positions


def measure_model(model_dir: Path, texts: list[str]) -> list[dict]:
    """One row per variant: bits, group size, head bytes, acceptance, positions."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        recipient = headless(model_dir, Path(tmp) / "recipient")
        for bits, group in tqdm(VARIANTS, desc=model_dir.name, unit="head"):
            head = Path(tmp) / f"head-{bits}-{group}.safetensors"
            extract(model_dir, head, bits=bits, group_size=group)
            out = Path(tmp) / f"graft-{bits}-{group}"
            graft(recipient, head, out)
            rate, positions = acceptance(out, texts)
            rows.append({"bits": bits, "group": group, "bytes": head.stat().st_size, "acceptance": rate,
                         "positions": positions})
    return rows


def render(results: dict[str, list[dict]], files: int) -> str:
    lines = [f"# Head quantization: depth-1 greedy acceptance (teacher forcing, {files} standard-library modules, "
             f"first {MAX_TOKENS} tokens each), heads extracted and grafted onto the head-less trunk", ""]
    for name, rows in results.items():
        base = rows[0]["acceptance"]
        lines += [f"## {name} ({rows[0]['positions']} positions)", "",
                  "| head | acceptance | vs bf16 | head MB |", "|---|---|---|---|"]
        for r in rows:
            label = "bf16" if r["bits"] == 16 else f"{r['bits']}-bit, group {r['group']}"
            lines.append(f"| {label} | {r['acceptance']:.4f} | {r['acceptance'] - base:+.4f} | "
                         f"{r['bytes'] / 1e6:.3f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", type=Path, default=list(MODELS), help="bf16 checkpoints with a head")
    parser.add_argument("--files", type=int, default=8,
                        help=f"standard-library modules to measure on (1-{len(MODULES)})")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results", help="folder of the dated result")
    args = parser.parse_args(argv)
    if not 1 <= args.files <= len(MODULES):
        parser.error(f"--files must be 1-{len(MODULES)}")
    missing = [str(m) for m in args.models if not (m / "config.json").is_file()]
    if missing:
        parser.error(f"not a model directory: {', '.join(missing)} (build/deep48: python benchmarks/deepen.py --out "
                     "build/deep48 --layers 48 --dtype bfloat16)")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / m).read_text() for m in MODULES[: args.files]]
    try:
        results = {m.name: measure_model(m, texts) for m in args.models}
    except Exception as e:  # noqa: BLE001 - one line, exit 1
        print(f"head_quantization: {e}", file=sys.stderr)
        return 1
    text = render(results, args.files)
    print(text)
    path = measure.write_result(args.out, 'head-quantization', text)
    print(f"written: {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
