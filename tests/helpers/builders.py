"""Tiny random Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoints built with the runtimes' own classes.

Each is saved the way a converted MLX checkpoint is (MLX layout, absolute RMSNorm scales), with the
head placed under a chosen name form and file, and a head-less twin to compare against; and images to prompt
vision checkpoints with.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from mtp_plugin.head.conventions import is_norm
from mtp_plugin.plugins import hook

ROPE = {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5, "mrope_interleaved": True}
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, linear_num_value_heads=4,
            linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, full_attention_interval=2, rms_norm_eps=1e-6,
            tie_word_embeddings=False, max_position_embeddings=512)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32, decoder_sparse_step=1)
VISION = dict(model_type="qwen3_5", depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
              out_hidden_size=64, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
              in_channels=3, num_position_embeddings=16)
KINDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def config_for(kind: str, vision: bool = False) -> dict:
    """config.json of a tiny model of ``kind``; with ``vision`` a tiny vision tower (for mlx-vlm)."""
    if kind == "qwen3_next":
        return dict(model_type=kind, **TEXT, **MOE, mlp_only_layers=[], rope_theta=10000.0,
                    partial_rotary_factor=0.5, mtp_num_hidden_layers=1)
    text = dict(model_type=f"{kind}_text", **TEXT, rope_parameters=ROPE, mtp_num_hidden_layers=1)
    if kind == "qwen3_5_moe":
        text.update(MOE)
    config = dict(model_type=kind, text_config=text, tie_word_embeddings=False)
    if vision:
        config.update(vision_config=VISION, image_token_id=250, video_token_id=251, vision_start_token_id=252)
    return config


def build_model(config: dict, runtime: str = "mlx_lm", seed: int = 0) -> nn.Module:
    """A randomly initialised model of the runtime's own class; RMSNorm scales drawn in [0.5, 1.5]."""
    mx.random.seed(seed)
    if runtime == "mlx_lm":
        from mlx_lm.utils import _get_classes

        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
    else:
        from mlx_vlm.utils import get_model_and_args

        arch = get_model_and_args(config)[0]
        model_config = arch.ModelConfig.from_dict(config)
        if "text_config" in config:
            model_config.text_config = arch.TextConfig.from_dict(config["text_config"])
        if "vision_config" in config:
            model_config.vision_config = arch.VisionConfig.from_dict(config["vision_config"])
        model = arch.Model(model_config)
    randomize_norms(model)
    return model


def randomize_norms(module: nn.Module) -> None:
    """Draw every 1-D ``*norm.weight`` in [0.5, 1.5] so that a double shift changes the logits."""
    updates = [(k, mx.random.uniform(0.5, 1.5, v.shape).astype(v.dtype))
               for k, v in tree_flatten(module.parameters()) if is_norm(k, v.shape)]
    module.load_weights(updates, strict=False)


def build_head(model: nn.Module, config: dict, quantize: dict | None = None) -> dict[str, mx.array]:
    """Random head weights (canonical names, absolute norms), optionally quantized ``{"bits", "group_size"}``.

    Its statistics are those of a trained head (norms moved, projections heavy-tailed: MLX's uniform init
    scaled entry by entry by exp(N(0, 0.5²)), kurtosis ≈ 5), so that nothing judges it random initialisation.
    """
    head = hook().mtp_build_head(model=model, config=config)
    head.update(tree_map(lambda v: v * mx.exp(0.5 * mx.random.normal(v.shape)) if v.ndim > 1 else v * 1.0,
                         head.parameters()))
    randomize_norms(head)
    if quantize:
        nn.quantize(head, **quantize)
    weights = dict(tree_flatten(head.parameters()))
    mx.eval(weights)
    return weights


def save_checkpoint(path: Path, config: dict, trunk: dict, head: dict | None = None,
                    head_file: str = "model.safetensors", prefix: str = "mtp.", index: bool = False) -> Path:
    """Write a converted checkpoint: trunk tensors in ``model.safetensors`` (or two indexed shards)
    and the head under ``prefix`` in ``head_file`` (which may be the trunk shard itself)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    files: dict[str, dict] = {"model.safetensors": dict(trunk)}
    if index:
        names = sorted(trunk)
        half = len(names) // 2
        files = {"model-00001-of-00002.safetensors": {k: trunk[k] for k in names[:half]},
                 "model-00002-of-00002.safetensors": {k: trunk[k] for k in names[half:]}}
    if head is not None:
        files.setdefault(head_file, {}).update({prefix + k: v for k, v in head.items()})
    for name, tensors in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(path / name), tensors, metadata={"format": "mlx"})
    if index:
        weight_map = {k: f for f, t in files.items() if f.startswith("model-0") for k in t}
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def trunk_weights(model: nn.Module) -> dict[str, mx.array]:
    """The model's parameters as a flat dict of converted (MLX) names."""
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    return weights


def cache_arrays(cache: list) -> list:
    """Every array a trunk cache holds (KV caches up to their offset, quantized ones as their packed arrays;
    GatedDeltaNet conv and recurrent states),
    as numpy arrays, to compare caches left by two decoding runs."""
    import numpy as np

    out = []
    for c in cache:
        if hasattr(c, "offset"):  # KVCache, RotatingKVCache before it wraps, QuantizedKVCache (tuples of arrays)
            parts = [p for kv in (c.keys, c.values) for p in (kv if isinstance(kv, tuple | list) else (kv,))]
            out += [p[..., : c.offset, :] for p in parts]
        else:
            out += list(c.cache)
    return [np.array(a) for a in out]


def to_float32(model: nn.Module) -> nn.Module:
    """Cast ``model``'s parameters and its loaded head's to float32 in place (exact greedy comparisons)."""
    model.update(tree_map(lambda a: a.astype(mx.float32), model.parameters()))
    head = model.mtp_head.module
    head.update(tree_map(lambda a: a.astype(mx.float32), head.parameters()))
    return model


def caches_after_close(model: nn.Module, prompt: list[int], stop: int, common: dict | None = None,
                       **mtp_options) -> tuple[list, list]:
    """``(plain, mtp)``: the arrays of the trunk cache left by plain decoding and by MTP decoding
    (``mtp_options``: ``generate_step`` keywords such as ``mtp_depth``; ``common``: keywords of both runs)
    when each generator is closed after ``stop`` tokens."""
    import importlib

    from mlx_lm.models.cache import make_prompt_cache

    generate_step = importlib.import_module("mlx_lm.generate").generate_step  # as patched now
    caches = []
    for options in ({"enable_mtp": False}, {"enable_mtp": True, **mtp_options}):
        cache = make_prompt_cache(model)
        generator = generate_step(mx.array(prompt), model, prompt_cache=cache, **(common or {}), **options)
        for _ in range(stop):
            next(generator)
        generator.close()
        caches.append(cache_arrays(cache))
    return caches[0], caches[1]


def png(width: int, height: int, seed: int) -> bytes:
    """An RGB PNG image (a colour gradient), encoded with zlib as the PNG format defines it."""
    rows = b"".join(b"\x00" + bytes((x * 7 + seed) % 256 for x in range(3 * width)) for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def quantized_sidecar_checkpoint(path: Path, files_from: Path, seed: int = 0) -> Path:
    """A random tiny Qwen3.5 checkpoint as a user's own 4-bit one: the trunk quantized by mlx-lm's ``quantize_model``
    (what ``mlx_lm.convert -q`` runs; group size 64), its head 4-bit in an ``mtp.safetensors`` sidecar, and the
    tokenizer and chat files of ``files_from`` (a checkpoint directory; the vocabulary takes its tokenizer's size).

    Returns:
        ``path``, written (its parent must exist).
    """
    import shutil

    from mlx_lm.utils import quantize_model

    vocab = json.loads((files_from / "tokenizer.json").read_text())["model"]["vocab"]
    config = config_for("qwen3_5")
    config["text_config"]["vocab_size"] = len(vocab)
    model = build_model(config, seed=seed)
    head = build_head(model, config, quantize={"bits": 4, "group_size": 64})
    model, config = quantize_model(model, config, 64, 4)
    save_checkpoint(path, config, trunk_weights(model), head, "mtp.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (files_from / name).exists():
            shutil.copy(files_from / name, path / name)
    return path


def untied_copy(source: Path, path: Path) -> Path:
    """A copy of the converted checkpoint ``source`` (tied word embeddings) with an ``lm_head`` of its own, equal to
    the embedding (quantized arrays copied as they are), so the logits and the head's drafts are unchanged; its
    ``model.safetensors.index.json`` names the new tensors. Returns ``path``."""
    import shutil

    shutil.copytree(source, path)
    config = json.loads((path / "config.json").read_text())
    for level in (config, config.get("text_config", {})):
        if "tie_word_embeddings" in level:
            level["tie_word_embeddings"] = False
    (path / "config.json").write_text(json.dumps(config))
    weights = mx.load(str(path / "model.safetensors"))
    embedding = "language_model.model.embed_tokens."
    weights.update({"language_model.lm_head." + k[len(embedding):]: v for k, v in list(weights.items())
                    if k.startswith(embedding)})
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: "model.safetensors" for k in sorted(weights)}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    return path
