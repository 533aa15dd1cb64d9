"""Parking a loaded head whose output is not finite or that accepts (almost) nothing over its first cycles: one
warning, then no more drafts in this or any later generation; output never changes. Design: docs/decoding.md#use."""

from __future__ import annotations

import logging

log = logging.getLogger("mtp_plugin")

PROBE_DRAFTS = 64  # draft tokens after which a head's acceptance is judged; 0: never
MIN_ACCEPTANCE = 0.02  # below this over the first PROBE_DRAFTS the head is initializer noise


class HeadHealth:
    """Lifetime counters of one loaded head and its parking decision (``parked``: the reason, or None)."""

    def __init__(self, name: str):
        self.name = name
        self.drafted = self.accepted = 0
        self.parked: str | None = None

    def park(self, reason: str) -> None:
        """Stop drafting with this head from now on; the first reason is kept and logged once as a warning."""
        if self.parked is None:
            self.parked = reason
            log.warning("mtp_plugin: MTP head %s parked, decoding without it: %s", self.name, reason)

    def nonfinite(self) -> None:
        """The head's output held NaN or Inf: its drafts were rejected; park it."""
        self.park("its output is not finite (NaN or Inf in its weights or activations); run "
                  "`mtp-plugin inspect` on the model directory")

    def observe(self, drafted: int, accepted: int) -> bool:
        """Count one cycle; True when parked (below ``MIN_ACCEPTANCE`` over the first ``PROBE_DRAFTS`` drafts)."""
        probing = 0 < PROBE_DRAFTS and self.drafted < PROBE_DRAFTS
        self.drafted += drafted
        self.accepted += accepted
        if probing and self.drafted >= PROBE_DRAFTS and self.accepted < MIN_ACCEPTANCE * self.drafted:
            self.park(f"it accepted {self.accepted} of its first {self.drafted} draft tokens (random "
                      "initialisation or wrong wiring?); run `mtp-plugin verify` on the model directory")
        return self.parked is not None
