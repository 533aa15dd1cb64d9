"""Reduced-vocabulary drafting: the head's draft logits over a frequency-ranked subset S of the vocabulary.

FR-Spec (Zhao et al., "FR-Spec: Accelerating Large-Vocabulary Language Models via Frequency-Ranked Speculative
Sampling", ACL 2025): a draft step's output projection reads |S| rows instead of V (for Qwen3.6 27B, 248,320 rows
of 5,120, heavier than the MTP layer itself). The rows are an exact copy of the trunk's output projection (its
``lm_head`` or tied embedding, quantized rows stay quantized); draft indices map back to full-vocabulary ids.
The trunk still verifies over the full vocabulary, so greedy output is unchanged, and sampling stays exact: the
proposal q is the subset's distribution scattered into V (zero outside S), and the acceptance test and the
residual distribution use that same q (``decoding.accept_sampled``), so a token outside S is reached through the
residual only.

S is built by ``mtp-plugin tune`` (``rank``: the model's own greedy output on the prompt suite, plus a user's text
file) and kept with the tuning record, or with ``--write`` beside the model as ``mtp_draft_vocab.json`` (JSON, not
safetensors: runtimes glob a model directory's ``*.safetensors`` as weights). Loading picks it up with no flag
(``attach``); ``MTP_PLUGIN_FULL_VOCAB=1`` turns it off.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from .. import tuning
from ..files import atomic_write

FILE_NAME = "mtp_draft_vocab.json"
OFF_ENV = "MTP_PLUGIN_FULL_VOCAB"
log = logging.getLogger("mtp_plugin")


@dataclass(frozen=True)
class DraftVocabulary:
    """The subset S a head drafts from.

    Attributes:
        ids: (k,) uint32 token ids of S, ascending, unique, each below ``vocab_size``.
        logits: head output (…, H) → draft logits (…, k) over S (the output projection's rows ``ids``).
        vocab_size: V, the width of the trunk's logits.
        source: where S came from (the user cache or the model's file), for messages.
    """

    ids: mx.array
    logits: Callable[[mx.array], mx.array]
    vocab_size: int
    source: str

    @property
    def size(self) -> int:
        """k = |S|."""
        return self.ids.size

    def tokens(self, index: mx.array) -> mx.array:
        """Full-vocabulary ids (…,) of subset indices (…,) (positions in ``ids``)."""
        return self.ids[index]

    def spread(self, q: mx.array) -> mx.array:
        """A distribution over S, (B, k), as one over the whole vocabulary, (B, V), float32, zero outside S."""
        full = mx.zeros((q.shape[0], self.vocab_size), dtype=mx.float32)
        return full.at[:, self.ids].add(q.astype(mx.float32))


def rank(counts: Counter, vocab_size: int, size: int) -> list[int]:
    """The ``size`` most frequent token ids, ascending: by count (ties: the lower id), then, past the tokens seen, the
    lowest unseen ids (byte-pair vocabularies number earlier, more frequent merges lower).

    Args:
        counts: token id → occurrences (ids outside 0..vocab_size-1 are ignored).
        vocab_size: V.
        size: k, 1 ≤ k ≤ V.
    """
    seen = sorted((t for t in counts if 0 <= t < vocab_size), key=lambda t: (-counts[t], t))[:size]
    chosen = set(seen)
    fill = (t for t in range(vocab_size) if t not in chosen)
    chosen.update(next(fill) for _ in range(size - len(chosen)))
    return sorted(chosen)


def candidate_sizes(vocab_size: int) -> list[int]:
    """Subset sizes ``mtp-plugin tune`` measures: V/16, V/8 and V/4 (FR-Spec found 1/8 to 1/4 of Llama-3's and
    Qwen2's vocabularies best), rounded up to a multiple of 64."""
    return sorted({min(vocab_size, -(-vocab_size // n // 64) * 64) for n in (16, 8, 4)})


def build(trunk, ids: Iterable[int], source: str) -> DraftVocabulary | None:
    """The ``DraftVocabulary`` of token ``ids`` for a trunk (``decoding.Trunk``) that can project onto a subset of
    its rows (``logits_over``); None for one that cannot (a family's own trunk without it: full-vocabulary drafts).

    Raises:
        ValueError: ids empty, repeated, not integers, or outside 0..V-1 (the message names ``source``).
    """
    if not hasattr(trunk, "logits_over"):
        return None
    vocab_size = trunk.vocab_size()
    ids = list(ids)
    if not ids or any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in ids):
        raise ValueError(f"{source}: token_ids must be a non-empty list of integers 0..{vocab_size - 1}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{source}: token_ids repeats a token")
    array = mx.array(sorted(ids), dtype=mx.uint32)
    logits = trunk.logits_over(array)
    return DraftVocabulary(array, logits, vocab_size, source)


def _stored(model_dir: Path) -> tuple[list[int] | None, str] | None:
    """(ids, where) of the subset recorded for ``model_dir``: the user cache's record for this model, machine and
    versions when it has one (``tuning.recorded``; None ids: full vocabulary chosen), else the model's
    ``mtp_draft_vocab.json``; None when neither says anything.

    Raises:
        ValueError, OSError: the model's file cannot be read or parsed (the message names it).
    """
    record = tuning.recorded(model_dir)
    if record is not None and "draft_vocab" in record:
        return record["draft_vocab"], f"{tuning.cache_file()} (tuning record)"
    path = Path(model_dir) / FILE_NAME
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict) or "token_ids" not in data:
        raise ValueError(f"{path}: expected an object with token_ids")
    return data["token_ids"], str(path)


def attach(model, loaded) -> None:
    """Give a just-loaded head (``loader.LoadedHead``) its tuned subset (``loaded.draft_vocab``), if one is recorded
    and ``MTP_PLUGIN_FULL_VOCAB`` is not set. Never raises: a subset that cannot be used is reported once as a
    warning naming its file and the fix, and the head drafts over the full vocabulary."""
    loaded.draft_vocab = None
    if os.environ.get(OFF_ENV, "") not in ("", "0"):
        return
    from ..plugins import hook

    model_dir = loaded.location.model_dir
    try:
        stored = _stored(model_dir)
        if stored is None or stored[0] is None:
            return
        ids, source = stored
        if not isinstance(ids, list):
            raise ValueError(f"{source}: token_ids must be a list of integers")
        trunk = hook().mtp_trunk(model=model, contract=loaded.module.contract)
        loaded.draft_vocab = build(trunk, ids, source)
    except (OSError, ValueError) as e:
        log.warning("mtp_plugin: draft vocabulary ignored, drafting over the full vocabulary: %s; run `mtp-plugin "
                    "tune %s` again (or delete that file)", e, model_dir)


def write(model_dir: Path, ids: list[int] | None, results: dict) -> Path:
    """Write ``model_dir/mtp_draft_vocab.json`` atomically: ``{"token_ids": ids or null (full vocabulary), "results":
    …}``. Returns its path.

    Raises:
        OSError: the directory is not writable (``tune`` checks before measuring).
    """
    path = Path(model_dir) / FILE_NAME
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps({"token_ids": ids, "results": results})))
    return path
