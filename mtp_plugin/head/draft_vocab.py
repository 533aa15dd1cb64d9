"""Reduced-vocabulary drafting (FR-Spec: Zhao et al., ACL 2025): the head's draft logits over a frequency-ranked
subset S of the vocabulary, from an exact copy of those rows of the trunk's output projection. Kept in the tuning
record or ``mtp_draft_vocab.json``; ``MTP_PLUGIN_FULL_VOCAB=1`` turns it off. Design: docs/decoding.md#draft-vocabulary.
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
    """The subset S a head drafts from: ``ids`` (k,) uint32, ascending, unique, each below ``vocab_size`` (V, the
    trunk's logit width); ``logits``: head output (…, H) → draft logits (…, k) over S; ``source``: for messages."""

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
        """Distribution over S (B, k) as the proposal q over V (B, V), float32, zero outside S (exact sampling)."""
        full = mx.zeros((q.shape[0], self.vocab_size), dtype=mx.float32)
        return full.at[:, self.ids].add(q.astype(mx.float32))


def rank(counts: Counter, vocab_size: int, size: int) -> list[int]:
    """The ``size`` (1 ≤ k ≤ V) most frequent ids of ``counts`` (id → occurrences; ids outside 0..V-1 ignored),
    ascending; ties to the lower id, then the lowest unseen ids (BPE numbers frequent merges lower)."""
    seen = sorted((t for t in counts if 0 <= t < vocab_size), key=lambda t: (-counts[t], t))[:size]
    chosen = set(seen)
    fill = (t for t in range(vocab_size) if t not in chosen)
    chosen.update(next(fill) for _ in range(size - len(chosen)))
    return sorted(chosen)


def candidate_sizes(vocab_size: int) -> list[int]:
    """Subset sizes ``mtp-plugin tune`` measures: V/16, V/8, V/4 (FR-Spec's range), rounded up to a multiple of 64."""
    return sorted({min(vocab_size, -(-vocab_size // n // 64) * 64) for n in (16, 8, 4)})


def build(trunk, ids: Iterable[int], source: str) -> DraftVocabulary | None:
    """``DraftVocabulary`` of ``ids`` for a ``decoding.single.Trunk``; None when it has no ``logits_over`` (full
    vocabulary). ValueError, naming ``source``: ids empty, repeated, not integers, or outside 0..V-1."""
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
    """(ids, where) from the tuning record (None ids: full vocabulary) or ``mtp_draft_vocab.json``; None if neither."""
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
    """Set ``loaded.draft_vocab`` to the recorded subset unless ``MTP_PLUGIN_FULL_VOCAB`` is set. Never raises: an
    unusable subset is one warning naming its file, and the head drafts over the full vocabulary."""
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
    """Write ``model_dir/mtp_draft_vocab.json`` atomically (``{"token_ids": ids or null, "results": …}``); returns
    its path. OSError when the directory is not writable."""
    path = Path(model_dir) / FILE_NAME
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps({"token_ids": ids, "results": results})))
    return path
