"""The one-call state capture of a verify pass equals the per-token capture bit for bit (float32, and bfloat16).

A verify pass of S tokens through the GatedDeltaNet layers, from the same cache, once with the runtime's update
called once over the S tokens (its single-token steps recorded) and once with one update call per token (the
fallback): the logits, the recorded states and the conv rows must be identical, and so must the caches after a
rollback to every prefix.
"""

import mlx.core as mx
import numpy as np
import pytest
from builders import build_model, config_for
from mlx.utils import tree_map
from mtp_plugin.adapters import capture

from mtp_plugin import rollback

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
