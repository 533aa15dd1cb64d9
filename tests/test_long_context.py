"""A prompt longer than the head's window (``drafter.window``) in ``mlx_lm.generate``: greedy MTP text equals plain
decoding's, the head is fed only the prompt's last pairs, the trunk's passes are cut where the window starts (which
leaves its caches bit-identical), and the first pass after the prompt is a plain step (the head's prompt pairs run
behind the first token)."""

import importlib
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from helpers.console_runs import HF, MLX4
from mlx_lm import load, stream_generate
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mtp_plugin.decoding import drafter, trunk

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def loaded():
    """The bundled bf16 checkpoint and a real source text long enough to exceed the head's context."""
    model, tokenizer = load(str(HF))
    source = Path(importlib.import_module("mlx_lm.generate").__file__).read_text()
    tokens = tokenizer.encode(source)[: drafter.HEAD_CONTEXT + 700]
    return model, tokenizer, tokens


def _generate(model, tokenizer, prompt, **options) -> list[int]:
    return [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS, **options)]


@pytest.fixture
def fed(monkeypatch):
    """Every ``Drafter.feed`` call's pair count, in order."""
    counts = []
    feed = drafter.Drafter.feed

    def counting(self, hidden, tokens, start):
        counts.append(tokens.size)
        return feed(self, hidden, tokens, start)

    monkeypatch.setattr(drafter.Drafter, "feed", counting)
    return counts


def test_a_long_prompt_feeds_the_head_its_last_pairs_and_stays_lossless(loaded, fed):
    model, tokenizer, prompt = loaded
    plain = _generate(model, tokenizer, prompt, enable_mtp=False)
    assert not fed
    tokens = _generate(model, tokenizer, prompt, mtp_depth=2, mtp_lookup=False)
    assert tokens == plain
    stats = model.mtp_head.stats
    assert stats.drafted > 0
    prompt_pairs = fed[0]  # one prefill pass holds the window here; the draft steps follow, one pair or a few each
    assert prompt_pairs == drafter.window(len(prompt)) - 1
    assert sum(fed) <= drafter.HEAD_CONTEXT + MAX_TOKENS * 3


@pytest.mark.parametrize("options", [{"kv_bits": 4, "quantized_kv_start": 600}, {"max_kv_size": 4096},
                                     {"max_kv_size": 1000}], ids=["kv-bits", "max-kv-size", "max-kv-size-wraps"])
def test_a_long_prompt_stays_lossless_under_the_cache_options(loaded, options):
    """mlx-lm's cache options over a prompt past the window: KV quantization switched on during the prompt (the prompt
    pass is not cut then), a rotating cache larger than the generation, one that wraps (MTP declines it)."""
    model, tokenizer, prompt = loaded
    plain = _generate(model, tokenizer, prompt, enable_mtp=False, **options)
    assert _generate(model, tokenizer, prompt, mtp_depth=2, **options) == plain


def test_the_trunk_passes_are_cut_where_the_window_starts(loaded, monkeypatch):
    """The prompt pass is cut in two at the window's first token, so the trunk's last layer runs only for the window's
    positions; the last token's pass is mlx-lm's own."""
    model, tokenizer, prompt = loaded
    passes = []
    hidden = trunk.StackTrunk.hidden

    def recording(self, tokens, cache):
        passes.append(tokens.shape[1])
        return hidden(self, tokens, cache)

    monkeypatch.setattr(trunk.StackTrunk, "hidden", recording)
    _generate(model, tokenizer, prompt, mtp_depth=2, mtp_lookup=False)
    start = len(prompt) - 1 - drafter.window(len(prompt))  # the window: pairs start … len(prompt) - 2
    assert passes[:3] == [start, len(prompt) - 1 - start, 1]


def test_cutting_the_prompt_pass_leaves_the_caches_bit_identical(loaded):
    """What makes the cut lossless against stock: on MLX's CPU backend a prompt processed in other chunks gives the
    same trunk caches, bit for bit (attention and GatedDeltaNet layers)."""
    model, _, prompt = loaded
    tokens = mx.array(prompt[:-1])[None]

    def caches(cuts):
        cache = make_prompt_cache(model)
        for start, stop in zip([0, *cuts], [*cuts, tokens.shape[1]], strict=True):
            model(tokens[:, start:stop], cache=cache)
            mx.eval([c.state for c in cache])
        return [a for c in cache for a in ((c.keys[..., : c.offset, :], c.values[..., : c.offset, :])
                                           if isinstance(c, KVCache) else c.cache)]

    whole, cut = caches([]), caches([699])
    assert len(whole) == len(cut) > 0
    assert all(mx.array_equal(a, b).item() for a, b in zip(whole, cut, strict=True))


def test_the_window_shrinks_as_the_context_grows():
    assert [drafter.window(n) for n in (100, 1024, 4096, 8192, 32768, 10**6)] == [1024, 1024, 256, 128, 32, 32]


def test_the_first_token_of_a_long_prompt_comes_from_a_plain_step(loaded):
    model, tokenizer, prompt = loaded
    _generate(model, tokenizer, prompt[:200], mtp_depth=2, mtp_lookup=False)
    short = model.mtp_head.stats.plain
    _generate(model, tokenizer, prompt, mtp_depth=2, mtp_lookup=False)
    assert model.mtp_head.stats.plain == short + 1 == 1


def test_a_long_prompt_without_a_head_drafts_from_the_context(loaded, tmp_path):
    """Lookup drafts only (the 4-bit conversion without its sidecar head): a long prompt decodes plain's tokens."""
    _, tokenizer, prompt = loaded
    shutil.copytree(MLX4, tmp_path / "headless", ignore=shutil.ignore_patterns("mtp.safetensors"))
    model, _ = load(str(tmp_path / "headless"))
    assert _generate(model, tokenizer, prompt, mtp_lookup=True) == _generate(model, tokenizer, prompt,
                                                                               enable_mtp=False)
