"""Rollback of GatedDeltaNet caches after a verify pass, bit for bit (float32, and bfloat16), on both runtimes.

The one-call state capture equals the per-token capture: a verify pass of S tokens through the GatedDeltaNet layers,
from the same cache, once with the runtime's update called once over the S tokens (its single-token steps recorded)
and once with one update call per token (the fallback): the logits, the recorded states and the conv rows must be
identical, and so must the caches after a rollback to every prefix.

Both ways (capture, replay) equal plain decoding: at every depth 1-8 the verify pass's logits are plain decoding's,
and a commit to every prefix (a rejection at every position) leaves the cache plain decoding leaves after those
tokens; replay keeps no per-token state. Rows of a batch committed to prefixes of different lengths get the same
caches by replay (one masked update) as by capture.
"""

import mlx.core as mx
import numpy as np
import pytest
from helpers.builders import build_model, caches_after_close, config_for, to_float32
from helpers.console_runs import HF
from mlx.utils import tree_map
from mtp_plugin.adapters import capture

from mtp_plugin.decoding import rollback

PROMPT = [5, 17, 3, 99, 42, 7, 8, 120, 64, 33]
VERIFIED = [11, 200, 4, 87, 19]


def exact(a: mx.array) -> np.ndarray:
    """``a`` as numpy float32 (bfloat16 widens exactly)."""
    return np.array(a.astype(mx.float32))


def verify_pass(model, runtime: str):
    """Logits (1, S, V), per layer the recorded states and conv rows, and the caches after each rollback."""
    if runtime == "mlx_lm":
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
    else:
        model = model.language_model
        cache = model.make_cache()
    model(mx.array([PROMPT]), cache=cache)
    mx.eval([c.state for c in cache])
    undo = rollback.snapshot(cache)
    with rollback.capturing(len(VERIFIED)) as recorder:
        recorder.way = "capture"  # where one call cannot capture: one call per token (not "auto": replay)
        logits = model(mx.array([VERIFIED]), cache=cache)
    records = [(exact(mx.stack(r.states)), exact(r.rows)) for r in recorder.layers.values()]
    committed = []
    for keep in range(len(VERIFIED), 0, -1):
        recorder.commit(cache, keep)
        committed.append([exact(a) for c in cache if id(c) in recorder.layers for a in c.cache])
    undo(keep)
    logits = logits.logits if hasattr(logits, "logits") else logits
    return exact(logits), records, committed


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("runtime", ["mlx_lm", "mlx_vlm"])
def test_one_call_capture_is_bit_equal_to_per_token(runtime, dtype, monkeypatch):
    model = build_model(config_for("qwen3_5", vision=runtime == "mlx_vlm"), runtime, seed=4)
    model.update(tree_map(lambda a: a.astype(dtype), model.parameters()))
    steps = []
    original = capture._one_call
    monkeypatch.setattr(capture, "_one_call", lambda *a: steps.append(result := original(*a)) or result)
    logits, records, committed = verify_pass(model, runtime)
    assert records and all(states.shape[0] == len(VERIFIED) for states, _ in records)
    # One call per layer: mlx-vlm's per-token-states update; mlx-lm's multi-token update steps token by token (CPU)
    assert len(steps) == len(records) and all(s is not None for s in steps)
    monkeypatch.setattr(capture, "_one_call", lambda *a: None)
    logits_pt, records_pt, committed_pt = verify_pass(model, runtime)
    assert np.array_equal(logits, logits_pt)
    for (states, rows), (states_pt, rows_pt) in zip(records, records_pt, strict=True):
        assert np.array_equal(states, states_pt) and np.array_equal(rows, rows_pt)
    for mine, theirs in zip(committed, committed_pt, strict=True):
        assert all(np.array_equal(a, b) for a, b in zip(mine, theirs, strict=True))


CODE = "def read_config(path):\n    \"\"\"Read a JSON configuration file.\"\"\"\n    with open(path) as f:\n"
VERIFIED_MAX = [11, 200, 4, 87, 19, 63, 150, 2, 99]  # the verified tokens of depth 8; depth d verifies the first d+1


def cache_state(cache) -> list[np.ndarray]:
    """Every array a trunk cache holds, exactly: KV caches up to their length (a batch cache: and its per-row
    offsets and left padding), conv and recurrent states."""
    if not hasattr(cache, "offset"):
        return [exact(a) for a in cache.cache if a is not None]
    used = getattr(cache, "_idx", cache.offset)  # BatchKVCache: its length; offset is per row
    rows = [cache.offset, cache.left_padding] if hasattr(cache, "left_padding") else []
    return [exact(a) for a in (cache.keys[..., :used, :], cache.values[..., :used, :], *rows)]


def text_model(runtime: str, dtype):
    """A random tiny Qwen3.5 of ``runtime`` in ``dtype`` and a function making its prompt-filled cache."""
    model = build_model(config_for("qwen3_5", vision=runtime == "mlx_vlm"), runtime, seed=4)
    model.update(tree_map(lambda a: a.astype(dtype), model.parameters()))
    if runtime == "mlx_vlm":
        model = model.language_model

    def filled():
        if runtime == "mlx_lm":
            from mlx_lm.models.cache import make_prompt_cache

            cache = make_prompt_cache(model)
        else:
            cache = model.make_cache()
        model(mx.array([PROMPT]), cache=cache)
        mx.eval([c.state for c in cache])
        return cache

    return model, filled


def logits_of(out) -> mx.array:
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("runtime", ["mlx_lm", "mlx_vlm"])
def test_capture_and_replay_equal_plain_decoding(runtime, dtype, monkeypatch):
    model, filled = text_model(runtime, dtype)
    cache = filled()  # plain decoding, one token per call: logits and the cache after each token
    plain_logits, plain_caches = [], []
    for token in VERIFIED_MAX:
        plain_logits.append(exact(logits_of(model(mx.array([[token]]), cache=cache))[0, 0]))
        plain_caches.append([a for c in cache for a in cache_state(c)])
    replays = []
    original = capture._replay
    monkeypatch.setattr(capture, "_replay", lambda *a: replays.append(a[2]) or original(*a))
    for way in ("capture", "replay"):
        for depth in range(1, 9):
            tokens = VERIFIED_MAX[: depth + 1]
            cache = filled()
            with rollback.capturing(len(tokens)) as recorder:
                assert recorder.way == "auto"
                recorder.way = way
                logits = exact(logits_of(model(mx.array([tokens]), cache=cache))[0])
            assert np.array_equal(logits, np.stack(plain_logits[: len(tokens)])), (way, depth)
            records = list(recorder.layers.values())
            assert records and all((len(r.states), r.replay is None) == ((len(tokens), True) if way == "capture"
                                                                         else (0, False)) for r in records)
            replays.clear()
            for keep in range(len(tokens), 0, -1):  # all accepted, then a rejection at every position
                recorder.commit(cache, keep)
                got = [a for c in cache for a in cache_state(c)]
                assert all(np.array_equal(a, b) for a, b in zip(got, plain_caches[keep - 1], strict=True)), \
                    (way, depth, keep)
            # replay: one update call per layer for each commit that drops tokens, none when all are kept
            assert replays == ([] if way == "capture" else [k for k in range(depth, 0, -1) for _ in records])


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_rows_with_different_prefixes_replay_as_captured(dtype):
    """A left-padded batch of mlx-lm's own batch caches; every row rejects at every position over the cases."""
    from mlx_lm.models.cache import ArraysCache, BatchKVCache

    model, _ = text_model("mlx_lm", dtype)
    prompts = [PROMPT, PROMPT[3:], PROMPT[:7]]
    padding = [len(PROMPT) - len(p) for p in prompts]
    inputs = mx.array([[0] * pad + p for pad, p in zip(padding, prompts, strict=True)])
    tokens = mx.array([VERIFIED_MAX[:4], VERIFIED_MAX[4:8], VERIFIED_MAX[1:5]])  # depth 3: S = 4
    for keep in ([1, 2, 4], [2, 4, 1], [4, 1, 3], [3, 3, 2], [1, 1, 1], [4, 4, 4]):
        caches = {}
        for way in ("capture", "replay"):
            cache = [ArraysCache(2, left_padding=padding) if layer.is_linear else BatchKVCache(padding)
                     for layer in model.layers]
            model(inputs, cache=cache)
            with rollback.capturing(4) as recorder:
                recorder.way = way
                model(tokens, cache=cache)
            recorder.commit_rows(cache, keep)
            caches[way] = [a for c in cache for a in cache_state(c)]
        assert all(np.array_equal(a, b) for a, b in zip(caches["capture"], caches["replay"], strict=True)), keep


def test_a_pass_that_missed_its_capture_points_is_detected():
    """``Recorder.missed``: a pass through the capture points captured every stateful layer; one run with them removed
    (``mtp_plugin.unpatch()`` on another thread) did not. Rows run alone on copies of the caches (mlx-vlm 0.6's batch)
    count as captured when every row ran through them, not when one did."""
    import mtp_plugin

    model, filled = text_model("mlx_lm", mx.float32)
    tokens = mx.array([VERIFIED[:3]])
    cache = filled()
    with rollback.capturing(3) as recorder:
        model(tokens, cache=cache)
    assert not recorder.missed(cache)
    copies = [filled(), filled()]
    with rollback.capturing(3) as recorder:
        for copy in copies:
            model(tokens, cache=copy)
    assert not recorder.missed(cache, rows=2) and recorder.missed(cache, rows=3)
    mtp_plugin.unpatch()  # conftest's autouse fixture patches again afterwards
    cache = filled()
    with rollback.capturing(3) as recorder:
        model(tokens, cache=cache)
    assert recorder.missed(cache)
    with pytest.raises(rollback.RollbackError, match="cannot be rolled back"):
        recorder.commit(cache, 1)


@pytest.fixture(scope="module")
def trained():
    """The bundled trained checkpoint and its tokenizer, by dtype (as stored: bfloat16; or cast to float32): its head
    accepts some drafts and rejects others, so cycles end at every position."""
    from mlx_lm import load

    loaded = {}

    def get(dtype: str):
        if dtype not in loaded:
            model, tokenizer = load(str(HF))
            loaded[dtype] = (to_float32(model) if dtype == "float32" else model), tokenizer
        return loaded[dtype]

    return get


@pytest.mark.parametrize("dtype,depth", [("bfloat16", 1), ("bfloat16", 3), ("float32", 2), ("float32", 8)])
def test_replayed_decoding_equals_plain(trained, monkeypatch, dtype, depth):
    """The single-stream loop with every rollback replayed: greedy tokens and the cache left after closing are plain
    decoding's; replays ran, per-token states were never recorded."""
    import importlib

    model, tokenizer = trained(dtype)
    replays, recorded = [], []
    original = capture._replay
    monkeypatch.setattr(capture, "_replay", lambda *a: replays.append(a[2]) or original(*a))
    monkeypatch.setattr(rollback.Recorder, "record_states", lambda self, states: recorded.append(states))
    prompt = mx.array(tokenizer.encode(CODE))
    generate_step = importlib.import_module("mlx_lm.generate").generate_step  # as patched
    plain = [t for t, _ in generate_step(prompt, model, max_tokens=40, enable_mtp=False)]
    rollback.force("replay")
    try:
        assert [t for t, _ in generate_step(prompt, model, max_tokens=40, mtp_depth=depth)] == plain
        stats = model.mtp_head.stats
        if dtype == "float32":
            cache_plain, cache_mtp = caches_after_close(model, prompt.tolist(), 29, mtp_depth=depth)
            assert all(np.array_equal(a, b) for a, b in zip(cache_plain, cache_mtp, strict=True))
    finally:
        rollback.force(None)
    assert 0 < stats.accepted < stats.drafted and replays and not recorded


def test_rollback_way_from_setting(monkeypatch, caplog):
    monkeypatch.setenv(rollback.MODE_ENV, "replay")
    assert rollback.Recorder(3).way == "replay"
    rollback.force("capture")  # the bench's override wins over the variable
    try:
        assert rollback.Recorder(3).way == "capture"
    finally:
        rollback.force(None)
    monkeypatch.setenv(rollback.MODE_ENV, "rewind")
    assert rollback.mode() == "auto" and rollback.mode() == "auto"
    assert [r.getMessage() for r in caplog.records] == ["mtp_plugin: MTP_PLUGIN_ROLLBACK='rewind' is not one of "
                                                        "auto, capture, replay; using auto"]  # once
    with pytest.raises(ValueError, match="rollback way must be one of auto, capture, replay, got 'fast'"):
        rollback.force("fast")
