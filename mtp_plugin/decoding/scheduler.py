"""The scheduler: what each row of a verify pass drafts this cycle (head drafts, a lookup draft or a plain step),
decided for the whole pass (``plan``). Costs are in plain steps of the pass's batch size (``CostModel``); acceptance
is the chain model of Leviathan et al. 2023, §3.1 (``Chain``). Design: docs/scheduling.md."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .. import tuning
from .controller import PLAIN, DepthController, chain_acceptance

SLACK = 0.05  # a widened pass may cost a row at most this share of its plain-step rate
CONTEXT_BAND = 2048  # tokens: passes whose longest contexts share a band (doubling from here) share a depth controller


@dataclass(frozen=True)
class Decision:
    """What one row verifies in a cycle: ``drafts`` head drafts, or the context's ``lookup`` tokens (found by a
    match of ``match`` tokens), or nothing (a plain step)."""

    drafts: int = 0
    lookup: tuple[int, ...] = ()
    match: int = 0

    @classmethod
    def head(cls, depth: int) -> Decision:
        return cls(depth)

    @classmethod
    def from_lookup(cls, tokens, match: int) -> Decision:
        return cls(len(tokens), tuple(tokens), match)

    @property
    def depth(self) -> int:
        """The head's draft steps (0 for a lookup or plain step)."""
        return 0 if self.lookup else self.drafts


PLAIN_STEP = Decision()


class Chain:
    """Decayed acceptance by draft position: p_k = P(draft k accepted | drafts 1..k-1 accepted), shrunk towards
    p_(k-1) by ``weight`` pseudo-cycles (p_1 towards ``first``); counts halve every ``half_life`` committed tokens.
    Raises ValueError for ``length`` < 1, ``half_life`` ≤ 0, ``first`` outside (0, 1) or ``weight`` < 0."""

    def __init__(self, length: int, first: float = 0.5, weight: float = 2.0, half_life: float = 256.0):
        if length < 1 or half_life <= 0 or not 0 < first < 1 or weight < 0:
            raise ValueError(f"a chain needs length >= 1, half_life > 0, 0 < first < 1 and weight >= 0; got "
                             f"{length}, {half_life}, {first}, {weight}")
        self.first, self.weight, self.half_life = first, weight, half_life
        self.reached = [0.0] * (length + 1)  # index k: cycles that verified draft k
        self.accepted = [0.0] * (length + 1)  # index k: cycles that accepted draft k

    def fade(self, tokens: int) -> None:
        """``tokens`` more tokens were committed (by any cycle or plain step)."""
        fade = 0.5 ** (tokens / self.half_life)
        self.reached[:] = [c * fade for c in self.reached]
        self.accepted[:] = [c * fade for c in self.accepted]

    def observe(self, drafts: int, accepted: int) -> None:
        """A cycle verified ``drafts`` drafts and accepted the first ``accepted``."""
        for k in range(1, min(accepted + 1, drafts, len(self.reached) - 1) + 1):
            self.reached[k] += 1
        for k in range(1, min(accepted, len(self.reached) - 1) + 1):
            self.accepted[k] += 1

    def expected(self, drafts: int) -> list[float]:
        """[E(0), …, E(drafts)], E(j) = 1 + p1 + p1·p2 + … + p1⋯pj: tokens a cycle of j drafts emits."""
        out, run = [1.0], 1.0
        for p in chain_acceptance(self.accepted, self.reached, self.weight, self.first)[:drafts]:
            run *= p
            out.append(out[-1] + run)
        return out


class CostModel:
    """c(k): the cost of a verify pass k positions wide, in plain steps of one batch-size class (c(1) = 1): a width's
    median seconds (last ``window`` passes) over plain steps' median, unmeasured widths on the least-squares line (slope
    ≥ 0); the prior 1 + ``slope``·(k − 1) alone with ``measured=False`` or before two widths are measured."""

    def __init__(self, slope: float, window: int = 32):
        self.slope = slope
        self.seconds: dict[int, deque] = {}
        self.window = window
        self._points: dict[int, float] | None = None  # c(k) of the measured widths, until the next observation

    def observe(self, width: int, seconds: float) -> None:
        """A pass ``width`` positions wide took ``seconds`` (draft steps excluded)."""
        self.seconds.setdefault(width, deque(maxlen=self.window)).append(max(seconds, 1e-9))
        self._points = None

    def __call__(self, width: int, measured: bool = True) -> float:
        prior = 1 + self.slope * (width - 1)
        if not measured or 1 not in self.seconds or len(self.seconds) < 2:
            return prior
        if self._points is None:
            plain = statistics.median(self.seconds[1])
            self._points = {k: max(statistics.median(v) / plain, 1.0) if k > 1 else 1.0
                            for k, v in self.seconds.items()}
        points = self._points
        if width in points:
            return points[width]
        mean_k = sum(points) / len(points)
        mean_c = sum(points.values()) / len(points)
        spread = sum((k - mean_k) ** 2 for k in points)
        slope = max(sum((k - mean_k) * (c - mean_c) for k, c in points.items()) / spread, 0.0)
        return max(mean_c + slope * (width - mean_k), 1.0)


def static_slope(model) -> float:
    """The prior cost of each position a verify pass adds, in plain steps, for ``model`` on MLX's default device:
    0.1 off the CPU; on a CPU, 0.3 for mostly 16-bit weights, else 1.0 (float32, quantized). See docs/scheduling.md."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    if mx.default_device().type != mx.cpu:
        return 0.1
    weights = [v for _, v in tree_flatten(model.parameters())]
    half = sum(w.size for w in weights if w.dtype in (mx.bfloat16, mx.float16))
    return 0.3 if 2 * half > sum(w.size for w in weights) else 1.0


class CostTable:
    """A model's cost models, one per batch-size class (``rows.bit_length()``: 1, 2-3, 4-7, …)."""

    def __init__(self, slope: float):
        self.slope, self.classes = slope, {}

    def of(self, rows: int) -> CostModel:
        size = rows.bit_length()
        if size not in self.classes:
            self.classes[size] = CostModel(self.slope)
        return self.classes[size]


def context_band(context: int) -> int:
    """The band of a pass whose longest trunk context holds ``context`` tokens: 0 below ``CONTEXT_BAND``, then one more
    each time the context doubles (1: 2-4k tokens, 2: 4-8k, …)."""
    return (max(context, 0) // CONTEXT_BAND).bit_length()


class Scheduler:
    """One model's scheduling, kept across generations and batches (``decoding.state.state_of``): its verify costs
    (``CostTable``), its adaptive depth controllers, the sampled rows' lookup prior (``lookup.new_prior``). Both loops
    ask it, a single generation as a pass of one row. ``model_dir``: where a tuned depth is looked up (None: the
    default ``default_depth``). Design: docs/scheduling.md."""

    def __init__(self, slope: float, lookup_prior: Chain, model_dir=None, default_depth: int = 2, max_depth: int = 8):
        self.costs, self.lookup_prior = CostTable(slope), lookup_prior
        self.model_dir, self.default_depth, self.max_depth = model_dir, default_depth, max_depth
        self.controllers: dict[tuple[float, int, int], DepthController] = {}

    def controller(self, temperature: float, rows: int, context: int) -> DepthController:
        """The adaptive depth controller of passes of ``rows`` rows sampling at ``temperature`` (the highest of the
        rows'; 0.0: greedy), whose longest context holds ``context`` tokens. The one keying rule: (temperature rounded
        to 0.1, batch-size class ``rows.bit_length()``, ``context_band``). A new one starts at the choice of the same
        temperature and size class's nearest shorter band; else one-row passes at the tuned depth (else the default)
        and larger batches parked (``controller.PLAIN``)."""
        key = (round(float(temperature), 1), rows.bit_length(), context_band(context))
        if key not in self.controllers:
            shorter = [k for k in self.controllers if k[:2] == key[:2] and k[2] < key[2]]
            if shorter:
                start = self.controllers[max(shorter)].choice
            elif key[1] == 1 and self.model_dir is not None:
                start = tuning.start_depth(self.model_dir, self.default_depth, self.max_depth)
            elif key[1] == 1:
                start = self.default_depth
            else:
                start = PLAIN
            self.controllers[key] = DepthController(start)
        return self.controllers[key]

    def next_depth(self, policy) -> int:
        """The head depth ``policy`` (``single.DepthPolicy``) chooses for the next cycle, 0..``max_depth`` (0: a plain
        step); ValueError outside that range. The one place a depth policy is asked."""
        depth = policy.next_depth()
        if not 0 <= depth <= self.max_depth:
            raise ValueError(f"depth policy chose depth {depth}; it must be 0..{self.max_depth}")
        return depth

    def price(self, rows: int, measured: bool, lookups) -> Callable[[int], float]:
        """The cost c(width) of a pass of ``rows`` rows (``pricing``)."""
        return pricing(self.costs.of(rows), measured, lookups)

    def decide(self, asks: list[Ask], lookups, measured: bool) -> list[Decision]:
        """Every row's decision for one verify pass (``plan``), priced for ``len(asks)`` rows: by the measured costs
        where ``measured`` (clocks decide only where tokens do not depend on the drafts and ranks need not agree),
        else the static prior, or a slope the rows' ``lookups`` settings fix. The one place ``plan`` is called."""
        return plan(asks, self.price(len(asks), measured, lookups))

    def observe(self, rows: int, width: int | None, seconds: float, policy=None, outcomes=()) -> None:
        """A pass of ``rows`` rows took ``seconds``: ``width`` positions wide with no head draft steps in it (its cost
        is measured), None when the head drafted; ``policy`` is told each of ``outcomes`` ((depth, accepted) of a row
        it decided; depth 0: a plain step) with the pass's seconds per row. The one place a depth policy is told."""
        if width is not None:
            self.costs.of(rows).observe(width, seconds)
        for depth, accepted in outcomes:
            policy.observe(depth, accepted, seconds / rows)


@dataclass
class Ask:
    """One row's question for a cycle: the head's draft ``depth`` (0: none) and ``head`` = [E(0), …, E(depth)] of its
    drafts; the lookup ``proposal`` cut to what the row may still emit (empty: none), its ``match`` length and
    ``lookup`` = [E(0), …, E(len(proposal))]."""

    depth: int = 0
    head: list[float] | None = None
    proposal: tuple[int, ...] = ()
    match: int = 0
    lookup: list[float] | None = None

    def best(self, width: int) -> tuple[float, Decision]:
        """The row's expected tokens and decision in a pass ``width`` wide (never narrower than its head's)."""
        out = (self.head[self.depth], Decision.head(self.depth)) if self.depth else (1.0, PLAIN_STEP)
        take = min(len(self.proposal), width - 1)
        if take and self.lookup[take] > out[0]:
            out = (self.lookup[take], Decision.from_lookup(self.proposal[:take], self.match))
        return out


def plan(asks: list[Ask], cost, slack: float = SLACK) -> list[Decision]:
    """Every row's decision for one verify pass (``asks``: one per row, B ≥ 1; ``cost(width)`` with c(1) = 1). The
    pass is at least W0 = (widest head depth asked) + 1 wide. A wider pass W, for lookup drafts, is taken when it
    maximises Σ E_i(W) / c(W) and no row's rate falls below its floor (1 − ``slack``) × min(1, E_i(W0) / c(W0)); within
    W a row takes its lookup draft when it expects more than from its head's. Rule: docs/scheduling.md."""
    base = max(a.depth for a in asks) + 1
    widest = max([base] + [len(a.proposal) + 1 for a in asks])
    costs = {width: cost(width) for width in range(base, widest + 1)}
    floors = [(1 - slack) * min(1.0, a.best(base)[0] / costs[base]) for a in asks]
    best, score = None, -1.0
    for width in range(base, widest + 1):
        picks = [a.best(width) for a in asks]
        c = costs[width]
        if width > base and any(e / c < f for (e, _), f in zip(picks, floors, strict=True)):
            continue
        total = sum(e for e, _ in picks) / c
        if total > score:
            best, score = picks, total
    return [d for _, d in best]


def pricing(model: CostModel, measured: bool, lookups) -> Callable[[int], float]:
    """The ``cost`` function ``plan`` takes: ``model``'s (its prior alone unless ``measured``), or, where a row's
    ``LookupSettings`` fix a slope, the static line of the least such slope."""
    fixed = [p.settings.slope for p in lookups if p is not None and p.settings.slope is not None]
    if fixed:
        line = CostModel(min(fixed))
        return lambda width: line(width, False)
    return lambda width: model(width, measured)


class RowState:
    """One row's state between cycles: its head drafts' ``Chain`` and its ``lookup.LookupPolicy`` (or None)."""

    def __init__(self, lookup=None, max_depth: int = 8):
        self.lookup, self.head = lookup, Chain(max_depth)

    def ask(self, depth: int, room: int | None, behind: bool = False) -> Ask:
        """The row's question: the head at ``depth`` (0: none) and its lookup draft of at most ``room`` tokens (None: no
        limit; ``behind`` as for ``lookup.ContextIndex.propose``)."""
        ask = Ask(depth, self.head.expected(depth))
        if self.lookup is not None and (room is None or room > 0):
            ask.proposal, ask.match, ask.lookup = self.lookup.propose(room, behind)
        return ask

    def observe(self, drafts: int, match: int, accepted: int) -> None:
        """A cycle verified ``drafts`` drafts (0: plain step), from the context if ``match`` (else the head), and
        accepted ``accepted``; every estimate fades by the tokens committed."""
        self.head.fade(accepted + 1)
        if self.lookup is not None:
            self.lookup.fade(accepted + 1)
        if match:
            self.lookup.observe(match, drafts, accepted)
        elif drafts:
            self.head.observe(drafts, accepted)
