"""Sampling as the runtime's sampler does it (``Sampling``), and sampled tokens that do not depend on the drafts:
token j is ``argmax(filters(logprobs) / temp + G_j)``, Gumbel noise G_j (V,) from key j of MLX's key sequence as it
stood when the generation started (the key mlx-lm's j-th draw takes); a draft for token j shares G_j (a Gumbel-max
coupling). Design: docs/decoding.md#sampling."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class Sampling:
    """Temperature sampling exactly as the runtime's sampler does it.

    ``filters``: log-probs (…, V) → filtered log-probs (-inf where excluded), in the runtime sampler's order. ``keyed``:
    ``keyed(logprobs (k, V), first) -> tokens (k,)``, draws keyed by generated-token position (0: the first after the
    prompt): every emitted token is drawn with it and a draft accepted iff equal; None: exact speculative sampling.
    ``coupled``: the drafts draw with ``keyed`` too (``sampling.GumbelDraws``); False: the head's argmax.
    """

    temp: float
    filters: tuple[Callable[[mx.array], mx.array], ...] = ()
    keyed: Callable[[mx.array, int], mx.array] | None = None
    coupled: bool = False

    def with_coupling(self) -> Sampling:
        """This distribution by ``sampling.GumbelDraws`` shared with the drafts (tokens: seed and trunk only)."""
        return dataclasses.replace(self, keyed=GumbelDraws(self.temp, self.filters), coupled=True)

    def probs(self, logprobs: mx.array) -> mx.array:
        """Sampling distribution (…, V), float32: softmax(filters(logprobs) / temp)."""
        for f in self.filters:
            logprobs = f(logprobs)
        return mx.softmax(logprobs.astype(mx.float32) / self.temp, axis=-1)


class GumbelDraws:
    """One generation's position-keyed draws (``Sampling.keyed``); ``filters``: log-probs (…, V) →
    filtered log-probs (-inf where excluded), in the sampler's order."""

    def __init__(self, temp: float, filters: tuple = ()):
        self.temp, self.filters = temp, filters
        self.states: list[mx.array] = []  # state before draw j; read at the first draw (after a lockstep's seed)
        self.keys: list[mx.array] = []  # key (2,) uint32 of draw j

    def key(self, j: int) -> mx.array:
        """The key of draw ``j`` (0: the first token after the prompt)."""
        if not self.states:
            self.states.append(mx.random.state[0])
        while len(self.keys) <= j:
            state, key = mx.random.split(self.states[-1])
            self.states.append(state)
            self.keys.append(key)
        return self.keys[j]

    def __call__(self, logprobs: mx.array, first: int) -> mx.array:
        """Tokens (k,) uint32 of draws ``first .. first+k-1`` from log-probs (k, V) of any float dtype."""
        for f in self.filters:
            logprobs = f(logprobs)
        noise = mx.stack([mx.random.gumbel(logprobs.shape[-1:], key=self.key(first + j))
                          for j in range(logprobs.shape[0])])
        return mx.argmax(logprobs.astype(mx.float32) / self.temp + noise, axis=-1).astype(mx.uint32)

    def release(self, drawn: int) -> None:
        """Leave MLX's global key sequence as ``drawn`` draws of the runtime's own sampler would (one host read)."""
        self.key(drawn)
        high, low = self.states[drawn].tolist()
        mx.random.seed((high << 32) | low)
