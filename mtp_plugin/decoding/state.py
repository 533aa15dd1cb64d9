"""What the engine keeps for one runtime model across generations and batches: one ``ModelState`` on the model
(``mtp_state``), made on first use. Design: docs/development.md#the-engines-shape."""

from __future__ import annotations

from dataclasses import dataclass

from .lookup import new_prior
from .options import MTPOptions
from .scheduler import Scheduler, static_slope
from .single import DEFAULT_DEPTH, MAX_DEPTH
from .stats import MTPStats


@dataclass
class ModelState:
    """``head``: the ``loading.loader.LoadedHead`` it serves (None: a model without a head; a head attached anew
    gets a new state); ``scheduler``: the model's ``scheduler.Scheduler`` (costs, depth controllers, lookup prior);
    ``batching``: a runtime adapter's ``batching.BatchingState``, kept across its batch generators (None: none yet; a
    failed one stays, so that every later batch decodes stock); ``lookup_stats``: a model without a head, the
    counters of its latest generation that drafted from the context (with a head: ``LoadedHead.stats``); ``serving``:
    the options of the server command line serving the model (None: not served; its requests carry their own);
    ``owner``: the runtime model this one is part of, where a server said so (mlx-vlm: a language model's full
    model)."""

    head: object
    scheduler: Scheduler
    batching: object | None = None
    lookup_stats: MTPStats | None = None
    serving: MTPOptions | None = None
    owner: object = None


def state_of(model, loaded) -> ModelState:
    """The state of ``model`` (the trunk's runtime model) with head ``loaded`` (None: none), made on first use and
    whenever another head was attached since: its verify costs' prior from the model's weights
    (``scheduler.static_slope``), its depth controllers starting at the depth tuned for the head's checkpoint."""
    state = getattr(model, "mtp_state", None)
    if state is None or state.head is not loaded:
        model_dir = None if loaded is None else loaded.location.model_dir
        scheduler = Scheduler(static_slope(model), new_prior(), model_dir, DEFAULT_DEPTH, MAX_DEPTH)
        state = model.mtp_state = ModelState(loaded, scheduler)
    return state
