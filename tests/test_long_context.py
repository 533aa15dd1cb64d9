"""A prompt longer than the head's context (``drafter.HEAD_CONTEXT``) in ``mlx_lm.generate``: greedy MTP text equals
plain decoding's, the head is fed only the prompt's last ``HEAD_CONTEXT`` pairs, and the first pass after the prompt
is a plain step (the head's prompt pairs run behind the first token)."""

import importlib
import shutil
from pathlib import Path

import pytest
from helpers.console_runs import HF, MLX4
from mlx_lm import load, stream_generate

from mtp_plugin.decoding import drafter

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
    prompt_pairs = fed[0]  # one prefill chunk holds the window here; the draft steps follow, one pair or a few each
    assert prompt_pairs == drafter.HEAD_CONTEXT - 1
    assert sum(fed) <= drafter.HEAD_CONTEXT + MAX_TOKENS * 3


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
