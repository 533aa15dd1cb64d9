"""A runtime's generation batch over the engine's ``decoding.continuous.BatchLoop``: the interface the runtime's
generator calls (``uids``, ``prompt_cache``, ``extend``, ``filter``, ``next``), and after a fault of the plugin's the
runtime's own batch of the same rows, to which every call goes from then on (the generator holding this object never
sees the change). Design: docs/development.md#the-engines-shape."""

from __future__ import annotations

import logging

from mtp_plugin.decoding.continuous import BatchLoop
from mtp_plugin.decoding.lockstep import LockstepError

log = logging.getLogger("mtp_plugin")


def context_of(batch):
    """The ``BatchingState`` of a batch's model (``BatchingModel.mtp_batching``; None: stock batching, also after a
    fault)."""
    ctx = getattr(batch.model, "mtp_batching", None)
    return None if ctx is None or ctx.failed else ctx


class LoopBatch:
    """``model``: the runtime's model as the generator sees it (a ``BatchingModel``); ``loop``: the rows decoding with
    MTP; ``stock``: the runtime's own batch once a fault handed the rows to it (``loop`` None then). A runtime's
    subclass gives ``_resume()`` (its rows as stock decoding resumes them, read before a call changes anything) and
    ``_stock(rows)`` (its own batch decoding them), and may emit tokens before each pass (``_before``)."""

    def __init__(self, model, loop: BatchLoop):
        self.model, self.loop, self.stock = model, loop, None

    def __len__(self) -> int:
        return len(self.stock if self.stock is not None else self.loop)

    @property
    def uids(self) -> list[int]:
        return self.stock.uids if self.stock is not None else [row.uid for row in self.loop.rows]

    @property
    def prompt_cache(self) -> list:
        return self.stock.prompt_cache if self.stock is not None else self.loop.cache

    def filter(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (finished, cancelled and removed rows leave)."""
        if self.stock is not None:
            self.stock.filter(keep)
            return
        log.debug("mtp_plugin: MTP batch of %d rows, %d leave", len(self.loop), len(self.loop) - len(keep))
        self.loop.filter(keep)

    def extend(self, batch) -> None:
        """Append another batch's rows (rows joining between passes); a fault hands every row to stock decoding."""
        mtp = isinstance(batch, LoopBatch) and batch.stock is None
        if self.stock is None and (context_of(self) is None or not mtp):  # batched MTP failed meanwhile
            self._fall_back(self._resume())
        if self.stock is not None:
            if isinstance(batch, LoopBatch):
                if batch.stock is None:
                    batch._fall_back(batch._resume())
                batch = batch.stock
            self.stock.extend(batch)  # stock's own
            return
        rows = self._resume() + batch._resume()
        try:
            self.loop.extend(batch.loop)
        except Exception as error:
            self._fall_back(rows, error)

    def next(self) -> list:
        """What ``_before`` emits, then one pass of every row (``BatchLoop.step``): the runtime's responses. A fault of
        the plugin's hands the rows to stock decoding; ranks of a sharded model that have drifted apart raise
        ``lockstep.LockstepError`` instead (on every rank)."""
        if self.stock is not None:
            return self.stock.next()
        if not len(self.loop):
            return []
        rows = self._resume()
        if context_of(self) is None:  # batched MTP failed in another batch of this model
            self._fall_back(rows)
            return self.next()
        try:
            return self._before() + self.loop.step()
        except LockstepError:  # the ranks have drifted apart: stock decoding of their rows would not match either
            raise
        except Exception as error:
            self._fall_back(rows, error)
            return self.next()

    def _before(self) -> list:
        """Responses to emit before the pass (none)."""
        return []

    def _resume(self) -> list:
        raise NotImplementedError

    def _stock(self, rows: list):
        raise NotImplementedError

    def _fall_back(self, rows: list, error: Exception | None = None) -> None:
        """Decode ``rows`` with the runtime's own batch from now on; ``error`` stops batched MTP for the model."""
        if error is not None:
            self.model.mtp_batching.fail(error)
        self.stock, self.loop = self._stock(rows), None
