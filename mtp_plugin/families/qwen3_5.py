"""Qwen3.5 / 3.6 / 3.8 (dense and MoE) and Qwen3-Next: the one-layer MTP head.

Head layout (Hugging Face names under ``mtp.``; reference: vLLM ``model_executor/models/qwen3_next_mtp.py``
and ``qwen3_5_mtp.py``): ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``fc`` (2·hidden → hidden),
``layers.0`` (one full-attention decoder layer of the trunk's own class, dense MLP or MoE), ``norm``.
The trunk's ``lm_head`` (or tied embedding) turns the head's output into logits.
"""

from __future__ import annotations

import inspect
import re

import mlx.core as mx
import mlx.nn as nn

from .. import decoding
from ..head import MTPHead
from ..hookspecs import hookimpl

MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
PREFIXES = ("language_model.model.mtp.", "model.language_model.mtp.", "language_model.mtp.", "model.mtp.", "mtp.")
BARE_ROOTS = ("fc.", "pre_fc_norm_embedding.", "pre_fc_norm_hidden.", "layers.", "norm.")
SIDECAR_NAMES = ("mtp.safetensors", "mtp/weights.safetensors", "model-mtp.safetensors")
CONFIG_KEYS = ("mtp_sidecar", "mtp_file", "mtp_weights")
_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@hookimpl
def mtp_model_types():
    """The Qwen3.5-family model types."""
    return list(MODEL_TYPES)


@hookimpl
def mtp_head_name(name, model_type, sidecar):
    """Strip any known head prefix; bare names only inside a sidecar."""
    if model_type not in MODEL_TYPES:
        return None
    for prefix in PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    if sidecar and name.startswith(BARE_ROOTS):
        return name
    return None


@hookimpl
def mtp_sidecar_paths(model_dir, config):
    """The sidecar file names seen in the wild, plus a file named by config.json."""
    if config.get("model_type") not in MODEL_TYPES:
        return []
    paths = [model_dir / n for n in SIDECAR_NAMES]
    for cfg in (config, config.get("text_config") or {}):
        paths += [model_dir / cfg[k] for k in CONFIG_KEYS if isinstance(cfg.get(k), str)]
    return paths


@hookimpl
def mtp_sanitize_head(weights, config):
    """Stack per-expert MoE tensors and split fused ``gate_up_proj`` into ``switch_mlp`` form."""
    if config.get("model_type") not in MODEL_TYPES:
        return None
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


def trunk_parts(model):
    """``(text_model, args)``: the decoder stack (``embed_tokens``, ``layers``, ``norm``) and its args.

    Works for mlx-lm and mlx-vlm Qwen3.5/Qwen3-Next classes: both nest the stack as
    ``language_model.model`` (Qwen3.5) or ``model`` (mlx-lm Qwen3-Next).
    """
    outer = getattr(model, "language_model", model)
    return outer.model, getattr(outer, "args", None) or model.args


@hookimpl
def mtp_build_head(model, config):
    """An MTPHead whose decoder layer is a fresh full-attention layer of the trunk's own class; None for a
    model that is not a runtime's Qwen3.5-family class (e.g. mlx-lm's ``load_model(get_model_classes=…)``
    building the caller's own class): it is left as built."""
    outer = getattr(model, "language_model", model)
    if config.get("model_type") not in MODEL_TYPES or not hasattr(getattr(outer, "model", None), "layers"):
        return None
    text_model, args = trunk_parts(model)
    index = next(i for i, layer in enumerate(text_model.layers) if not layer.is_linear)
    layer = type(text_model.layers[index])(args, index)
    return MTPHead(args.hidden_size, args.rms_norm_eps, layer)



@hookimpl
def mtp_norm_roles(config):
    """The first layer's input norm also sees raw embeddings; the final norm feeds the head's hidden."""
    if config.get("model_type") not in MODEL_TYPES:
        return None
    return {
        "pre_fc_norm_embedding.weight": "layers.0.input_layernorm.weight",
        "pre_fc_norm_hidden.weight": "norm.weight",
        "norm.weight": "norm.weight",
        "layers.0.input_layernorm.weight": "input_layernorm.weight",
        "layers.0.post_attention_layernorm.weight": "post_attention_layernorm.weight",
        "layers.0.self_attn.q_norm.weight": "self_attn.q_norm.weight",
        "layers.0.self_attn.k_norm.weight": "self_attn.k_norm.weight",
    }


@hookimpl
def mtp_required_tensors(config):
    """Norms, fc and attention; the MLP is checked by loading (dense, per-expert or stacked forms)."""
    if config.get("model_type") not in MODEL_TYPES:
        return None
    attention = [f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"]
    return ["fc.weight", "norm.weight", *mtp_norm_roles(config), *attention]


@hookimpl
def mtp_head_in_features(config):
    """Input widths from the text config (dense MLP, routed experts, shared expert and router)."""
    if config.get("model_type") not in MODEL_TYPES:
        return None
    text = config.get("text_config") or config
    hidden = text["hidden_size"]
    heads, head_dim = text["num_attention_heads"], text.get("head_dim") or hidden // text["num_attention_heads"]
    attention = {f"layers.0.self_attn.{p}_proj": hidden for p in "qkv"}
    mlp = {f"layers.0.mlp.{p}": hidden for p in ("gate_proj", "up_proj", "switch_mlp.gate_proj",
                                                   "switch_mlp.up_proj", "shared_expert.gate_proj",
                                                   "shared_expert.up_proj", "gate", "shared_expert_gate")}
    return {
        "fc": 2 * hidden,
        **attention,
        "layers.0.self_attn.o_proj": heads * head_dim,
        **mlp,
        "layers.0.mlp.down_proj": text.get("intermediate_size", 0),
        "layers.0.mlp.switch_mlp.down_proj": text.get("moe_intermediate_size", 0),
        "layers.0.mlp.shared_expert.down_proj": text.get("shared_expert_intermediate_size", 0),
    }


class QwenTrunk:
    """The trunk functions the decoding loop needs, over an mlx-lm or mlx-vlm Qwen3.5 / Qwen3-Next model.

    ``hidden`` returns the decoder stack's output after its final norm (contract ``post_norm``), or
    before it (``pre_norm``: the final norm is bypassed for the call, so the model must not be used
    by another thread meanwhile). A decoder stack whose call takes ``position_ids`` (mlx-vlm's
    Qwen3.5, multimodal RoPE) is given the positions of text tokens explicitly: every one of the three
    mRoPE axes carries the absolute position (cache offset + i), which is what mlx-vlm's language
    model computes for text-only input (rope delta 0; Qwen2-VL's ``get_rope_index``).
    """

    def __init__(self, model, contract):
        self.text_model, _ = trunk_parts(model)
        self.lm_head = getattr(getattr(model, "language_model", model), "lm_head", None)
        self.pre_norm = contract.hidden == "pre_norm"
        self.mrope = "position_ids" in inspect.signature(self.text_model.__call__).parameters

    def hidden(self, tokens, cache):
        """(1, S, H) hidden states of tokens (1, S) in the contract's variant, advancing cache."""
        kwargs = {"position_ids": self.text_positions(cache, tokens.shape[1])} if self.mrope else {}
        if not self.pre_norm:
            return self.text_model(tokens, cache=cache, **kwargs)
        norm = self.text_model.norm
        self.text_model.norm = nn.Identity()
        try:
            return self.text_model(tokens, cache=cache, **kwargs)
        finally:
            self.text_model.norm = norm

    def text_positions(self, cache, length):
        """mRoPE position ids (3, 1, S), int32, of the next S text tokens: offset of the first
        full-attention layer's KV cache (0 without a cache) + arange(S) on every axis."""
        offset = 0 if cache is None else next(c.offset for layer, c in zip(self.text_model.layers, cache, strict=True)
                                              if not layer.is_linear)
        return mx.broadcast_to(mx.arange(offset, offset + length, dtype=mx.int32), (3, 1, length))

    def embed(self, tokens):
        """(…, H) input embeddings."""
        return self.text_model.embed_tokens(tokens)

    def logits(self, hidden):
        """(…, V) logits through the lm_head, or the tied embedding."""
        if self.lm_head is None:
            return self.text_model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def trunk_logits(self, hidden):
        """(…, V) trunk logits of ``hidden`` output: the final norm first when it was bypassed (``pre_norm``)."""
        return self.logits(self.text_model.norm(hidden) if self.pre_norm else hidden)


def _handled(model, drafting: bool = False) -> bool:
    """A Qwen3.5-family model with a loaded head (``drafting``: one that is not parked, see ``health.py``)."""
    loaded = getattr(model, "mtp_head", None)
    ok = loaded is not None and loaded.location.model_type in MODEL_TYPES
    return ok and not (drafting and loaded.health.parked)


@hookimpl
def mtp_trunk(model, contract):
    """A ``QwenTrunk`` for a Qwen3.5-family model with a loaded head."""
    return QwenTrunk(model, contract) if _handled(model) else None


@hookimpl
def mtp_generate_step(prompt, model, options):
    """The MTP decoding loop for a Qwen3.5-family model with a loaded head (None, i.e. stock, once it is parked)."""
    if not _handled(model, drafting=True):
        return None
    head = model.mtp_head.module
    return decoding.generate(prompt, QwenTrunk(model, head.contract), head, health=model.mtp_head.health, **options)
