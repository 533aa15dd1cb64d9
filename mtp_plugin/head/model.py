"""The MTP head module: one decoder layer drafting token t+2 from the trunk's hidden state h[t]. Forward (Qwen3-Next /
Qwen3.5 wiring; vLLM ``qwen3_next_mtp.py``): out = norm(layers[0](fc(concat[pre_fc_norm_embedding(embed(x[t+1])),
pre_fc_norm_hidden(h[t])]))), the layer of the trunk's own class (``families/``); the trunk's ``lm_head`` gives logits.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .conventions import Contract

NORM_ROLES = {  # MTPHead's norms -> the trunk norms with the same role (``mtp_norm_roles``), for every family using it
    "pre_fc_norm_embedding.weight": "layers.0.input_layernorm.weight",  # sees raw embeddings, as layer 0's input norm
    "pre_fc_norm_hidden.weight": "norm.weight",  # the final norm's role
    "norm.weight": "norm.weight",
    "layers.0.input_layernorm.weight": "input_layernorm.weight",
    "layers.0.post_attention_layernorm.weight": "post_attention_layernorm.weight",
}


class MTPHead(nn.Module):
    """One-layer MTP head. ``layer``: a full-attention decoder layer ``layer(x, mask, cache) -> x`` of the trunk's
    class; ``eps``: the trunk's RMSNorm epsilon; ``array_mask``: the layer's attention takes only a boolean array
    mask (DeepSeek's MLA), not ``"causal"``."""

    def __init__(self, hidden_size: int, eps: float, layer: nn.Module, contract: Contract | None = None,
                 array_mask: bool = False):
        super().__init__()
        self.array_mask = array_mask
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden_size, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden_size, eps=eps)
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.layers = [layer]
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        self.contract = contract or Contract()

    def __call__(self, hidden: mx.array, embeddings: mx.array, cache=None, mask=None,
                 positions: mx.array | None = None) -> mx.array:
        """Head output before the lm_head, (B, T, H) in the weights' dtype. ``hidden``: h[t] (B, T, H) in the
        contract's variant; ``embeddings``: trunk embeddings of x[t+1] (B, T, H); ``cache``: the head's own KV cache
        (mlx-lm/mlx-vlm ``KVCache`` or batched) or None; ``mask``: a batched cache's ``make_mask``, None: causal;
        ``positions``: multimodal rotary positions (3, B, T), passed as ``position_ids`` (mlx-vlm's Qwen3.5 layers);
        None: the layer counts from its cache offset."""
        e = self.pre_fc_norm_embedding(embeddings)
        h = self.pre_fc_norm_hidden(hidden)
        pair = [e, h] if self.contract.concat_order == "embedding_first" else [h, e]
        x = self.fc(mx.concatenate(pair, axis=-1))
        if mask is None and x.shape[1] > 1:
            mask = self._causal(x.shape[1], cache) if self.array_mask else "causal"  # bottom-right aligned
        extra = {} if positions is None else {"position_ids": positions}
        return self.norm(self.layers[0](x, mask=mask, cache=cache, **extra))

    @staticmethod
    def _causal(length: int, cache) -> mx.array:
        """(T, offset+T) bool: query i (at position offset+i) sees keys 0..offset+i."""
        offset = 0 if cache is None else cache.offset
        return mx.arange(offset, offset + length)[:, None] >= mx.arange(offset + length)[None]
