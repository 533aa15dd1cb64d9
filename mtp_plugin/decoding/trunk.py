"""The decoding loop's view of a runtime's decoder-stack trunk (hidden states, embeddings, logits), and the built-in
plugin that serves it, with the MTP decoding loop, to every family whose trunk is a decoder stack."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from ..hookspecs import hookimpl
from .lockstep import Lockstep, gather_rows, group_of, sharded_rows


def trunk_parts(model):
    """``(text_model, args)``: the decoder stack (``embed_tokens``, ``layers``, ``norm``), nested as
    ``language_model.model`` (mlx-vlm, mlx-lm Qwen3.5) or ``model`` (mlx-lm Qwen3-Next, DeepSeek-V3, GLM-4 MoE)."""
    outer = getattr(model, "language_model", model)
    return outer.model, getattr(outer, "args", None) or model.args


def multimodal(model) -> bool:
    """Whether ``model``'s decoder stack takes multimodal rotary ``position_ids`` (mlx-vlm's Qwen3.5)."""
    return "position_ids" in inspect.signature(trunk_parts(model)[0].__call__).parameters


@dataclass(frozen=True)
class PromptInputs:
    """The prompt pass as the runtime runs it (mlx-vlm: after ``model.get_input_embeddings``): ``embeddings`` (1, T, H)
    of the T prompt tokens, media merged in; ``run(tokens (1, S), cache, keywords) -> (1, S, H)``, the runtime's
    language-model pass (post-norm hidden states, the runtime's positions); ``keywords`` for every prompt pass
    (mlx-vlm: ``position_ids`` (3, 1, T'), ``rope_deltas``, ...), none for later passes."""

    embeddings: mx.array
    run: Callable[[mx.array, list, dict], mx.array]
    keywords: dict = field(default_factory=dict)

    def pass_keywords(self, start: int, stop: int) -> dict:
        """Keywords of the pass feeding prompt tokens ``start .. stop-1``, their embeddings included."""
        return {**self.keywords, "inputs_embeds": self.embeddings[:, start:stop]}

    def head_positions(self, start: int, length: int) -> mx.array | None:
        """Multimodal rotary positions (3, 1, length), int32, of the head's pairs ``start .. start+length-1``: the
        prompt's own, then one past their maximum (Qwen2-VL ``get_rope_index``); None without 3-axis positions."""
        positions = self.keywords.get("position_ids")
        if positions is None or positions.ndim != 3:
            return None
        prompt = positions[..., -self.embeddings.shape[1]:].astype(mx.int32)  # longer with a cached prefix's
        inside = prompt[..., start : start + length]
        beyond = length - inside.shape[-1]
        if beyond <= 0:
            return inside
        first = prompt.max() + 1 + max(start - prompt.shape[-1], 0)
        after = mx.broadcast_to(mx.arange(beyond, dtype=mx.int32) + first, (3, 1, beyond))
        return mx.concatenate([inside, after], axis=-1) if inside.shape[-1] else after


class StackTrunk:
    """``single.Trunk`` over a runtime's decoder-stack model. ``hidden`` returns the stack's output after its final
    norm (``contract.hidden`` ``post_norm``) or before it (``pre_norm``: the norm is swapped out during the call, so no
    other thread may use the model meanwhile). With ``prompt`` (its first ``hidden`` calls being the prompt's tokens,
    in order) each pass is the runtime's own call; without, a stack taking ``position_ids`` gets ``text_positions``."""

    def __init__(self, model, contract, prompt: PromptInputs | None = None):
        self.text_model, _ = trunk_parts(model)
        self.lm_head = getattr(getattr(model, "language_model", model), "lm_head", None)
        self.vocab_group = sharded_rows(self.lm_head)  # tensor parallel: this rank holds a slice of the rows
        self.pre_norm = contract.hidden == "pre_norm"
        self.mrope = multimodal(model)
        self.prompt, self.prompt_done = prompt, 0

    def hidden(self, tokens, cache):
        """(1, S, H) hidden states of tokens (1, S) in the contract's variant, advancing cache."""
        if not self.pre_norm:
            return self._run(tokens, cache)
        norm = self.text_model.norm
        self.text_model.norm = nn.Identity()
        try:
            return self._run(tokens, cache)
        finally:
            self.text_model.norm = norm

    def _run(self, tokens, cache):
        if self.prompt is not None:
            keywords = {}
            if self.prompt_done < self.prompt.embeddings.shape[1]:
                start, self.prompt_done = self.prompt_done, self.prompt_done + tokens.shape[1]
                keywords = self.prompt.pass_keywords(start, self.prompt_done)
            return self.prompt.run(tokens, cache, keywords)
        if self.mrope:
            return self.text_model(tokens, cache=cache, position_ids=self.text_positions(cache, tokens.shape[1]))
        return self.text_model(tokens, cache=cache)

    def text_positions(self, cache, length):
        """mRoPE position ids (3, 1, S), int32, of the next S text tokens: the first full-attention layer's cache offset
        (0 without a cache) + arange(S) on every axis, as mlx-vlm's for text."""
        layers = [layer for layer in self.text_model.layers if layer is not None]  # a pipeline stage's own
        offset = 0 if cache is None else next(c.offset for layer, c in zip(layers, cache, strict=True)
                                              if not getattr(layer, "is_linear", False))
        return mx.broadcast_to(mx.arange(offset, offset + length, dtype=mx.int32), (3, 1, length))

    def embed(self, tokens):
        """(…, H) input embeddings."""
        return self.text_model.embed_tokens(tokens)

    def head_inputs(self, tokens, start: int):
        """Embeddings (1, S, H) (the prompt pass's own for prompt tokens) and positions (3, 1, S) or None of the head's
        pairs (h[start+i], x[start+i+1]), i < S, for tokens x (S,) counted from the prompt's first token."""
        if self.prompt is None:
            return self.embed(tokens[None]), None
        prompt = self.prompt.embeddings
        inside = prompt[:, start + 1 : start + 1 + tokens.size]
        rest = tokens[inside.shape[1]:]
        embeddings = inside if not rest.size else (
            mx.concatenate([inside, self.embed(rest[None])], axis=1) if inside.shape[1] else self.embed(rest[None]))
        return embeddings, self.prompt.head_positions(start, tokens.size)

    def logits(self, hidden):
        """(…, V) logits through the lm_head or the tied embedding; a tensor-parallel lm_head's slices gathered."""
        if self.lm_head is None:
            return self.text_model.embed_tokens.as_linear(hidden)
        logits = self.lm_head(hidden)
        return logits if self.vocab_group is None else gather_rows(logits, self.vocab_group)

    def _projection(self):
        return self.text_model.embed_tokens if self.lm_head is None else self.lm_head

    def vocab_size(self) -> int:
        """V, the width of the logits (rows of the output projection, times its shard count)."""
        rows = self._projection().weight.shape[0]
        return rows if self.vocab_group is None else rows * self.vocab_group.size()

    def logits_over(self, ids):
        """``hidden (…, H) -> logits (…, k)`` over token ``ids`` (k,): a copy of those output-projection rows (quantized
        stays quantized), equal to the full logits up to summation order; ValueError if sharded over ranks."""
        if self.vocab_group is not None:
            raise ValueError("a draft vocabulary needs the whole lm_head; this rank holds a slice of it")
        source = self._projection()
        rows = copy.copy(source)
        rows.update(tree_map(lambda a: a[ids], source.parameters()))
        mx.eval(rows.parameters())
        return rows if self.lm_head is not None else rows.as_linear

    def trunk_logits(self, hidden):
        """(…, V) trunk logits of ``hidden``, the final norm applied first under ``pre_norm``."""
        return self.logits(self.text_model.norm(hidden) if self.pre_norm else hidden)


class LogitsTrunk:
    """The trunk of a model decoded without a head (lookup drafts only): each pass is the model's own call, whose
    logits (1, S, V) stand in for hidden states, so verified positions get exactly the plain loop's logits."""

    def __init__(self, model):
        self.model = model

    def hidden(self, tokens, cache):
        """The logits (1, S, V) of tokens (1, S), advancing cache."""
        return self.model(tokens, cache=cache)

    def trunk_logits(self, hidden):
        return hidden


def _loaded(model, drafting: bool = False):
    """``model``'s ``loading.loader.LoadedHead`` or None; with ``drafting``, None too once it is parked."""
    loaded = getattr(model, "mtp_head", None)
    return None if loaded is None or (drafting and loaded.health.parked) else loaded


@hookimpl(trylast=True)
def mtp_trunk(model, contract):
    """A ``StackTrunk`` for any model with a loaded head (families whose trunk is no decoder stack answer first)."""
    return StackTrunk(model, contract) if _loaded(model) is not None else None


@hookimpl(trylast=True)
def mtp_generate_step(prompt, model, options):
    """``single.generate`` over a ``StackTrunk`` for a model with a head that drafts, or over a ``LogitsTrunk``
    with lookup drafts only when ``options`` carry a ``lookup`` policy and no ``prompt_inputs``; else None (stock)."""

    from . import single

    loaded = _loaded(model, drafting=True)
    if loaded is None:
        if options.get("lookup") is None or "prompt_inputs" in options:
            return None
        options = {**options, "head_cache": None}
        return single.generate(prompt, LogitsTrunk(model), None, **options)
    head, options = loaded.module, dict(options)
    trunk = StackTrunk(model, head.contract, options.pop("prompt_inputs", None))
    group = group_of(model)
    return single.generate(prompt, trunk, head, health=loaded.health, draft_vocab=loaded.draft_vocab,
                             lockstep=None if group is None else Lockstep(group), **options)
