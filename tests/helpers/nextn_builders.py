"""Tiny random DeepSeek-V3 / GLM-4 MoE / GLM-4.7-Flash checkpoints with a next-n head, built with mlx-lm's classes.

Float32 throughout (MLX's CPU ``gather_mm``, used by the MoE layers, runs in float32 only). Saved either as an
MLX conversion (trunk in mlx-lm's layout) with the head where a runtime may keep it, or in the Hugging Face
layout (per-expert tensors, MLA's ``kv_b_proj``, the head as layer ``num_hidden_layers``) that
``mlx_lm.convert`` reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from helpers.builders import build_head, build_model, save_checkpoint, trunk_weights

KINDS = ("deepseek_v3", "glm4_moe", "glm4_moe_lite")
LAYERS = 2  # trunk depth: the head is layer 2, an index DeepSeek-V3's own sanitize does not drop (it drops 61)
COMMON = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
              num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
              num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=1.0, n_group=1, topk_group=1,
              norm_topk_prob=True, first_k_dense_replace=1, rms_norm_eps=1e-6, rope_theta=10000.0,
              max_position_embeddings=512, rope_scaling=None, attention_bias=False, tie_word_embeddings=False,
              topk_method="noaux_tc", scoring_func="sigmoid", num_nextn_predict_layers=1)
MLA = dict(kv_lora_rank=64, qk_rope_head_dim=8, qk_nope_head_dim=64, v_head_dim=16, moe_layer_freq=1)
EXTRA = {
    "deepseek_v3": dict(MLA, q_lora_rank=64),
    "glm4_moe": dict(head_dim=16, use_qk_norm=True, partial_rotary_factor=0.5),
    "glm4_moe_lite": dict(MLA, q_lora_rank=None, partial_rotary_factor=1.0),
}
LAYER_NAMES = {  # canonical head root -> its name under the next-n layer
    "pre_fc_norm_embedding.": "enorm.", "pre_fc_norm_hidden.": "hnorm.", "fc.": "eh_proj.",
    "norm.": "shared_head.norm.", "layers.0.": "",
}


def config_for(kind: str) -> dict:
    """config.json of a tiny ``kind`` model whose checkpoint carries one next-n layer."""
    return dict(model_type=kind, **COMMON, **EXTRA[kind])


def layer_names(head: dict, trunk: dict, n: int = LAYERS) -> dict:
    """Canonical head weights under ``model.layers.{n}.`` as the original checkpoints name them, with the copies of
    the trunk's embedding and lm_head that DeepSeek-V3 stores there."""
    out = {}
    for name, value in head.items():
        root = next(r for r in LAYER_NAMES if name.startswith(r))
        out[f"model.layers.{n}.{LAYER_NAMES[root]}{name[len(root):]}"] = value
    out[f"model.layers.{n}.embed_tokens.weight"] = trunk["model.embed_tokens.weight"]
    out[f"model.layers.{n}.shared_head.head.weight"] = trunk["lm_head.weight"]
    return out


def to_hf_layout(weights: dict, config: dict) -> dict:
    """mlx-lm layout -> Hugging Face layout: ``switch_mlp`` unstacked into ``experts.{e}``, MLA's ``embed_q`` and
    ``unembed_out`` joined back into ``kv_b_proj`` (the inverse of mlx-lm's ``sanitize``)."""
    out = {}
    for name, value in weights.items():
        if ".switch_mlp." in name:
            prefix, rest = name.split(".switch_mlp.")
            for e in range(value.shape[0]):
                out[f"{prefix}.experts.{e}.{rest}"] = value[e]
        elif name.endswith("self_attn.embed_q.weight"):
            prefix = name[: -len("embed_q.weight")]
            wk = value.swapaxes(-1, -2)  # (heads, nope, lora)
            wv = weights[prefix + "unembed_out.weight"]  # (heads, v, lora)
            out[prefix + "kv_b_proj.weight"] = mx.concatenate([wk, wv], axis=1).reshape(-1, wk.shape[-1])
        elif not name.endswith("self_attn.unembed_out.weight"):
            out[name] = value
    return out


def build(kind: str, seed: int = 0):
    """``(config, trunk weights, head weights)``: mlx-lm layout, canonical head names, float32."""
    config = config_for(kind)
    model = build_model(config, seed=seed)
    return config, trunk_weights(model), build_head(model, config)


def save_mlx(path: Path, kind: str, form: str, seed: int = 0) -> tuple[Path, Path, dict]:
    """``(head-less twin, checkpoint with the head, head weights)`` of an MLX conversion; ``form`` ``layer``: the
    head as layer ``num_hidden_layers`` in the trunk's shard; ``sidecar``: canonical names in ``mtp.safetensors``."""
    config, trunk, head = build(kind, seed)
    plain = save_checkpoint(path / "plain", config, trunk)
    if form == "layer":
        with_head = save_checkpoint(path / "head", config, {**trunk, **layer_names(head, trunk)})
    else:
        with_head = save_checkpoint(path / "head", config, trunk, head, "mtp.safetensors", "mtp.")
    return plain, with_head, head


def save_hf(path: Path, kind: str, seed: int = 0) -> tuple[Path, dict]:
    """``(directory, head weights)``: a Hugging Face layout checkpoint, the head as layer ``num_hidden_layers``."""
    config, trunk, head = build(kind, seed)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    weights = to_hf_layout({**trunk, **layer_names(head, trunk)}, config)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    return path, head


def distilled(kind: str, steps: int = 200, seed: int = 0) -> tuple[dict, dict, dict]:
    """``(config, trunk weights, head weights)`` of a vocabulary-256, dense ``kind`` model whose head is trained to
    draft what its trunk decodes (self-distillation): from the pair (h[t], x[t+1]) of random token windows, the trunk's
    own greedy token after x[t+1], by cross-entropy through the trunk's frozen ``lm_head`` (Adam, ``steps`` batches
    of 8 × 32 pairs). The trunk is random with its attention and MLP outputs scaled by 0.2, so that what it decodes
    depends mostly on the newest tokens and a one-layer head can learn it; such a head reaches an acceptance near
    0.6, where a random one stays near 0: it measures acceptance on a family without a trained tiny checkpoint."""
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten

    from mtp_plugin.decoding.trunk import trunk_parts
    from mtp_plugin.plugins import hook

    config = {**config_for(kind), "vocab_size": 256, "first_k_dense_replace": LAYERS + 1}  # dense MLPs: mlx-lm
    # 0.31's MoE router has no gradient (its expert indices lack ``stop_gradient``)
    model = build_model(config, seed=seed)
    model.load_weights([(k, v * 0.2) for k, v in tree_flatten(model.parameters())
                        if "o_proj" in k or "down_proj" in k], strict=False)
    head = hook().mtp_build_head(model=model, config=config)
    text, _ = trunk_parts(model)
    optimizer = optim.Adam(learning_rate=3e-3)

    def loss(head, hidden, following, target):
        return nn.losses.cross_entropy(model.lm_head(head(hidden, text.embed_tokens(following))), target).mean()

    value_and_grad = nn.value_and_grad(head, loss)
    for _ in range(steps):
        tokens = mx.random.randint(0, config["vocab_size"], (8, 33))
        hidden = mx.stop_gradient(text(tokens))
        target = mx.argmax(model.lm_head(hidden), axis=-1)  # the trunk's greedy token after each position
        _, grads = value_and_grad(head, hidden[:, :-1], tokens[:, 1:], target[:, 1:])
        optimizer.update(head, grads)
        mx.eval(head.parameters(), optimizer.state)
    return config, trunk_weights(model), dict(tree_flatten(head.parameters()))
