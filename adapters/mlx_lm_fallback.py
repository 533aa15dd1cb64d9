"""mlx-lm adapter: stock decoding (mlx-lm's ``PromptProcessingBatch`` / ``GenerationBatch``) for the rows of a batch
whose MTP cycle failed, each row's trunk cache rebuilt from its tokens by a stock prompt pass of that row alone.
Design: docs/mlx-lm-server.md#no-request-takes-the-server-down."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass


@dataclass
class Resume:
    """One row of a batch as stock decoding resumes it.

    Attributes:
        tokens: the row's token list; its first ``length`` ids were in the trunk cache (the list may have grown since).
        last: the newest token, not yet fed.
        emitted: tokens already sent for the request (the last ``emitted`` of the context and ``last``).
    """

    uid: int
    tokens: list[int]
    length: int
    last: int
    emitted: int
    sampler: object
    processors: list
    stops: object
    max_tokens: int


def stock_batch(model, fallback_sampler, rows: list[Resume]):
    """mlx-lm's ``GenerationBatch`` decoding ``rows`` (batch order) from where they stood, its first step queued, caches
    rebuilt from their tokens, counters and stop matchers carried over. ``model``: the runtime's, not the wrapper."""
    generate = importlib.import_module("mlx_lm.generate")
    from mlx_lm.models.cache import make_prompt_cache

    batch = generate.GenerationBatch.empty(model, fallback_sampler)
    parameters = inspect.signature(generate.PromptProcessingBatch).parameters
    stops_name = "stop_sequences" if "stop_sequences" in parameters else "state_machines"  # mlx-lm 0.32 / 0.31
    for row in rows:  # one prompt pass per row: mlx-lm < 0.32 lets right padding into GatedDeltaNet state
        prompt = generate.PromptProcessingBatch(
            model, [row.uid], [make_prompt_cache(model)], samplers=[row.sampler], fallback_sampler=fallback_sampler,
            logits_processors=[row.processors], max_tokens=[row.max_tokens], **{stops_name: [row.stops]})
        batch.extend(prompt.generate([[*row.tokens[: row.length], row.last]]))
    for i, row in enumerate(rows):
        sequence = [*row.tokens[: row.length], row.last]
        batch._num_tokens[i] = row.emitted
        _replay_stops(batch, i, sequence[len(sequence) - row.emitted:])
    return batch


def _replay_stops(batch, i: int, emitted: list[int]) -> None:
    """Advance row i's stop matcher over the tokens it already emitted."""
    if hasattr(batch, "_matchers"):  # mlx-lm 0.32: ``StopSequences`` matchers
        for token in emitted:
            batch._matchers[i].advance(token)
        return
    state, machine = batch._matcher_states[i], batch.state_machines[i]  # mlx-lm 0.31
    for token in emitted:
        state = machine.match(state, token)[0]
    batch._matcher_states[i] = state
