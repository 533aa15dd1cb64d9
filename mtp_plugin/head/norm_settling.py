"""Settle, per tensor, the convention of head norms that ``conventions.decide_norm`` left open, by the head's
log-likelihood of a prompt's own tokens x[t+2] (its training objective: DeepSeek-V3 technical report §2.2), from the
prompt pass's hidden states (``decoding.drafter.Drafter.prefill``): once per loaded head, in the prompt phase; it
changes acceptance only, never output. Design: docs/checkpoints.md#norm-conventions."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import mlx.core as mx
from mlx.utils import tree_flatten

from .conventions import ABSOLUTE, ZERO_CENTRED

MIN_POSITIONS = 64  # scored positions a prompt must carry to settle the head's open norms
MAX_POSITIONS = 256  # positions scored: each head pass of the search scores these (head + lm_head)
Z = 3.0  # standard errors of the mean gain a flip needs
GAIN = 0.1  # nats per position a flip needs


def other(convention: str) -> str:
    """The other reading of a norm weight."""
    return ABSOLUTE if convention == ZERO_CENTRED else ZERO_CENTRED


def readings(stored: mx.array) -> dict[str, mx.array]:
    """``{convention: weight the head loads}`` for a stored norm weight (H,); zero-centred: 1 + w in float32, stored
    dtype kept."""
    return {ABSOLUTE: stored, ZERO_CENTRED: (stored.astype(mx.float32) + 1.0).astype(stored.dtype)}


@dataclasses.dataclass(frozen=True)
class Test:
    """One paired comparison over positions: a reading against the chosen ones."""

    gain: float  # mean score gain per position (nats)
    z: float  # gain over its standard error

    @property
    def passes(self) -> bool:
        """Whether the reading is clearly better (``GAIN`` and ``Z``)."""
        return self.gain >= GAIN and self.z >= Z


def _tests(differences: list[mx.array]) -> list[Test]:
    """Mean and z of each per-position difference (N,) (one host sync for all)."""
    stats = []
    for d in differences:
        mean = d.mean()
        stats += [mean, mx.sqrt(mx.sum((d - mean) ** 2) / max(d.size - 1, 1) / d.size)]
    values = mx.stack(stats).tolist()
    return [Test(g, g / se if se > 0 else 0.0) for g, se in zip(values[::2], values[1::2], strict=True)]


def search(head, candidates: dict[str, dict[str, mx.array]], start: dict[str, str],
           score: Callable[[], mx.array]) -> tuple[dict[str, str], dict[str, Test]]:
    """Best-improvement search of norm readings, per tensor: every norm flipped at once, then one flip per round while
    the best passes ``Test.passes``; ``head`` holds the chosen readings on return. ``candidates``: per norm, its weight
    per convention (``readings``), not empty; ``score``: per-position scores (N,) float32 of the head as loaded (higher
    is better). Returns (convention per norm, per norm the test of its other reading against the final choice)."""
    def load(conventions: dict[str, str]) -> None:
        head.load_weights([(n, candidates[n][c]) for n, c in conventions.items()], strict=False)

    chosen = dict(start)
    load(chosen)
    base = score()
    if len(chosen) > 1:
        flipped = {n: other(c) for n, c in chosen.items()}
        load(flipped)
        trial = score()
        if _tests([trial - base])[0].passes:
            chosen, base = flipped, trial
        else:
            load(chosen)
    trials: dict[str, mx.array] = {}  # per norm: the scores with its other reading, the others as chosen
    while True:
        for name in sorted(set(chosen) - set(trials)):
            load({name: other(chosen[name])})
            trials[name] = score()
            load({name: chosen[name]})
        tests = dict(zip(trials, _tests([trials[n] - base for n in trials]), strict=True))
        best = max(tests, key=lambda n: tests[n].gain)
        if not tests[best].passes:
            return chosen, tests
        chosen[best] = other(chosen[best])
        load({best: chosen[best]})
        trials, base = {best: base}, trials[best]  # the way back is the previous choice


def prompt_score(head, trunk, hidden: mx.array, tokens: mx.array, cache, limit: int = MAX_POSITIONS):
    """``score`` for ``search``: per position t, the head's log-likelihood (nats) of the prompt's own token x[t+2],
    as (N,) float32, N = min(P - 1, ``limit``). ``hidden``: (1, P, H) trunk hidden states h[0..P-1] in the contract's
    variant; ``tokens``: (P,) x[1..P]; ``trunk``: ``decoding.single.Trunk``; ``cache``: the head's empty trimmable
    KV cache, left empty."""
    n = min(tokens.size - 1, limit)
    embeddings, positions = trunk.head_inputs(tokens[:n], 0)
    targets = tokens[1 : n + 1, None].astype(mx.int32)

    def score() -> mx.array:
        logits = trunk.logits(head(hidden[:, :n], embeddings, cache=cache, positions=positions)[0])
        logits = logits.astype(mx.float32)
        likelihood = mx.take_along_axis(logits, targets, axis=-1)[:, 0] - mx.logsumexp(logits, axis=-1)
        mx.eval(likelihood)
        cache.trim(n)
        return likelihood

    return score


class OpenNorms:
    """The open norms (``NormDecision.settled`` False, loaded as stored) of a ``loading.loader.LoadedHead``."""

    def __init__(self, loaded):
        self.loaded = loaded
        self.names = sorted(n for n, d in loaded.norms.items() if not d.settled)
        self.lock = threading.Lock()

    def settle(self, score: Callable[[], mx.array], positions: int) -> None:
        """Search the open norms' readings with ``score`` (``prompt_score`` over ``positions`` positions), load the
        chosen ones and record each reading and its evidence, settled, in ``LoadedHead.norms``."""
        head = self.loaded.module
        weights = dict(tree_flatten(head.parameters()))  # as loaded, in the head's dtype now (a caller may cast it)
        candidates = {n: readings(weights[n]) for n in self.names}
        start = {n: self.loaded.norms[n].convention for n in self.names}
        chosen, tests = search(head, candidates, start, score)
        mx.eval(head.parameters())
        for name in self.names:
            test, reading = tests[name], chosen[name]
            measured = (f"reading it {other(reading)} changes the head's log-likelihood of the first prompt's tokens "
                        f"by {test.gain:+.3f} nats per token (z = {test.z:+.1f}, {positions} positions)")
            close = "" if test.z <= -Z else f": too close to tell, kept {reading}"
            evidence = f"settled by the head's own predictions: {measured}{close}"
            self.loaded.norms[name] = dataclasses.replace(self.loaded.norms[name], convention=reading,
                                                          evidence=evidence, settled=True)


def attach(loaded) -> None:
    """Keep ``loaded``'s open norms on ``module.open_norms`` for ``on_prompt``; None when its files decide all."""
    pending = OpenNorms(loaded)
    loaded.module.open_norms = pending if pending.names else None


def on_prompt(head, trunk, hidden: mx.array, tokens: mx.array, cache) -> None:
    """Settle ``head``'s open norms (``attach``) when it has some, its cache is empty and the prompt's pairs carry at
    least ``MIN_POSITIONS`` scored positions; else nothing. ``hidden``: (1, P, H) trunk hidden states of tokens
    0..P-1 (the contract's variant); ``tokens``: (P,) tokens 1..P (pair i is (h[i], x[i+1])); ``cache`` left empty."""
    pending = getattr(head, "open_norms", None)
    if pending is None or cache.offset or tokens.size - 1 < MIN_POSITIONS:
        return
    if not pending.lock.acquire(blocking=False):  # another thread is settling it: that one decides
        return
    try:
        if head.open_norms is pending:
            pending.settle(prompt_score(head, trunk, hidden, tokens, cache), min(tokens.size - 1, MAX_POSITIONS))
            head.open_norms = None
    finally:
        pending.lock.release()
