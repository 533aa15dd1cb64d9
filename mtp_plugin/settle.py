"""Settle the norm convention of head norms whose files carry no evidence, by the head's own predictions.

Only when ``conventions.decide_norm`` left a decision provisional (an MLX-written sidecar without
``mtp_norm_convention`` whose norms are all positive). One trunk pass over ``TOKENS`` pseudo-random token
ids (a fixed key: the same every load) and two head passes: for each position t the head drafts token
t+2 from (h[t], x[t+1]) and the draft counts when it equals the trunk's own argmax at t+1 (as
``mtp-plugin verify`` measures it, on a few dozen tokens). The zero-centred reading replaces the stored
one only when it agrees with the trunk clearly more often (``MARGIN``): two readings that predict
alike are equally good, and reading as stored is then kept. Pseudo-random tokens are out of the
trunk's distribution, so only a reading that breaks the head outright is overturned (on the bundled
tiny checkpoint the two readings of rescaled pre-fc norms differ by 0.04 on text and by noise on
random tokens, and the stored reading stays).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
from mlx.utils import tree_flatten

from .conventions import ZERO_CENTRED
from .plugins import hook

TOKENS = 64
MARGIN = 0.1  # acceptance on TOKENS positions; a wrong norm reading costs a trained head far more


def settle_norms(model) -> None:
    """Settle ``model.mtp_head``'s provisional norm decisions in place (weights and ``norms``).

    Args:
        model: a runtime model whose ``mtp_head`` (``loader.LoadedHead``) was just loaded.
    """
    loaded = model.mtp_head
    names = sorted(n for n, d in loaded.norms.items() if not d.settled)
    if not names:
        return
    head = loaded.module
    trunk = hook().mtp_trunk(model=model, contract=head.contract)
    stored = {k: v for k, v in tree_flatten(head.parameters()) if k in names}
    tokens = mx.random.randint(0, _vocab(trunk), (1, TOKENS), key=mx.random.key(0))
    hidden = trunk.hidden(tokens, None)
    target = mx.argmax(trunk.trunk_logits(hidden), axis=-1)[0, 1:]
    embeddings = trunk.embed(tokens[:, 1:])

    def agreement() -> float:
        _, head_cache = hook().mtp_new_caches(model=model)  # the runtime's attention wants a cache for positions
        draft = mx.argmax(trunk.logits(head(hidden[:, :-1], embeddings, cache=head_cache)), axis=-1)[0]
        return (draft == target).mean().item()

    as_stored = agreement()
    head.load_weights([(k, (v.astype(mx.float32) + 1.0).astype(v.dtype)) for k, v in stored.items()], strict=False)
    zero_centred = agreement()
    keep_zero = zero_centred > as_stored + MARGIN
    if not keep_zero:
        head.load_weights(list(stored.items()), strict=False)
    mx.eval(head.parameters())
    evidence = (f"settled by the head's own predictions on {TOKENS} tokens: {as_stored:.2f} of its drafts "
                f"agree with the trunk read as stored, {zero_centred:.2f} read zero-centred")
    for name in names:
        decision = loaded.norms[name]
        convention = ZERO_CENTRED if keep_zero else decision.convention
        loaded.norms[name] = dataclasses.replace(decision, convention=convention, evidence=evidence, settled=True)


def _vocab(trunk) -> int:
    """Rows of the trunk's logits: its vocabulary size."""
    return trunk.trunk_logits(trunk.embed(mx.zeros((1, 1), dtype=mx.int32))).shape[-1]
