"""Capture points for rollback, wired inside a runtime's GatedDeltaNet layers (active only during a verify pass).

The layer call keeps its whole conv input window in the cache; ``gated_delta_update`` steps token by
token and records its state after each one, so ``rollback.Recorder.commit`` can restore any prefix.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from mtp_plugin import rollback


def capture_conv_window(call):
    """Wrap a GatedDeltaNet ``__call__``: during a verify pass, keep the whole conv input in the cache."""

    @functools.wraps(call)
    def wrapper(self, inputs, mask=None, cache=None):
        recorder = rollback.active()
        if recorder is None or cache is None:
            return call(self, inputs, mask, cache)
        kernel = self.conv_kernel_size
        self.conv_kernel_size = kernel + inputs.shape[1]
        try:
            with recorder.layer(cache, window=kernel - 1):
                return call(self, inputs, mask, cache)
        finally:
            self.conv_kernel_size = kernel

    return wrapper


def capture_states(update):
    """Wrap ``gated_delta_update``: during a verify pass, step token by token and record every state."""

    @functools.wraps(update)
    def wrapper(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, use_kernel=True):
        recorder = rollback.active()
        if recorder is None or recorder.current is None:
            return update(q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=use_kernel)
        outs, states = [], []
        for t in range(q.shape[1]):
            step = slice(t, t + 1)
            out, state = update(q[:, step], k[:, step], v[:, step], a[:, step], b[:, step], A_log, dt_bias,
                                state, None if mask is None else mask[:, step], use_kernel=use_kernel)
            outs.append(out)
            states.append(state)
        recorder.record_states(states)
        return mx.concatenate(outs, axis=1), state

    return wrapper
