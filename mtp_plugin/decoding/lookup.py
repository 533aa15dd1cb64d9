"""Drafts from the context (prompt lookup, as llama.cpp's ``ngram-simple`` and vLLM's ``[ngram]`` proposer) and the
acceptance of those drafts so far; ``scheduler.plan`` decides whether a cycle verifies them. Design: docs/lookup.md."""

from __future__ import annotations

from dataclasses import dataclass

from .scheduler import Chain

MAX_LOOKUP = 16  # longest lookup draft


class ContextIndex:
    """The n-grams (n = ``n_min``..``n_max``) of a request's committed tokens, each mapped to the position after its
    latest occurrence. Raises ValueError unless 1 ≤ n_min ≤ n_max."""

    def __init__(self, n_min: int = 2, n_max: int = 4):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram lengths must satisfy 1 <= n_min <= n_max, got {n_min}..{n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self.follows: dict[tuple[int, ...], int] = {}  # n-gram → position of the token after its latest occurrence

    def extend(self, tokens: list[int]) -> None:
        """Commit token ids, in order, indexing the n-grams they complete."""
        for token in tokens:
            i = len(self.tokens)
            self.tokens.append(token)
            for n in range(self.n_min, min(self.n_max, i) + 1):
                self.follows[tuple(self.tokens[i - n : i])] = i

    def copy(self) -> ContextIndex:
        """An index of the same tokens that extends apart from this one."""
        other = ContextIndex(self.n_min, self.n_max)
        other.tokens, other.follows = list(self.tokens), dict(self.follows)
        return other

    def propose(self, max_len: int, behind: bool = False) -> tuple[list[int], int]:
        """``(drafts, n)``: up to ``max_len`` ids to follow the newest token, from the longest match n (repeating with
        its period past the context's end); ``([], 0)`` if none of ``n_min`` or more. ``behind``: the newest token is
        uncommitted; the match ends at the last committed one, whose first follower stands for it."""
        size = len(self.tokens)
        for n in range(min(self.n_max, size), self.n_min - 1, -1):
            start = self.follows.get(tuple(self.tokens[-n:]))
            if start is None:
                continue
            # what followed the match; past the context's end it goes on with itself (a repeat of period size-start)
            period = size - start
            run = [self.tokens[start + i % period] for i in range(int(behind), max_len + int(behind))]
            return run, n
        return [], 0


@dataclass(frozen=True)
class LookupSettings:
    """Constants of ``LookupPolicy`` (ValueError names each one out of range): ``max_len`` 1..``MAX_LOOKUP``;
    ``slope`` None (a verify pass costs what ``scheduler.CostModel`` says) or ≥ 0 (a pass of k drafts costs 1 + slope·k
    plain steps, whatever was measured); ``first_prior`` in (0, 1) and ``prior_weight`` ≥ 0 pseudo-cycles: the prior
    acceptance of a first draft; ``half_life`` > 0 committed tokens; ``n_min``..``n_max``: n-gram lengths matched."""

    max_len: int = MAX_LOOKUP
    slope: float | None = None
    first_prior: float = 0.6
    prior_weight: float = 2.0
    half_life: float = 256.0
    n_min: int = 2
    n_max: int = 4

    def __post_init__(self):
        bad = [f"{name}={value!r} (must be {rule})" for name, value, ok, rule in (
            ("max_len", self.max_len, 1 <= self.max_len <= MAX_LOOKUP, f"1..{MAX_LOOKUP}"),
            ("slope", self.slope, self.slope is None or self.slope >= 0, "None or >= 0"),
            ("first_prior", self.first_prior, 0 < self.first_prior < 1, "in (0, 1)"),
            ("prior_weight", self.prior_weight, self.prior_weight >= 0, ">= 0"),
            ("half_life", self.half_life, self.half_life > 0, "> 0"),
            ("n_min", self.n_min, 1 <= self.n_min <= self.n_max, "1..n_max")) if not ok]
        if bad:
            raise ValueError(f"LookupSettings: {'; '.join(bad)}")


def new_prior() -> Chain:
    """A model's first-draft acceptance of lookup drafts in sampled generations (``scheduler.Scheduler.lookup_prior``):
    a one-draft ``Chain``, 2 pseudo-cycles at ``LookupSettings.first_prior``, halved per generation."""
    return Chain(1, LookupSettings.first_prior, 2.0, half_life=1.0)


class LookupPolicy:
    """A generation's lookup drafts: its context's index and their acceptance per match length. ``prior``: a sampled
    generation's model prior (``new_prior``); its p_1 replaces ``settings.first_prior``; it learns from this one."""

    def __init__(self, settings: LookupSettings | None = None, prior: Chain | None = None):
        self.settings = s = settings or LookupSettings()
        self.prior = prior
        if prior is not None:
            prior.fade(1)  # a generation starts: the earlier ones' evidence weighs half
        first = s.first_prior if prior is None else prior.expected(1)[1] - 1
        self.index = ContextIndex(s.n_min, s.n_max)
        self.chains = {n: Chain(s.max_len, first, s.prior_weight, s.half_life) for n in range(s.n_min, s.n_max + 1)}

    def propose(self, room: int | None, behind: bool = False) -> tuple[tuple[int, ...], int, list[float]]:
        """``(drafts, match, expected)``, at most ``room`` drafts (None: no limit), ``expected`` = [E(0), …,
        E(len(drafts))] by the match's chain; ``((), 0, [1.0])`` if none; ``behind``: ``ContextIndex``'s."""
        longest = self.settings.max_len if room is None else min(self.settings.max_len, room)
        drafts, n = self.index.propose(longest, behind) if longest > 0 else ([], 0)
        if not drafts:
            return (), 0, [1.0]
        return tuple(drafts), n, self.chains[n].expected(len(drafts))

    def observe(self, n: int, length: int, accepted: int) -> None:
        """A lookup cycle verified ``length`` drafts from a match of length ``n`` and accepted ``accepted``."""
        self.chains[n].observe(length, accepted)
        if self.prior is not None:
            self.prior.observe(length, accepted)

    def fade(self, tokens: int) -> None:
        """``tokens`` more tokens were committed (``scheduler.Chain.fade``)."""
        for chain in self.chains.values():
            chain.fade(tokens)


def lookup_policy(option, headless: bool, prior: Chain | None = None) -> LookupPolicy | None:
    """The loop's ``lookup`` for a generation's ``mtp_lookup`` ``option``: None (on with a head that drafts, off
    when ``headless``), True, False, or ``LookupSettings`` (on, with these constants; ``prior`` unused). Returns a
    fresh ``LookupPolicy`` or None (no lookup drafts); raises ValueError for any other option."""
    if not (option is None or isinstance(option, (bool, LookupSettings))):
        raise ValueError(f"mtp_lookup must be True, False, None (default: on with an MTP head) or LookupSettings; "
                         f"got {option!r}")
    if option is False or (option is None and headless):
        return None
    if isinstance(option, LookupSettings):
        return LookupPolicy(option)
    return LookupPolicy(None, prior)
