"""mlx-lm adapter: stock decoding for the rows of a batch whose MTP cycle failed.

A fault in the plugin's batched path (``mlx_lm_batching.MTPGenerationBatch.next``) must cost no request: the
batch gives back its rows as they stood when the failing call began (``Resume``: each row's context, its newest
token and how many tokens it has emitted) and mlx-lm's own ``PromptProcessingBatch`` / ``GenerationBatch`` take
over. Each row's trunk cache is rebuilt from its tokens by a stock prompt pass of that row alone, so nothing a
half-run cycle left in the caches (a verify pass's extra tokens, a partial rollback) reaches the output, and
the result is what stock mlx-lm serves for a request whose prompt cache holds that context. The rows' stop
matchers replay the tokens already emitted, so stop sequences spanning the switch still end the row.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass


@dataclass
class Resume:
    """One row of a batch as stock decoding resumes it.

    Attributes:
        uid: the request's id in the ``BatchGenerator``.
        tokens: the row's token list, whose first ``length`` ids were in its trunk cache (prompt and emitted tokens
            before ``last``); the list may have grown since (read only on a fault, so taking a row costs O(1)).
        length: see ``tokens``.
        last: the newest token, not yet fed (the prompt's last token before the first step).
        emitted: tokens already sent for the request (the last ``emitted`` of the context and ``last``).
        sampler, processors, stops, max_tokens: the row's own, as mlx-lm gave them.
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
    """mlx-lm's ``GenerationBatch`` decoding ``rows`` from where they stood, its caches rebuilt from their tokens.

    Args:
        model: the runtime's model (not the MTP batching wrapper).
        fallback_sampler: the generator's sampler for rows without their own.
        rows: the rows, in batch order.

    Returns:
        The stock batch, its first step queued (mlx-lm's pipelining), counters and stop matchers carried over.
    """
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
