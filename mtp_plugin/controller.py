"""Adaptive draft depth: pick the depth with the most expected tokens per second, from live measurements.

Model. A cycle at draft depth d runs d head steps and one verify pass of d+1 tokens, costs c(d) seconds
(measured: draft + verify + the cycle's one host sync) and emits in expectation (Leviathan et al. 2023,
"Fast Inference from Transformers via Speculative Decoding", §3.1, with per-position acceptance)

    E(d) = 1 + p1 + p1·p2 + … + p1·p2⋯pd   tokens,

where p_k = P(draft k accepted | drafts 1..k-1 accepted). Plain decoding emits 1 token per t(1) seconds.
The controller chooses, among plain decoding and depths 1..max, the highest expected rate: E(d) / c(d)
for a depth, 1 / t(1) for plain.

Estimates. p_k from each cycle's accepted count: counts of "draft k verified" and "draft k accepted",
both decayed with a half-life in emitted tokens (so old evidence fades, also while parked), with a prior
of a few pseudo-cycles centred on p_(k-1) (p_1: 0.5), so an unexplored deeper position is assumed as good
as the one before it. c(d) and t(1): median of the last few measurements of that depth; for a depth not yet
measured, a straight line in d through the measured costs (plain decoding is the point d = 0).

Decisions. A newly chosen depth is kept for a few cycles (``dwell``) before the next decision, and the
controller switches only when the predicted rate beats the current one by a clear ``margin`` (hysteresis).
Candidates are plain, every measured depth and the unmeasured neighbours of the current one (one step
of exploration at a time). When plain wins, the loop decodes plain ("parked") for ``park`` tokens, then
probes drafting again for ``probe`` cycles at the depth predicted best, so a recovering acceptance rate is
noticed; each consecutive park is twice as long (up to ``max_park``). When no measured depth could beat
plain decoding even if every draft were accepted ((d+1)/c(d) ≤ 1/t(1): a verify pass costs more than the
tokens it could give, as on a CPU whose matmul cost grows with the tokens of a pass), the park lasts
``long_park`` tokens: probing again soon could only lose. While drafting, t(1) is re-measured every
``plain_every`` tokens over ``plain_probe`` plain tokens, as long as plain decoding is still in contention.

Pure logic: no mlx, no clock. The decoding loop asks ``next_depth()`` once per cycle and reports each
cycle with ``observe``; the question may run one cycle ahead of the reports (the loop queues each
block's successor before yielding the block), and the last one of a generation may go unreported.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

PLAIN = 0  # depth value meaning one plain decoding step (no drafting)
MIN_SECONDS = 1e-9  # the least cost recorded for a cycle, so that rates stay finite


@dataclass(frozen=True)
class Settings:
    """Controller constants.

    Attributes:
        max_depth: largest draft depth considered (≥ 1).
        margin: relative predicted gain needed to switch (0.05: 5 % more tokens per second).
        half_life: emitted tokens after which acceptance evidence weighs half.
        prior_weight: pseudo-cycles of prior in each p_k estimate.
        first_prior: prior p_1 before any evidence.
        window: measurements per depth whose median is its cost.
        dwell: cycles run at a newly chosen depth before the next decision.
        plain_probe: plain tokens per measurement of t(1).
        plain_every: emitted tokens between re-measurements of t(1) while drafting.
        contest: t(1) is re-measured only while plain's predicted rate is within this fraction of the
            chosen depth's (a plain step costs most when drafting is far ahead).
        park: tokens of the first park; doubled at each consecutive park.
        max_park: longest park, in tokens.
        probe: cycles drafted when a park ends, before the next decision.
        long_park: tokens of a park when no measured depth could beat plain even with every draft accepted.
    """

    max_depth: int = 8
    margin: float = 0.05
    half_life: float = 128.0
    prior_weight: float = 2.0
    first_prior: float = 0.5
    window: int = 9
    dwell: int = 4
    plain_probe: int = 4
    plain_every: int = 256
    contest: float = 0.25
    park: int = 32
    max_park: int = 256
    probe: int = 2
    long_park: int = 1024


class DepthController:
    """Chooses the draft depth of each cycle (``PLAIN`` = a plain decoding step).

    Args:
        start: depth to start with, 0..max_depth (0: start parked, e.g. when tuning found plain fastest).
        settings: constants (defaults suit both CPU and GPU backends).

    Raises:
        ValueError: ``start`` outside 0..max_depth.
    """

    def __init__(self, start: int = 2, settings: Settings | None = None):
        self.settings = s = settings or Settings()
        if not 0 <= start <= s.max_depth:
            raise ValueError(f"start depth must be 0..{s.max_depth}, got {start}")
        self.reached = [0.0] * (s.max_depth + 1)  # index k: decayed count of cycles that verified draft k
        self.accepted = [0.0] * (s.max_depth + 1)  # index k: decayed count of cycles that accepted draft k
        self.costs = [deque(maxlen=s.window) for _ in range(s.max_depth + 1)]  # index 0: plain, seconds/token
        self.choice = start  # the regime chosen: a depth, or PLAIN when parked
        self.running = start  # what next_depth() returns until the next decision
        self.hold = s.park if start == PLAIN else s.dwell  # cycles to issue before the next decision
        self.park_length = s.park  # tokens of the current or last park
        self.probing = False  # drafting resumed after a park, not yet re-decided
        self.since_plain = 0  # tokens emitted since t(1) was last measured
        self.switches = 0  # changes of choice so far

    # Estimates -------------------------------------------------------------------------------------

    def acceptance(self) -> list[float]:
        """Estimated conditional acceptance [p_1, …, p_max], each in (0, 1)."""
        s, out, prior = self.settings, [], self.settings.first_prior
        for k in range(1, s.max_depth + 1):
            prior = (self.accepted[k] + s.prior_weight * prior) / (self.reached[k] + s.prior_weight)
            out.append(prior)
        return out

    def expected_tokens(self, depth: int) -> float:
        """E(depth) = 1 + p1 + p1·p2 + … (tokens per cycle; 1.0 for PLAIN)."""
        total, run = 1.0, 1.0
        for p in self.acceptance()[:depth]:
            run *= p
            total += run
        return total

    def cost(self, depth: int) -> float | None:
        """Seconds per cycle at ``depth`` (PLAIN: per plain token): measured median, else a line in d through
        the measured depths; None when nothing is measured."""
        if self.costs[depth]:
            return statistics.median(self.costs[depth])
        points = [(d, statistics.median(c)) for d, c in enumerate(self.costs) if c]
        if not points:
            return None
        if len(points) == 1:  # one point: assume cost proportional to the tokens a pass handles
            d0, c0 = points[0]
            return c0 * (depth + 1) / (d0 + 1)
        n = len(points)
        mean_d = sum(d for d, _ in points) / n
        mean_c = sum(c for _, c in points) / n
        slope = sum((d - mean_d) * (c - mean_c) for d, c in points) / sum((d - mean_d) ** 2 for d, _ in points)
        slope = max(slope, 0.0)
        return max(mean_c + slope * (depth - mean_d), min(c for _, c in points))

    def rate(self, depth: int) -> float | None:
        """Predicted tokens per second at ``depth`` (PLAIN: plain decoding), or None if no cost is known."""
        c = self.cost(depth)
        return None if c is None else self.expected_tokens(depth) / c

    # Loop interface --------------------------------------------------------------------------------

    def next_depth(self) -> int:
        """Depth of the next cycle, 1..max_depth, or PLAIN for one plain decoding step."""
        if self.hold <= 0:
            self._decide()
        self.hold -= 1
        return self.running

    def observe(self, depth: int, accepted: int, seconds: float) -> None:
        """Report a finished cycle.

        Args:
            depth: what ran: a draft depth, or PLAIN (one plain step emitting one token).
            accepted: drafts accepted, 0..depth (0 for PLAIN).
            seconds: its cost (wall-clock seconds spent in the decoding loop, consumer time excluded); a clock
                too coarse to see it (0) counts as ``MIN_SECONDS``.
        """
        emitted = accepted + 1
        fade = 0.5 ** (emitted / self.settings.half_life)
        self.reached = [r * fade for r in self.reached]
        self.accepted = [a * fade for a in self.accepted]
        for k in range(1, min(accepted + 1, depth) + 1):
            self.reached[k] += 1
        for k in range(1, accepted + 1):
            self.accepted[k] += 1
        self.costs[depth].append(max(seconds, MIN_SECONDS))
        self.since_plain = 0 if depth == PLAIN else self.since_plain + emitted

    # Decisions -------------------------------------------------------------------------------------

    def _run(self, depth: int, hold: int) -> None:
        self.running, self.hold = depth, hold

    def _choose(self, depth: int, hold: int) -> None:
        self.switches += depth != self.choice
        self.choice = depth
        self._run(depth, hold)

    def _decide(self) -> None:
        s = self.settings
        if self.choice == PLAIN:  # a park ended: probe drafting at the depth that looks best
            self.probing = True
            self._choose(max(range(1, s.max_depth + 1), key=self._rate_or_zero), s.probe)
            return
        if self._plain_stale():
            self._run(PLAIN, s.plain_probe)  # measure t(1); the choice stays
            return
        best = max(self._candidates(), key=self._rate_or_zero)
        if best == self.choice or self._rate_or_zero(best) <= self._rate_or_zero(self.choice) * (1 + s.margin):
            best = self.choice
        if best == PLAIN:  # parks right after a probe grow: acceptance has not recovered
            self.park_length = min(2 * self.park_length, s.max_park) if self.probing else s.park
            self._choose(PLAIN, s.long_park if self._hopeless() else self.park_length)
        else:
            self._choose(best, s.dwell)
        self.probing = False

    def _plain_stale(self) -> bool:
        """t(1) unmeasured, or old while plain is still in contention (within ``contest`` of the choice)."""
        s = self.settings
        if not self.costs[PLAIN]:
            return True
        if self.running == PLAIN or self.since_plain < s.plain_every:
            return False
        return self._rate_or_zero(PLAIN) * (1 + s.contest) >= self._rate_or_zero(self.choice)

    def _hopeless(self) -> bool:
        """No measured depth d beats plain even at full acceptance: (d+1)/c(d) ≤ 1/t(1) for each."""
        plain = self.rate(PLAIN)
        measured = [d for d in range(1, self.settings.max_depth + 1) if self.costs[d]]
        return plain is not None and bool(measured) and all((d + 1) / self.cost(d) <= plain for d in measured)

    def _rate_or_zero(self, depth: int) -> float:
        return self.rate(depth) or 0.0

    def _candidates(self) -> list[int]:
        """Plain, every measured depth, and the current depth's neighbours."""
        measured = [d for d, c in enumerate(self.costs) if c]
        neighbours = [d for d in (self.choice - 1, self.choice + 1) if 1 <= d <= self.settings.max_depth]
        return sorted({PLAIN, *measured, *neighbours})


class SampledDepth:
    """The depth policy of a sampled generation with the automatic depth: decisions from counts only, never from
    clocks, so that a seed fixes the tokens as in stock decoding (the draws a cycle makes depend on its depth).

    Every cycle drafts ``depth`` tokens until ``probe`` cycles have run; then, if their mean tokens per cycle
    (1 + accepted drafts) is below the cost of a cycle in plain steps by a static model of the backend,
    ``1 + slope × depth`` (``tuning.sampled_policy``: a verify pass of d+1 tokens costs about 1 + 0.1 d plain steps
    on a GPU or Apple silicon, and its share of a compute-bound CPU pass grows with every token), the rest of the
    generation decodes plain: its drafts do not pay (a random-initialised head accepts 6-15 % of its drafts when
    sampling, enough to pass the head's 2 % health check).

    Args:
        depth: the draft depth, 1..8 (the tuned one, else the default).
        slope: cycle cost per draft token, in plain steps (the model above).
        probe: cycles counted before the decision.
    """

    def __init__(self, depth: int, slope: float, probe: int = 16):
        self.depth, self.slope, self.probe = depth, slope, probe
        self.cycles = self.tokens = 0
        self.parked = False

    def next_depth(self) -> int:
        """``depth``, or PLAIN once parked."""
        return PLAIN if self.parked else self.depth

    def observe(self, depth: int, accepted: int, seconds: float) -> None:
        """Count a drafting cycle's tokens; decide once ``probe`` cycles have run (``seconds`` is ignored)."""
        if depth == PLAIN or self.cycles >= self.probe:
            return
        self.cycles += 1
        self.tokens += accepted + 1
        if self.cycles == self.probe:
            self.parked = self.tokens / self.cycles < 1 + self.slope * self.depth


class FixedDepth:
    """The depth policy of an explicit depth: every cycle drafts ``depth`` tokens, nothing is learned."""

    def __init__(self, depth: int):
        self.depth = depth

    def next_depth(self) -> int:
        """Always ``depth``."""
        return self.depth

    def observe(self, depth: int, accepted: int, seconds: float) -> None:
        """Ignored."""
