"""The adaptive depth controller on synthetic acceptance and cost traces (no model, no wall clock).

A trace draws each cycle's accepted count from per-position conditional acceptance p_k and its cost
from a cost model in units of one plain step (verify pass of k tokens + d head steps), with
multiplicative noise; throughput is tokens emitted per simulated second.
"""

import random

import pytest

from mtp_plugin.controller import PLAIN, DepthController, Settings

TOKENS = 3000


class Trace:
    """Synthetic decoding.

    Args:
        acceptance: emitted-token count → conditional acceptance [p_1, p_2, …] (last value repeats).
        verify: k → cost of a verify pass of k tokens, in plain steps (verify(1) is a plain step).
        draft: cost of one head step, in plain steps.
        noise: relative standard deviation of each measured cost.
    """

    def __init__(self, acceptance, verify, draft, noise=0.05, seed=0):
        self.acceptance, self.verify, self.draft, self.noise = acceptance, verify, draft, noise
        self.rng = random.Random(seed)
        self.emitted = 0

    def run(self, depth: int) -> tuple[int, float]:
        """One cycle at ``depth`` (PLAIN: one plain step): (accepted drafts, seconds)."""
        cost = self.verify(1) if depth == PLAIN else self.verify(depth + 1) + depth * self.draft
        accepted = 0
        p = self.acceptance(self.emitted)
        while accepted < depth and self.rng.random() < p[min(accepted, len(p) - 1)]:
            accepted += 1
        self.emitted += accepted + 1
        return accepted, cost * max(0.2, self.rng.gauss(1.0, self.noise))


def throughput(trace: Trace, policy) -> tuple[float, list[int]]:
    """Decode TOKENS tokens with ``policy`` (a fixed depth or a DepthController).

    Returns:
        (tokens per second, the depth in use at each emitted token).
    """
    seconds, depths = 0.0, []
    while trace.emitted < TOKENS:
        depth = policy if isinstance(policy, int) else policy.next_depth()
        accepted, cost = trace.run(depth)
        if not isinstance(policy, int):
            policy.observe(depth, accepted, cost)
        seconds += cost
        depths += [depth] * (accepted + 1)
    return trace.emitted / seconds, depths


def constant(*p):
    return lambda _: list(p)


def linear(slope):
    return lambda k: 1 + slope * (k - 1)


SCENARIOS = {
    # dense trunk on a GPU: verify nearly flat, high acceptance on code
    "dense-gpu": dict(acceptance=constant(0.9, 0.85, 0.8, 0.75, 0.7), verify=linear(0.06), draft=0.05),
    # MoE trunk: expert loads grow with the tokens verified, moderate acceptance (seed 003): plain wins
    "moe": dict(acceptance=constant(0.6, 0.5), verify=linear(0.8), draft=0.1),
    # the tiny checkpoint on a 2-core CPU: about break-even at depth 1
    "tiny-cpu": dict(acceptance=constant(0.5, 0.7), verify=linear(0.23), draft=0.18),
    # 4-bit trunk on CPU: quantized matmul linear in tokens, nothing can win
    "quantized-cpu": dict(acceptance=constant(0.9), verify=linear(0.9), draft=0.1),
    # acceptance collapses for a stretch (e.g. prose in a code file) and recovers
    "phases": dict(acceptance=lambda n: [0.85, 0.8, 0.75] if n < 1000 or n > 2000 else [0.1],
                   verify=linear(0.15), draft=0.08),
}


def best_fixed(name, seed=0):
    """(depth, throughput) of the best of plain and fixed depths 1..8."""
    rates = {d: throughput(Trace(**SCENARIOS[name], seed=seed), d)[0] for d in range(9)}
    return max(rates.items(), key=lambda item: item[1])


@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("seed", [0, 1])
def test_within_a_few_percent_of_best_fixed(name, seed):
    _, best = best_fixed(name, seed)
    adaptive, _ = throughput(Trace(**SCENARIOS[name], seed=seed), DepthController())
    assert adaptive >= 0.95 * best, (adaptive / best)


def test_parks_when_plain_wins():
    for name in ("moe", "quantized-cpu"):
        _, depths = throughput(Trace(**SCENARIOS[name]), DepthController())
        assert depths.count(PLAIN) / len(depths) > 0.9


def test_climbs_when_acceptance_high_and_verify_cheap():
    assert best_fixed("dense-gpu")[0] >= 4
    _, depths = throughput(Trace(**SCENARIOS["dense-gpu"]), DepthController(start=1))
    settled = depths[TOKENS // 3:]
    assert sum(d >= 4 for d in settled) / len(settled) > 0.9


def test_stays_put_under_noise():
    """Depths 1 and 2 equally fast, costs measured with 15 % noise: hysteresis keeps switches rare."""
    scenario = dict(acceptance=constant(0.7, 0.486, 0.1), verify=linear(0.2), draft=0.05, noise=0.15)
    switches = {}
    for margin in (0.0, Settings().margin):
        controllers = [DepthController(start=1, settings=Settings(margin=margin)) for _ in range(3)]
        for seed, controller in enumerate(controllers):
            throughput(Trace(**scenario, seed=seed), controller)
        switches[margin] = [c.switches for c in controllers]
    assert max(switches[Settings().margin]) <= 6
    assert sum(switches[Settings().margin]) < sum(switches[0.0]) / 2


def test_comes_back_from_parking_when_acceptance_recovers():
    """Acceptance collapses over tokens 1000-2000: parked there, drafting again after one park at most."""
    _, depths = throughput(Trace(**SCENARIOS["phases"]), DepthController())
    low, recovered = depths[1200:2000], depths[2000 + Settings().max_park + 100:]
    assert low.count(PLAIN) / len(low) > 0.7
    assert recovered.count(PLAIN) / len(recovered) < 0.05


def test_start_parked_measures_plain_first():
    controller = DepthController(start=PLAIN)
    for _ in range(Settings().park):
        assert controller.next_depth() == PLAIN
        controller.observe(PLAIN, 0, 1.0)
    assert controller.next_depth() >= 1  # then it probes drafting


def test_estimates():
    controller = DepthController(start=2, settings=Settings(max_depth=3, prior_weight=1e-9, half_life=1e9))
    for accepted in (2, 1, 0, 2):  # draft 1 verified 4×, accepted 3×; draft 2 verified 3×, accepted 2×
        controller.observe(2, accepted, 2.0)
    p = controller.acceptance()
    assert p[0] == pytest.approx(0.75) and p[1] == pytest.approx(2 / 3) and p[2] == pytest.approx(2 / 3)
    assert controller.expected_tokens(2) == pytest.approx(1 + 0.75 + 0.5)
    controller.observe(PLAIN, 0, 1.0)
    assert controller.cost(2) == 2.0 and controller.cost(3) == pytest.approx(2.5)  # line through (0, 1), (2, 2)


def test_invalid_start():
    with pytest.raises(ValueError, match="start depth"):
        DepthController(start=9)


def test_long_park_when_no_depth_could_win():
    """A cycle costs more than the tokens it could give even at full acceptance ((d+1)/c(d) < 1/t(1), as on a CPU
    whose matmul cost grows with the tokens of a pass): after the probe, the park lasts ``long_park`` tokens; with
    a verify pass that could win at full acceptance, parks double as before."""
    s = Settings()
    for verify, park in ((linear(1.2), s.long_park), (linear(0.6), 2 * s.park)):
        controller = DepthController(start=PLAIN)
        trace = Trace(acceptance=constant(0.05), verify=verify, draft=0.1, noise=0.0)
        for _ in range(s.park):
            assert controller.next_depth() == PLAIN
            controller.observe(PLAIN, *trace.run(PLAIN))
        for _ in range(s.probe):
            depth = controller.next_depth()
            assert depth >= 1
            controller.observe(depth, *trace.run(depth))
        parked = 0
        while controller.next_depth() == PLAIN:
            parked += 1
            controller.observe(PLAIN, *trace.run(PLAIN))
        assert parked == park


def test_scenarios_settle_with_few_probes_when_drafting_cannot_win():
    """Every draft rejected and a verify pass dearer than its tokens: under 0.5 % of tokens are probes (parks that
    only doubled to 256 tokens, with 4-cycle probes, spent 1.6 % on them)."""
    _, depths = throughput(Trace(acceptance=constant(0.0), verify=linear(1.5), draft=0.2), DepthController())
    assert depths.count(PLAIN) / len(depths) > 0.995


def test_zero_costs_from_a_coarse_clock():
    """Cycles measured as 0 s (a clock too coarse to see them) neither crash the controller nor stop it deciding."""
    for zero_when in (lambda d: True, lambda d: d == PLAIN, lambda d: d != PLAIN):
        controller = DepthController(start=2)
        for _ in range(300):
            depth = controller.next_depth()
            controller.observe(depth, 0, 0.0 if zero_when(depth) else 1.0)
        assert 0 <= controller.next_depth() <= Settings().max_depth
