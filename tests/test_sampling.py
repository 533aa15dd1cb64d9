"""Temperature sampling with MTP draws from exactly the trunk's distribution (position-keyed draws that the drafts
share, ``coupling.GumbelDraws``), and a seed fixes the tokens whatever the loop drafts.

A small-vocabulary float32 model of each family with a random head (so drafts are accepted and rejected often): the
empirical distribution of generated tokens 2 and 3 under MTP is compared, by a chi-square
goodness-of-fit test, with the exact marginals computed from the trunk by enumeration.
"""

import importlib

import mlx.core as mx
import numpy as np
import pytest
from helpers import nextn_builders
from helpers.builders import build_head, build_model, config_for, save_checkpoint, trunk_weights
from mlx_lm.sample_utils import apply_top_k, make_sampler
from mlx_lm.utils import load_model
from scipy.stats import chisquare

from mtp_plugin.decoding.lookup import LookupSettings

VOCAB = 24
PROMPT = [3, 9, 1, 17]
RUNS = 1500


@pytest.fixture(scope="module", params=["qwen3_5", "deepseek_v3"])
def model(request, tmp_path_factory):
    """A Qwen3.5 head, and a DeepSeek-V3 next-n head (MLA attention, MoE layer) of the second family."""
    if request.param == "qwen3_5":
        config = config_for("qwen3_5")
        config["text_config"]["vocab_size"] = VOCAB
    else:
        config = {**nextn_builders.config_for(request.param), "vocab_size": VOCAB}
    built = build_model(config, seed=3)
    path = save_checkpoint(tmp_path_factory.mktemp("small"), config, trunk_weights(built),
                           build_head(built, config), "mtp.safetensors")
    return load_model(path)[0]


def distribution(model, sequences, temp, top_k):
    """Sampling distribution of the next token after each sequence (rows), as mlx-lm's sampler defines it."""
    logits = model(mx.array(sequences))[:, -1, :].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if top_k:
        logprobs = apply_top_k(logprobs, top_k)
    return np.array(mx.softmax(logprobs / temp, axis=-1))


def exact_marginals(model, temp, top_k, prompt=PROMPT):
    """Exact marginal distributions of generated tokens 2 and 3 by enumerating tokens 1 and 2."""
    p1 = distribution(model, [prompt], temp, top_k)[0]
    p2 = distribution(model, [prompt + [a] for a in range(VOCAB)], temp, top_k)
    p3 = distribution(model, [prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)], temp, top_k)
    joint12 = p1[:, None] * p2
    return joint12.sum(0), (joint12.reshape(-1, 1) * p3).sum(0)


def chi_square_p(samples, expected, vocab=VOCAB):
    observed = np.bincount(samples, minlength=vocab).astype(float)
    expected = expected.astype(np.float64)
    expected = expected / expected.sum() * len(samples)
    keep = expected >= 5
    observed = np.append(observed[keep], observed[~keep].sum())
    expected = np.append(expected[keep], expected[~keep].sum())
    return chisquare(observed[expected > 0], expected[expected > 0]).pvalue


@pytest.mark.parametrize("temp,top_k,depth", [(1.0, 0, 2), (0.7, 8, 3)])
def test_mtp_sampling_matches_trunk_distribution(model, temp, top_k, depth):
    generate_step = importlib.import_module("mlx_lm.generate").generate_step
    sampler = make_sampler(temp=temp, top_k=top_k)
    mx.random.seed(1234)
    second, third, accepted, drafted = [], [], 0, 0
    for _ in range(RUNS):
        out = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=3, sampler=sampler, mtp_depth=depth)]
        second.append(out[1])
        third.append(out[2])
        accepted += model.mtp_head.stats.accepted
        drafted += model.mtp_head.stats.drafted
    assert 0 < accepted < drafted  # both acceptance and the residual path were exercised
    m2, m3 = exact_marginals(model, temp, top_k)
    assert chi_square_p(np.array(second), m2) > 1e-3
    assert chi_square_p(np.array(third), m3) > 1e-3


def test_mtp_sampling_with_draft_vocabulary_matches_trunk_distribution(model, monkeypatch):
    """Drafts from half the vocabulary only (q zero outside it): the output keeps the trunk's distribution, and no
    draft is ever outside the subset."""
    from mtp_plugin.decoding.batch import BatchDrafter
    from mtp_plugin.head import draft_vocab
    from mtp_plugin.plugins import hook

    ids = list(range(0, VOCAB, 2))
    model.mtp_head.draft_vocab = draft_vocab.build(
        hook().mtp_trunk(model=model, contract=model.mtp_head.module.contract), ids, "test")
    drafted, original = [], BatchDrafter._choose
    monkeypatch.setattr(BatchDrafter, "_choose", lambda self, *a: drafted.extend((out := original(self, *a))[0]
                                                                                 .reshape(-1).tolist()) or out)
    generate_step = importlib.import_module("mlx_lm.generate").generate_step
    sampler = make_sampler(temp=1.0)
    mx.random.seed(4321)
    second, third = [], []
    try:
        for _ in range(RUNS):
            out = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=3, sampler=sampler, mtp_depth=2)]
            second.append(out[1])
            third.append(out[2])
    finally:
        model.mtp_head.draft_vocab = None
    assert set(drafted) <= set(ids)
    assert set(second) - set(ids)  # tokens outside the subset are still emitted (a rejected draft's)
    m2, m3 = exact_marginals(model, 1.0, 0)
    assert chi_square_p(np.array(second), m2) > 1e-3
    assert chi_square_p(np.array(third), m3) > 1e-3


@pytest.mark.parametrize("headless", [False, True])
def test_lookup_sampling_matches_trunk_distribution(model, headless):
    """A lookup draft is a point-mass proposal: accepted with probability p(d), else a token of the residual (p without
    d, renormalised). With the head: the lookup cycle, then a head cycle after a rejection (mixed cycles in one
    generation); without one (the model's head taken away): lookup cycles and plain steps."""
    if headless and model.model_type != "qwen3_5":
        pytest.skip("without a head no family code runs: one family covers it")
    generate_step = importlib.import_module("mlx_lm.generate").generate_step
    prompt = [3, 9, 1, 17, 3, 9]  # "3 9" proposes "1 17 …": the draft after token 1 is 17
    sampler, head = make_sampler(temp=1.0), model.mtp_head
    mx.random.seed(99)
    second, third, lookup, cycles = [], [], [0, 0], 0
    try:
        model.mtp_head = None if headless else head
        for _ in range(RUNS):
            out = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=3, sampler=sampler, mtp_depth=1,
                                               mtp_lookup=LookupSettings(slope=0.0, first_prior=0.99))]
            second.append(out[1])
            third.append(out[2])
            stats = model.mtp_state.lookup_stats if headless else head.stats
            lookup = [lookup[0] + stats.lookup_accepted, lookup[1] + stats.lookup_drafted]
            cycles += stats.cycles
    finally:
        model.mtp_head = head
    assert 0 < lookup[0] < lookup[1] == RUNS  # one lookup draft per generation, accepted and rejected
    assert (cycles == 0) if headless else (cycles > 0)
    m2, m3 = exact_marginals(model, 1.0, 0, prompt)
    assert chi_square_p(np.array(second), m2) > 1e-3
    assert chi_square_p(np.array(third), m3) > 1e-3


def test_same_seed_same_tokens_whatever_is_drafted(model):
    """As in stock mlx-lm, a seed fixes the sampled tokens: the same at every depth, adaptive (whose depths follow
    clocks and what earlier generations measured), with and without lookup drafts, and run after run; and MLX's key
    sequence is left as stock mlx-lm leaves it (a draw per token and one more)."""
    generate_step = importlib.import_module("mlx_lm.generate").generate_step
    sampler = make_sampler(temp=0.9, top_k=12)
    runs, after = {}, {}
    for name, options in {"adaptive": {}, "adaptive again": {}, "depth 1": {"mtp_depth": 1},
                          "depth 3": {"mtp_depth": 3}, "no lookup": {"mtp_depth": 2, "mtp_lookup": False},
                          "lookup always": {"mtp_depth": 2, "mtp_lookup": LookupSettings(slope=0.0)}}.items():
        mx.random.seed(7)
        runs[name] = [t for t, _ in generate_step(mx.array(PROMPT * 3), model, max_tokens=40, sampler=sampler,
                                                  **options)]
        assert model.mtp_head.stats.drafted > 0 or "mtp_depth" not in options, name  # adaptive: it may park
        after[name] = mx.random.state[0].tolist()
    mx.random.seed(7)
    stock = [t for t, _ in generate_step(mx.array(PROMPT * 3), model, max_tokens=40, sampler=sampler,
                                         enable_mtp=False)]
    assert len(set(map(tuple, runs.values()))) == 1, runs
    assert len(stock) == 40 and {tuple(a) for a in after.values()} == {tuple(mx.random.state[0].tolist())}


@pytest.mark.parametrize("depth", ["3", 2.5, True, False])
def test_bad_depth_is_refused_when_sampling(model, depth):
    generate_step = importlib.import_module("mlx_lm.generate").generate_step
    with pytest.raises(ValueError, match="mtp_depth"):
        generate_step(mx.array(PROMPT), model, max_tokens=4, mtp_depth=depth, sampler=make_sampler(temp=0.9))


def test_walk_sampling_matches_processed_distributions():
    """A verify pass read position by position (``decoding.Walk``: with logits processors) is exact speculative
    sampling: the first token is drawn from the processed p0, the token after an accepted draft from p1, the bonus
    token after two from p2, whatever q the drafts came from (a head whose output is not finite: every draft
    rejected, the first token still from p0)."""
    from mtp_plugin.decoding.acceptance import Walk
    from mtp_plugin.decoding.sampling import Sampling

    rng = np.random.default_rng(0)
    vocab, trials = 6, 3000
    logits = mx.array(rng.normal(size=(3, vocab)), dtype=mx.float32)
    bias = mx.array(rng.normal(size=(vocab,)), dtype=mx.float32)

    def processor(tokens, row):
        return row + bias

    q = rng.dirichlet(np.ones(vocab), size=2)
    p = np.array(mx.softmax(logits + bias, axis=-1))
    sampling, history = Sampling(1.0), mx.array([1, 2], dtype=mx.uint32)
    mx.random.seed(5)
    seen = {0: [], 1: [], 2: [], "nonfinite": []}
    for trial in range(trials):
        drafts = [rng.choice(vocab, p=q[0]), rng.choice(vocab, p=q[1])]
        inputs = mx.array([3, *drafts], dtype=mx.uint32)
        finite = mx.array(trial % 10 != 0)
        walk = Walk(logits, inputs, history, [processor], sampling, mx.array(q, dtype=mx.float32), finite)
        for position in range(3):
            walk.process()
            token, ok = walk.read()
            if trial % 10 == 0:
                seen["nonfinite"].append(token)
                assert not ok
                break
            seen[position].append(token)
            if not ok:
                break
            assert token == drafts[position]
    for position in range(3):
        assert chi_square_p(np.array(seen[position]), p[position], vocab) > 1e-3, position
    assert chi_square_p(np.array(seen["nonfinite"]), p[0], vocab) > 1e-3
