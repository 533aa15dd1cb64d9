"""MTP decoding in mlx-lm: lossless greedy output, exact rollback, exact sampling distribution.

Random tiny float32 models of every family member; their random heads are rejected at the first
draft (every cycle exercises rollback); the trained tiny checkpoint (test_tiny_checkpoint.py)
exercises acceptance at every depth.
"""

import dataclasses
import importlib
import inspect
import threading

import mlx.core as mx
import numpy as np
import pytest
from helpers.builders import (
    KINDS,
    build_head,
    build_model,
    cache_arrays,
    caches_after_close,
    config_for,
    save_checkpoint,
    trunk_weights,
)
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.utils import load_model

import mtp_plugin
from mtp_plugin.decoding import rollback

PROMPTS = {"1-token": [7], "short": [3, 17, 42, 99, 7, 128, 5, 64],
           "long": [(7 * i) % 250 + 1 for i in range(300)]}  # token ids stay below the vocabulary size, 256


@pytest.fixture(scope="module", params=KINDS)
def model(request, tmp_path_factory):
    config = config_for(request.param)
    built = build_model(config)
    path = save_checkpoint(tmp_path_factory.mktemp(request.param), config, trunk_weights(built),
                           build_head(built, config), "mtp.safetensors")
    return load_model(path)[0]


def generate_step(*args, **kwargs):
    """mlx-lm's generate_step as patched now (looked up at call time)."""
    return importlib.import_module("mlx_lm.generate").generate_step(*args, **kwargs)


def tokens(model, prompt, **kwargs):
    return [t for t, _ in generate_step(mx.array(prompt), model, **kwargs)]


@pytest.mark.parametrize("prompt", sorted(PROMPTS))
@pytest.mark.parametrize("depth", [1, 2, 3, 8])
def test_greedy_identical_to_plain(model, prompt, depth):
    kwargs = dict(max_tokens=24, prefill_step_size=64)
    plain = tokens(model, PROMPTS[prompt], enable_mtp=False, **kwargs)
    mtp = tokens(model, PROMPTS[prompt], mtp_depth=depth, **kwargs)
    assert mtp == plain
    stats = model.mtp_head.stats
    assert stats.cycles > 0 and stats.emitted + stats.lookup_emitted == len(mtp) - 1


def test_greedy_identical_with_pre_norm_contract(model):
    """A head wired to the trunk's pre-norm hidden states still verifies with the trunk's own (normed) logits."""
    head = model.mtp_head.module
    post_norm = head.contract
    head.contract = dataclasses.replace(post_norm, hidden="pre_norm")
    try:
        mtp = tokens(model, PROMPTS["short"], mtp_depth=2, max_tokens=24)
    finally:
        head.contract = post_norm
    assert mtp == tokens(model, PROMPTS["short"], enable_mtp=False, max_tokens=24)


def test_logits_processors_applied_per_position(model):
    kwargs = dict(max_tokens=24, logits_processors=make_logits_processors(repetition_penalty=1.5))
    plain = tokens(model, PROMPTS["short"], enable_mtp=False, **kwargs)
    assert tokens(model, PROMPTS["short"], mtp_depth=3, **kwargs) == plain


@pytest.mark.parametrize("max_tokens", [0, 1, 2, 5, 13])
def test_cache_after_generation_equals_plain(model, max_tokens):
    """The trunk cache ends holding prompt + every yielded token, exactly as plain decoding leaves it."""
    caches = []
    for enable in (False, True):
        cache = make_prompt_cache(model)
        tokens(model, PROMPTS["short"], max_tokens=max_tokens, prompt_cache=cache, enable_mtp=enable, mtp_depth=4)
        caches.append(cache_arrays(cache))
    for plain, mtp in zip(*caches, strict=True):
        np.testing.assert_allclose(mtp, plain, rtol=1e-5, atol=1e-5)


def test_generator_closed_early_leaves_plain_cache(model):
    plain_cache, mtp_cache = caches_after_close(model, PROMPTS["short"], 4, mtp_depth=3)
    for plain, mtp in zip(plain_cache, mtp_cache, strict=True):
        np.testing.assert_allclose(mtp, plain, rtol=1e-5, atol=1e-5)


def test_prompt_cache_reuse_across_calls(model):
    first, second = PROMPTS["short"], [11, 12, 13]
    outputs = []
    for enable in (False, True):
        cache = make_prompt_cache(model)
        a = tokens(model, first, max_tokens=6, prompt_cache=cache, enable_mtp=enable)
        b = tokens(model, second, max_tokens=10, prompt_cache=cache, enable_mtp=enable)
        outputs.append((a, b))
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("keep", [1, 2, 3, 5, 6])
def test_rollback_equals_plain_replay(model, keep):
    """Verify 6 tokens with capture, commit the first ``keep``: every cache equals feeding only those."""
    prefix, verify = mx.array([[5, 9, 2, 44]]), mx.array([[8, 1, 77, 3, 19, 60]])
    captured, replayed = make_prompt_cache(model), make_prompt_cache(model)
    for cache in (captured, replayed):
        model(prefix, cache=cache)
    with rollback.capturing(verify.shape[1]) as recorder:
        model(verify, cache=captured)
    recorder.commit(captured, keep)
    model(verify[:, :keep], cache=replayed)
    for got, want in zip(cache_arrays(captured), cache_arrays(replayed), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(model(mx.array([[4]]), cache=captured)),
                               np.array(model(mx.array([[4]]), cache=replayed)), rtol=1e-5, atol=1e-5)


KV_OPTIONS = {  # mlx-lm's KV cache options: all decode with MTP, exactly as plain decoding does
    "max_kv_size": {"max_kv_size": 16},  # Qwen3.5-family models build their own caches: no rotation
    "kv_bits=8": {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0},
    "kv_bits=4 from 13": {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 13},  # switch while decoding
    "kv_bits=8 default start": {"kv_bits": 8, "kv_group_size": 32},
}


@pytest.fixture(scope="module", params=KINDS)
def kv_model(request, tmp_path_factory):
    """A tiny model whose KV heads mx.quantize accepts (head_dim 32, its smallest group size)."""
    config = config_for(request.param)
    text = config.get("text_config", config)
    text["head_dim"] = 32
    rope = text.get("rope_parameters", text)
    rope["partial_rotary_factor"] = 0.25  # the same rotary dimensions (mRoPE sections) as head_dim 16 at 0.5
    built = build_model(config)
    path = save_checkpoint(tmp_path_factory.mktemp(f"kv-{request.param}"), config, trunk_weights(built),
                           build_head(built, config), "mtp.safetensors")
    return load_model(path)[0]


@pytest.mark.parametrize("option,prompt", [(option, "short") for option in KV_OPTIONS] + [("kv_bits=8", "long")])
def test_kv_cache_options_identical_to_plain(kv_model, option, prompt):
    """Tokens and the cache left behind (its types, offsets and arrays) are plain decoding's."""
    model = kv_model
    kwargs = dict(max_tokens=24, prefill_step_size=64, **KV_OPTIONS[option])
    runs = []
    for options in ({"enable_mtp": False}, {"mtp_depth": 3}):
        cache = make_prompt_cache(model)
        runs.append((tokens(model, PROMPTS[prompt], prompt_cache=cache, **kwargs, **options),
                     [(type(c).__name__, getattr(c, "offset", None)) for c in cache], cache_arrays(cache)))
    (plain, plain_kinds, plain_cache), (mtp, mtp_kinds, mtp_cache) = runs
    assert model.mtp_head.stats.cycles > 0
    assert mtp == plain and mtp_kinds == plain_kinds
    for a, b in zip(mtp_cache, plain_cache, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stop", [2, 9, 11, 12, 13, 17])
def test_quantized_cache_closed_early_leaves_plain_cache(kv_model, stop):
    """Closing the generator around the switch to a quantized cache (at 8 prompt + 12 tokens) leaves plain
    decoding's cache."""
    kv = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 20}
    plain_cache, mtp_cache = caches_after_close(kv_model, PROMPTS["short"], stop, kv, mtp_depth=4)
    assert [a.dtype for a in mtp_cache] == [a.dtype for a in plain_cache]
    for plain, mtp in zip(plain_cache, mtp_cache, strict=True):
        np.testing.assert_allclose(mtp, plain, rtol=1e-5, atol=1e-5)


def rotating_cache(model, max_size):
    """The model's cache with every KV layer replaced by mlx-lm's ``RotatingKVCache`` (a caller's own cache)."""
    return [RotatingKVCache(max_size=max_size, keep=4) if isinstance(c, KVCache) else c
            for c in make_prompt_cache(model)]


@pytest.mark.parametrize("max_size,wraps", [(64, False), (20, True), (8, True)])
def test_rotating_prompt_cache(model, caplog, max_size, wraps):
    """A rotating cache that cannot wrap during the generation decodes with MTP; one that could wrap cannot
    be rolled back exactly, and decodes stock with one warning. Either way the tokens are plain decoding's."""
    kwargs = dict(max_tokens=24)
    plain = tokens(model, PROMPTS["short"], prompt_cache=rotating_cache(model, max_size), enable_mtp=False, **kwargs)
    caplog.clear()
    mtp = tokens(model, PROMPTS["short"], prompt_cache=rotating_cache(model, max_size), mtp_depth=2, **kwargs)
    assert mtp == plain
    warnings = [r.getMessage() for r in caplog.records if "rotating KV cache" in r.getMessage()]
    assert len(warnings) == int(wraps), warnings
    assert (model.mtp_head.stats is not None and model.mtp_head.stats.cycles > 0) != wraps


def test_head_memory_is_released(model):
    """Rollback keeps S states per layer, never context-length state: nothing of a generation outlives it."""
    del model.mtp_head.stats
    before = sum(v.nbytes for _, v in tree_flatten(model.mtp_head.module.parameters()))
    tokens(model, PROMPTS["long"], max_tokens=8, mtp_depth=4)
    assert sum(v.nbytes for _, v in tree_flatten(model.mtp_head.module.parameters())) == before


def test_mtp_loop_runs_on_mlx_lms_stream(model):
    """As mlx-lm's own loop: on ``generate_step``'s ``stream`` (mlx-lm ≥ 0.32), else on its ``generation_stream``."""
    runtime = importlib.import_module("mlx_lm.generate")
    stream = mx.new_stream(mx.default_device())
    args = (stream,) if "stream" in inspect.signature(runtime.generate_step).parameters else ()
    with mx.stream(stream if args else runtime.generation_stream):  # a thread-local stream: this thread's
        want = mx.default_stream(mx.default_device())
    seen = [mx.default_stream(mx.default_device())
            for _ in generate_step(mx.array(PROMPTS["short"]), model, *args, mtp_depth=2, max_tokens=5)]
    assert len(seen) == 5 and all(s == want for s in seen)
    assert model.mtp_head.stats is not None  # it decoded with MTP


@pytest.mark.parametrize("depth", ["3", 2.5, True, False, -1, 9, object()])
def test_bad_depth_is_refused_with_its_name(model, depth):
    """Anything but an integer 0-8, None or a depth policy is refused before decoding, naming the option."""
    with pytest.raises(ValueError, match="mtp_depth"):
        tokens(model, PROMPTS["short"], max_tokens=4, mtp_depth=depth)


@pytest.mark.parametrize("depth", [np.int64(2), 0, None])
def test_integer_like_depths(model, depth):
    mtp = tokens(model, PROMPTS["short"], max_tokens=8, mtp_depth=depth)
    assert model.mtp_head.stats.depth == (2 if depth else None)
    assert mtp == tokens(model, PROMPTS["short"], max_tokens=8, enable_mtp=False)


@pytest.mark.parametrize("fallback", [{"enable_mtp": False}, {"sampler": lambda logprobs: mx.argmax(logprobs, -1)},
                                      {"prompt_cache": "rotating"}])
def test_stats_are_reset_when_a_generation_decodes_stock(model, fallback):
    """``model.mtp_head.stats`` describes the last generation: None when it did not decode with MTP."""
    tokens(model, PROMPTS["short"], max_tokens=8, mtp_depth=2)
    assert model.mtp_head.stats.cycles > 0
    if fallback.get("prompt_cache") == "rotating":
        fallback = {"prompt_cache": rotating_cache(model, 12)}
    tokens(model, PROMPTS["short"], max_tokens=8, **fallback)
    assert model.mtp_head.stats is None


@pytest.mark.parametrize("after", [1, 4])
def test_unpatch_during_generation_finishes_it(model, caplog, after):
    """``mtp_plugin.unpatch()`` between two tokens of an MTP generation (as another thread may call it): the
    generation finishes (the cycles it can no longer roll back become plain steps), with plain decoding's
    tokens and cache, and one warning that says why."""
    plain_cache, mtp_cache = make_prompt_cache(model), make_prompt_cache(model)
    plain = tokens(model, PROMPTS["short"], max_tokens=16, prompt_cache=plain_cache, enable_mtp=False)
    generator = generate_step(mx.array(PROMPTS["short"]), model, max_tokens=16, prompt_cache=mtp_cache, mtp_depth=3)
    mtp = [next(generator)[0] for _ in range(after)]
    mtp_plugin.unpatch()
    mtp += [t for t, _ in generator]
    assert mtp == plain
    for a, b in zip(cache_arrays(mtp_cache), cache_arrays(plain_cache), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert sum("unpatched during this generation" in r.getMessage() for r in caplog.records) == 1


def test_unpatch_from_another_thread(model):
    """A generation on one thread while the main thread unpatches and patches again, many times."""
    plain = tokens(model, PROMPTS["long"], max_tokens=48, enable_mtp=False)
    result = {}
    worker = threading.Thread(target=lambda: result.update(tokens=tokens(model, PROMPTS["long"], max_tokens=48,
                                                                          mtp_depth=2)))
    worker.start()
    while worker.is_alive():
        mtp_plugin.unpatch()
        mtp_plugin.patch()
    worker.join()
    assert result["tokens"] == plain
