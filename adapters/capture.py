"""Capture points for rollback, wired inside a runtime's GatedDeltaNet layers (active only during a verify pass).

The layer call keeps its whole conv input window in the cache; ``gated_delta_update`` steps token by
token and records its state after each one, so ``rollback.Recorder.commit`` can restore any prefix.
Both accept the call forms of mlx-lm and of mlx-vlm (extra layer keywords such as mlx-vlm 0.6's
``gdn_sink``/``target_verify``; mlx-vlm 0.7's ``gated_delta_update(..., cache=, cache_index=)``,
where the cache owns the recurrent state).
"""

from __future__ import annotations

import functools
import importlib

import mlx.core as mx

from mtp_plugin import rollback
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


def capture_states(update):
    """Wrap ``gated_delta_update``: during a verify pass, step token by token and record every state.

    Single-token steps are what plain decoding runs, so the verified states equal plain decoding's.
    With ``cache=`` (mlx-vlm ≥ 0.7) the initial state is read from and the final one written to
    ``cache[cache_index]``, as the runtime's own cache-owned update does.
    """

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
        outs, states = [], []
        for t in range(q.shape[1]):
            step = slice(t, t + 1)
            out, state = update(q[:, step], k[:, step], v[:, step], a[:, step], b[:, step], A_log, dt_bias,
                                state, None if mask is None else mask[:, step], use_kernel=use_kernel, **kwargs)
            outs.append(out)
            states.append(state)
        if cache is not None:
            cache[index] = state
        recorder.record_states(states)
        return mx.concatenate(outs, axis=1), state

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
        patches.wrap(layer, "__call__", capture_conv_window)
        patches.wrap(module, "gated_delta_update", capture_states)
        wired[module_name, layer_class] = True
    return {model_type: wired[module_name, layer_class] for model_type, module_name, layer_class in listed}


def rollback_ready(captured: dict[str, bool], model_type: str | None) -> bool:
    """Whether a trunk of ``model_type`` can be rolled back after a verify pass: its layers that need capture
    points got them (``install``), or it needs none (every cache trimmable)."""
    return captured.get(model_type, True)
