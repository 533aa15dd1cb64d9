"""Drafts from the context (prompt lookup) beside the head, and alone on models without one: the index, the policy,
and greedy output identical to plain decoding in mlx-lm (sampling: ``test_sampling.py``)."""

import importlib
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers.builders import KINDS, build_model, caches_after_close, config_for
from mlx_lm import load
from mlx_lm.models import llama
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mtp_plugin.adapters.mlx_lm_decoding import command_line_options

from mtp_plugin.decoding.lookup import ContextIndex, LookupSettings, lookup_policy
from mtp_plugin.decoding.options import MTPOptions

MLX4 = Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3_5" / "mlx-4bit"
SOURCE = "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n\n\n"
EDIT_PROMPT = SOURCE * 3 + "def read_config(path):\n"  # the greedy continuation repeats the text above
FORCED = LookupSettings(slope=0.0, first_prior=0.99)  # every match drafted, whatever it gave before
RANDOM_PROMPT = [5, 9, 14, 3, 5, 9, 14, 3, 5, 9, 30, 31, 5, 9]  # repeats: a random model still gets lookup drafts


def generate_step(*args, **kwargs):
    return importlib.import_module("mlx_lm.generate").generate_step(*args, **kwargs)


def tokens(model, prompt, **kwargs):
    return [t for t, _ in generate_step(mx.array(prompt), model, **kwargs)]


@pytest.fixture(scope="module")
def bundled():
    model, tokenizer = load(str(MLX4))
    return model, tokenizer.encode(EDIT_PROMPT)


def tiny_llama() -> llama.Model:
    """A random plain-KV model (every cache trimmable), no head."""
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=64,
                           tie_word_embeddings=True)
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module", params=[*KINDS, "llama"])
def headless(request):
    """A random model of each hybrid family and a plain-KV one, built without a head."""
    return tiny_llama() if request.param == "llama" else build_model(config_for(request.param))


def test_index_proposes_what_followed_the_latest_match():
    index = ContextIndex(2, 4)
    index.extend([1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3])
    assert index.propose(2) == ([4, 5], 3)  # "1 2 3" at the start (its repeat at the end has no follower yet)
    assert index.propose(8, behind=True) == ([5, 9, 2, 3, 7, 1, 2, 3], 3)


def test_index_extends_a_repeat_past_the_context_end():
    index = ContextIndex(2, 4)
    index.extend([7, 8, 7, 8, 7])
    assert index.propose(5) == ([8, 7, 8, 7, 8], 3)
    assert index.propose(5, behind=True) == ([7, 8, 7, 8, 7], 3)


def test_index_without_a_match_proposes_nothing():
    index = ContextIndex(2, 4)
    index.extend([1, 2, 3, 4, 5])
    assert index.propose(4) == ([], 0)
    index.extend([9])
    with pytest.raises(ValueError, match="n_min"):
        ContextIndex(3, 2)


def test_index_proposal_at_a_long_context_is_the_repeat_of_what_followed():
    index = ContextIndex(2, 4)
    context = [int(t) for t in np.random.default_rng(0).integers(10, 500, 32768)] + [1, 2, 3, 4, 5]
    index.extend(context + [1, 2, 3])
    assert index.propose(16) == (([4, 5, 1, 2, 3] * 4)[:16], 3)  # the match 3 tokens back: a repeat of period 5
    assert index.propose(4, behind=True)[0] == [5, 1, 2, 3]


def test_bad_lookup_option_is_refused(bundled):
    model, prompt = bundled
    with pytest.raises(ValueError, match="mtp_lookup"):
        tokens(model, prompt, max_tokens=4, mtp_lookup="yes")
    for bad in ({"max_len": 40}, {"half_life": 0}, {"first_prior": 1.5}, {"first_prior": 0}, {"prior_weight": -1},
                {"slope": -0.1}, {"n_min": 5}):
        with pytest.raises(ValueError, match=f"LookupSettings: {next(iter(bad))}="):
            LookupSettings(**bad)
    assert lookup_policy(None, headless=True) is None and lookup_policy(False, False) is None


@pytest.mark.parametrize("options", [{"mtp_lookup": FORCED}, {"mtp_lookup": FORCED, "mtp_depth": 2},
                                     {"mtp_lookup": LookupSettings(slope=0.0, max_len=3), "mtp_depth": 1}])
def test_greedy_identical_with_head_and_lookup(bundled, options):
    model, prompt = bundled
    plain = tokens(model, prompt, max_tokens=64, enable_mtp=False)
    assert tokens(model, prompt, max_tokens=64, **options) == plain
    stats = model.mtp_head.stats
    assert stats.lookup_cycles > 0 and stats.lookup_accepted > 0 and stats.cycles > 0  # mixed cycles
    assert stats.emitted + stats.lookup_emitted + stats.plain == len(plain) - 1
    assert "lookup: cycles=" in stats.summary()


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 17])
def test_lookup_drafts_never_run_past_max_tokens(bundled, max_tokens):
    model, prompt = bundled
    plain = tokens(model, prompt, max_tokens=max_tokens, enable_mtp=False)
    assert tokens(model, prompt, max_tokens=max_tokens, mtp_lookup=FORCED) == plain
    stats = model.mtp_head.stats
    assert stats.lookup_drafted <= max(max_tokens - 2, 0) * stats.lookup_cycles


def test_lookup_with_logits_processors_and_kv_quantization(bundled):
    model, prompt = bundled
    common = dict(max_tokens=40, logits_processors=make_logits_processors(repetition_penalty=1.1),
                  kv_bits=8, kv_group_size=32, quantized_kv_start=len(prompt) + 12)
    plain = tokens(model, prompt, enable_mtp=False, **common)
    assert tokens(model, prompt, mtp_lookup=FORCED, **common) == plain
    assert model.mtp_head.stats.lookup_cycles > 0


def test_sampled_generations_share_a_lookup_prior_and_greedy_ones_keep_theirs(bundled):
    model, prompt = bundled
    model.mtp_state = None  # a fresh state: a fresh prior
    tokens(model, prompt, max_tokens=24)
    prior = model.mtp_state.scheduler.lookup_prior
    assert prior.reached == [0.0, 0.0]  # greedy: the static prior of LookupSettings, the model's left alone
    mx.random.seed(3)
    sampled = tokens(model, prompt, max_tokens=48, sampler=make_sampler(0.8))
    assert prior.reached[1] == model.mtp_head.stats.lookup_cycles > 0
    mx.random.seed(3)
    assert tokens(model, prompt, max_tokens=48, sampler=make_sampler(0.8)) == sampled  # the prior drafts, never draws
    assert model.mtp_state.scheduler.lookup_prior is prior


def test_lookup_off_drafts_from_the_head_only(bundled):
    model, prompt = bundled
    plain = tokens(model, prompt, max_tokens=32, enable_mtp=False)
    assert tokens(model, prompt, max_tokens=32, mtp_lookup=False, mtp_depth=2) == plain
    assert model.mtp_head.stats.lookup_cycles == 0 and model.mtp_head.stats.cycles > 0


def test_headless_greedy_identical_and_cache_as_plain(headless):
    plain = tokens(headless, RANDOM_PROMPT, max_tokens=40, enable_mtp=False)
    assert tokens(headless, RANDOM_PROMPT, max_tokens=40, mtp_lookup=FORCED) == plain
    stats = headless.mtp_state.lookup_stats
    assert stats.lookup_cycles > 0 and stats.cycles == 0
    assert stats.lookup_emitted + stats.plain == len(plain) - 1
    assert stats.summary().startswith("MTP lookup: drafted=")
    tokens(headless, RANDOM_PROMPT[:3], max_tokens=2, mtp_lookup=FORCED)  # nothing to match: plain steps only
    summary = headless.mtp_state.lookup_stats.summary()
    assert summary == ("MTP lookup: drafted=0 accepted=0 cycles=0 plain=1 (the context never repeated what was being "
                       "generated: no lookup draft to verify)"), summary
    for stop in (3, 11):
        plain_cache, lookup_cache = caches_after_close(headless, RANDOM_PROMPT, stop, mtp_lookup=FORCED)
        for a, b in zip(plain_cache, lookup_cache, strict=True):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="off the CPU a verify pass costs little: drafts pay")
def test_a_lookup_that_drafts_nothing_says_why(tmp_path):
    """The bundled 4-bit conversion without its head, on a prompt whose continuation repeats it: on a CPU the cost
    model prices a pass of two 4-bit positions at two steps, so every lookup draft is declined, and the line says so."""
    shutil.copytree(MLX4, tmp_path / "headless", ignore=shutil.ignore_patterns("mtp.safetensors"))
    model, tokenizer = load(str(tmp_path / "headless"))
    tokens(model, tokenizer.encode(EDIT_PROMPT), max_tokens=24, mtp_lookup=True)
    stats = model.mtp_state.lookup_stats
    summary = stats.summary()
    assert " cycles=0 plain=23 (" in summary and stats.lookup_declined > 0, summary
    assert "lookup drafts declined as not worth a verify pass: one draft costs 2.00 plain steps here" in summary


def test_headless_decodes_stock_unless_asked(headless):
    plain = tokens(headless, RANDOM_PROMPT, max_tokens=12, enable_mtp=False)
    assert tokens(headless, RANDOM_PROMPT, max_tokens=12) == plain
    assert getattr(headless, "mtp_state", None) is None or headless.mtp_state.lookup_stats is None
    assert tokens(headless, RANDOM_PROMPT, max_tokens=12, mtp_lookup=True, enable_mtp=False) == plain
    assert getattr(headless, "mtp_state", None) is None or headless.mtp_state.lookup_stats is None


def test_cli_flags_are_the_generations_options(bundled):
    from mlx_lm.generate import setup_arg_parser

    on = setup_arg_parser().parse_args(["--mtp-lookup", "--mtp-depth", "3"])
    assert on.mtp_lookup is True and command_line_options(on) == MTPOptions(lookup=True, depth=3)
    off = setup_arg_parser().parse_args(["--no-mtp-lookup"])
    assert off.mtp_lookup is False and command_line_options(off) == MTPOptions(lookup=False)
    assert command_line_options(setup_arg_parser().parse_args([])) == MTPOptions()  # depth 0: automatic
    assert MTPOptions().over(depth=0).depth is None and MTPOptions(lookup=True).over(lookup=False).lookup is False
    model, prompt = bundled
    tokens(model, prompt, max_tokens=24, **{**command_line_options(off).keywords(), "mtp_depth": 2})
    assert model.mtp_head.stats.lookup_cycles == 0  # the flags are the generation's keywords
