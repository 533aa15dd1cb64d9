"""Deepen a Qwen3.5-hybrid HF checkpoint to N trunk layers with inert copies of its trained layers: a fixture with a
real model's proportions (one head layer against 40-64 trunk layers) and the bundled model's function.

``python benchmarks/deepen.py [SOURCE] --out DIR [--layers 48] [--dtype source] [--force]``

An inserted layer is a copy of a trained layer of the same kind (GatedDeltaNet or full attention) with its output
projections zero: GatedDeltaNet ``out_proj``, attention ``o_proj``, MLP ``down_proj`` (and their biases, if any).
It does all the work of a real layer (norms, projections, the recurrence or attention with its own cache, the MLP)
and adds exactly 0 to the residual stream: ``h + 0 == h`` in every float format, so every trunk hidden state, the
trunk's logits, the greedy tokens and the head's inputs (hence its acceptance) are the source model's
(``tests/test_deep_fixture.py`` checks tokens and logits for equality).

Placement. The runtimes build layer i as full attention iff ``(i + 1) % full_attention_interval == 0`` (mlx-lm and
mlx-vlm both; HF reads ``layer_types``, which must agree), so a layer keeps its kind when moved by a multiple of the
interval P. Trained layer i of n goes to slot ``i + P * round(i * K / (n - 1))`` with K = (N - n) // P: the trained
layers keep their order and kinds, the first stays first, and they spread evenly over the deep stack. Every other
slot gets an inert copy of the nearest trained layer of its kind before it (else the first one after it). Since the
inert layers are exactly the identity on the residual stream, any such placement gives the same function; spreading
keeps the trained layers' caches and work apart as in a real deep model.

Dtype: ``--dtype source`` (the default) keeps the source's dtype (bfloat16 for the bundled checkpoint), so the deep
checkpoint and the source cast alike under ``mtp-plugin bench --dtype``; ``float32`` / ``bfloat16`` / ``float16``
cast every floating tensor on the way out (config's ``dtype`` follows).

No ``--hidden`` (widening with zero-padded weights): it cannot be function-exact. RMSNorm divides by the root mean
square over the hidden width, so padding with zeros scales every normalised vector by sqrt(H'/H); folding that into
the norm weights and eps is exact only for power-of-four ratios, and even then the reduction over H' elements sums in
a different order than over H (different rounding), Qwen3.5's zero-centred norm weights (1 + w) do not rescale exactly
in bfloat16, and ``rms_norm_eps`` is shared with the q/k and gated norms, whose width would not change.

Writes ``DIR/model.safetensors`` (with mlx's own safetensors reader and writer, ``mx.load`` / ``mx.save_safetensors``,
as mlx-lm saves its checkpoints: the ``safetensors`` package's mlx frontend goes through numpy, which has no bfloat16;
every tensor of the source's ``*.safetensors``, head ``mtp.*`` and any vision tower unchanged), its
``model.safetensors.index.json`` (mlx-lm's pipeline ``sharded_load`` reads it), ``config.json``
(``num_hidden_layers``, ``layer_types``) and a copy of every other file (tokenizer, generation config, chat
template), into a temporary directory beside DIR renamed into place when complete. Exit
status 2 on a usage error (DIR exists and is not empty without ``--force``, N below the source's depth), 1 when the
source is not a checkpoint this script can deepen.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "examples" / "tiny-qwen3_5" / "hf"
LAYER = re.compile(r"^((?:model\.)?(?:language_model\.)?(?:model\.)?layers)\.(\d+)\.(.+)$")
OUTPUT_PROJECTIONS = re.compile(r"(?:^|\.)(?:out_proj|o_proj|down_proj)\.(?:weight|bias)$")
INDEX = "model.safetensors.index.json"
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


class SourceError(Exception):
    """The source directory is not an unquantized Qwen3.5-hybrid HF checkpoint this script can deepen."""


def placement(n: int, layers: int, interval: int) -> list[int]:
    """Source layer each of the ``layers`` slots copies, as ``i`` (trained layer i) or ``-1 - i`` (inert copy of i).

    Args:
        n: the source's trunk layers (n ≥ 1).
        layers: N ≥ n, the deep stack's layers.
        interval: ``full_attention_interval`` P: slot j is full attention iff (j + 1) % P == 0.

    Returns:
        N entries; the trained layers 0..n-1 appear once each, in order, each at a slot of its own kind.
    """
    def kind(j: int) -> bool:
        return (j + 1) % interval == 0

    shift = (layers - n) // interval
    slots = {i + interval * round(i * shift / max(n - 1, 1)): i for i in range(n)}
    plan = []
    for j in range(layers):
        if j in slots:
            plan.append(slots[j])
            continue
        same = [s for s in slots if kind(s) == kind(j)]
        before = [s for s in same if s < j]
        plan.append(-1 - slots[max(before) if before else min(same)])
    return plan


def _text_config(config: dict) -> dict:
    return config.get("text_config", config)


def _pattern(count: int, interval: int) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(count)]


def read_source(source: Path) -> tuple[dict, dict[str, mx.array], dict]:
    """``(config, {tensor name: array (lazy)}, metadata)`` of the source checkpoint (every ``*.safetensors`` file).

    Raises:
        SourceError: no config.json or safetensors, a quantized checkpoint, a layer list that disagrees with
            ``full_attention_interval``, or a kind of layer missing from the source.
    """
    config_file = source / "config.json"
    if not config_file.is_file():
        raise SourceError(f"{source}: no config.json (an HF-layout checkpoint directory is expected)")
    config = json.loads(config_file.read_text())
    text = _text_config(config)
    interval, n = text.get("full_attention_interval"), text.get("num_hidden_layers")
    if not isinstance(interval, int) or not isinstance(n, int):
        raise SourceError(f"{config_file}: needs integer num_hidden_layers and full_attention_interval "
                          "(a Qwen3.5-hybrid config)")
    if text.get("layer_types", _pattern(n, interval)) != _pattern(n, interval):
        raise SourceError(f"{config_file}: layer_types disagrees with full_attention_interval={interval}; the "
                          "runtimes build layers from the interval, so the deep stack's kinds would be ambiguous")
    if n < interval:
        raise SourceError(f"{config_file}: {n} layers hold no full-attention layer to copy (interval {interval})")
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise SourceError(f"{source}: no *.safetensors file")
    tensors, metadata = {}, {}
    for file in files:
        arrays, meta = mx.load(str(file), return_metadata=True)
        metadata = metadata or meta
        for name, a in arrays.items():
            if name.endswith(".scales"):
                raise SourceError(f"{file}: tensor {name}: a quantized checkpoint; deepen its unquantized "
                                  "original (zeroed quantized projections would not be exactly zero)")
            tensors[name] = a
    indices = {int(m.group(2)) for m in map(LAYER.match, tensors) if m}
    if indices != set(range(n)):
        raise SourceError(f"{source}: trunk layers {sorted(indices)} in the safetensors, config.json says {n}")
    return config, tensors, metadata


def deepen_tensors(tensors: dict[str, mx.array], plan: list[int], dtype=None, progress: bool = True) -> dict:
    """Every output tensor: non-layer tensors as they are, slot j's layer copied from its source layer (zero output
    projections for an inert copy), each cast to ``dtype`` if given (floating tensors only)."""
    by_layer: dict[int, list[tuple[str, str, str]]] = {}
    out = {}

    def load(key):
        a = tensors[key]
        return a.astype(dtype) if dtype is not None and mx.issubdtype(a.dtype, mx.floating) else a

    for key in tensors:
        m = LAYER.match(key)
        if m:
            by_layer.setdefault(int(m.group(2)), []).append((key, m.group(1), m.group(3)))
        else:
            out[key] = load(key)
    for j, source in enumerate(tqdm(plan, desc="layers", disable=not progress)):
        inert = source < 0
        for key, prefix, rest in by_layer[-1 - source if inert else source]:
            a = load(key)
            out[f"{prefix}.{j}.{rest}"] = mx.zeros_like(a) if inert and OUTPUT_PROJECTIONS.search(rest) else a
        mx.eval(list(out.values()))
    return out


def deep_config(config: dict, layers: int, dtype: str | None) -> dict:
    """config.json of the deep checkpoint: ``num_hidden_layers``, ``layer_types`` (and ``dtype`` when cast)."""
    config = json.loads(json.dumps(config))
    text = _text_config(config)
    text["num_hidden_layers"] = layers
    text["layer_types"] = _pattern(layers, text["full_attention_interval"])
    if dtype is not None:
        for c in {id(c): c for c in (config, text)}.values():
            for key in ("dtype", "torch_dtype"):
                if key in c:
                    c[key] = dtype
    return config


def write(source: Path, out: Path, layers: int, dtype: str | None, force: bool, progress: bool = True) -> list[int]:
    """Build the deep checkpoint in a temporary directory beside ``out``, then rename it into place.

    Returns:
        the placement (``placement``).

    Raises:
        SourceError: see ``read_source``.
        ValueError: ``layers`` below the source's depth.
        FileExistsError: ``out`` exists, is not an empty directory, and ``force`` is False (or it is a file).
    """
    config, tensors, metadata = read_source(source)
    text = _text_config(config)
    n, interval = text["num_hidden_layers"], text["full_attention_interval"]
    if layers < n:
        raise ValueError(f"--layers {layers} is below the source's {n} trained layers")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not force)):
        raise FileExistsError(f"{out} exists and is not an empty directory (pass --force to replace it)")
    plan = placement(n, layers, interval)
    out.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    build.chmod(0o777 & ~umask)  # a directory as mkdir makes it, not mkdtemp's private 0700
    try:
        deep = deepen_tensors(tensors, plan, DTYPES.get(dtype), progress)
        mx.save_safetensors(str(build / "model.safetensors"), deep, metadata=metadata)
        index = {"metadata": {}, "weight_map": dict.fromkeys(sorted(deep), "model.safetensors")}
        (build / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        (build / "config.json").write_text(json.dumps(deep_config(config, layers, dtype), indent=2) + "\n")
        for item in source.iterdir():
            if item.is_file() and item.suffix != ".safetensors" and item.name not in ("config.json", INDEX):
                shutil.copy2(item, build / item.name)
        if out.exists() and any(out.iterdir()):
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
            out.rename(old / out.name)
            build.rename(out)
            shutil.rmtree(old)
        else:
            if out.exists():
                out.rmdir()
            build.rename(out)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    return plan


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", type=Path, default=SOURCE,
                        help="HF-layout Qwen3.5-hybrid checkpoint (default: the bundled tiny one)")
    parser.add_argument("--out", type=Path, required=True, help="output directory (created atomically)")
    parser.add_argument("--layers", type=int, default=48, help="trunk layers of the deep checkpoint (default 48)")
    parser.add_argument("--dtype", choices=["source", *DTYPES], default="source",
                        help="dtype of the written floating tensors (default: the source's)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    args = parser.parse_args(argv)
    source, out = args.source.resolve(), args.out.resolve()
    if out == source or source in out.parents:
        parser.error(f"--out {args.out} is inside the source checkpoint {args.source}; write elsewhere")
    try:
        plan = write(source, out, args.layers, None if args.dtype == "source" else args.dtype, args.force)
    except (ValueError, FileExistsError) as e:
        parser.error(str(e))
    except SourceError as e:
        print(f"deepen: {e}", file=sys.stderr)
        return 1
    trained = [j for j, s in enumerate(plan) if s >= 0]
    print(f"wrote {out}: {len(plan)} layers, trained layers at slots {trained}, {len(plan) - len(trained)} inert")
    return 0


if __name__ == "__main__":
    sys.exit(main())
