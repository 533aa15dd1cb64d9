"""Varying draft depth and parked (plain) steps inside the MTP loop: output, caches and head history.

A ``Schedule`` replays a fixed sequence of depths (0: a plain step) through the loop's depth-policy
interface, so parking, resuming and depth changes happen at known places; the adaptive controller
itself runs on the trained tiny checkpoint.
"""

import importlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers.builders import (
    build_head,
    build_model,
    cache_arrays,
    caches_after_close,
    config_for,
    save_checkpoint,
    to_float32,
    trunk_weights,
)
from mlx_lm import load
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.utils import load_model

from mtp_plugin.decoding import single
from mtp_plugin.decoding.controller import PLAIN, DepthController
from mtp_plugin.decoding.drafter import HISTORY_WINDOW, PendingPairs
from mtp_plugin.plugins import hook

HF = Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3_5" / "hf"
CODE = "def read_config(path):\n    \"\"\"Read a JSON configuration file.\"\"\"\n    with open(path) as f:\n"
SCHEDULES = {
    "parked-first": [0, 0, 0, 2, 0, 1, 3],
    "mixed": [2, 0, 0, 0, 0, 0, 1, 8, 0, 3, 3, 0],
    "long-park": [1] + [0] * 15 + [4],
}


class Schedule:
    """A depth policy replaying ``depths`` cyclically; it checks that the loop ran what it was told, in order."""

    def __init__(self, depths):
        self.depths, self.asked, self.ran = depths, [], []

    def next_depth(self):
        self.asked.append(self.depths[len(self.asked) % len(self.depths)])
        return self.asked[-1]

    def observe(self, depth, accepted, seconds):
        assert depth == self.asked[len(self.ran)] and 0 <= accepted <= depth and seconds > 0
        self.ran.append((depth, accepted))


def generate_step(*args, **kwargs):
    return importlib.import_module("mlx_lm.generate").generate_step(*args, **kwargs)


def tokens(model, prompt, **kwargs):
    return [t for t, _ in generate_step(mx.array(prompt), model, **kwargs)]


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    config = config_for("qwen3_5")
    built = build_model(config)
    path = save_checkpoint(tmp_path_factory.mktemp("adaptive"), config, trunk_weights(built),
                           build_head(built, config), "mtp.safetensors")
    return load_model(path)[0]


@pytest.fixture(scope="module")
def tiny():
    """The trained tiny checkpoint in float32 (its head accepts about half the drafts)."""
    model, tokenizer = load(str(HF))
    to_float32(model)
    return model, tokenizer.encode(CODE)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_greedy_identical_random_model(random_model, schedule):
    prompt = [3, 17, 42, 99, 7, 128, 5, 64]
    plain = tokens(random_model, prompt, max_tokens=30, enable_mtp=False)
    policy = Schedule(SCHEDULES[schedule])
    assert tokens(random_model, prompt, max_tokens=30, mtp_depth=policy) == plain
    stats = random_model.mtp_head.stats
    assert stats.depth is None and stats.plain > 0
    assert stats.emitted + stats.plain + stats.lookup_emitted == len(plain) - 1
    assert stats.depths == [d for d, _ in policy.ran if d != PLAIN][: stats.cycles]


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_greedy_identical_tiny_checkpoint(tiny, schedule):
    model, prompt = tiny
    plain = tokens(model, prompt, max_tokens=60, enable_mtp=False)
    assert tokens(model, prompt, max_tokens=60, mtp_depth=Schedule(SCHEDULES[schedule]), mtp_lookup=False) == plain
    assert model.mtp_head.stats.accepted > 0


def test_adaptive_identical_tiny_checkpoint(tiny):
    model, prompt = tiny
    plain = tokens(model, prompt, max_tokens=120, enable_mtp=False)
    controller = DepthController(start=3)
    assert tokens(model, prompt, max_tokens=120, mtp_depth=controller) == plain
    assert tokens(model, prompt, max_tokens=120) == plain  # automatic depth: a fresh controller
    stats = model.mtp_head.stats
    assert stats.depth is None and "depth=auto" in stats.summary() and stats.cycles + stats.plain > 0


def test_logits_processors_with_parking(random_model):
    kwargs = dict(max_tokens=24, logits_processors=make_logits_processors(repetition_penalty=1.5))
    plain = tokens(random_model, [3, 17, 42, 99], enable_mtp=False, **kwargs)
    assert tokens(random_model, [3, 17, 42, 99], mtp_depth=Schedule(SCHEDULES["mixed"]), **kwargs) == plain


@pytest.mark.parametrize("max_tokens", [0, 1, 2, 3, 5, 9])
@pytest.mark.parametrize("schedule", ["parked-first", "mixed"])
def test_cache_after_generation_equals_plain(random_model, max_tokens, schedule):
    caches = []
    for depth in (None, Schedule(SCHEDULES[schedule])):
        cache = make_prompt_cache(random_model)
        tokens(random_model, [3, 17, 42, 99, 7], max_tokens=max_tokens, prompt_cache=cache,
               enable_mtp=depth is not None, mtp_depth=depth)
        caches.append(cache_arrays(cache))
    for plain, mtp in zip(*caches, strict=True):
        np.testing.assert_allclose(mtp, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stop", [1, 2, 4, 6])
def test_generator_closed_while_parked_leaves_plain_cache(random_model, stop):
    plain_cache, mtp_cache = caches_after_close(random_model, [3, 17, 42, 99, 7], stop,
                                                mtp_depth=Schedule(SCHEDULES["parked-first"]))
    for plain, mtp in zip(plain_cache, mtp_cache, strict=True):
        np.testing.assert_allclose(mtp, plain, rtol=1e-5, atol=1e-5)


def test_head_history_after_parking_equals_feeding_all_along(tiny):
    """The head's KV cache after parks and depth changes equals one pass of the head over every pair
    (h[i], x[i+1]) of the final context: the drafts are those of a head fed at every token."""
    model, prompt = tiny
    head = model.mtp_head.module
    trunk = hook().mtp_trunk(model=model, contract=head.contract)
    head_cache = KVCache()
    out = [t for t, _ in single.generate(mx.array(prompt), trunk, head, cache=make_prompt_cache(model),
                                           head_cache=head_cache, depth=Schedule(SCHEDULES["long-park"]),
                                           max_tokens=50)]
    sequence = mx.array(prompt + out)[None]
    hidden = trunk.hidden(sequence, None)
    reference = KVCache()
    head(hidden[:, :-1], trunk.embed(sequence[:, 1:]), cache=reference)
    fed = head_cache.offset
    assert len(prompt) + 20 < fed < sequence.shape[1]
    for got, want in ((head_cache.keys, reference.keys), (head_cache.values, reference.values)):
        np.testing.assert_allclose(np.array(got[..., :fed, :]), np.array(want[..., :fed, :]), rtol=1e-4, atol=1e-4)


def test_park_longer_than_the_window_feeds_only_its_last_pairs(tiny):
    """After a park longer than ``HISTORY_WINDOW`` tokens the head is fed only the window's pairs (its history has a
    gap of the rest), and the output is still plain greedy's."""
    model, prompt = tiny
    head = model.mtp_head.module
    trunk = hook().mtp_trunk(model=model, contract=head.contract)
    gap, head_cache = 12, KVCache()
    n = HISTORY_WINDOW + gap + 6
    schedule = Schedule([1] + [0] * (HISTORY_WINDOW + gap) + [2] * 8)
    out = [t for t, _ in single.generate(mx.array(prompt), trunk, head, cache=make_prompt_cache(model),
                                           head_cache=head_cache, depth=schedule, max_tokens=n)]
    assert out == tokens(model, prompt, enable_mtp=False, max_tokens=n)
    assert any(depth == 2 for depth, _ in schedule.ran)  # drafting resumed after the long park
    assert head_cache.offset <= len(prompt) + n - gap


def test_pending_pairs_keep_the_newest_window():
    pairs = PendingPairs(window=5)
    assert pairs.take() is None and not pairs.add(mx.zeros((1, 3, 2)), mx.array([0, 1, 2]))
    assert pairs.add(mx.ones((1, 4, 2)), mx.array([3, 4, 5, 6]))  # 7 pairs: the two oldest are dropped
    assert len(pairs) == 5
    hidden, following = pairs.take()
    assert following.tolist() == [2, 3, 4, 5, 6] and hidden[0, :, 0].tolist() == [0, 1, 1, 1, 1]
    assert len(pairs) == 0 and pairs.peek() is None


def test_policy_depth_out_of_range_is_refused(random_model):
    with pytest.raises(ValueError, match="depth policy chose depth 9"):
        tokens(random_model, [3, 17, 42], max_tokens=4, mtp_depth=Schedule([9]))


def test_generator_closed_anywhere_leaves_plain_cache(tiny):
    """Closed after every token count up to 14: inside a cycle's accepted drafts, on its bonus token, on a
    plain step, with a plain step or a cycle already queued behind the block; the cache equals plain's."""
    model, prompt = tiny
    depths = [3, 0, 2, 3, 0, 0, 4, 1]
    seen = Schedule(depths)
    tokens(model, prompt, max_tokens=14, mtp_depth=seen)
    assert any(accepted >= 2 for _, accepted in seen.ran), "no cycle accepted two drafts: partial blocks untested"
    for stop in range(1, 15):
        plain_cache, mtp_cache = caches_after_close(model, prompt, stop, mtp_depth=Schedule(depths))
        for plain, mtp in zip(plain_cache, mtp_cache, strict=True):
            np.testing.assert_allclose(mtp, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cycles", [1, 2, 3])
def test_policy_error_between_blocks_leaves_plain_cache(tiny, cycles):
    """A policy refused after some cycles: the cache holds the prompt and the yielded tokens only."""
    model, prompt = tiny
    cache, out = make_prompt_cache(model), []
    with pytest.raises(ValueError, match="depth policy chose depth 9"):
        for token, _ in generate_step(mx.array(prompt), model, prompt_cache=cache, max_tokens=40,
                                      mtp_depth=Schedule([3] * cycles + [9])):
            out.append(token)
    plain = make_prompt_cache(model)
    assert tokens(model, prompt, max_tokens=len(out), prompt_cache=plain, enable_mtp=False) == out
    for want, got in zip(cache_arrays(plain), cache_arrays(cache), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
