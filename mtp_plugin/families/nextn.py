"""DeepSeek-V3-style next-n heads (DeepSeek-V3, GLM-4.5 / 4.6 / 4.7 MoE, GLM-4.7-Flash): one extra decoder layer,
``model.layers.{num_hidden_layers}.``; only the first next-n layer is used. Layout (DeepSeek-V3 ``inference/model.py``,
vLLM ``deepseek_mtp.py``, ``glm4_moe_mtp.py``) and name mapping: docs/plugins.md#built-in-families.
"""

from __future__ import annotations

from ..decoding.trunk import trunk_parts
from ..head.conventions import ABSOLUTE
from ..head.model import NORM_ROLES, MTPHead
from ..hookspecs import hookimpl
from ..loading.checkpoint import CheckpointError
from ..loading.fit import text_config
from ..plugins import hook
from . import for_model_types

MODEL_TYPES = ("deepseek_v3", "glm4_moe", "glm4_moe_lite")
LAYER_PREFIXES = ("model.layers.{n}.", "language_model.model.layers.{n}.", "model.language_model.layers.{n}.")
OWN_PREFIXES = ("mtp.", "model.mtp.", "language_model.mtp.")  # sidecars the plugin (and others) write
ROOTS = {  # head-layer name root -> canonical root
    "enorm.": "pre_fc_norm_embedding.",
    "hnorm.": "pre_fc_norm_hidden.",
    "eh_proj.": "fc.",
    "shared_head.norm.": "norm.",
    "shared_head.head.": "shared_head.head.",
    "embed_tokens.": "embed_tokens.",
    "self_attn.": "layers.0.self_attn.",
    "mlp.": "layers.0.mlp.",
    "input_layernorm.": "layers.0.input_layernorm.",
    "post_attention_layernorm.": "layers.0.post_attention_layernorm.",
}
CANONICAL_ROOTS = ("fc.", "pre_fc_norm_embedding.", "pre_fc_norm_hidden.", "layers.0.", "norm.")
COPIES = ("shared_head.head.", "embed_tokens.")  # trunk tensors the layout duplicates: claimed, then dropped


@hookimpl
def mtp_model_types():
    """The next-n model types mlx-lm implements."""
    return list(MODEL_TYPES)


def _canonical(rest: str) -> str | None:
    return next((ROOTS[root] + rest[len(root):] for root in ROOTS if rest.startswith(root)), None)


@hookimpl
@for_model_types(MODEL_TYPES)
def mtp_head_name(name, model_type, sidecar, config):
    """``model.layers.{N}.…`` (N from ``config``; VLM prefix forms too), canonical names under ``mtp.``, and
    bare names (either form) inside a sidecar."""
    if config is not None:
        n = text_config(config).get("num_hidden_layers")
        for form in LAYER_PREFIXES:
            prefix = form.format(n=n)
            if name.startswith(prefix):
                return _canonical(name[len(prefix):])
    for prefix in OWN_PREFIXES:
        if name.startswith(prefix) and name[len(prefix):].startswith(CANONICAL_ROOTS):
            return name[len(prefix):]
    if sidecar:
        return name if name.startswith(CANONICAL_ROOTS) else _canonical(name)
    return None


def _runtime_sanitize(model_type: str, config: dict, layer: dict) -> dict:
    """``layer`` (names under ``layers.0.``) in the runtime's layout (``mtp_layer_sanitize``); ``CheckpointError``
    naming a missing tensor, or when no runtime has ``model_type``."""
    try:
        out = hook().mtp_layer_sanitize(model_type=model_type, config=config,
                                        weights={"model." + k: v for k, v in layer.items()})
    except KeyError as e:  # the runtime pops every expert of a layer that has one
        missing = str(e.args[0])[len("model."):] if e.args else "a tensor"
        raise CheckpointError(f"head incomplete: {missing} is missing (the runtime's {model_type} layout needs "
                              "every expert of the layer); restore it from the original checkpoint") from None
    if out is None:
        raise CheckpointError(f"no installed runtime implements {model_type!r}, whose head layer needs its "
                              "runtime's layout; install mlx-lm")
    return {k[len("model."):]: v for k, v in out.items()}


@hookimpl
@for_model_types(MODEL_TYPES)
def mtp_sanitize_head(weights, config):
    """Drop the duplicated trunk tensors; put the layer in mlx-lm's layout with mlx-lm's own ``sanitize``."""
    model_type = config.get("model_type")
    kept = {k: v for k, v in weights.items() if not k.startswith(COPIES)}
    layer = {k: v for k, v in kept.items() if k.startswith("layers.0.")}
    if not any(".experts." in k or ".kv_b_proj." in k or k.endswith("_scale_inv") for k in layer):
        return kept  # already in the built layout
    rest = {k: v for k, v in kept.items() if k not in layer}
    return {**rest, **_runtime_sanitize(model_type, config, layer)}


@hookimpl
@for_model_types(MODEL_TYPES)
def mtp_build_head(model, config):
    """An MTPHead whose layer is a fresh decoder layer of the trunk's own class at index ``num_hidden_layers`` (so
    MoE or dense as DeepSeek-V3's ``first_k_dense_replace`` / ``moe_layer_freq`` rules place it)."""
    if not hasattr(getattr(model, "model", None), "layers"):
        return None
    text_model, args = trunk_parts(model)
    layer = type(text_model.layers[0])(args, args.num_hidden_layers)
    return MTPHead(args.hidden_size, args.rms_norm_eps, layer, array_mask=hasattr(layer.self_attn, "embed_q"))


def _attention_norms(text: dict) -> list[str]:
    if "kv_lora_rank" in text:  # MLA
        query = ["self_attn.q_a_layernorm.weight"] if text.get("q_lora_rank") else []
        return [*query, "self_attn.kv_a_layernorm.weight"]
    return ["self_attn.q_norm.weight", "self_attn.k_norm.weight"] if text.get("use_qk_norm") else []


@hookimpl
@for_model_types(MODEL_TYPES)
def mtp_norm_roles(config):
    """enorm sees raw embeddings as the first layer's input norm does; hnorm and shared_head.norm play the final
    norm's role; the layer's own norms those of every trunk layer."""
    return NORM_ROLES | {f"layers.0.{n}": n for n in _attention_norms(text_config(config))}


@hookimpl
@for_model_types(MODEL_TYPES)
def mtp_stored_norm_convention(config, shapes, pytorch):
    """Absolute in every layout (DeepSeek-V3's reference modelling code and mlx-lm's use the weights as stored)."""
    return ABSOLUTE, "a DeepSeek-V3-style checkpoint (absolute RMSNorm scales in every layout)"
