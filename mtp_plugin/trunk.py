"""The decoding loop's view of a runtime's decoder-stack trunk (hidden states, embeddings, logits), and the built-in
plugin that serves it, with the MTP decoding loop, to every family whose trunk is a decoder stack."""

from __future__ import annotations

import inspect

import mlx.core as mx
import mlx.nn as nn

from .hookspecs import hookimpl


def trunk_parts(model):
    """``(text_model, args)``: the decoder stack (``embed_tokens``, ``layers``, ``norm``) and its args.

    Works for runtimes' decoder-stack classes, which nest the stack as ``language_model.model`` (mlx-vlm,
    mlx-lm Qwen3.5) or ``model`` (mlx-lm Qwen3-Next, DeepSeek-V3, GLM-4 MoE).
    """
    outer = getattr(model, "language_model", model)
    return outer.model, getattr(outer, "args", None) or model.args


class StackTrunk:
    """The trunk functions the decoding loop needs (``decoding.Trunk``), over a runtime's decoder-stack model
    (``trunk_parts``): Qwen3.5 / Qwen3-Next of mlx-lm and mlx-vlm, DeepSeek-V3, GLM-4 MoE.

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
                                              if not getattr(layer, "is_linear", False))
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


def _loaded(model, drafting: bool = False):
    """``model``'s loaded head (``loader.LoadedHead``), or None; with ``drafting``, None too once it is parked."""
    loaded = getattr(model, "mtp_head", None)
    return None if loaded is None or (drafting and loaded.health.parked) else loaded


@hookimpl(trylast=True)
def mtp_trunk(model, contract):
    """A ``StackTrunk`` for any model with a loaded head (a family whose trunk is no decoder stack answers first)."""
    return StackTrunk(model, contract) if _loaded(model) is not None else None


@hookimpl(trylast=True)
def mtp_generate_step(prompt, model, options):
    """``decoding.generate`` over a ``StackTrunk`` for any model with a head that drafts (a family with its own loop
    answers first); None (stock decoding) once the head is parked."""
    from . import decoding

    loaded = _loaded(model, drafting=True)
    if loaded is None:
        return None
    head = loaded.module
    return decoding.generate(prompt, StackTrunk(model, head.contract), head, health=loaded.health, **options)
