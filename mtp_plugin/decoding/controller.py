"""Adaptive draft depth: each cycle, plain decoding or the draft depth d with the most predicted tokens per second,
E(d) / c(d), E(d) shrunk towards the chain model of Leviathan et al. 2023, §3.1. Pure logic: no mlx, no clock.
Design: docs/decoding.md (Draft depth: adaptive, tuned, or fixed)."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

PLAIN = 0  # depth value meaning one plain decoding step (no drafting)
MIN_SECONDS = 1e-9  # the least cost recorded for a cycle, so that rates stay finite


@dataclass(frozen=True)
class Settings:
    """Controller constants (tuned on the traces of ``tests/test_controller.py``); weights in pseudo-cycles, half-lives
    in emitted tokens. ``margin``: relative predicted gain in tokens per second needed to switch. ``half_life``,
    ``prior_weight``, ``first_prior``: the chain model's p_k counts and their prior. ``realized_prior``,
    ``realized_half_life``: the chain's weight in, and the half-life of, the tokens per cycle a depth gave. ``window``:
    measurements per depth whose median is its cost; ``reference``: the choice's latest cycles whose median seconds
    make the cost unit; ``cost_prior``: the line's weight in a measured draft depth's cost. ``block``: cycles per
    decision; ``explore_every`` to ``max_explore_every``: emitted tokens between exploration rounds (doubling);
    ``contest``: plain is explored only while within this fraction of the choice's rate; ``probe``: cycles of an
    exploration block while no measured depth could beat plain even at full acceptance."""

    max_depth: int = 8
    margin: float = 0.05
    half_life: float = 128.0
    prior_weight: float = 2.0
    first_prior: float = 0.5
    realized_prior: float = 16.0
    realized_half_life: float = 512.0
    window: int = 32
    reference: int = 16
    cost_prior: float = 16.0
    block: int = 8
    explore_every: int = 384
    max_explore_every: int = 1024
    contest: float = 0.25
    probe: int = 2


def chain_acceptance(accepted: list[float], reached: list[float], weight: float, first: float) -> list[float]:
    """Conditional acceptance [p_1, …, p_n] from decayed counts of cycles that accepted / verified draft k (index
    k; 0 unused), each p_k shrunk towards p_(k-1) by ``weight`` pseudo-cycles, p_1 towards ``first``."""
    out, prior = [], first
    for k in range(1, len(accepted)):
        prior = (accepted[k] + weight * prior) / (reached[k] + weight)
        out.append(prior)
    return out


class DepthController:
    """Chooses the draft depth of each cycle (``PLAIN``: a plain step); ``start``: 0..max_depth (0: parked), else
    ValueError. ``next_depth()`` is asked once per cycle and ``observe`` reports it; questions may run one cycle ahead
    of the reports, and a generation's last cycle may go unreported. ``cycles_at``, ``tokens_at``, ``explored_at``: per
    depth (index 0: plain), cycles run, tokens emitted and cycles asked for in exploration blocks (not decayed)."""

    def __init__(self, start: int = 2, settings: Settings | None = None):
        self.settings = s = settings or Settings()
        if not 0 <= start <= s.max_depth:
            raise ValueError(f"start depth must be 0..{s.max_depth}, got {start}")
        n = s.max_depth + 1
        self.reached = [0.0] * n  # index k: decayed count of cycles that verified draft k
        self.accepted = [0.0] * n  # index k: decayed count of cycles that accepted draft k
        self.tokens = [0.0] * n  # index d: decayed tokens emitted by cycles at depth d
        self.cycles = [0.0] * n  # index d: decayed cycles at depth d
        self.costs = [deque(maxlen=s.window) for _ in range(n)]  # index 0: plain; in units of the choice's cost
        self.recent: deque = deque(maxlen=s.reference)  # seconds of the choice's latest cycles
        self.cycles_at, self.tokens_at, self.explored_at = [0] * n, [0] * n, [0] * n
        self.choice = self.running = start  # the depth chosen; what next_depth() returns until the next decision
        self.hold = s.block  # cycles to issue before the next decision
        self.queue: list[int] = []  # depths still to explore in this round
        self.interval = s.explore_every  # tokens between exploration rounds
        self.since = 0  # tokens emitted since the last round began
        self.rounds = 0  # exploration rounds begun
        self.confirming = False  # a round ran since the last decision
        self.switches = 0

    # Estimates -------------------------------------------------------------------------------------

    def acceptance(self) -> list[float]:
        """The chain model's [p_1, …, p_max], each in (0, 1)."""
        s = self.settings
        return chain_acceptance(self.accepted, self.reached, s.prior_weight, s.first_prior)

    def chain_tokens(self, depth: int) -> float:
        """The chain model's E(depth) = 1 + p1 + p1·p2 + … (tokens per cycle; 1.0 for PLAIN)."""
        total, run = 1.0, 1.0
        for p in self.acceptance()[:depth]:
            run *= p
            total += run
        return total

    def expected_tokens(self, depth: int) -> float:
        """Tokens per cycle at ``depth``: what it gave, shrunk towards the chain model (1.0 for PLAIN)."""
        if depth == PLAIN:
            return 1.0
        prior = self.settings.realized_prior
        return (self.tokens[depth] + prior * self.chain_tokens(depth)) / (self.cycles[depth] + prior)

    def cost(self, depth: int) -> float | None:
        """Cost of a cycle at ``depth`` (PLAIN: a plain token) in units of the choice's (``unit``); None before any
        measurement. A measured draft depth's median is shrunk towards ``_line`` by ``cost_prior`` pseudo-cycles."""
        points = {d: (statistics.median(c), len(c)) for d, c in enumerate(self.costs) if c}
        if not points:
            return None
        if depth == PLAIN and PLAIN in points:
            return points[PLAIN][0]
        drafts = {d: p for d, p in points.items() if d != PLAIN}
        line = _line(drafts if depth != PLAIN and drafts else points, depth)
        if depth not in points:
            return line
        median, n = points[depth]
        return (n * median + self.settings.cost_prior * line) / (n + self.settings.cost_prior)

    def unit(self) -> float | None:
        """Seconds of a cost unit now (median of the choice's latest cycles); None before any cycle."""
        return statistics.median(self.recent) if self.recent else None

    def rate(self, depth: int) -> float | None:
        """Predicted tokens per cost unit at ``depth``, or None if no cost is known."""
        c = self.cost(depth)
        return None if c is None else self.expected_tokens(depth) / c

    def report(self) -> dict:
        """Per depth that ran: ``cycles``, ``tokens``, ``explored``, ``tokens_per_cycle``, ``cost`` (seconds) and
        ``rate`` (tokens/s) at the present speed; plus ``choice``, ``switches`` and ``rounds``."""
        unit, depths = self.unit(), {}
        for d in (d for d in range(self.settings.max_depth + 1) if self.cycles_at[d]):
            cost = self.cost(d)
            cost = None if unit is None or cost is None else cost * unit
            depths[d] = {"cycles": self.cycles_at[d], "tokens": self.tokens_at[d], "explored": self.explored_at[d],
                         "tokens_per_cycle": self.expected_tokens(d), "cost": cost,
                         "rate": None if cost is None else self.expected_tokens(d) / cost}
        return {"depths": depths, "choice": self.choice, "switches": self.switches, "rounds": self.rounds}

    # Loop interface --------------------------------------------------------------------------------

    def next_depth(self) -> int:
        """Depth of the next cycle, 1..max_depth, or PLAIN for one plain decoding step."""
        if self.hold <= 0:
            self._decide()
        self.hold -= 1
        if self.running != self.choice:
            self.explored_at[self.running] += 1
        return self.running

    def observe(self, depth: int, accepted: int, seconds: float) -> None:
        """Report a finished cycle: ``accepted`` drafts, 0..depth (0 for PLAIN), in ``seconds`` of wall-clock time
        in the decoding loop (consumer time excluded; 0 counts as ``MIN_SECONDS``)."""
        emitted = accepted + 1
        fade = 0.5 ** (emitted / self.settings.half_life)
        for counts in (self.reached, self.accepted):
            counts[:] = [c * fade for c in counts]
        fade = 0.5 ** (emitted / self.settings.realized_half_life)
        for counts in (self.tokens, self.cycles):
            counts[:] = [c * fade for c in counts]
        for k in range(1, min(accepted + 1, depth) + 1):
            self.reached[k] += 1
        for k in range(1, accepted + 1):
            self.accepted[k] += 1
        self.tokens[depth] += emitted
        self.cycles[depth] += 1
        self.cycles_at[depth] += 1
        self.tokens_at[depth] += emitted
        seconds = max(seconds, MIN_SECONDS)
        if depth == self.choice:
            self.recent.append(seconds)
        if self.recent:  # else nothing to compare with yet (a plain step the loop ran before the choice ran)
            self.costs[depth].append(seconds / self.unit())
        self.since += emitted

    # Decisions -------------------------------------------------------------------------------------

    def _decide(self) -> None:
        s = self.settings
        if not self.queue and (not self.rounds or self.since >= self.interval):
            self.queue = [PLAIN, *self._neighbours()] if self.choice != PLAIN else self._neighbours()
            self.queue = list(dict.fromkeys(self.queue))  # plain first: its rate decides what is worth exploring
            self.rounds, self.since, self.confirming = self.rounds + 1, 0, True
        while self.queue:
            depth = self.queue.pop(0)
            if self._worth_exploring(depth):
                return self._explore(depth)
        candidates = {PLAIN, self.choice, *self._neighbours(), *(d for d, c in enumerate(self.costs) if c),
                      max(range(1, s.max_depth + 1), key=lambda d: self.rate(d) or 0.0)}
        rates = {d: self.rate(d) or 0.0 for d in candidates}
        best = max(sorted(rates), key=rates.get)
        gains = best != self.choice and rates[best] > rates[self.choice] * (1 + s.margin)
        if gains and not self.costs[best] and not self.explored_at[best]:  # never asked for: explored before a switch
            return self._explore(best)
        if gains:
            self.switches += 1
            self._rebase(self.cost(best))
            self.choice, self.interval = best, s.explore_every
            self.queue = [d for d in self._neighbours() if not self.costs[d]]  # a new neighbourhood
        elif self.confirming and all(rates[d] < rates[self.choice] * (1 - s.margin) for d in self._neighbours()
                                     if self.costs[d]):  # a round clearly confirmed the choice: explore less often
            self.interval = min(2 * self.interval, s.max_explore_every)
        if self.choice == PLAIN and self._hopeless():
            self.interval = s.max_explore_every
        self.confirming = False
        self.running, self.hold = self.choice, s.block

    def _explore(self, depth: int) -> None:
        hopeless = self.choice == PLAIN and self._hopeless()
        self.running, self.hold = depth, self.settings.probe if hopeless else self.settings.block

    def _rebase(self, ratio: float) -> None:
        """Make the cost unit the new choice's, which costs ``ratio`` of the present unit."""
        recent = [v * ratio for v in self.recent]  # what the new choice would have taken
        self.recent.clear()
        self.recent.extend(recent)
        for window in self.costs:
            values = [v / ratio for v in window]
            window.clear()
            window.extend(values)

    def _neighbours(self) -> list[int]:
        d = self.choice
        return [n for n in (d - 1, d + 1) if 1 <= n <= self.settings.max_depth] + ([PLAIN] if d != PLAIN else [])

    def _worth_exploring(self, depth: int) -> bool:
        plain, current = self.rate(PLAIN), self.rate(self.choice)
        if depth == self.choice:
            return False
        if depth == PLAIN:
            return plain is None or current is None or plain * (1 + self.settings.contest) >= current
        cost = self.cost(depth)
        return self.choice == PLAIN or plain is None or cost is None or (depth + 1) / cost > plain

    def _hopeless(self) -> bool:
        """No measured depth d beats plain even at full acceptance: (d+1)/c(d) ≤ 1/t(1) for each."""
        plain = self.rate(PLAIN)
        measured = [d for d in range(1, self.settings.max_depth + 1) if self.costs[d]]
        return plain is not None and bool(measured) and all((d + 1) / self.cost(d) <= plain for d in measured)


def _line(points: dict[int, tuple[float, int]], depth: int) -> float:
    """Cost at ``depth`` on the cycle-weighted least-squares line through {depth: (median cost, cycles)} (slope ≥ 0,
    never below the least point); through one point: cost proportional to depth + 1."""
    if len(points) == 1:
        ((d0, (c0, _)),) = points.items()
        return c0 * (depth + 1) / (d0 + 1)
    total = sum(n for _, n in points.values())
    mean_d = sum(d * n for d, (_, n) in points.items()) / total
    mean_c = sum(c * n for c, n in points.values()) / total
    spread = sum(n * (d - mean_d) ** 2 for d, (_, n) in points.items())
    slope = max(sum(n * (d - mean_d) * (c - mean_c) for d, (c, n) in points.items()) / spread, 0.0)
    return max(mean_c + slope * (depth - mean_d), min(c for c, _ in points.values()))


class FixedDepth:
    """The depth policy of an explicit depth: every cycle drafts ``depth`` tokens."""

    def __init__(self, depth: int):
        self.depth = depth

    def next_depth(self) -> int:
        return self.depth

    def observe(self, depth: int, accepted: int, seconds: float) -> None:
        """Ignored."""
