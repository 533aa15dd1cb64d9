"""Settle, per tensor, the convention of head norms whose files leave it open, on a prompt's own tokens.

Which norms: those ``conventions.decide_norm`` left provisional (an MLX-written sidecar without
``mtp_norm_convention`` whose entries are all positive). Until settled they are read as stored (absolute).

When: at the first prompt with at least ``MIN_POSITIONS`` scored positions. ``Drafter.prefill`` hands ``on_prompt``
the pairs (h[t], x[t+1]) of a prompt's first chunk before feeding them to the head: single-stream decoding (mlx-lm,
mlx-vlm) and each row of the mlx-lm server's batched prompt pass. The trunk's hidden states are the prompt pass's
own, so settling runs no trunk pass. A shorter prompt leaves the norms open for a later one. It runs once per loaded
head, in the prompt phase (its host syncs are there, none in the per-token loop), and never changes output: every
draft is still verified by the trunk. A head whose files decide every norm pays one attribute lookup per prompt.

Evidence: for each of the prompt's first ``MAX_POSITIONS`` positions t the head drafts x[t+2] from (h[t], x[t+1]);
a reading scores, at t, the log-likelihood the head gives the prompt's own token x[t+2]. That is the head's training
objective (MTP heads are trained by cross-entropy on the data's token t+2: DeepSeek-V3 technical report §2.2,
Qwen3-Next, the bundled tiny checkpoint's ``build_tiny_checkpoint.py``), so the reading a head was trained under
scores best in expectation. It needs no lm_head pass of the trunk over the prompt (the trunk's argmax would), and it
is graded where agreement is 0 or 1 per position, so fewer positions decide.

Search, per tensor (best improvement): first every norm's other reading at once (a head written one way
throughout), then rounds in which each norm's other reading is scored alone, the others held, and the flip that
gains most is taken if a paired test over positions calls it better: mean gain at least ``GAIN`` nats per position
and at least ``Z`` standard errors. Rounds end when no flip passes (the mean score rises with every flip taken, so
the search ends). With k open norms that is k + 2 head passes when the readings as stored hold, k - 1 more per flip;
an exhaustive search would cost 2^k (128 for a Qwen3.5 head's seven norms) and test as many hypotheses. Two
readings that predict alike (q_norm / k_norm of a small head: their scale only sharpens attention) stay as read:
on the bundled checkpoint such flips gain under 0.02 nats per position, a wrong reading loses ≥ 0.1 at z ≥ 3.
"""

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
    """Both readings of a norm weight (H,) as stored, ``{convention: weight the head loads}`` (zero-centred: 1 + w,
    computed in float32, stored dtype kept)."""
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
    """Best-improvement search of norm readings, per tensor (see the module docstring).

    Args:
        head: the head module; its norms named in ``candidates`` are loaded with the chosen readings on return.
        candidates: per norm (canonical name), its weight under each convention (``readings``); not empty.
        start: the convention each norm starts from.
        score: per-position scores (N,) float32 of the head as currently loaded (higher is better).

    Returns:
        the chosen convention per norm, and per norm the test of its other reading against the final choice.
    """
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
    """``score`` for ``search``: per position, the head's log-likelihood of the prompt's own token x[t+2].

    Args:
        head: the head module.
        trunk: the trunk's functions (``decoding.Trunk``).
        hidden: (1, P, H) trunk hidden states h[0..P-1] of the prompt's first P tokens, in the contract's variant.
        tokens: (P,) tokens x[1..P], the second member of each pair.
        cache: the head's empty trimmable KV cache (left empty).
        limit: most positions scored (the first ones).

    Returns:
        a function of no arguments returning (N,) float32 log-likelihoods (nats), N = min(P - 1, limit).
    """
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
    """A loaded head's norms whose files leave their convention open, until ``on_prompt`` settles them.

    Args:
        loaded: the ``loader.LoadedHead``; its open norms (``NormDecision.settled`` False) are loaded as stored.
    """

    def __init__(self, loaded):
        self.loaded = loaded
        self.names = sorted(n for n, d in loaded.norms.items() if not d.settled)
        self.lock = threading.Lock()

    def settle(self, score: Callable[[], mx.array], positions: int) -> None:
        """Search the open norms' readings with ``score`` (``prompt_score`` over ``positions`` positions), load the
        chosen ones and record each norm's reading and evidence, settled, on the loaded head (``LoadedHead.norms``).
        """
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
    """Keep ``loaded``'s open norms on its head module (``module.open_norms``) for the first prompt with enough
    evidence to settle them (``on_prompt``); None when its files decide every norm."""
    pending = OpenNorms(loaded)
    loaded.module.open_norms = pending if pending.names else None


def on_prompt(head, trunk, hidden: mx.array, tokens: mx.array, cache) -> None:
    """Settle ``head``'s open norms (``attach``) on the first pairs of a prompt, when it has open norms, the head's
    cache is empty and the pairs carry at least ``MIN_POSITIONS`` scored positions; else nothing.

    Args:
        head: the head module.
        trunk: the trunk's functions (``decoding.Trunk``).
        hidden: (1, P, H) trunk hidden states of the prompt's tokens 0..P-1 (the contract's variant).
        tokens: (P,) the prompt's tokens 1..P (pair i is (h[i], x[i+1])).
        cache: the head's KV cache, empty (left empty).
    """
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
