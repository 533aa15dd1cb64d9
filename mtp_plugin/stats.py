"""Counters of one MTP generation: draft tokens, accepted tokens, acceptance by depth, tokens per cycle."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MTPStats:
    """Counts for one generation.

    Attributes:
        depth: draft depth used (drafts per cycle).
        cycles: draft → verify → accept cycles run.
        drafted: draft tokens proposed.
        accepted: draft tokens accepted and emitted.
        emitted: tokens emitted by the cycles (accepted drafts plus one bonus/correction per cycle).
        reached: per depth k (index k-1), cycles whose drafts 1..k-1 were all accepted.
        accepted_at: per depth k, cycles whose draft k was accepted.
    """

    depth: int
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    reached: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.reached = self.reached or [0] * self.depth
        self.accepted_at = self.accepted_at or [0] * self.depth

    def record(self, accepted: int, emitted: int) -> None:
        """One cycle: ``accepted`` leading drafts accepted, ``emitted`` tokens emitted by it."""
        self.cycles += 1
        self.drafted += self.depth
        self.accepted += accepted
        self.emitted += emitted
        for k in range(min(accepted + 1, self.depth)):
            self.reached[k] += 1
        for k in range(accepted):
            self.accepted_at[k] += 1

    @property
    def acceptance(self) -> float:
        """Accepted / drafted (0.0 before any cycle)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_by_depth(self) -> list[float]:
        """Conditional acceptance p_k = P(draft k accepted | drafts 1..k-1 accepted), k = 1..depth."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached, strict=True)]

    @property
    def tokens_per_cycle(self) -> float:
        """Emitted tokens per cycle (each cycle is one verify pass of the trunk)."""
        return self.emitted / self.cycles if self.cycles else 0.0

    def summary(self) -> str:
        """The line ``mlx_lm.generate`` prints: ``MTP: depth=2 drafted=120 accepted=96 acceptance=0.800 ...``."""
        return (f"MTP: depth={self.depth} drafted={self.drafted} accepted={self.accepted} "
                f"acceptance={self.acceptance:.3f} tokens/cycle={self.tokens_per_cycle:.2f}")
