"""Random-weight checkpoints at the shapes users run, built on demand into a cache directory (never committed).

    python benchmarks/real_shapes.py [--shape NAME ...] [--cache DIR] [--force]

Each is a converted MLX checkpoint as ``mlx_lm.convert`` writes one (mlx-lm's own model class, ``quantize_model`` and
``save_model``: sharded, with an index) that kept its head: the MTP head, built by the family's ``mtp_build_head``,
under ``mtp.*`` in the last shard beside trunk layers (DeepSeek-V3's in a sidecar ``mtp.safetensors``). Weights are
MLX's initializers' draws (stacked experts drawn block by block from the same distribution: ``draw_experts``), so
acceptance means nothing here; memory and time do. Shapes (``SHAPES``) follow the published configs' widths with fewer
trunk layers where the full depth would not fit this machine. Prints each checkpoint's directory; exit status 2 on a
usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear
from mlx_lm.utils import quantize_model, save_config, save_model

from mtp_plugin.plugins import hook

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mtp_plugin" / "real_shapes"
ROPE = {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10], "mrope_interleaved": True}
VOCAB = 248320
GDN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16)
COMMON = dict(head_dim=256, vocab_size=VOCAB, full_attention_interval=4, rms_norm_eps=1e-6, rope_parameters=ROPE,
              max_position_embeddings=262144, mtp_num_hidden_layers=1, attn_output_gate=True, **GDN)
SHAPES = {
    "qwen3_5-2b": dict(kind="qwen3_5", bits=None, text=dict(
        hidden_size=2048, num_hidden_layers=24, intermediate_size=6144, num_attention_heads=8, num_key_value_heads=2,
        linear_num_value_heads=16, tie_word_embeddings=True)),
    "qwen3_5-9b-4bit": dict(kind="qwen3_5", bits=4, text=dict(
        hidden_size=4096, num_hidden_layers=32, intermediate_size=12288, num_attention_heads=16,
        num_key_value_heads=4, linear_num_value_heads=32, tie_word_embeddings=False)),
    "qwen3_6-27b-4layers": dict(kind="qwen3_5", bits=None, text=dict(
        hidden_size=5120, num_hidden_layers=4, intermediate_size=17408, num_attention_heads=24,
        num_key_value_heads=4, linear_num_value_heads=48, tie_word_embeddings=False)),
    "qwen3_5-35b-a3b-4layers-4bit": dict(kind="qwen3_5_moe", bits=4, text=dict(
        hidden_size=2048, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=2,
        linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, decoder_sparse_step=1, tie_word_embeddings=False)),
    # DeepSeek-V3's published widths (MLA, 256 routed experts of 2048, vocabulary 129280) with one dense trunk layer, so
    # that the next-n head (the layer at index num_hidden_layers) is an MoE layer as in the full model
    "deepseek_v3-1layer-4bit": dict(kind="deepseek_v3", bits=4, flat=dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=1, first_k_dense_replace=1, num_attention_heads=128, num_key_value_heads=128,
        n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_method="noaux_tc", scoring_func="sigmoid",
        norm_topk_prob=True, n_group=8, topk_group=4, num_experts_per_tok=8, moe_layer_freq=1, rms_norm_eps=1e-6,
        rope_theta=10000, max_position_embeddings=163840, num_nextn_predict_layers=1, tie_word_embeddings=False)),
}
EXPERT_BLOCK = 16  # experts drawn and quantized at a time


def config_of(name: str) -> dict:
    """config.json of shape ``name`` before quantization (KeyError: an unknown shape)."""
    shape = SHAPES[name]
    if "flat" in shape:  # a text-only model type: no text_config
        return dict(model_type=shape["kind"], **shape["flat"])
    text = dict(COMMON, model_type=f"{shape['kind']}_text", **shape["text"])
    return dict(model_type=shape["kind"], text_config=text, tie_word_embeddings=text["tie_word_embeddings"])


def build(name: str, out: Path) -> Path:
    """Write shape ``name`` to ``out`` (through a temporary directory beside it, renamed when complete); ``out``."""
    config = config_of(name)
    model = hook().mtp_build_model(config=config)  # mlx-lm's class, lazy: nothing is drawn until a shard is written
    if model is None:
        raise SystemExit(f"{name}: the installed mlx-lm has no model type {config['model_type']!r}")
    head = hook().mtp_build_head(model=model, config=config)
    model.set_dtype(mx.bfloat16)
    head.set_dtype(mx.bfloat16)
    bits = SHAPES[name]["bits"]
    if bits:
        with contextlib.redirect_stdout(sys.stderr):  # its progress lines; stdout lists the checkpoints
            model, config = quantize_model(model, config, 64, bits)
            quantize_model(head, {}, 64, bits)
        for module in (model, head):
            draw_experts(module)
    sidecar = "flat" in SHAPES[name]  # mlx-lm's deepseek_v3 drops only model.layers.61: a stock load would fail
    if not sidecar:
        model.mtp = head  # saved under mtp.*, after the trunk: in the last shard
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}-*"):  # left by a build that was killed
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o755)  # as a directory made by mkdir, not mkdtemp's owner-only
    try:
        save_model(tmp, model, donate_model=True)
        if sidecar:  # a sidecar stock mlx-lm does not read (it loads model*.safetensors)
            mx.save_safetensors(str(tmp / "mtp.safetensors"), dict(tree_flatten(head.parameters())),
                                metadata={"format": "mlx"})
        save_config(config, tmp / "config.json")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def draw_experts(module) -> None:
    """Give each quantized switch layer (stacked experts) of ``module`` weights drawn and quantized ``EXPERT_BLOCK``
    experts at a time, evaluated: its initializer's lazy draw is one float32 array of every expert (15 GB for one of
    DeepSeek-V3's projections), which is then never evaluated. Same distribution: uniform in ±1/sqrt(input width)."""
    for _, layer in module.named_modules():
        if not isinstance(layer, QuantizedSwitchLinear):
            continue
        experts, rows, packed = layer.weight.shape
        width = packed * 32 // layer.bits
        bound = width ** -0.5
        blocks = []
        for first in range(0, experts, EXPERT_BLOCK):
            shape = (min(EXPERT_BLOCK, experts - first), rows, width)
            block = mx.quantize(mx.random.uniform(-bound, bound, shape, dtype=mx.bfloat16), layer.group_size,
                                layer.bits)
            mx.eval(block)
            blocks.append(block)
        layer.weight, layer.scales, layer.biases = (mx.concatenate([b[i] for b in blocks]) for i in range(3))


def ensure(name: str, cache: Path = CACHE, force: bool = False) -> Path:
    """The checkpoint of shape ``name`` in ``cache``, built if absent (or with ``force``)."""
    out = cache / name
    if force or not (out / "config.json").exists():
        build(name, out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", choices=list(SHAPES), help="repeatable; default: every shape")
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--force", action="store_true", help="rebuild checkpoints already in the cache")
    args = parser.parse_args()
    for name in args.shape or SHAPES:
        print(ensure(name, args.cache, args.force))


if __name__ == "__main__":
    main()
