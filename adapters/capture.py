"""Capture points for rollback, wired inside a runtime's GatedDeltaNet layers (active only during a verify pass).

The layer call keeps its whole conv input window in the cache; ``gated_delta_update`` leaves, for
``rollback.Recorder.commit`` to restore any prefix, either every verified token's recurrent state (capture) or the
state before the pass with the update's inputs (replay: ``rollback``'s docstring). The states, and the verify pass's
outputs, must be those plain decoding computes, one token per call.

Capture, two ways:

* **One call** (``capture_states``, first choice): the runtime's own per-token-states update where it has one
  (mlx-vlm ≥ 0.6.8's ``gated_delta_update_with_states``: its ops on the CPU and CUDA, its Metal kernel, the same
  arithmetic per step as the one-token kernel); else the runtime's own update once over the S verified tokens,
  where the runtime computes it as a loop of its single-token step (mlx-lm's ``gated_delta_ops`` calling
  ``_gated_delta_step_ops``: every backend but Metal), the wrapped step (``record_steps``) keeping each state. Either
  way each step sees exactly the inputs a one-token call gives it (gates and β are elementwise), so outputs and
  states equal the per-token ones bit for bit (``tests/test_capture.py``), for one update's host cost instead of S.
* **Per token** (fallback): S one-token calls of the update. Used where neither applies (mlx-lm's fused Metal
  kernel); the first such call is detected (fewer recorded steps than tokens), its lazy result dropped
  unevaluated, and that update goes per token from then on.

Replay: the verify pass is one call of the runtime's update as plain decoding steps it (mlx-vlm's per-token-states
update, asked for no states where it takes ``state_steps``, since its plain multi-token update is a chunked scan
that rounds differently on the CPU; else the update itself: mlx-lm's ops loop, or its fused Metal kernel, whose
per-thread loop over tokens is the arithmetic of its one-token calls); a rejection replays the same call over the
accepted prefix from the state before the pass.

Which: ``rollback.mode()``. "capture" and "replay" as forced; "auto" (the default) captures in one call where that
is possible and replays where capture would take S one-token calls (mlx-lm on Metal). On the CPU capture's states
are computed by the verify pass anyway, so keeping them costs nothing, while a replay adds an update over the
prefix to every cycle with a rejection (``mtp-plugin bench`` prints both).

Both accept the call forms of mlx-lm and of mlx-vlm (extra layer keywords such as mlx-vlm 0.6's
``gdn_sink``/``target_verify``; mlx-vlm 0.7's ``gated_delta_update(..., cache=, cache_index=)``,
where the cache owns the recurrent state).
"""

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
    """Wrap a GatedDeltaNet ``__call__``: during a verify pass, keep the whole conv input in the cache.

    The layer keeps ``conv_kernel_size - 1`` trailing rows of its conv input; widening the kernel size
    by the S verified tokens for the call makes it keep all K-1+S rows (the weights are untouched).
    """

    @functools.wraps(call)
    def wrapper(self, inputs, mask=None, cache=None, **kwargs):
        recorder = rollback.active()
        if recorder is None or cache is None:
            return call(self, inputs, mask, cache, **kwargs)
        kernel = self.conv_kernel_size
        self.conv_kernel_size = kernel + inputs.shape[1]
        try:
            with recorder.layer(cache, window=kernel - 1):
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
    """``(out, state, states)`` of one call over ``tokens`` tokens: of the runtime's per-token-states update
    ``with_states`` when given (and no runtime-specific keyword is passed), else of ``update`` with every step's state
    recorded; None (its lazy result dropped) when that call did not step token by token."""
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
    """``(out, state)`` of the runtime's per-token-states update ``with_states``, asking it for no states where it
    takes ``state_steps`` (mlx-vlm ≥ 0.7); elsewhere its states are built lazily and never evaluated."""
    keywords = {"state_steps": 0} if "state_steps" in inspect.signature(with_states).parameters else {}

    def run(*args, **kwargs):
        out, state, _ = with_states(*args, **kwargs, **keywords)
        return out, state

    return run


def _replay(run, args: tuple, length: int, rows=None):
    """The state after the first ``length`` tokens of the pass ``run(*args)``, from its initial state, in one call;
    ``rows`` (B, length) bool: the tokens each row takes (with the pass's own mask)."""
    q, k, v, a, b, A_log, dt_bias, state, mask = args
    mask = mask if mask is None else mask[:, :length]
    if rows is not None:
        mask = rows if mask is None else mask & rows
    prefix = [x[:, :length] for x in (q, k, v, a, b)]
    return run(*prefix, A_log, dt_bias, state, mask)[1]


def capture_states(update, with_states=None):
    """Wrap ``gated_delta_update``: during a verify pass, record what restores any prefix (module docstring): every
    token's state in one call where the runtime offers per-token states (``with_states``) or steps token by token,
    else (way "replay", or "auto" where capture takes one call per token) the replay of the pass; way "capture"
    there: one call per token.

    Single-token steps are what plain decoding runs, so the verified states equal plain decoding's.
    With ``cache=`` (mlx-vlm ≥ 0.7) the initial state is read from and the final one written to
    ``cache[cache_index]``, as the runtime's own cache-owned update does.
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
    """Wire the capture points into ``runtime``'s GatedDeltaNet layers that the families list
    (``mtp_capture_points``).

    Args:
        patches: the adapter's ``Patches`` (so that unpatching removes them).
        runtime: ``"mlx_lm"`` or ``"mlx_vlm"``; a listed module ``m`` is ``{runtime}.models.{m}`` and must define
            the layer class and ``gated_delta_update``.

    Returns:
        ``{model_type: wired}`` for every listed model type (a missing module or class is not wired: those
        checkpoints decode stock). A model type not listed needs no capture points (``rollback_ready``).
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
