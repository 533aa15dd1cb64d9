"""Batched MTP inside mlx-lm's own ``BatchGenerator`` (as ``mlx_lm.server`` builds it), on the real runtime.

Every row of a batch must decode exactly what the same request decodes alone with stock mlx-lm (greedy:
token for token; sampling: the trunk's distribution), whatever the other rows do: different prompt
lengths, depths, processors, MTP off, rows joining between cycles and rows cancelled; and the cache a row
leaves must equal a replay of its tokens.
"""

import importlib
import logging
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers.builders import (
    build_head,
    build_model,
    cache_arrays,
    config_for,
    save_checkpoint,
    to_float32,
    trunk_weights,
)
from helpers.console_runs import HF
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.utils import load_model
from mtp_plugin.adapters import capture
from mtp_plugin.adapters.mlx_lm_server import MTPRequest, RequestProcessors
from mtp_plugin.adapters.patching import release
from test_sampling import PROMPT, VOCAB, chi_square_p, exact_marginals

from mtp_plugin.decoding import rollback
from mtp_plugin.decoding.drafter import HISTORY_WINDOW
from mtp_plugin.decoding.lookup import ContextIndex, LookupSettings
from mtp_plugin.decoding.options import MTPOptions
from mtp_plugin.decoding.scheduler import Scheduler
from mtp_plugin.decoding.state import state_of

# mlx-lm < 0.32 pollutes the GatedDeltaNet state of right-padded prompt rows (its ArraysCache mask ignores the
# prompt lengths), so its own batched output differs from a request served alone; there the reference of a batch
# is stock mlx-lm batching the same rows.
ALONE_IS_REFERENCE = release("mlx-lm") >= (0, 32)

PROMPTS = ["def fib(n):", "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path", "for i in range(",
           "x", "    return self._data[key]\n", "def main():\n    parser = argparse.ArgumentParser("]
MAX_TOKENS = [40, 28, 33, 20, 30, 36]


@pytest.fixture(scope="module")
def trained():
    """The bundled trained checkpoint in float32 (exact greedy comparisons), and its tokenizer."""
    model, tokenizer = load(str(HF))
    return to_float32(model), tokenizer


def stock_tokens(model, prompts: list, max_tokens: list, processors=None) -> list[list[int]]:
    """What a stock mlx-lm server decodes for each request: mlx-lm's own ``BatchGenerator``, each request alone
    (where mlx-lm batches correctly), else all of them in one batch."""
    generator_class = importlib.import_module("mlx_lm.generate").BatchGenerator
    processors = processors or [[]] * len(prompts)
    groups = [[i] for i in range(len(prompts))] if ALONE_IS_REFERENCE else [list(range(len(prompts)))]
    out = {}
    for group in groups:
        generator = generator_class(model)
        uids = generator.insert([prompts[i] for i in group], max_tokens=[max_tokens[i] for i in group],
                                samplers=[make_sampler(0.0)] * len(group),
                                logits_processors=[processors[i] for i in group])
        results = {}
        drain(generator, results)
        out.update({i: results[uid] for i, uid in zip(group, uids, strict=True)})
    return [out[i] for i in range(len(prompts))]


def mtp_generator(model):
    """The server's ``BatchGenerator`` (the plugin's wrapper) for ``model``: it must decode with MTP."""
    server = importlib.import_module("mlx_lm.server")
    generator = server.BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    assert type(generator._generation_batch).__name__ == "MTPGenerationBatch"
    return generator


def insert(generator, prompts, max_tokens, options=None, processors=None, sampler=None) -> list[int]:
    """Insert requests one by one as the server does, each with its own MTP options (carried by its processors)."""
    uids = []
    for i, prompt in enumerate(prompts):
        carried = RequestProcessors((processors or [[]] * len(prompts))[i])
        carried.mtp = (options or [None] * len(prompts))[i]
        uids += generator.insert([prompt], max_tokens=[max_tokens[i]], samplers=[sampler or make_sampler(0.0)],
                                 logits_processors=[carried])
    return uids


def drain(generator, results: dict, steps: int | None = None) -> None:
    """Collect generated tokens per uid until the generator is idle (or for ``steps`` calls)."""
    n = 0
    while steps is None or n < steps:
        responses = generator.next_generated()
        n += 1
        if not responses:
            return
        for r in responses:
            results.setdefault(r.uid, []).append(r.token)


@pytest.mark.parametrize("depth", [1, 3, 0])
def test_rows_decode_as_stock_alone(trained, depth):
    """Mixed prompt lengths and max_tokens, one row with a repetition penalty, one with MTP off; depth 0: adaptive."""
    model, tokenizer = trained
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    processors = [[], make_logits_processors(repetition_penalty=1.3), [], [], [], []]
    options = [MTPRequest(True, depth), MTPRequest(True, depth), MTPRequest(False), None, MTPRequest(True, depth),
               MTPRequest(True, depth)]
    generator = mtp_generator(model)
    uids = insert(generator, prompts, MAX_TOKENS, options, processors)
    results = {}
    drain(generator, results)
    assert [results[uid] for uid in uids] == stock_tokens(model, prompts, MAX_TOKENS, processors)
    assert options[0].stats is not None and options[2].stats is None  # MTP off: plain tokens in the same passes
    if depth:  # adaptive rows draft as their policy's measured costs say (a clock): Schedule below forces it
        assert options[0].stats.drafted > 0 and options[0].stats.accepted > 0
        assert set(options[0].stats.depths) == {depth}


def test_a_batch_keeps_a_policy_per_context_band(trained):
    """A one-row batch past 2048 tokens of context gets its own adaptive policy (``scheduler.context_band``), started
    at the shorter band's choice; the short band's is left as it was."""
    model, tokenizer = trained
    generator = mtp_generator(model)
    controllers = model.mtp_state.scheduler.controllers
    insert(generator, [tokenizer.encode(PROMPTS[0])], [8], [MTPRequest(True, 0, False)])
    drain(generator, {})
    short = controllers[0.0, 1, 0]
    short.choice = short.running = 3  # as if it had settled there
    before = list(short.cycles_at)
    source = Path(importlib.import_module("mlx_lm.generate").__file__).read_text()
    insert(generator, [tokenizer.encode(source)[:2100]], [8], [MTPRequest(True, 0, False)])
    drain(generator, {})
    assert {(0.0, 1, 0), (0.0, 1, 1)} <= set(controllers) and short.cycles_at == before
    assert controllers[0.0, 1, 1].choice == 3 and controllers[0.0, 1, 1].cycles_at[3] > 0


def test_a_conversations_next_turn_indexes_only_its_new_tokens(trained, monkeypatch):
    """The lookup index of a prompt is kept (``BatchingState.lookup_index``): a request whose prompt extends it indexes
    only the tokens it adds, and decodes stock's tokens."""
    model, tokenizer = trained
    generator = mtp_generator(model)
    extended = []
    original = ContextIndex.extend
    monkeypatch.setattr(ContextIndex, "extend", lambda self, tokens: extended.append(len(tokens)) or original(self,
                                                                                                              tokens))
    first = tokenizer.encode(PROMPTS[1])
    results = {}
    (uid,) = insert(generator, [first], [6], [MTPRequest(True, 1, True)])
    drain(generator, results)
    second = first + results[uid] + tokenizer.encode("\n    def load(self")
    extended.clear()
    (uid,) = insert(generator, [second], [6], [MTPRequest(True, 1, True)])
    drain(generator, results)
    assert extended[0] == len(second) - len(first)
    assert results[uid] == stock_tokens(model, [second], [6])[0]


def test_rows_decode_as_stock_alone_with_replayed_rollback(trained, monkeypatch):
    """Every cycle's GatedDeltaNet rollback replayed (``rollback.force("replay")``): rows that keep prefixes of
    different lengths are restored by one masked update per layer, and every row still decodes stock's tokens."""
    model, tokenizer = trained
    prompts = [tokenizer.encode(p) for p in PROMPTS[:4]]
    options = [MTPRequest(True, 3), MTPRequest(True, 1), MTPRequest(True, 2), MTPRequest(True, 3)]
    masked = []
    original = capture._replay
    monkeypatch.setattr(capture, "_replay", lambda *a: masked.append(a[3] is not None) or original(*a))
    generator = mtp_generator(model)
    rollback.force("replay")
    try:
        uids = insert(generator, prompts, MAX_TOKENS[:4], options)
        results = {}
        drain(generator, results)
    finally:
        rollback.force(None)
    assert [results[uid] for uid in uids] == stock_tokens(model, prompts, MAX_TOKENS[:4])
    assert any(masked) and all(o.stats.accepted > 0 for o in options)


class Schedule:
    """A depth policy that plays a fixed sequence of depths (0: plain steps), to force every transition."""

    def __init__(self, depths):
        self.depths, self.asked = depths, 0

    def next_depth(self):
        self.asked += 1
        return self.depths[(self.asked - 1) % len(self.depths)]

    def observe(self, depth, accepted, seconds):
        pass


@pytest.mark.parametrize("schedule", [None, [0, 0, 0, 2, 2, 0, 1, 0, 3, 0, 0]], ids=["own-depths", "plain-and-back"])
def test_rows_join_and_leave_between_cycles(trained, monkeypatch, schedule):
    """Rows join one by one while others decode (each prefilled alone, as a request arriving on its own); a
    cancelled row leaves; the others are undisturbed and their caches equal a replay of their tokens. With a
    schedule, every row follows the batch policy through pipelined plain steps and back to drafting."""
    model, tokenizer = trained
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    generator = mtp_generator(model)
    results, uids = {}, []
    options = [MTPRequest(True, 2), MTPRequest(True, 2), MTPRequest(True, 3), None, None, MTPRequest(True, 1)]
    if schedule is not None:
        policy = Schedule(schedule)
        monkeypatch.setattr(Scheduler, "controller", lambda self, temperature, rows, context: policy)
        options = [None] * len(prompts)
    for i in range(len(prompts)):
        uids += insert(generator, prompts[i : i + 1], MAX_TOKENS[i : i + 1], options[i : i + 1])
        drain(generator, results, steps=2)
        if i == 3:
            cancelled = uids[1]
            generator.remove([cancelled])
    for cache, tokens in generator.extract_cache(uids).values():
        replay = make_prompt_cache(model)
        model(mx.array(tokens)[None], cache=replay)
        for got, want in zip(cache_arrays(cache), cache_arrays(replay), strict=True):
            np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-3)
    drain(generator, results)
    for uid, prompt, n in zip(uids, prompts, MAX_TOKENS, strict=True):
        (want,) = stock_tokens(model, [prompt], [n])
        assert results[uid] == (want[: len(results[uid])] if uid == cancelled else want)
    assert len(results[cancelled]) < MAX_TOKENS[1]


def test_row_parked_past_the_window_keeps_only_its_last_pairs(trained, monkeypatch):
    """A row parked for longer than ``HISTORY_WINDOW`` steps keeps that many pairs for its head, decodes stock's
    tokens, and its head is not remembered for prompt-cache reuse (its history has a gap)."""
    model, tokenizer = trained
    generator = mtp_generator(model)
    monkeypatch.setattr(Scheduler, "controller", lambda self, temperature, rows, context: Schedule([0]))
    model.mtp_state.batching.store.clear()
    prompt, n, results = tokenizer.encode(PROMPTS[1]), HISTORY_WINDOW + 8, {}
    (uid,) = insert(generator, [prompt], [n], [MTPRequest(lookup=False)])  # plain steps only while parked
    drain(generator, results, steps=HISTORY_WINDOW + 4)
    (row,) = generator._generation_batch.loop.rows
    assert len(row.pending) == HISTORY_WINDOW and not row.head_whole
    drain(generator, results)
    assert results[uid] == stock_tokens(model, [prompt], [n])[0]
    assert not model.mtp_state.batching.store


@pytest.fixture(scope="module")
def small_path(tmp_path_factory):
    """A small-vocabulary float32 checkpoint with a random head: drafts are accepted and rejected often."""
    config = config_for("qwen3_5")
    config["text_config"]["vocab_size"] = VOCAB
    built = build_model(config, seed=3)
    return save_checkpoint(tmp_path_factory.mktemp("small"), config, trunk_weights(built),
                           build_head(built, config), "mtp.safetensors")


@pytest.fixture(scope="module")
def small(small_path):
    return load_model(small_path)[0]


def test_sampled_rows_keep_the_trunk_distribution(small):
    """Four sampled rows (depth 2) and a greedy row per batch: tokens 2 and 3 of the sampled rows follow the
    exact marginals of the trunk's distribution (chi-square), and the greedy row stays the trunk's argmax."""
    temp, runs, rows = 1.0, 300, 4
    sampler = make_sampler(temp=temp)
    mx.random.seed(99)
    (greedy,) = stock_tokens(small, [PROMPT], [3])
    second, third, drafted, accepted = [], [], 0, 0
    for _ in range(runs):
        generator = mtp_generator(small)
        options = [MTPRequest(True, 2) for _ in range(rows)]
        uids = insert(generator, [PROMPT] * rows, [3] * rows, options, sampler=sampler)
        (greedy_uid,) = insert(generator, [PROMPT], [3], [MTPRequest(True, 2)])
        results = {}
        drain(generator, results)
        assert results[greedy_uid] == greedy
        second += [results[u][1] for u in uids]
        third += [results[u][2] for u in uids]
        drafted += sum(o.stats.drafted for o in options)
        accepted += sum(o.stats.accepted for o in options)
    assert 0 < accepted < drafted
    m2, m3 = exact_marginals(small, temp, 0)
    assert chi_square_p(np.array(second), m2) > 1e-3
    assert chi_square_p(np.array(third), m3) > 1e-3


def test_reused_prompt_cache_brings_the_head_history(trained):
    """A follow-up request that reuses a finished request's cache (as the server's prompt cache hands it over)
    gets the head's pairs for that prefix too: the same head cache as a fresh request over the whole prompt."""
    model, tokenizer = trained
    generator, finals = mtp_generator(model), {}
    (first,) = insert(generator, [tokenizer.encode(PROMPTS[1])], [24], [MTPRequest(True, 2)])
    while responses := generator.next_generated():
        finals.update({r.uid: r for r in responses if r.finish_reason})
    prefix, cache = finals[first].all_tokens, finals[first].prompt_cache
    follow = tokenizer.encode("\n\n\ndef load(path):\n    return")

    def head_after_prompt(caches, all_tokens, prompt):
        generator = mtp_generator(model)
        generator.insert([prompt], max_tokens=[4], caches=caches, all_tokens=all_tokens,
                         samplers=[make_sampler(0.0)])
        while not len(generator._generation_batch):
            generator.next()
        batch = generator._generation_batch
        return batch.loop.head_cache.extract(0), batch.loop.rows[0].head_whole

    reused, whole = head_after_prompt([cache], [list(prefix)], follow)
    fresh, _ = head_after_prompt(None, None, list(prefix) + follow)
    assert whole and reused.offset == fresh.offset == len(prefix) + len(follow) - 2
    for got, want in ((reused.keys, fresh.keys), (reused.values, fresh.values)):
        np.testing.assert_allclose(np.array(got[..., : fresh.offset, :]), np.array(want[..., : fresh.offset, :]),
                                   atol=2e-4, rtol=2e-3)
    model.mtp_state.batching.store.clear()
    forgotten, whole = head_after_prompt([finals[first].prompt_cache], [list(prefix)], follow)
    assert not whole and forgotten.offset == len(follow) - 2  # only the new tokens: no pairs for the prefix


def test_nonfinite_head_output_never_reaches_a_row(small_path, caplog):
    """A head whose output turned NaN: sampled rows keep to the trunk's own top-k and run their full length, the
    greedy row is the trunk's, and the head is parked with one warning (later cycles decode plain)."""
    model = load_model(small_path)[0]
    module = model.mtp_head.module
    module.update({"fc": {"weight": mx.full(module.fc.weight.shape, mx.nan, dtype=module.fc.weight.dtype)}})
    (greedy,) = stock_tokens(model, [PROMPT], [12])
    generator, results, top_k = mtp_generator(model), {}, 3
    with caplog.at_level(logging.WARNING, logger="mtp_plugin"):
        sampled = insert(generator, [PROMPT] * 3, [12] * 3, [MTPRequest(True, 2)] * 3,
                         sampler=make_sampler(temp=1.0, top_k=top_k))
        (plain,) = insert(generator, [PROMPT], [12], [MTPRequest(True, 3)])
        while responses := generator.next_generated():
            for r in responses:
                results.setdefault(r.uid, []).append((r.token, np.array(r.logprobs)))
    assert [t for t, _ in results[plain]] == greedy
    for uid in sampled:
        assert len(results[uid]) == 12
        for token, logprobs in results[uid]:
            assert np.isfinite(logprobs).all() and token in np.argsort(-logprobs)[:top_k]
    assert "not finite" in model.mtp_head.health.parked
    assert len([r for r in caplog.records if "parked" in r.getMessage()]) == 1


FORCED = LookupSettings(slope=0.0, first_prior=0.99)  # every match drafted (the float32 CPU slope would refuse most)
EDIT = "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n\n\n" * 3 + "def read"
LOOKUP_PROMPT = [3, 9, 1, 17, 3, 9]  # "3 9" proposes "1 17 …" (test_sampling.test_lookup_sampling_…)


def test_rows_with_lookup_drafts_decode_as_stock_alone(trained):
    """Rows verifying lookup drafts beside rows drafting from the head (their drafts of different lengths in one verify
    pass), a row with lookup off, one with MTP off, one with a repetition penalty: every row is stock's."""
    model, tokenizer = trained
    prompts = [tokenizer.encode(p) for p in [EDIT, PROMPTS[1], EDIT, PROMPTS[5], EDIT]]
    lengths = [40, 28, 36, 30, 33]
    processors = [[], [], make_logits_processors(repetition_penalty=1.3), [], []]
    options = [MTPRequest(True, 2, FORCED), MTPRequest(True, 3, FORCED), MTPRequest(True, 0, FORCED),
               MTPRequest(True, 2, False), MTPRequest(False)]
    generator = mtp_generator(model)
    uids = insert(generator, prompts, lengths, options, processors)
    results = {}
    drain(generator, results)
    assert [results[uid] for uid in uids] == stock_tokens(model, prompts, lengths, processors)
    assert options[0].stats.lookup_accepted > 0 and options[2].stats.lookup_cycles > 0
    assert options[0].stats.cycles + options[1].stats.cycles > 0  # head drafts beside them
    assert options[3].stats.lookup_cycles == 0


def test_a_repeating_row_widens_the_pass_only_where_no_row_loses(trained):
    """The scheduler in mlx-lm's batch (issue 34): a row whose context repeats, at head depth 1, with a verify pass
    costing 1 + 0.3 (k - 1) plain steps. Beside three rows with MTP off it verifies at most one lookup draft a cycle
    (the width its head pays for anyway: any wider pass would slow the plain rows); alone it takes long ones. Every
    row is stock's."""
    model, tokenizer = trained
    repeating = LookupSettings(slope=0.3, first_prior=0.95)
    prompts = [tokenizer.encode(p) for p in [EDIT, PROMPTS[1], PROMPTS[3], PROMPTS[5]]]
    lengths = [24, 40, 40, 40]
    beside = [MTPRequest(True, 1, repeating), MTPRequest(False), MTPRequest(False), MTPRequest(False)]
    alone = [MTPRequest(True, 1, repeating)]
    for options, count in ((beside, 4), (alone, 1)):
        generator = mtp_generator(model)
        uids = insert(generator, prompts[:count], lengths[:count], options)
        results = {}
        drain(generator, results)
        assert [results[uid] for uid in uids] == stock_tokens(model, prompts[:count], lengths[:count])
    assert 0 < beside[0].stats.lookup_cycles and beside[0].stats.lookup_drafted <= beside[0].stats.lookup_cycles
    assert alone[0].stats.lookup_drafted > 4 * alone[0].stats.lookup_cycles


def test_rows_without_a_head_decode_as_stock_with_lookup(trained, monkeypatch):
    """A model without a head on a server run with ``--mtp-lookup``: its rows verify lookup drafts or step plain, and
    every row is stock's (lookup off for one, MTP off for another)."""
    model, tokenizer = trained
    monkeypatch.setattr(model, "mtp_head", None)
    state_of(model, None).serving = MTPOptions(lookup=True)
    prompts = [tokenizer.encode(p) for p in [EDIT, PROMPTS[1], EDIT, "x"]]
    lengths = [40, 20, 30, 6]
    options = [MTPRequest(True, None, FORCED), MTPRequest(True, None, FORCED), MTPRequest(True, None, False),
               MTPRequest(False)]
    generator = mtp_generator(model)
    uids = insert(generator, prompts, lengths, options)
    results = {}
    drain(generator, results)
    assert [results[uid] for uid in uids] == stock_tokens(model, prompts, lengths)
    assert options[0].stats.lookup_accepted > 0 and options[0].stats.cycles == 0
    assert options[2].stats.lookup_cycles == 0
    assert model.mtp_state.batching.failed is None


@pytest.mark.parametrize("headless", [False, True])
def test_sampled_lookup_rows_keep_the_trunk_distribution(small, monkeypatch, headless):
    """Sampled rows whose first cycle verifies a lookup draft (a point mass: accepted with probability p(d), else the
    residual), then a head cycle after a rejection, or plain steps without a head: tokens 2 and 3 follow the exact
    marginals of the trunk's distribution (chi-square)."""
    if headless:
        monkeypatch.setattr(small, "mtp_head", None)
        state_of(small, None).serving = MTPOptions(lookup=True)
    temp, runs, rows = 1.0, 300, 4
    sampler = make_sampler(temp=temp)
    mx.random.seed(5)
    second, third, looked = [], [], [0, 0]
    for _ in range(runs):
        generator = mtp_generator(small)
        options = [MTPRequest(True, 1, FORCED) for _ in range(rows)]
        uids = insert(generator, [LOOKUP_PROMPT] * rows, [3] * rows, options, sampler=sampler)
        results = {}
        drain(generator, results)
        second += [results[u][1] for u in uids]
        third += [results[u][2] for u in uids]
        looked = [looked[0] + sum(o.stats.lookup_accepted for o in options),
                  looked[1] + sum(o.stats.lookup_drafted for o in options)]
    assert 0 < looked[0] < looked[1]
    m2, m3 = exact_marginals(small, temp, 0, LOOKUP_PROMPT)
    assert chi_square_p(np.array(second), m2) > 1e-3
    assert chi_square_p(np.array(third), m3) > 1e-3


SHORT = ["x", "import os", "def", "  "]  # 1- and 2-token prompts: the head gets no pair before the first step


@pytest.mark.parametrize("together", [False, True], ids=["alone", "beside-others"])
def test_one_and_two_token_prompts(trained, together):
    """Prompts of 1 and 2 tokens with ``max_tokens`` 1-4 and MTP on, off and by the server default, alone and
    beside a long row, twice on one generator (a finished row's empty head is remembered): every row is stock's."""
    model, tokenizer = trained
    prompts = [tokenizer.encode(p) for p in SHORT]
    assert {len(p) for p in prompts} == {1, 2}
    lengths = [1, 4, 2, 3]
    options = [MTPRequest(False), None, MTPRequest(True, 2), MTPRequest(True, 1)]
    if together:
        prompts, lengths, options = [tokenizer.encode(PROMPTS[1]), *prompts], [20, *lengths], [None, *options]
    want = stock_tokens(model, prompts, lengths)
    generator = mtp_generator(model)
    for _ in range(2):
        if together:
            uids = insert(generator, prompts, lengths, options)
        else:
            uids = []
            for i in range(len(prompts)):
                uids += insert(generator, prompts[i : i + 1], lengths[i : i + 1], options[i : i + 1])
        results = {}
        drain(generator, results)
        assert [results[uid] for uid in uids] == want
    assert model.mtp_state.batching.failed is None


@pytest.fixture
def fresh(trained):
    """The trained model with a fresh batching context (a fault stops batched MTP for the model's lifetime)."""
    model, tokenizer = trained
    state_of(model, model.mtp_head).batching = None
    yield model, tokenizer
    model.mtp_state.batching = None


def inject(monkeypatch, owner, name: str, call: int):
    """Make the plugin's own ``owner.name`` raise on its ``call``-th call (1-based), as a bug there would."""
    original, calls = getattr(owner, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise RuntimeError(f"injected fault in {name}")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)
    return calls


FAULTS = {  # where a bug of the plugin's can strike: the part it breaks, and at which call
    "cycle": ("mtp_plugin.decoding.batch.BatchDrafter", "launch", 3),
    "commit": ("mtp_plugin.decoding.batch.BatchDrafter", "commit", 2),
    "plain": ("mtp_plugin.decoding.batch.BatchDrafter", "plain", 2),
    "head-prompt": ("mtp_plugin.decoding.drafter.Drafter", "prefill", 2),
    "join": ("mtp_plugin.decoding.continuous.BatchLoop", "extend", 1),
    "respond": ("mtp_plugin.decoding.continuous.BatchLoop", "_respond", 4),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_fault_in_the_plugin_costs_no_request(fresh, monkeypatch, caplog, fault):
    """A fault injected into the plugin's batched path (drafting and verifying, rolling back, plain steps, the
    head's prompt pass, rows joining, responding): every row, the short ones included, still gets stock's tokens,
    one warning names the fault, and every later batch of the model is stock."""
    model, tokenizer = fresh
    path, name, call = FAULTS[fault]
    module, owner = path.rsplit(".", 1)
    calls = inject(monkeypatch, getattr(importlib.import_module(module), owner), name, call)
    prompts = [tokenizer.encode(p) for p in [PROMPTS[0], SHORT[0], PROMPTS[1], SHORT[1], PROMPTS[2]]]
    lengths = [24, 3, 30, 1, 26]
    options = [MTPRequest(True, 2), None, MTPRequest(False), MTPRequest(True, 3), None]
    if fault == "plain":  # rows at depth 0 decode in pipelined plain steps
        options = [MTPRequest(False)] * len(prompts)
    generator, results, uids = mtp_generator(model), {}, []
    with caplog.at_level(logging.WARNING, logger="mtp_plugin"):
        for i in range(len(prompts)):  # rows join while others decode
            uids += insert(generator, prompts[i : i + 1], lengths[i : i + 1], options[i : i + 1])
            drain(generator, results, steps=2)
        drain(generator, results)
    assert len(calls) >= call, f"the fault point {fault} was never reached"
    alone = [stock_tokens(model, [p], [n])[0] for p, n in zip(prompts, lengths, strict=True)]
    assert [results[uid] for uid in uids] == alone
    warnings = [r.getMessage() for r in caplog.records if "batched MTP failed" in r.getMessage()]
    assert len(warnings) == 1 and f"injected fault in {name}" in warnings[0]
    later = importlib.import_module("mlx_lm.server").BatchGenerator(model)
    assert type(later._generation_batch).__name__ == "GenerationBatch"
