"""The scheduler's decisions: one row as a stream, a batch sharing one verify pass, the cost model and the chain
model (pure logic; the loops that call it are tested end to end in test_lookup, test_batching and test_server)."""

import pytest

from mtp_plugin.decoding.controller import PLAIN
from mtp_plugin.decoding.lookup import LookupPolicy, LookupSettings, lookup_policy, new_prior
from mtp_plugin.decoding.scheduler import (
    PLAIN_STEP,
    Ask,
    Chain,
    CostModel,
    Decision,
    RowState,
    Scheduler,
    plan,
    pricing,
)
from mtp_plugin.decoding.single import DEFAULT_DEPTH

CPU_BF16 = CostModel(0.43)  # a pass of k positions costs 1 + 0.43(k-1) plain steps (bf16 on a compute-bound CPU)
GPU = CostModel(0.02)  # a pass of a few positions costs little more than one


def prior(model):
    return lambda width: model(width, measured=False)


def repeating(length: int = 16, p: float = 0.97) -> Ask:
    """A row whose context repeats: a long lookup draft, nearly all of it expected to be accepted."""
    expected = [1.0]
    for k in range(1, length + 1):
        expected.append(expected[-1] + p**k)
    return Ask(proposal=tuple(range(length)), match=4, lookup=expected)


def test_one_row_takes_a_lookup_draft_that_pays_and_keeps_the_head_otherwise():
    assert plan([repeating()], prior(CPU_BF16))[0].drafts == 8  # E/c is highest there: 8.0 tokens for 4.4 steps
    weak = Ask(proposal=(1, 2, 3), match=2, lookup=[1.0, 1.2, 1.25, 1.26])
    assert plan([weak], prior(CPU_BF16)) == [PLAIN_STEP]  # 1.2 tokens for 1.43 plain steps: plain
    head = Ask(depth=2, head=[1.0, 1.8, 2.4], proposal=(5, 6, 7), match=2, lookup=[1.0, 1.5, 1.7, 1.8])
    assert plan([head], prior(CPU_BF16)) == [Decision.head(2)]  # the head's 2.4 beats the context's 1.7 at width 3


def test_a_batch_never_widens_its_pass_at_the_cost_of_a_plain_row():
    # The workload: one request repeats, three others decode plain. On a CPU every row pays for the widest.
    asks = [repeating(), Ask(), Ask(), Ask()]
    assert plan(asks, prior(CPU_BF16)) == [PLAIN_STEP] * 4
    # Where a wide pass costs little more than a narrow one, the same rule takes the drafts.
    decisions = plan(asks, prior(GPU))
    assert decisions[0].drafts == 2 and decisions[1:] == [PLAIN_STEP] * 3  # 1/1.04 keeps the plain rows above 0.95
    # Rows that all gain share a wide pass.
    decisions = plan([repeating(), repeating(6)], prior(CPU_BF16))
    assert [d.drafts for d in decisions] == [6, 6]


def test_a_lookup_draft_fills_the_width_the_heads_already_pay_for():
    asks = [Ask(depth=3, head=[1.0, 1.5, 1.7, 1.8]), repeating()]
    assert plan(asks, prior(CPU_BF16)) == [Decision.head(3), Decision.from_lookup(tuple(range(3)), 4)]


def test_every_row_keeps_its_floor_when_the_pass_widens():
    # Row 0 drafts from the head at depth 1: its floor is 0.95 × min(1, 1.9 / c(2)). A pass of 9 would give it
    # 1.9 / 4.44 and is refused though the lookup row alone would prefer it; a pass of 2 gives the batch
    # (1.9 + 1.97) / 1.43, more than a pass of 3's (1.9 + 2.91) / 1.86.
    asks = [Ask(depth=1, head=[1.0, 1.9]), repeating()]
    assert plan(asks, prior(CPU_BF16)) == [Decision.head(1), Decision.from_lookup((0,), 4)]
    assert plan([Ask(depth=1, head=[1.0, 1.9]), repeating()], prior(CostModel(0.0)))[1].drafts == 16


def test_cost_model_measures_widths_and_falls_back_to_its_prior():
    model = CostModel(0.3)
    assert model(5) == pytest.approx(2.2)
    model.observe(1, 0.010)
    assert model(5) == pytest.approx(2.2)  # one width measured: still the prior
    for seconds in (0.019, 0.020, 0.021):
        model.observe(3, seconds)
    assert model(3) == pytest.approx(2.0) and model(3, measured=False) == pytest.approx(1.6)
    assert model(5) == pytest.approx(3.0)  # on the line through c(1) = 1 and c(3) = 2
    assert model(1) == 1.0


def test_pricing_follows_a_fixed_slope_in_the_settings():
    forced = LookupPolicy(LookupSettings(slope=0.0))
    price = pricing(CostModel(1.0), True, [None, forced])
    assert price(17) == 1.0
    assert pricing(CostModel(1.0), True, [None])(3) == 3.0


def test_chain_and_row_state_learn_from_what_cycles_gave():
    chain = Chain(4)
    assert chain.expected(2) == pytest.approx([1.0, 1.5, 1.75])
    for _ in range(50):
        chain.observe(4, 4)
    assert chain.expected(4)[-1] > 4.5
    state = RowState(LookupPolicy())
    state.lookup.index.extend([1, 2, 3, 9, 1, 2])
    ask = state.ask(0, room=2)
    assert ask.proposal == (3, 9) and ask.match == 2 and len(ask.lookup) == 3
    for _ in range(30):
        state.observe(2, 2, 0)  # the lookup drafts of 2-token matches were all rejected
    assert plan([state.ask(0, room=2)], prior(CPU_BF16)) == [PLAIN_STEP]
    assert state.ask(0, room=0).proposal == ()


def test_a_decision_says_what_the_head_runs():
    lookup = Decision.from_lookup((7, 8, 9), 3)
    assert lookup.drafts == 3 and lookup.depth == 0 and Decision.head(2).depth == 2 and PLAIN_STEP.drafts == 0


def test_estimates_fade_with_every_committed_token():
    state = RowState(LookupPolicy(LookupSettings(half_life=4.0)))
    for _ in range(10):
        state.observe(2, 2, 0)  # lookup drafts of 2-token matches rejected
    rejected = state.lookup.chains[2].expected(2)[-1]
    for _ in range(40):
        state.observe(0, 0, 0)  # plain steps: the rejections age
    assert state.lookup.chains[2].expected(2)[-1] > rejected + 0.3


def test_sampled_generations_learn_the_first_prior_of_lookup_drafts():
    prior = new_prior()
    first = LookupPolicy(prior=prior)
    assert first.chains[2].expected(1) == pytest.approx([1.0, 1.6])  # no evidence yet: the default
    for _ in range(6):
        first.observe(2, 3, 0)  # every lookup draft of this generation rejected
    later = [LookupPolicy(prior=prior).chains[3].expected(1)[1] - 1 for _ in range(4)]
    assert later[0] < 0.25 and later == sorted(later) and later[-1] < 0.6  # low, drifting back towards the default
    accepted = LookupPolicy(prior=prior)
    for _ in range(12):
        accepted.observe(4, 8, 8)
    assert LookupPolicy(prior=prior).chains[4].expected(1)[1] - 1 > 0.75
    own = lookup_policy(LookupSettings(first_prior=0.3), False, prior)  # constants the user set stay theirs
    assert own.prior is None and own.chains[2].expected(1) == pytest.approx([1.0, 1.3])


def test_one_scheduler_keys_both_loops_alike():
    """One keying rule (temperature rounded to 0.1, batch-size class, context band) for a single generation and a
    batch; a new band starts at the nearest shorter band's choice, a new one-row key at the default depth, larger
    batches parked; a depth policy is asked and told only through the scheduler."""
    scheduler = Scheduler(0.3, new_prior())
    one = scheduler.controller(0.0, 1, 100)
    assert scheduler.controller(0.04, 1, 2047) is one and one.choice == DEFAULT_DEPTH
    pair = scheduler.controller(0.0, 2, 100)
    assert pair is not one and scheduler.controller(0.0, 3, 100) is pair and pair.choice == PLAIN
    one.choice = 3
    assert scheduler.controller(0.0, 1, 5000).choice == 3  # band 2 starts at band 0's choice
    assert scheduler.controller(0.7, 1, 5000).choice == DEFAULT_DEPTH  # another temperature: its own

    class Policy:
        def __init__(self, depth):
            self.depth, self.told = depth, []

        def next_depth(self):
            return self.depth

        def observe(self, *report):
            self.told.append(report)

    assert scheduler.next_depth(Policy(3)) == 3
    with pytest.raises(ValueError, match="0..8"):
        scheduler.next_depth(Policy(9))
    policy = Policy(2)
    scheduler.observe(2, None, 1.0, policy, [(2, 1), (PLAIN, 0)])  # head steps ran: no cost measured
    assert policy.told == [(2, 1, 0.5), (PLAIN, 0, 0.5)] and not scheduler.costs.of(2).seconds
    scheduler.observe(2, 3, 0.8)
    assert list(scheduler.costs.of(3).seconds) == [3] and not scheduler.costs.of(1).seconds
