"""Lockstep decoding across the ranks of a model mlx-lm has sharded (``model.shard(group)``, tensor parallel;
``model.model.pipeline(group)``, pipeline parallel): ranks agree on each cycle's shape (``Lockstep.agree``) and share
the random state (``Lockstep.share_seed``) so their collectives match. Design: docs/distributed.md."""

from __future__ import annotations

import logging
import zlib

import mlx.core as mx
import mlx.nn as nn

log = logging.getLogger("mtp_plugin")

SHARDED_LINEARS = tuple(getattr(nn, name) for name in (
    "AllToShardedLinear", "ShardedToAllLinear", "QuantizedAllToShardedLinear", "QuantizedShardedToAllLinear")
    if hasattr(nn, name))
NONE = -1  # an agreed value meaning "none" (the generation ends; no depth asked)


class LockstepError(RuntimeError):
    """The ranks of a sharded model disagree about decoding state (raised on every rank at the same cycle)."""


def group_of(model) -> mx.distributed.Group | None:
    """The group ``model``'s trunk is sharded over (tensor parallel: its first sharded linear layer's; pipeline:
    the global group, LockstepError if the sizes differ), or None on one process."""
    outer = getattr(model, "language_model", model)
    stack = getattr(outer, "model", None)
    size = getattr(stack, "pipeline_size", 1)
    if size > 1:
        group = mx.distributed.init()
        if group.size() != size:
            raise LockstepError(f"the model is pipelined over {size} ranks but the global group has "
                                f"{group.size()}: MTP decoding needs the pipeline over the global group")
        return group
    for _, module in model.named_modules():
        if isinstance(module, SHARDED_LINEARS) and module.group.size() > 1:
            return module.group
    return None


def sharded_rows(module) -> mx.distributed.Group | None:
    """The group over which ``module`` (an output projection) holds a slice of the rows (mlx-lm ≥ 0.32.1 shards
    an untied ``lm_head`` this way), or None when it holds them all."""
    if isinstance(module, SHARDED_LINEARS) and "AllToSharded" in type(module).__name__ and module.group.size() > 1:
        return module.group
    return None


def gather_rows(logits: mx.array, group: mx.distributed.Group) -> mx.array:
    """Logits (…, V) from each rank's slice (…, V / N) of a row-sharded projection, in rank order (as mlx-lm's
    ``models.base.gather_last_axis``)."""
    n, size = group.size(), logits.shape[-1]
    parts = mx.distributed.all_gather(logits.reshape(-1, size), group=group)
    return parts.reshape(n, -1, size).transpose(1, 0, 2).reshape(*logits.shape[:-1], n * size)


class Lockstep:
    """Shared decisions for the ranks of one sharded model; ``group``: ``group_of``'s, size > 1."""

    def __init__(self, group: mx.distributed.Group):
        self.group, self.rank, self.size = group, group.rank(), group.size()

    def table(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (int32, same count on all), row r rank r's: one ``all_gather`` (current stream)."""
        local = mx.array(values, dtype=mx.int32)
        return mx.distributed.all_gather(local[None], group=self.group).tolist()

    def check(self, table: list[list[int]], columns: dict[str, int]) -> None:
        """Raise ``LockstepError`` on every rank, naming each rank's value, when a named column differs."""
        for name, column in columns.items():
            values = [row[column] for row in table]
            if len(set(values)) > 1:
                raise LockstepError(
                    f"mtp_plugin: the {self.size} ranks of the sharded model disagree on {name} "
                    f"(rank by rank: {values}), so their next trunk passes would not match; the generation stops "
                    "here on every rank. Every rank must get the same prompt and options (a sampling seed set on "
                    "one rank only does not cause this: the seed is shared).")

    def agree(self, decision: int, state: dict[str, int]) -> int:
        """Rank 0's ``decision`` (a draft depth, 0: a plain step, or ``NONE``) once every rank reports the same
        ``state`` (same names in the same order); else ``LockstepError`` on every rank."""
        table = self.table([decision, *state.values()])
        self.check(table, {name: column for column, name in enumerate(state, start=1)})
        return table[0][0]

    def share_seed(self) -> None:
        """Seed every rank from rank 0's random key (as mlx-lm's server does): later draws agree everywhere."""
        key = mx.random.state[0]
        mine = key if self.rank == 0 else mx.zeros_like(key)
        mx.random.seed(mx.distributed.all_sum(mine, group=self.group).view(mx.uint64).item())

    def start(self, loaded, mtp: bool, state: dict[str, int]) -> bool:
        """Agree, once per generation before anything is queued, on MTP decoding (True only when every rank's
        ``mtp`` is) and the draft vocabulary: ``loaded.draft_vocab`` is dropped on every rank, with one warning, unless
        every rank holds the same one. ``state``: integers every rank must report equal (else ``LockstepError``)."""
        vocab = loaded.draft_vocab
        signature = [0, 0] if vocab is None else [vocab.size, zlib.crc32(bytes(memoryview(vocab.ids))) & 0x7FFFFFFF]
        table = self.table([int(mtp), *signature, *state.values()])
        self.check(table, {name: column for column, name in enumerate(state, start=3)})
        if vocab is not None and len({tuple(row[1:3]) for row in table}) > 1:
            loaded.draft_vocab = None
            log.warning("mtp_plugin: the ranks of the sharded model hold different draft vocabularies (tuned on one "
                        "machine only?); every rank drafts over the full vocabulary")
        return all(row[0] for row in table)
