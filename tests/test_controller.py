"""The adaptive depth controller on synthetic acceptance and cost traces (no model, no wall clock).

A trace draws each cycle's accepted count from per-position conditional acceptance p_k (or reads it from a
periodic pattern of how many chained drafts are right at each position, as the bundled model's greedy loops give)
and its cost from a cost model in units of one plain step (verify pass of k tokens + d head steps), with
multiplicative noise; throughput is tokens emitted per simulated second.
"""

import itertools
import random
import statistics

import pytest

from mtp_plugin.decoding.controller import PLAIN, DepthController, Settings

TOKENS = 3000


class Trace:
    """Synthetic decoding.

    Args:
        acceptance: emitted-token count → conditional acceptance [p_1, p_2, …] (last value repeats).
        verify: k → cost of a verify pass of k tokens, in plain steps (verify(1) is a plain step).
        draft: cost of one head step, in plain steps.
        noise: relative standard deviation of each measured cost.
    """

    def __init__(self, acceptance, verify, draft, noise=0.05, seed=0, pattern=None):
        self.acceptance, self.verify, self.draft, self.noise = acceptance, verify, draft, noise
        self.pattern = pattern  # drafts right from each position, repeating (then ``acceptance`` is unused)
        self.rng = random.Random(seed)
        self.emitted = 0

    def run(self, depth: int) -> tuple[int, float]:
        """One cycle at ``depth`` (PLAIN: one plain step): (accepted drafts, seconds)."""
        cost = self.verify(1) if depth == PLAIN else self.verify(depth + 1) + depth * self.draft
        accepted = 0
        if self.pattern is not None:
            accepted = min(depth, self.pattern[self.emitted % len(self.pattern)])
        else:
            p = self.acceptance(self.emitted)
            while accepted < depth and self.rng.random() < p[min(accepted, len(p) - 1)]:
                accepted += 1
        self.emitted += accepted + 1
        return accepted, cost * max(0.2, self.rng.gauss(1.0, self.noise))


class DriftingTrace(Trace):
    """A machine whose speed changes between generations: every ``every`` emitted tokens, each cost is multiplied by
    a new factor drawn uniformly from 1 ± ``amplitude`` (a 2-core CPU's speed moved by up to 20 % from one 96-token
    generation to the next)."""

    def __init__(self, *args, amplitude=0.25, every=96, **kwargs):
        super().__init__(*args, **kwargs)
        self.amplitude, self.every = amplitude, every
        self.speed_rng = random.Random(kwargs.get("seed", 0) + 1000)
        self.generation, self.factor = -1, 1.0

    def run(self, depth: int) -> tuple[int, float]:
        if self.emitted // self.every != self.generation:
            self.generation = self.emitted // self.every
            self.factor = self.speed_rng.uniform(1 - self.amplitude, 1 + self.amplitude)
        accepted, cost = super().run(depth)
        return accepted, cost * self.factor


class BurstyTrace(Trace):
    """A machine whose speed changes within a generation: stretches of 8-80 emitted tokens, each with its cost
    factor drawn uniformly from 1 ± ``amplitude`` (an exploration block may fall in a slow one)."""

    def __init__(self, *args, amplitude=0.25, **kwargs):
        super().__init__(*args, **kwargs)
        self.amplitude = amplitude
        self.speed_rng = random.Random(kwargs.get("seed", 0) + 77)
        self.until, self.factor = -1, 1.0

    def run(self, depth: int) -> tuple[int, float]:
        if self.emitted >= self.until:
            self.until = self.emitted + self.speed_rng.randint(8, 80)
            self.factor = self.speed_rng.uniform(1 - self.amplitude, 1 + self.amplitude)
        accepted, cost = super().run(depth)
        return accepted, cost * self.factor


def throughput(trace: Trace, policy, tokens: int = TOKENS) -> tuple[float, list[int]]:
    """Decode ``tokens`` tokens with ``policy`` (a fixed depth or a DepthController).

    Returns:
        (tokens per second, the depth in use at each emitted token).
    """
    seconds, depths = 0.0, []
    while trace.emitted < tokens:
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
    # the bundled model's greedy loop (its drafts are right 3, 2, 1, 0, 0, 0 positions ahead, period 6) on the deep
    # fixture's bf16 CPU costs: depth 1 best, depth 2 the worst of 1-3, and the acceptance pooled at depth 2
    # predicts depths 1 and 3 too low (benchmarks/results: the bench on the deep fixture)
    "periodic-deep": dict(acceptance=None, pattern=[3, 2, 1, 0, 0, 0], verify=linear(0.315), draft=0.025,
                          noise=0.15),
    # the deep fixture sampled at temperature 1.0 in bf16 on a CPU (1.75, 2.24, 2.45 tokens per cycle at depths 1-3,
    # a drafting cycle's fixed cost 0.2): depths 2 and 3 tie, depth 4 is 5 % behind (benchmarks/results: sampled)
    "sampled-deep": dict(acceptance=constant(0.75, 0.65, 0.45), verify=lambda k: 1 + 0.17 * (k - 1) + 0.2 * (k > 1),
                         draft=0.015),
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


@pytest.mark.parametrize("name", ["periodic-deep", "sampled-deep"])
def test_machine_speed_drifting_between_generations(name):
    """Costs compare as if measured together: a depth measured in a slow minute is not ranked below one measured in a
    fast minute (with each depth's own median seconds, the median run lost 5 % on the periodic text)."""
    ratios = []
    for seed in range(6):
        best = max(throughput(DriftingTrace(**SCENARIOS[name], seed=seed), d)[0] for d in range(7))
        ratios.append(throughput(DriftingTrace(**SCENARIOS[name], seed=seed), DepthController())[0] / best)
    assert statistics.median(ratios) >= 0.97, ratios


def test_a_slow_stretch_does_not_decide_alone():
    """A depth measured in 8 cycles of a slow stretch is not written off: its cost leans on the line through the
    other depths' (with each depth's median alone, 4 of these 8 runs lost 11-21 %)."""
    ratios = []
    for seed in range(8):
        best = max(throughput(BurstyTrace(**SCENARIOS["sampled-deep"], seed=seed), d)[0] for d in range(7))
        ratios.append(throughput(BurstyTrace(**SCENARIOS["sampled-deep"], seed=seed), DepthController())[0] / best)
    assert min(ratios) >= 0.9, ratios


def test_switches_only_to_a_measured_depth():
    """A depth that only the estimates rank first (not yet run) is explored for a block before the choice moves."""
    controller, trace = DepthController(start=1), Trace(**SCENARIOS["dense-gpu"])
    while trace.emitted < TOKENS:
        choice = controller.choice
        depth = controller.next_depth()
        if controller.choice != choice:
            assert controller.cycles_at[controller.choice] > 0, (choice, controller.choice)
        controller.observe(depth, *trace.run(depth))
    assert controller.choice >= 4


@pytest.mark.parametrize("seed", range(4))
def test_periodic_acceptance_finds_the_best_depth(seed):
    """Where cycles start decides what they accept (a periodic text): the depth that gives the most tokens per
    second is found and kept from depth 2, which the acceptance pooled at depth 2 would keep."""
    assert best_fixed("periodic-deep", seed)[0] == 1
    controller = DepthController(start=2)
    _, depths = throughput(Trace(**SCENARIOS["periodic-deep"], seed=seed), controller)
    settled = depths[TOKENS // 4:]
    assert settled.count(1) / len(settled) > 0.9


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
    """Acceptance collapses over tokens 1000-2000: parked there, drafting again within one exploration interval."""
    _, depths = throughput(Trace(**SCENARIOS["phases"]), DepthController(), tokens=4000)
    low, recovered = depths[1200:2000], depths[2000 + Settings().max_explore_every:]
    assert low.count(PLAIN) / len(low) > 0.7
    assert recovered.count(PLAIN) / len(recovered) < 0.05


def test_start_parked_measures_plain_first():
    controller = DepthController(start=PLAIN)
    for _ in range(Settings().block):
        assert controller.next_depth() == PLAIN
        controller.observe(PLAIN, 0, 1.0)
    assert controller.next_depth() >= 1  # then it explores drafting


def test_estimates():
    settings = Settings(max_depth=3, prior_weight=1e-9, half_life=1e9, realized_half_life=1e9, realized_prior=4.0)
    controller = DepthController(start=2, settings=settings)
    for accepted in (2, 1, 0, 2):  # draft 1 verified 4×, accepted 3×; draft 2 verified 3×, accepted 2×
        controller.observe(2, accepted, 2.0)
    p = controller.acceptance()
    assert p[0] == pytest.approx(0.75) and p[1] == pytest.approx(2 / 3) and p[2] == pytest.approx(2 / 3)
    assert controller.chain_tokens(2) == pytest.approx(1 + 0.75 + 0.5)
    assert controller.expected_tokens(2) == pytest.approx((9 + 4 * 2.25) / (4 + 4))  # it gave 9 tokens in 4 cycles
    for _ in range(4):  # depth 1 gives more than the chain predicts (where the cycles start matters)
        controller.observe(1, 1, 1.5)
    chain = controller.chain_tokens(1)
    assert controller.expected_tokens(1) == pytest.approx((8 + 4 * chain) / (4 + 4)) and chain < 2.0
    controller.observe(PLAIN, 0, 1.0)
    assert controller.unit() == 2.0  # costs in units of the choice's: 2 s
    assert controller.cost(2) == 1.0 and controller.cost(1) == 0.75 and controller.cost(PLAIN) == 0.5
    assert controller.cost(3) == pytest.approx(1.25)  # line through d = 0, 1, 2
    report = controller.report()["depths"]
    assert report[1]["cycles"] == 4 and report[2]["tokens"] == 9 and report[PLAIN]["rate"] == 1
    assert report[2]["cost"] == 2.0


def test_invalid_start():
    with pytest.raises(ValueError, match="start depth"):
        DepthController(start=9)


def drafting_runs(depths: list[int]) -> list[tuple[int, int]]:
    """(first token, length) of each maximal run of drafted tokens in a per-token depth record (with nothing ever
    accepted, a run's length is its cycles)."""
    runs, position = [], 0
    for drafting, group in itertools.groupby(depths, key=lambda d: d != PLAIN):
        length = len(list(group))
        if drafting:
            runs.append((position, length))
        position += length
    return runs


def test_long_intervals_and_short_probes_when_no_depth_could_win():
    """A cycle costs more than the tokens it could give even at full acceptance ((d+1)/c(d) < 1/t(1), as on a CPU
    whose matmul cost grows with the tokens of a pass): once plain is chosen, drafting is probed for ``probe`` cycles
    every ``max_explore_every`` tokens; with a verify pass that could win at full acceptance, for whole blocks."""
    s = Settings()
    for verify, block in ((linear(1.2), s.probe), (linear(0.6), s.block)):
        trace = Trace(acceptance=constant(0.0), verify=verify, draft=0.1, noise=0.0)
        _, depths = throughput(trace, DepthController(start=PLAIN), tokens=4000)
        later = [run for run in drafting_runs(depths) if run[0] > 200]
        assert later and all(cycles == block for _, cycles in later), later
        if block == s.probe:
            assert all(b[0] - a[0] >= s.max_explore_every for a, b in itertools.pairwise(later)), later


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
