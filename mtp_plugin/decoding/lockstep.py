"""Lockstep decoding across the ranks of a model that mlx-lm has sharded (``mlx.launch``: ``model.shard(group)``,
tensor parallel; ``model.model.pipeline(group)``, pipeline parallel).

Every rank runs the same MTP loop on its part of the trunk, and every trunk pass is a collective: the ranks must feed
passes of the same shape in the same order, or the collective waits forever. What a rank decides from its own clock
(the adaptive controller's depth) or its own random state (sampling) differs between ranks, so:

* each cycle's shape is agreed before the cycle is queued (``Lockstep.agree``): one ``all_gather`` of a few integers
  on the generation stream; rank 0's decision is taken by every rank, and the ranks' states (tokens emitted so far,
  whether the head drafts) are compared, so that ranks that have drifted apart raise ``LockstepError`` together
  instead of hanging in the next pass;
* the random state is shared once per generation (``Lockstep.share_seed``: rank 0's key), as mlx-lm's server shares
  it once per server, so that rejection sampling draws the same numbers everywhere.

The same approach as mlx-lm's own distributed server, which shares each request and its time budget through
``mx.distributed.all_sum`` (``mlx_lm/server.py``: ``_share_object``, ``TimeBudget``).
"""

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
    """The distributed group ``model``'s trunk is sharded over, or None for a model on one process.

    Tensor parallel: the group of its first sharded linear layer (mlx's ``AllToShardedLinear`` and kin, which
    ``mlx_lm.models``' ``shard`` methods install). Pipeline parallel (``PipelineMixin.pipeline``, which keeps
    the rank and size but not the group): the global group, which ``mlx_lm.utils.sharded_load`` and mlx-lm's
    server and chat pass it.

    Raises:
        LockstepError: a pipeline whose size is not the global group's (its group cannot be found).
    """
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
    ``models.base.gather_last_axis`` joins them)."""
    n, size = group.size(), logits.shape[-1]
    parts = mx.distributed.all_gather(logits.reshape(-1, size), group=group)
    return parts.reshape(n, -1, size).transpose(1, 0, 2).reshape(*logits.shape[:-1], n * size)


class Lockstep:
    """Shared decisions for the ranks of one sharded model (see the module docstring).

    Args:
        group: the ranks (``group_of``), size > 1.
    """

    def __init__(self, group: mx.distributed.Group):
        self.group, self.rank, self.size = group, group.rank(), group.size()

    def table(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (int32; the same count on every rank), row r being rank r's: one ``all_gather`` on
        the current stream (it waits for the work queued before it)."""
        local = mx.array(values, dtype=mx.int32)
        return mx.distributed.all_gather(local[None], group=self.group).tolist()

    def check(self, table: list[list[int]], columns: dict[str, int]) -> None:
        """Raise on every rank (all hold the same ``table``) when a named column differs between ranks.

        Raises:
            LockstepError: names the first differing value (``columns``: name → column) and each rank's.
        """
        for name, column in columns.items():
            values = [row[column] for row in table]
            if len(set(values)) > 1:
                raise LockstepError(
                    f"mtp_plugin: the {self.size} ranks of the sharded model disagree on {name} "
                    f"(rank by rank: {values}), so their next trunk passes would not match; the generation stops "
                    "here on every rank. Every rank must get the same prompt and options (a sampling seed set on "
                    "one rank only does not cause this: the seed is shared).")

    def agree(self, decision: int, state: dict[str, int]) -> int:
        """Rank 0's ``decision``, after checking that every rank reports the same ``state``: one ``table``.

        Args:
            decision: this rank's choice (a draft depth, 0 for a plain step, ``NONE``).
            state: named integers that must be equal on every rank (same names, same order on every rank).

        Raises:
            LockstepError: on every rank, when a state value differs between ranks (``check``).
        """
        table = self.table([decision, *state.values()])
        self.check(table, {name: column for column, name in enumerate(state, start=1)})
        return table[0][0]

    def share_seed(self) -> None:
        """Seed every rank's random state from rank 0's key (``mx.random.state``: two uint32 read as one uint64, as
        mlx-lm's server reads the sum of its ranks' keys): the next draws are the same everywhere."""
        key = mx.random.state[0]
        mine = key if self.rank == 0 else mx.zeros_like(key)
        mx.random.seed(mx.distributed.all_sum(mine, group=self.group).view(mx.uint64).item())

    def start(self, loaded, mtp: bool, state: dict[str, int]) -> bool:
        """Agree, once per generation and before anything is queued, on whether it decodes with MTP and with which
        draft vocabulary. A rank may decide otherwise from files of its own machine (a tuning record in its user
        cache, ``MTP_PLUGIN_FULL_VOCAB``), and ranks that decode differently issue different collectives.

        Args:
            loaded: the model's ``loader.LoadedHead``; its ``draft_vocab`` is dropped, on every rank and with one
                warning, unless every rank holds the same one.
            mtp: whether this rank chose MTP decoding (True: it has its options).
            state: named integers that must be equal on every rank (the prompt's length, whether it samples).

        Returns:
            True when every rank chose MTP; False: every rank decodes stock.

        Raises:
            LockstepError: on every rank, when a state value differs (``check``).
        """
        vocab = loaded.draft_vocab
        signature = [0, 0] if vocab is None else [vocab.size, zlib.crc32(bytes(memoryview(vocab.ids))) & 0x7FFFFFFF]
        table = self.table([int(mtp), *signature, *state.values()])
        self.check(table, {name: column for column, name in enumerate(state, start=3)})
        if vocab is not None and len({tuple(row[1:3]) for row in table}) > 1:
            loaded.draft_vocab = None
            log.warning("mtp_plugin: the ranks of the sharded model hold different draft vocabularies (tuned on one "
                        "machine only?); every rank drafts over the full vocabulary")
        return all(row[0] for row in table)
