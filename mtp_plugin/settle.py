"""Settle, per tensor, the convention of head norms whose files leave it open, on a prompt's own tokens.

Which norms: those ``conventions.decide_norm`` left provisional (an MLX-written sidecar without
``mtp_norm_convention`` whose entries are all positive). Until settled they are read as stored (absolute).

When: at the first prompt that carries enough evidence. ``Drafter.prefill`` hands ``on_prompt`` the pairs
(h[t], x[t+1]) of a prompt's first chunk before feeding them to the head: single-stream decoding (mlx-lm, mlx-vlm)
and each row of the mlx-lm server's batched prompt pass. The trunk's hidden states are the prompt pass's own, so
settling runs no trunk pass. A prompt with fewer than ``MIN_POSITIONS`` scored positions leaves the norms open for a
later, longer one. It runs once per loaded head, in the prompt phase (its host syncs are there, none in the
per-token loop), and never changes output: every draft is still verified by the trunk.

Evidence: for each of the prompt's first ``MAX_POSITIONS`` positions t the head drafts x[t+2] from (h[t], x[t+1]);
a reading scores, at t, the log-likelihood the head gives the prompt's own token x[t+2]. That is the head's training
objective (MTP heads are trained by cross-entropy on the data's token t+2: DeepSeek-V3 technical report §2.2,
Qwen3-Next, the bundled tiny checkpoint's ``build_tiny_checkpoint.py``), so the reading a head was trained under
scores best in expectation. It needs no lm_head pass of the trunk over the prompt (the trunk's argmax would), and it
is graded where agreement is 0 or 1 per position, so fewer positions decide.

Search, per tensor (best improvement): from the current readings, each round scores every open norm's other
reading alone, the others held, and takes the flip with the strongest evidence if a paired test over positions
calls it better: mean gain at least ``GAIN`` nats per position and at least ``Z`` standard errors. Rounds end when
no flip passes (the mean score rises with every flip, so the search ends). With k open norms that is k + 1 head
passes over the positions when the stored readings hold and k more per flip; an exhaustive search would cost 2^k
(128 for a Qwen3.5 head's seven norms) and test as many hypotheses. Two readings that predict alike (q_norm /
k_norm of a small head: their scale only sharpens attention) stay as they are: the thresholds were set on the
bundled checkpoint, where such flips reach z ≈ 4 on some texts with tiny gains and a wrong reading loses ≥ 0.3
nats per position at z ≥ 6.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable

import mlx.core as mx
from mlx.utils import tree_flatten

from .conventions import ABSOLUTE, ZERO_CENTRED

MIN_POSITIONS = 64  # scored positions a prompt must carry to settle the head's open norms
MAX_POSITIONS = 256  # positions scored: the cost is (k + 1 + k·flips) head and lm_head passes over them
Z = 3.0  # standard errors of the mean gain a flip needs (and of the loss that settles a reading)
GAIN = 0.1  # nats per position a flip needs
SETTLE_POSITIONS = 1024  # positions scored, over prompts, after which a norm still undecided keeps its reading


def other(convention: str) -> str:
    """The other reading of a norm weight."""
    return ABSOLUTE if convention == ZERO_CENTRED else ZERO_CENTRED


def readings(stored: mx.array) -> dict[str, mx.array]:
    """Both readings of a norm weight as stored, ``{convention: weight the head loads}`` (zero-centred: 1 + w,
    computed in float32, stored dtype kept)."""
    return {ABSOLUTE: stored, ZERO_CENTRED: (stored.astype(mx.float32) + 1.0).astype(stored.dtype)}


@dataclasses.dataclass(frozen=True)
class Test:
    """One paired comparison: a norm's other reading against the current ones, over positions."""

    gain: float  # mean score gain per position (nats)
    z: float  # gain over its standard error


def _tests(differences: list[mx.array]) -> list[Test]:
    """Mean and z of each per-position difference (N,) (one host sync for all)."""
    stats = []
    for d in differences:
        mean = d.mean()
        stats += [mean, mx.sqrt(mx.sum((d - mean) ** 2) / max(d.size - 1, 1)) / d.size**0.5]
    values = mx.stack(stats).tolist() if stats else []
    return [Test(g, g / se if se > 0 else (0.0 if g == 0 else float("inf") * g))
            for g, se in zip(values[::2], values[1::2], strict=True)]


def _passes(test: Test) -> bool:
    return test.gain >= GAIN and test.z >= Z


def moves(names: list[str]) -> list[tuple[str, ...]]:
    """The moves a search round tries: each norm's other reading alone, and each pair's together (norms that scale
    the same signal, as the two pre-fc norms feeding fc do, may only improve together)."""
    names = sorted(names)
    return [(n,) for n in names] + list(itertools.combinations(names, 2))


def search(head, candidates: dict[str, dict[str, mx.array]], start: dict[str, str],
           score: Callable[[], mx.array]) -> tuple[dict[str, str], dict[tuple[str, ...], Test]]:
    """Best-improvement search of norm readings, per tensor (see the module docstring).

    First every norm's other reading at once against ``start`` (a head written one way throughout), the better
    start kept; then rounds of ``moves``: a pair is eligible only if it also beats each of its norms' moves alone (a
    pair that gains by one of them is that norm's move), and the eligible move that gains most is taken (a norm can
    make up for part of another's wrong reading: the larger gain fixes the cause first).

    Args:
        head: the head module; its norms named in ``candidates`` are loaded with the chosen readings on return.
        candidates: per norm (canonical name), its weight under each convention (``readings``).
        start: the convention each norm starts from.
        score: per-position scores (N,) float32 of the head as currently loaded (higher is better).

    Returns:
        the chosen convention per norm, and each move's test against the final choice.
    """
    def load(conventions: dict[str, str]) -> None:
        head.load_weights([(n, candidates[n][c]) for n, c in conventions.items()], strict=False)

    chosen = dict(start)
    load(chosen)
    base = score()
    if len(chosen) > 2:
        flipped = {n: other(c) for n, c in chosen.items()}
        load(flipped)
        trial = score()
        (test,) = _tests([trial - base])
        if _passes(test):
            chosen, base = flipped, trial
        else:
            load(chosen)
    while True:
        trials = {}
        for move in moves(list(candidates)):
            load({n: other(chosen[n]) for n in move})
            trials[move] = score()
            load({n: chosen[n] for n in move})
        found = list(trials)
        pairs = [m for m in found if len(m) == 2]
        values = _tests([trials[m] - base for m in found] + [trials[m] - trials[(n,)] for m in pairs for n in m])
        tests = dict(zip(found, values[: len(found)], strict=True))
        beyond = dict(zip([(m, n) for m in pairs for n in m], values[len(found):], strict=True))
        eligible = [m for m in found if _passes(tests[m]) and (len(m) == 1 or all(_passes(beyond[(m, n)]) for n in m))]
        if not eligible:
            return chosen, tests
        move = max(eligible, key=lambda m: tests[m].gain)
        chosen.update({n: other(chosen[n]) for n in move})
        load({n: chosen[n] for n in move})
        base = trials[move]


def prompt_score(head, trunk, hidden: mx.array, tokens: mx.array, cache, limit: int | None = MAX_POSITIONS):
    """``score`` for ``search``: per position, the head's log-likelihood of the prompt's own token x[t+2].

    Args:
        head: the head module.
        trunk: the trunk's functions (``decoding.Trunk``).
        hidden: (1, P, H) trunk hidden states h[0..P-1] of the prompt's first P tokens, in the contract's variant.
        tokens: (P,) tokens x[1..P], the second member of each pair.
        cache: the head's empty trimmable KV cache (left empty).
        limit: most positions scored (the first ones), None: all P - 1.

    Returns:
        a function of no arguments returning (N,) float32 log-likelihoods, N = min(P - 1, limit).
    """
    n = tokens.size - 1 if limit is None else min(tokens.size - 1, limit)
    embeddings, positions = trunk.head_inputs(tokens[:n], 0)
    targets = tokens[1 : n + 1]

    def score() -> mx.array:
        logits = trunk.logits(head(hidden[:, :n], embeddings, cache=cache, positions=positions)[0])
        logits = logits.astype(mx.float32)
        chosen = mx.take_along_axis(logits, targets[:, None].astype(mx.int32), axis=-1)[:, 0]
        likelihood = chosen - mx.logsumexp(logits, axis=-1)
        mx.eval(likelihood)
        cache.trim(n)
        return likelihood

    return score


class OpenNorms:
    """A loaded head's norms whose files leave their convention open, settled by ``on_prompt``.

    Args:
        loaded: the ``loader.LoadedHead``; its open norms (``NormDecision.settled`` False) are loaded as stored.
    """

    def __init__(self, loaded):
        self.loaded = loaded
        self.names = sorted(n for n, d in loaded.norms.items() if not d.settled)
        self.candidates: dict[str, dict[str, mx.array]] = {}  # both readings, from the weights the first prompt finds
        self.scored = 0  # positions scored so far, over prompts
        self.lock = threading.Lock()

    def settle(self, score, positions: int) -> bool:
        """Search the open norms' readings with ``score`` (``prompt_score`` over ``positions`` positions) and record
        each one's reading and evidence on the loaded head (``LoadedHead.norms``). A norm is settled when its other
        reading is clearly worse (z ≤ -``Z``; a flip taken leaves its way back so), or, undecided, once
        ``SETTLE_POSITIONS`` positions have been scored; the others stay open for the next prompt.

        Returns:
            True when no norm is left open.
        """
        head = self.loaded.module
        if not self.candidates:  # as loaded, in the dtype the head has now (a caller may have cast it)
            weights = dict(tree_flatten(head.parameters()))
            self.candidates = {n: readings(weights[n]) for n in self.names}
        start = {n: self.loaded.norms[n].convention for n in self.names}
        chosen, tests = search(head, {n: self.candidates[n] for n in self.names}, start, score)
        mx.eval(head.parameters())
        self.scored += positions
        last = self.scored >= SETTLE_POSITIONS
        for name in self.names:
            test, reading = tests[(name,)], chosen[name]
            clear = all(t.z <= -Z for m, t in tests.items() if name in m)  # every move of it is clearly worse
            settled = clear or last
            measured = (f"reading it {other(reading)} changes the head's log-likelihood of the prompts' tokens by "
                        f"{test.gain:+.3f} nats per token (z = {test.z:+.1f}, {self.scored} positions)")
            evidence = (f"settled by the head's own predictions: {measured}" if clear else
                        f"{measured}: too close to tell, kept {reading}" if settled else
                        f"read {reading} until a prompt settles it; so far {measured}")
            self.loaded.norms[name] = dataclasses.replace(self.loaded.norms[name], convention=reading,
                                                          evidence=evidence, settled=settled)
        self.names = [n for n in self.names if not self.loaded.norms[n].settled]
        return not self.names


def attach(loaded) -> None:
    """Keep ``loaded``'s open norms on its head module (``module.open_norms``) for the first prompt with enough
    evidence to settle (``on_prompt``); None when its files decide every norm."""
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
        if head.open_norms is pending and pending.settle(prompt_score(head, trunk, hidden, tokens, cache),
                                                          min(tokens.size - 1, MAX_POSITIONS)):
            head.open_norms = None
    finally:
        pending.lock.release()
