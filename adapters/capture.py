"""Capture points for rollback in a runtime's GatedDeltaNet layers, active only during a verify pass: the conv
window, and what restores the recurrent state to any verified prefix (each token's state, or replay inputs), bit for
bit plain decoding's (``tests/test_capture.py``). Runtime internals: ``capture_states``. Design: docs/decoding.md."""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import threading

import mlx.core as mx

from mtp_plugin.decoding import rollback
from mtp_plugin.plugins import hook


def capture_conv_window(call):
    """Wrap a GatedDeltaNet ``__call__``: during a verify pass of S tokens, ``conv_kernel_size`` K is widened by S so
    the cache keeps all K-1+S conv input rows (weights untouched)."""

    @functools.wraps(call)
    def wrapper(self, inputs, mask=None, cache=None, **kwargs):
        recorder = rollback.active()
        if recorder is None or cache is None:
            return call(self, inputs, mask, cache, **kwargs)
        kernel = self.conv_kernel_size
        self.conv_kernel_size = kernel + inputs.shape[1]
        try:
            with recorder.layer(cache, window=kernel - 1, owner=self):
                return call(self, inputs, mask, cache, **kwargs)
        finally:
            self.conv_kernel_size = kernel

    return wrapper


_local = threading.local()  # ``steps``: the states the wrapped step records during a one-call capture
_stepwise: set = set()  # (update, device) pairs whose multi-token call does not step token by token


def record_steps(step):
    """Wrap a runtime's single-token recurrence step ``step(q, k, v, g, beta, state, mask) -> (y, state)``: during a
    one-call capture on this thread, keep each returned state."""

    @functools.wraps(step)
    def wrapper(*args, **kwargs):
        y, state = step(*args, **kwargs)
        steps = getattr(_local, "steps", None)
        if steps is not None:
            steps.append(state)
        return y, state

    return wrapper


def _one_call(update, args, kwargs, tokens: int, with_states=None):
    """``(out, state, states)`` of one call (``with_states``, else ``update`` recorded); None if not stepwise."""
    if with_states is not None and not kwargs.keys() - {"use_kernel"}:
        out, state, states = with_states(*args, **kwargs)
        return out, state, [states[:, t] for t in range(tokens)]
    key = (update, str(mx.default_device()))
    if key in _stepwise:
        return None
    _local.steps = []
    try:
        out, state = update(*args, **kwargs)
    finally:
        steps, _local.steps = _local.steps, None
    if len(steps) != tokens:
        _stepwise.add(key)
        return None
    return out, state, steps


def _final_only(with_states):
    """``(out, state)`` of ``with_states``, asking for no states where it takes ``state_steps`` (mlx-vlm ≥ 0.7)."""
    keywords = {"state_steps": 0} if "state_steps" in inspect.signature(with_states).parameters else {}

    def run(*args, **kwargs):
        out, state, _ = with_states(*args, **kwargs, **keywords)
        return out, state

    return run


def _replay(run, args: tuple, length: int, rows=None):
    """State after the first ``length`` tokens of the pass ``run(*args)``; ``rows`` (B, length) bool: tokens taken."""
    q, k, v, a, b, A_log, dt_bias, state, mask = args
    mask = mask if mask is None else mask[:, :length]
    if rows is not None:
        mask = rows if mask is None else mask & rows
    prefix = [x[:, :length] for x in (q, k, v, a, b)]
    return run(*prefix, A_log, dt_bias, state, mask)[1]


def capture_states(update, with_states=None):
    """Wrap ``gated_delta_update``: during a verify pass, record what restores any prefix (``rollback.mode()`` decides).

    Capture: one call of mlx-vlm ≥ 0.6.8's ``gated_delta_update_with_states``, or of an ``update`` that loops its
    single-token step (mlx-lm's ``gated_delta_ops`` over ``_gated_delta_step_ops``, kept by ``record_steps``); else
    (mlx-lm's fused Metal kernel, detected on first use) one call per token, or under "auto" replay. Replay: the pass
    as plain decoding steps it (mlx-vlm: the per-token-states update with no states, as its multi-token update is a
    chunked scan that rounds differently on the CPU), re-run over the accepted prefix after a rejection. Accepts mlx-vlm
    0.6's extra layer keywords and 0.7's ``cache=`` / ``cache_index=`` (state read from and written to the cache).
    """
    stepped = None if with_states is None else _final_only(with_states)

    @functools.wraps(update)
    def wrapper(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, use_kernel=True, **kwargs):
        recorder = rollback.active()
        if recorder is None or recorder.current is None:
            return update(q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=use_kernel, **kwargs)
        cache, index = kwargs.pop("cache", None), kwargs.pop("cache_index", 1)
        if cache is not None:
            state = cache[index]
            if state is not None and state.shape[0] != q.shape[0]:
                state = None
        args, options = (q, k, v, a, b, A_log, dt_bias, state, mask), {"use_kernel": use_kernel, **kwargs}
        whole = None if recorder.way == "replay" else _one_call(update, args, options, q.shape[1], with_states)
        if whole is not None:
            out, state, states = whole
            recorder.record_states(states)
        elif recorder.way == "capture":
            outs, states = [], []
            for t in range(q.shape[1]):
                step = slice(t, t + 1)
                out, state = update(q[:, step], k[:, step], v[:, step], a[:, step], b[:, step], A_log, dt_bias,
                                    state, None if mask is None else mask[:, step], **options)
                outs.append(out)
                states.append(state)
            out = mx.concatenate(outs, axis=1)
            recorder.record_states(states)
        else:
            own = options.keys() - {"use_kernel"}
            run = functools.partial(update if stepped is None or own else stepped, **options)
            out, state = run(*args)
            recorder.record_replay(state, functools.partial(_replay, run, args))
        if cache is not None:
            cache[index] = state
        return out, state

    return wrapper


def install(patches, runtime: str) -> dict[str, bool]:
    """Wire capture points into ``runtime``'s GatedDeltaNet layers that the families list (``mtp_capture_points``).

    ``runtime``: ``"mlx_lm"`` or ``"mlx_vlm"``; a listed module ``m`` is ``{runtime}.models.{m}`` and must define the
    layer class and ``gated_delta_update``. Returns ``{model_type: wired}`` for every listed type (a missing module or
    class is not wired: those checkpoints decode stock); an unlisted type needs none.
    """
    listed = [item for items in hook().mtp_capture_points(runtime=runtime) for item in items]
    wired: dict[tuple[str, str], bool] = {}
    steps_wrapped = set()
    for _, module_name, layer_class in listed:
        if (module_name, layer_class) in wired:
            continue
        wired[module_name, layer_class] = False
        try:
            module = importlib.import_module(f"{runtime}.models.{module_name}")
        except ImportError:
            continue
        layer = getattr(module, layer_class, None)
        if layer is None or not hasattr(module, "gated_delta_update"):
            continue
        recurrence = sys.modules.get(getattr(module.gated_delta_update, "__module__", ""))
        if hasattr(recurrence, "_gated_delta_step_ops") and recurrence.__name__ not in steps_wrapped:
            steps_wrapped.add(recurrence.__name__)
            patches.wrap(recurrence, "_gated_delta_step_ops", record_steps)
        with_states = getattr(recurrence, "gated_delta_update_with_states", None)
        patches.wrap(layer, "__call__", capture_conv_window)
        patches.wrap(module, "gated_delta_update", functools.partial(capture_states, with_states=with_states))
        wired[module_name, layer_class] = True
    return {model_type: wired[module_name, layer_class] for model_type, module_name, layer_class in listed}


def rollback_ready(captured: dict[str, bool], model_type: str | None) -> bool:
    """Whether a trunk of ``model_type`` can be rolled back after a verify pass: its layers that need capture
    points got them (``install``), or it needs none (every cache trimmable)."""
    return captured.get(model_type, True)
