"""Reduced-vocabulary drafting (``draft_vocab.py``): drafts come from the subset S only, the output stays the trunk's
(greedy: token for token at every depth, alone and in the server's batch), and a tuned subset is found at load time.

The sampled distribution with a subset is checked in ``test_sampling.py`` (chi-square against the exact marginals).
"""

import importlib
import json
import logging
import shutil
from collections import Counter

import mlx.core as mx
import pytest
from helpers.builders import to_float32
from helpers.console_runs import HF
from mlx_lm import load
from mlx_lm.sample_utils import make_sampler

from mtp_plugin import tuning
from mtp_plugin.decoding.batch import BatchDrafter
from mtp_plugin.head import draft_vocab
from mtp_plugin.plugins import hook

PROMPT = "def fibonacci(n):\n"
SUBSET = 64  # of 2048: most of the trunk's tokens are outside it, so many drafts would be without the subset


def subset_of(model, ids):
    """The ``DraftVocabulary`` of ``ids`` for ``model``'s trunk."""
    trunk = hook().mtp_trunk(model=model, contract=model.mtp_head.module.contract)
    return draft_vocab.build(trunk, ids, "test")


def spy_drafts(monkeypatch) -> list[int]:
    """Every draft token the single-stream loop proposes from now on."""
    drafted = []
    original = BatchDrafter._choose

    def choose(self, rows, g, depths, k, allowed=None):
        out = original(self, rows, g, depths, k, allowed)
        drafted.extend(out[0].reshape(-1).tolist())
        return out

    monkeypatch.setattr(BatchDrafter, "_choose", choose)
    return drafted


@pytest.fixture(scope="module")
def trained():
    """The bundled trained checkpoint in float32, its tokenizer, the prompt and stock greedy tokens."""
    model, tokenizer = load(str(HF))
    model = to_float32(model)
    prompt = mx.array(tokenizer.encode(PROMPT))
    generate_step = importlib.import_module("mlx_lm.generate").generate_step
    stock = [t for t, _ in generate_step(prompt, model, max_tokens=48, enable_mtp=False)]
    return model, prompt, stock


@pytest.mark.parametrize("depth", range(1, 9))
def test_greedy_identical_with_subset_and_drafts_inside_it(trained, depth, monkeypatch):
    model, prompt, stock = trained
    vocab_size = hook().mtp_trunk(model=model, contract=model.mtp_head.module.contract).vocab_size()
    ids = draft_vocab.rank(Counter(stock[::2]), vocab_size, SUBSET)  # half the output's tokens are in S, some not
    assert set(stock) - set(ids)
    model.mtp_head.draft_vocab = subset_of(model, ids)
    drafted = spy_drafts(monkeypatch)
    try:
        generate_step = importlib.import_module("mlx_lm.generate").generate_step
        out = [t for t, _ in generate_step(prompt, model, max_tokens=48, mtp_depth=depth)]
    finally:
        model.mtp_head.draft_vocab = None
    assert out == stock
    assert drafted and set(drafted) <= set(ids)
    assert model.mtp_head.stats.accepted > 0


def test_server_batch_drafts_inside_the_subset(trained, monkeypatch):
    """mlx-lm's server batch (the plugin's batched MTP): rows decode their stock tokens, drafts only from S."""
    from mtp_plugin.adapters.mlx_lm_server import MTPRequest
    from test_batching import drain, insert, mtp_generator

    from mtp_plugin.decoding import batch

    model, prompt, stock = trained
    ids = sorted(set(stock[1::2]) | set(range(32)))
    model.mtp_head.draft_vocab = subset_of(model, ids)
    drafted = []
    original = batch.propose

    def propose(*args, **kwargs):
        tokens, q = original(*args, **kwargs)
        drafted.extend(tokens.tolist())
        return tokens, q

    monkeypatch.setattr(batch, "propose", propose)
    try:
        generator = mtp_generator(model)
        uids = insert(generator, [prompt.tolist()] * 2, [48, 30], [MTPRequest(True, 2), MTPRequest(True, 3)])
        results = {}
        drain(generator, results)
    finally:
        model.mtp_head.draft_vocab = None
    assert [results[u] for u in uids] == [stock, stock[:30]]
    assert drafted and set(drafted) <= set(ids)


def test_rank_orders_by_frequency_then_lowest_unseen_ids():
    counts = Counter({7: 5, 3: 5, 9: 1, 100: 2, 5000: 9})  # 5000 is outside the vocabulary
    assert draft_vocab.rank(counts, 200, 3) == [3, 7, 100]
    assert draft_vocab.rank(counts, 200, 6) == [0, 1, 3, 7, 9, 100]
    assert draft_vocab.candidate_sizes(2048) == [128, 256, 512]


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return shutil.copytree(HF, tmp_path / "model")


def test_loading_picks_up_the_tuned_subset(model_dir, monkeypatch):
    ids = list(range(0, 600, 3))
    draft_vocab.write(model_dir, ids, {})
    model, _ = load(str(model_dir))
    assert model.mtp_head.draft_vocab.ids.tolist() == ids
    assert "draft vocabulary 200 tokens" in model.mtp_head.summary()

    monkeypatch.setenv(draft_vocab.OFF_ENV, "1")  # one option turns it off
    assert load(str(model_dir))[0].mtp_head.draft_vocab is None
    monkeypatch.delenv(draft_vocab.OFF_ENV)

    tuning.record(model_dir, 2, {}, draft_vocab=[5, 6, 7])  # the user cache's record comes first
    assert load(str(model_dir))[0].mtp_head.draft_vocab.ids.tolist() == [5, 6, 7]
    tuning.record(model_dir, 2, {}, draft_vocab=None)  # tuned to the full vocabulary
    assert load(str(model_dir))[0].mtp_head.draft_vocab is None


@pytest.mark.parametrize("content", ["{not json", "[" * 100000, json.dumps({"token_ids": [1, 1, 2]}),
                                     json.dumps({"token_ids": [1, 99999]}), json.dumps([1, 2])])
def test_unusable_subset_file_is_ignored_with_a_warning(model_dir, content, caplog):
    (model_dir / draft_vocab.FILE_NAME).write_text(content)
    with caplog.at_level(logging.WARNING, logger="mtp_plugin"):
        model, tokenizer = load(str(model_dir))
    assert model.mtp_head is not None and model.mtp_head.draft_vocab is None
    assert draft_vocab.FILE_NAME in caplog.text and "full vocabulary" in caplog.text
    generate_step = importlib.import_module("mlx_lm.generate").generate_step
    out = list(generate_step(mx.array(tokenizer.encode(PROMPT)), model, max_tokens=5, mtp_depth=2,
                             sampler=make_sampler(0.0)))
    assert len(out) == 5


@pytest.mark.parametrize("damaged", ['{"records": 5}', "[]", '{"records": [1]}', "{"])
def test_damaged_user_cache_is_ignored_and_replaced(model_dir, damaged):
    tuning.cache_file().parent.mkdir(parents=True)
    tuning.cache_file().write_text(damaged)
    draft_vocab.write(model_dir, [1, 2, 3], {})
    assert load(str(model_dir))[0].mtp_head.draft_vocab.ids.tolist() == [1, 2, 3]  # the model's file, as if no cache
    tuning.record(model_dir, 1, {}, draft_vocab=[4, 5])
    assert tuning.recorded(model_dir)["draft_vocab"] == [4, 5]
