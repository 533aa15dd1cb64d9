"""The verify pass's side of a cycle: accepting drafts against the trunk's log-probs, greedy (argmax), keyed (draws that
do not depend on the drafts) or exact speculative sampling (Leviathan et al. 2023, Algorithm 1), and a pass read
position by position for logits processors (``Walk``). Design: docs/decoding.md."""

from __future__ import annotations

import mlx.core as mx

from .drafter import log_softmax
from .sampling import Sampling


def categorical(probs: mx.array) -> mx.array:
    """A sample (…,) of each distribution ``probs`` (…, V)."""
    return mx.random.categorical(mx.log(probs))


def accept_greedy(logprobs: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array]:
    """Greedy acceptance of drafts (D,) against trunk log-probs (D+1, V): ``(accepted, block)``, the scalar count a
    of leading drafts equal to the argmax and the (D+1,) argmax tokens, whose first a+1 are emitted."""
    return accept_matching(mx.argmax(logprobs, axis=-1), drafts)


def accept_matching(targets: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array]:
    """Acceptance of drafts (D,) against tokens (D+1,) already chosen at the verified positions (argmax, or
    ``Sampling.keyed`` draws: exact, since they do not depend on the drafts); returns as ``accept_greedy``."""
    accepted = mx.cumprod(targets[:-1] == drafts).sum()
    return accepted, targets


def accept_sampled(p: mx.array, q: mx.array, drafts: mx.array,
                   finite: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """Exact speculative sampling (Leviathan et al. 2023, Algorithm 1) of drafts (D,) drawn from q (D, V)
    against p (D+1, V); ``finite`` False (head output not finite) rejects every draft, q taken as 0. Returns
    ``(accepted, block)``: the count a and (D+1,) tokens whose first a+1 are emitted: the drafts, then a sample of
    the residual norm(max(p − q, 0)) at the first rejection, or a bonus sample from p[D]."""
    ok, q = _draft_test(p[:-1], q, drafts, finite)
    accepted = mx.cumprod(ok).sum()
    fallback = categorical(mx.concatenate([_residual(p[:-1], q), p[-1:]], axis=0))
    index = mx.arange(drafts.shape[0] + 1)
    block = mx.where(index < accepted, mx.concatenate([drafts, drafts[:1]]), fallback)
    return accepted, block


def accept_sampled_position(p: mx.array, q: mx.array, draft: mx.array,
                            finite: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """One position of ``accept_sampled`` (p, q (1, V), draft (1,)) for a pass read position by position
    (``Walk``): ``(ok, token)``, a scalar bool and (1,) the draft or a sample of the residual."""
    ok, q = _draft_test(p, q, draft, finite)
    return ok[0], mx.where(ok, draft, categorical(_residual(p, q)))


def _draft_test(p: mx.array, q: mx.array, drafts: mx.array, finite: mx.array | None) -> tuple[mx.array, mx.array]:
    """Per draft (D,): u·q(d) < p(d), u uniform (False where not finite); and q with non-finite rows zeroed."""
    rows = mx.arange(drafts.shape[0])
    if finite is not None:
        q = mx.where(finite, q, 0.0)
    ok = mx.random.uniform(shape=drafts.shape) * q[rows, drafts] < p[rows, drafts]
    return (ok if finite is None else ok & finite), q


def _residual(p: mx.array, q: mx.array) -> mx.array:
    """The residual distribution norm(max(p − q, 0)) (…, V)."""
    residual = mx.maximum(p - q, 0.0)
    return residual / mx.maximum(residual.sum(axis=-1, keepdims=True), 1e-30)


NONFINITE = -1  # the accepted count read back for a cycle whose head output was not finite


def reject_nonfinite(accepted: mx.array, finite: mx.array) -> mx.array:
    """The cycle's outcome as one scalar for the host sync: ``accepted``, or ``NONFINITE`` where ``finite`` (from
    ``batch.BatchDrafter.launch``) is False; ``accepted`` must be 0 then (the accept test was given ``finite``)."""
    return mx.where(finite, accepted, NONFINITE)


def processed_logprobs(logits: mx.array, inputs: mx.array, past: mx.array | None, processors) -> mx.array:
    """Log-probs (S, V) of ``logits`` (S, V) after mlx-lm style ``processors`` (``processor(tokens, logits)``),
    position i seeing the tokens ``past`` (None: none) + ``inputs[:i+1]``, as mlx-lm applies them per step."""
    if processors:
        rows = []
        for i in range(inputs.size):
            seen = mx.concatenate([past, inputs[: i + 1]]) if past is not None else inputs[: i + 1]
            row = logits[i : i + 1]
            for processor in processors:
                row = processor(seen, row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    return log_softmax(logits)


class Walk:
    """A verify pass read one position at a time, so logits processors see exactly the calls plain decoding makes:
    position j (seeing ``history + inputs[:j+1]``) is processed only after ``read`` showed draft j accepted, one host
    read per position. ``inputs`` (S,): the newest token, then S - 1 drafts; ``q`` (S - 1, V): the head's distributions
    (exact sampling), else None; ``first``: position 0's index among the generated tokens (``Sampling.keyed``).
    """

    def __init__(self, logits: mx.array, inputs: mx.array, history: mx.array, processors, sampling: Sampling | None,
                 q: mx.array | None, finite: mx.array, first: int = 0):
        self.logits, self.inputs, self.history, self.processors = logits, inputs, history, processors
        self.sampling, self.q, self.finite, self.first = sampling, q, finite, first
        self.logprobs: list[mx.array] = []  # (V,) after the processors, per processed position
        self.outcomes: list[mx.array] = []  # (3,) int32 per processed position: its token, its draft accepted, finite
        self.finite_read = True  # the head's output was finite, as the latest ``read`` showed

    def process(self) -> mx.array:
        """Call the processors at the next position and queue its token and acceptance; the outcome (3,) int32."""
        j = len(self.logprobs)
        seen = mx.concatenate([self.history, self.inputs[: j + 1]])
        row = self.logits[j : j + 1]
        for processor in self.processors:
            row = processor(seen, row)
        logprobs = log_softmax(row)
        draft = self.inputs[j + 1 : j + 2]
        sampling = self.sampling
        if sampling is not None and sampling.keyed is None:
            p = sampling.probs(logprobs)
            if draft.size:
                ok, token = accept_sampled_position(p, self.q[j : j + 1], draft, self.finite)
            else:
                ok, token = mx.array(False), categorical(p)  # the bonus token
        else:
            token = mx.argmax(logprobs, axis=-1) if sampling is None else sampling.keyed(logprobs, self.first + j)
            ok = (token[0] == draft[0]) & self.finite if draft.size else mx.array(False)
        outcome = mx.stack([token[0].astype(mx.int32), ok.astype(mx.int32), self.finite.astype(mx.int32)])
        self.logprobs.append(logprobs[0])
        self.outcomes.append(outcome)
        mx.async_eval(outcome, logprobs)
        return outcome

    def read(self) -> tuple[int, bool]:
        """``(token, accepted)`` of the latest processed position (one host read; sets ``finite_read``)."""
        token, ok, finite = self.outcomes[-1].tolist()
        self.finite_read = bool(finite)
        return token, bool(ok)
