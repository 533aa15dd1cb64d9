"""Qwen3.5 / 3.6 / 3.8 (dense and MoE) and Qwen3-Next: the one-layer MTP head under ``mtp.`` (layout: vLLM
``qwen3_next_mtp.py``, ``qwen3_5_mtp.py``; docs/plugins.md#built-in-families).
"""

from __future__ import annotations

import re

from ..decoding.trunk import trunk_parts
from ..head.conventions import ABSOLUTE, ZERO_CENTRED
from ..head.model import NORM_ROLES, MTPHead
from ..hookspecs import hookimpl
from . import for_model_types

MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
PREFIXES = ("language_model.model.mtp.", "model.language_model.mtp.", "language_model.mtp.", "model.mtp.", "mtp.")
BARE_ROOTS = ("fc.", "pre_fc_norm_embedding.", "pre_fc_norm_hidden.", "layers.", "norm.")
HF_STACK = "model.language_model."  # the original (Hugging Face) trunk prefix of Qwen3.5-family checkpoints
LINEAR_ATTENTION = {  # runtime -> model type -> (module under {runtime}.models, its GatedDeltaNet layer class)
    "mlx_lm": {t: ("qwen3_5", "GatedDeltaNet") for t in MODEL_TYPES if t != "qwen3_next"}
    | {"qwen3_next": ("qwen3_next", "Qwen3NextGatedDeltaNet")},
    "mlx_vlm": {t: ("qwen3_5.language", "Qwen3_5GatedDeltaNet") for t in MODEL_TYPES if t != "qwen3_next"}
    | {"qwen3_next": ("qwen3_next.language", "Qwen3NextGatedDeltaNet")},
}
_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@hookimpl
def mtp_model_types():
    """The Qwen3.5-family model types."""
    return list(MODEL_TYPES)


@hookimpl
def mtp_capture_points(runtime):
    """Every Qwen3.5-family trunk has GatedDeltaNet layers, whose recurrent state cannot be trimmed."""
    return [(t, module, layer) for t, (module, layer) in LINEAR_ATTENTION.get(runtime, {}).items()]


@hookimpl
@for_model_types(MODEL_TYPES)
def mtp_head_name(name, model_type, sidecar):
    """Strip any known head prefix; bare names only inside a sidecar."""
    for prefix in PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    if sidecar and name.startswith(BARE_ROOTS):
        return name
    return None


@hookimpl
@for_model_types(MODEL_TYPES)
def mtp_sanitize_head(weights, config):
    """Stack per-expert MoE tensors and split fused ``gate_up_proj`` into ``switch_mlp`` form."""
    import mlx.core as mx

    out, experts = {}, {}
    for name, value in weights.items():
        m = _EXPERT.match(name)
        if m:
            experts.setdefault((m[1], m[3]), {})[int(m[2])] = value
        elif name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name[: -len("experts.gate_up_proj")]
            mid = value.shape[-2] // 2
            out[prefix + "switch_mlp.gate_proj.weight"] = value[..., :mid, :]
            out[prefix + "switch_mlp.up_proj.weight"] = value[..., mid:, :]
        elif name.endswith(".mlp.experts.down_proj"):
            out[name[: -len("experts.down_proj")] + "switch_mlp.down_proj.weight"] = value
        else:
            out[name] = value
    for (layer, proj), by_index in experts.items():
        out[f"layers.{layer}.mlp.switch_mlp.{proj}.weight"] = mx.stack([by_index[e] for e in sorted(by_index)])
    return out


@hookimpl
@for_model_types(MODEL_TYPES)
def mtp_build_head(model, config):
    """An MTPHead around a fresh full-attention layer of the trunk's own class; None for a model that is not a
    runtime's Qwen3.5-family class (e.g. the caller's own, via mlx-lm's ``load_model(get_model_classes=…)``)."""
    outer = getattr(model, "language_model", model)
    if not hasattr(getattr(outer, "model", None), "layers"):
        return None
    text_model, args = trunk_parts(model)
    index = next(i for i, layer in enumerate(text_model.layers) if not layer.is_linear)
    layer = type(text_model.layers[index])(args, index)
    return MTPHead(args.hidden_size, args.rms_norm_eps, layer)



@hookimpl
@for_model_types(MODEL_TYPES)
def mtp_norm_roles(config):
    """The first layer's input norm also sees raw embeddings; the final norm feeds the head's hidden."""
    return NORM_ROLES | {"layers.0.self_attn.q_norm.weight": "self_attn.q_norm.weight",
                         "layers.0.self_attn.k_norm.weight": "self_attn.k_norm.weight"}


@hookimpl
@for_model_types(MODEL_TYPES)
def mtp_stored_norm_convention(config, shapes, pytorch):
    """The original (Hugging Face layout) checkpoint, written by PyTorch, with ``model.language_model.*`` names or
    conv1d weights (C, 1, K), keeps zero-centred norms (the runtime adds 1); an MLX conversion absolute ones."""
    if pytorch:
        return ZERO_CENTRED, "the original checkpoint"
    if any(n.startswith(HF_STACK) or (n.endswith("conv1d.weight") and shape[-1] != 1) for n, shape in shapes.items()):
        return ZERO_CENTRED, "an original (Hugging Face layout) checkpoint"
    return ABSOLUTE, "an MLX conversion"
