"""Counters of one MTP generation: draft tokens, accepted tokens, acceptance by depth, tokens per cycle."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class MTPStats:
    """Counts for one generation (the first token, from the prompt pass, is not counted).

    Attributes:
        depth: the fixed draft depth, or None (adaptive).
        emitted: tokens emitted by the cycles (accepted drafts plus one bonus/correction token per cycle).
        plain: tokens emitted by plain decoding steps.
        reached: per draft position k (index k-1), cycles whose drafts 1..k-1 were all accepted.
        accepted_at: per draft position k (index k-1), cycles whose draft k was accepted.
        lookup_cycles, …: the same counts for cycles that verified context drafts (not in the counts above).
        lookup_declined: lookup drafts the scheduler found and declined for a plain step (not worth a verify pass);
            ``lookup_price``: the last one's (cost of a pass verifying one draft in plain steps, tokens it expected).
        forced: drafts a grammar forced (counted in ``drafted`` too; the head did not choose them).
        masked: head drafts a grammar changed (the head's top token was forbidden).
        grammar_seconds: host time in the grammar (masks, forced tokens, consumption, rollback).
        headless: the model has no head (lookup drafts and plain steps only).
    """

    depth: int | None = None
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    plain: int = 0
    reached: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    lookup_cycles: int = 0
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    lookup_emitted: int = 0
    lookup_declined: int = 0
    lookup_price: tuple[float, float] | None = None
    forced: int = 0
    masked: int = 0
    grammar_seconds: float = 0.0
    headless: bool = False

    def record_lookup(self, accepted: int, emitted: int, drafted: int) -> None:
        """One cycle verifying ``drafted`` lookup drafts, ``accepted`` of them accepted, ``emitted`` tokens emitted."""
        self.lookup_cycles += 1
        self.lookup_drafted += drafted
        self.lookup_accepted += accepted
        self.lookup_emitted += emitted

    def decline_lookup(self, cost: float, expected: float) -> None:
        """The scheduler took a plain step over a lookup draft: a pass verifying one draft would cost ``cost`` plain
        steps and emit ``expected`` tokens."""
        self.lookup_declined += 1
        self.lookup_price = (cost, expected)

    def record(self, accepted: int, emitted: int, depth: int | None = None) -> None:
        """One head cycle at ``depth`` (default: the fixed ``self.depth``)."""
        depth = self.depth if depth is None else depth
        grow = depth - len(self.reached)
        if grow > 0:
            self.reached += [0] * grow
            self.accepted_at += [0] * grow
        self.cycles += 1
        self.drafted += depth
        self.accepted += accepted
        self.emitted += emitted
        self.depths.append(depth)
        for k in range(min(accepted + 1, depth)):
            self.reached[k] += 1
        for k in range(accepted):
            self.accepted_at[k] += 1

    def add(self, other: MTPStats) -> None:
        """Accumulate another generation's counts into this one (the depths of both are kept)."""
        for name in ("cycles", "drafted", "accepted", "emitted", "plain", "lookup_cycles", "lookup_drafted",
                     "lookup_accepted", "lookup_emitted", "lookup_declined", "forced", "masked", "grammar_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("reached", "accepted_at"):
            mine, theirs = getattr(self, name), getattr(other, name)
            mine += [0] * (len(theirs) - len(mine))
            for k, v in enumerate(theirs):
                mine[k] += v
        self.depths += other.depths

    @property
    def acceptance(self) -> float:
        """Accepted / drafted (0.0 before any cycle)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_by_depth(self) -> list[float]:
        """Conditional acceptance p_k = P(draft k accepted | drafts 1..k-1 accepted), k = 1..deepest depth run."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached, strict=True)]

    @property
    def tokens_per_cycle(self) -> float:
        """Emitted tokens per cycle (each cycle is one verify pass of the trunk)."""
        return self.emitted / self.cycles if self.cycles else 0.0

    @property
    def passes_per_token(self) -> float:
        """Trunk forward passes per token emitted after the first (head and lookup cycles and plain steps alike)."""
        tokens = self.emitted + self.plain + self.lookup_emitted
        return (self.cycles + self.plain + self.lookup_cycles) / tokens if tokens else 0.0

    def summary(self) -> str:
        """The line ``mlx_lm.generate`` prints (``MTP: depth=… drafted=… accepted=… …``); an adaptive generation
        says ``depth=auto`` and adds its cycles per depth and plain tokens."""
        if self.headless:
            line = (f"MTP lookup: drafted={self.lookup_drafted} accepted={self.lookup_accepted} "
                    f"cycles={self.lookup_cycles} plain={self.plain}")
            return line + self._why_no_lookup() if not self.lookup_cycles and self.plain else line
        line = (f"MTP: depth={self.depth or 'auto'} drafted={self.drafted} accepted={self.accepted} "
                f"acceptance={self.acceptance:.3f} tokens/cycle={self.tokens_per_cycle:.2f}")
        if self.depth is None:
            counts = sorted(Counter(self.depths).items())
            line += f" cycles={','.join(f'd{d}:{n}' for d, n in counts) or '-'} plain={self.plain}"
        if self.lookup_cycles:
            line += (f" lookup: cycles={self.lookup_cycles} drafted={self.lookup_drafted} "
                     f"accepted={self.lookup_accepted}")
        if self.forced or self.masked:
            line += f" grammar: forced={self.forced} masked={self.masked}"
        return line

    def _why_no_lookup(self) -> str:
        """Why a generation verified no lookup draft, for its summary."""
        if not self.lookup_declined:
            return " (the context never repeated what was being generated: no lookup draft to verify)"
        cost, expected = self.lookup_price
        return (f" ({self.lookup_declined} lookup drafts declined as not worth a verify pass: one draft costs "
                f"{cost:.2f} plain steps here for {expected:.2f} expected tokens; MLX on a CPU prices each added "
                "position of quantized or float32 weights near a whole step, bf16 weights, a GPU or Apple silicon far "
                "less: docs/scheduling.md)")
