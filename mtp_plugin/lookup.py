"""Drafts from the context (prompt lookup): the tokens that followed the latest earlier occurrence of the context's
last few tokens, and the policy that decides, per cycle, whether such a draft beats the head's.

Index (``ContextIndex``). Every n-gram of the request's tokens (prompt, then each committed token), n in
``n_min .. n_max``, maps to the position right after its latest occurrence that has a following token. Each new
token adds ``n_max - n_min + 1`` entries, so the search costs O(n_max) per cycle, however long the context. A
proposal matches the context's last n tokens for the longest n that occurred before, and drafts what followed them
there (llama.cpp's ``ngram-simple`` speculative type; vLLM's ``[ngram]`` proposer, ``prompt_lookup_min/max``).

A proposal can run one token behind: after a plain decoding step the loop queues its successor before reading the
step's token t (as mlx-lm pipelines its steps). The match then ends at t-1 and its first following token stands for
t; the draft is what comes after it. If t turns out different, the drafts are most likely rejected, never emitted
unverified.

Policy (``LookupPolicy``). Counts only, no clock, so that a seed fixes a sampled generation's tokens and every rank of a
sharded model decides alike. A cycle verifying k drafts costs ``1 + slope·k`` plain steps (``tuning.verify_slope``:
the device's and dtype's static cost of a wider verify pass). A lookup draft of length L is expected to give
``E(L) = 1 + p1 + p1·p2 + … + p1⋯pL`` tokens (Leviathan et al. 2023, §3.1), p_k the decayed acceptance of lookup draft
k given drafts 1..k-1 accepted, kept apart for each match length n (a longer match predicts better), with a prior
of ``prior_weight`` pseudo-cycles at ``first_prior`` (then each p_k's prior is p_(k-1)). The other decoding in this
generation (head cycles and plain steps) runs at its decayed tokens per cost unit, 1.0 before any is seen (plain
decoding). The lookup draft is taken at the L that maximises E(L) / (1 + slope·L), when that beats the other
decoding's rate; a head cycle's own draft steps are not counted in its cost, which favours the head.
"""

from __future__ import annotations

from dataclasses import dataclass

from .controller import chain_acceptance

MAX_LOOKUP = 16  # longest lookup draft


class ContextIndex:
    """The n-grams of a request's tokens, kept as tokens are committed.

    Args:
        n_min, n_max: the n-gram lengths matched (1 ≤ n_min ≤ n_max).

    Raises:
        ValueError: a bad range.
    """

    def __init__(self, n_min: int = 2, n_max: int = 4):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram lengths must satisfy 1 <= n_min <= n_max, got {n_min}..{n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self.follows: dict[tuple[int, ...], int] = {}  # n-gram → position of the token after its latest occurrence

    def extend(self, tokens: list[int]) -> None:
        """Commit token ids, in order; each n-gram they complete before a following token gets indexed."""
        for token in tokens:
            i = len(self.tokens)
            self.tokens.append(token)
            for n in range(self.n_min, min(self.n_max, i) + 1):
                self.follows[tuple(self.tokens[i - n : i])] = i

    def propose(self, max_len: int, behind: bool = False) -> tuple[list[int], int]:
        """A lookup draft.

        Args:
            max_len: the most draft tokens.
            behind: the newest token is not committed yet (it is the one after ``tokens``): the match ends at the last
                committed token, and its first following token stands for the newest.

        Returns:
            ``(drafts, n)``: up to ``max_len`` token ids to follow the newest token, and the length of the match that
            proposed them; ``([], 0)`` when the context's last ``n_min`` tokens never occurred before.
        """
        size = len(self.tokens)
        for n in range(min(self.n_max, size), self.n_min - 1, -1):
            start = self.follows.get(tuple(self.tokens[-n:]))
            if start is None:
                continue
            # what followed the match; past the context's end it goes on with itself (a repeat of period size-start)
            run = self.tokens[start:] + [0] * (max_len + 1)
            for i in range(size - start, max_len + 1):
                run[i] = run[i - (size - start)]
            return run[1 : max_len + 1] if behind else run[:max_len], n
        return [], 0


@dataclass(frozen=True)
class LookupSettings:
    """Constants of ``LookupPolicy``.

    Attributes:
        max_len: longest lookup draft, 1..``MAX_LOOKUP``.
        slope: a verify pass of k drafts costs ``1 + slope·k`` plain steps (``tuning.verify_slope``).
        first_prior: prior acceptance of a lookup's first draft.
        prior_weight: pseudo-cycles of prior in each acceptance estimate.
        half_life: committed tokens after which a count weighs half.
        n_min, n_max: the n-gram lengths matched (``ContextIndex``).
    """

    max_len: int = MAX_LOOKUP
    slope: float = 0.3
    first_prior: float = 0.6
    prior_weight: float = 2.0
    half_life: float = 256.0
    n_min: int = 2
    n_max: int = 4


class LookupPolicy:
    """Per cycle, whether a lookup draft is worth its verify pass, and how much of it to verify.

    Args:
        settings: constants (``LookupSettings``).

    Raises:
        ValueError: ``max_len`` outside 1..``MAX_LOOKUP`` or a negative ``slope``.
    """

    def __init__(self, settings: LookupSettings | None = None):
        self.settings = s = settings or LookupSettings()
        if not 1 <= s.max_len <= MAX_LOOKUP or s.slope < 0:
            raise ValueError(f"lookup drafts need 1 <= max_len <= {MAX_LOOKUP} and slope >= 0, got {s.max_len}, "
                             f"{s.slope}")
        self.index = ContextIndex(s.n_min, s.n_max)
        self.reached = {n: [0.0] * (s.max_len + 1) for n in range(s.n_min, s.n_max + 1)}  # [n][k]: drafts k verified
        self.accepted = {n: [0.0] * (s.max_len + 1) for n in range(s.n_min, s.n_max + 1)}  # [n][k]: draft k accepted
        self.other_tokens = self.other_cost = 0.0  # decayed tokens and cost units of head cycles and plain steps

    def acceptance(self, n: int) -> list[float]:
        """Estimated [p_1, …, p_max_len] of lookup drafts from a match of length ``n``, each in (0, 1)."""
        s = self.settings
        return chain_acceptance(self.accepted[n], self.reached[n], s.prior_weight, s.first_prior)

    def other_rate(self) -> float:
        """Tokens per cost unit (a plain step) of this generation's head cycles and plain steps; 1.0 before any."""
        return self.other_tokens / self.other_cost if self.other_cost else 1.0

    def choose(self, available: int, n: int, ceiling: int | None = None) -> int:
        """The lookup draft length to verify, or 0 to draft otherwise (head or plain).

        Args:
            available: lookup draft tokens proposed (``ContextIndex.propose``).
            n: the length of the match that proposed them.
            ceiling: the most drafts the next pass may carry (None: no limit).
        """
        limit = min(available, self.settings.max_len, ceiling if ceiling is not None else available)
        best, best_rate, expected, run = 0, self.other_rate(), 1.0, 1.0
        for length, p in enumerate(self.acceptance(n)[:limit], start=1):
            run *= p
            expected += run
            rate = expected / (1 + self.settings.slope * length)
            if rate > best_rate:
                best, best_rate = length, rate
        return best

    def observe_lookup(self, n: int, length: int, accepted: int) -> None:
        """A lookup cycle ran: ``length`` drafts from a match of length ``n``, ``accepted`` of them accepted."""
        self._fade(accepted + 1)
        reached, hits = self.reached[n], self.accepted[n]
        for k in range(1, min(accepted + 1, length) + 1):
            reached[k] += 1
        for k in range(1, accepted + 1):
            hits[k] += 1

    def observe_other(self, depth: int, accepted: int) -> None:
        """A head cycle at ``depth`` (``accepted`` drafts accepted) or a plain step (depth 0) ran."""
        self._fade(accepted + 1)
        self.other_tokens += accepted + 1
        self.other_cost += 1 + self.settings.slope * depth

    def _fade(self, tokens: int) -> None:
        fade = 0.5 ** (tokens / self.settings.half_life)
        for counts in (*self.reached.values(), *self.accepted.values()):
            counts[:] = [c * fade for c in counts]
        self.other_tokens *= fade
        self.other_cost *= fade


def verify_slope(model) -> float:
    """The static cost of each draft a verify pass carries, in plain steps, for ``model`` on MLX's default device: 0.1
    on a GPU or Apple silicon (a pass of a few tokens costs little more than one); on a CPU, whose passes are
    compute-bound, 0.3 for 16-bit weights (measured on ``build/deep48`` in bfloat16: t_verify(k)/t(1) = 1.23, 1.44,
    1.63 for k = 2, 3, 4) and 1.0 for float32 and quantized weights (a pass of k tokens costs about k plain steps)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    if mx.default_device().type != mx.cpu:
        return 0.1
    weights = [v for _, v in tree_flatten(model.parameters())]
    half = sum(w.size for w in weights if w.dtype in (mx.bfloat16, mx.float16))
    return 0.3 if 2 * half > sum(w.size for w in weights) else 1.0


def lookup_policy(option, model, headless: bool, slope: float | None = None) -> LookupPolicy | None:
    """The loop's ``lookup`` for a generation's ``mtp_lookup`` option on ``model``.

    Args:
        option: None (the default: on for a model with a head, off without one), True, False, or ``LookupSettings``
            (on, with these constants).
        model: the runtime's model (its weights' dtype gives the cost slope: ``verify_slope``).
        headless: the model has no head that drafts.
        slope: ``verify_slope(model)`` when the caller knows it already (None: computed).

    Returns:
        a fresh ``LookupPolicy`` (its index is this generation's), or None: no lookup drafts.

    Raises:
        ValueError: ``option`` is none of those.
    """
    if not (option is None or isinstance(option, (bool, LookupSettings))):
        raise ValueError(f"mtp_lookup must be True, False, None (default: on with an MTP head) or LookupSettings; "
                         f"got {option!r}")
    if option is False or (option is None and headless):
        return None
    if isinstance(option, LookupSettings):
        return LookupPolicy(option)
    return LookupPolicy(LookupSettings(slope=verify_slope(model) if slope is None else slope))
