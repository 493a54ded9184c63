"""Target-confidence gating: no drafts while the target itself is unsure.

When the target gave its last emitted token a low probability, the text is at a fork the
drafter is unlikely to guess; drafting there costs draft passes and a wider verification for
little. The gate holds a sequence back from drafting until the target is confident again (its
probability for the last emitted token at or above the threshold). Gating only chooses who
drafts, so output is unchanged.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sequence import Sequence


class TargetConfidenceGate:
    def __init__(self, min_target_prob: float | None):
        self.min_target_prob = min_target_prob
        # The target's probability for each sequence's last emitted token; weak keys, so a
        # finished sequence leaves nothing behind.
        self._last: weakref.WeakKeyDictionary[Sequence, float] = weakref.WeakKeyDictionary()
        self.num_gated = 0  # decode steps held back from drafting

    @property
    def enabled(self) -> bool:
        return self.min_target_prob is not None

    def allows(self, seq: Sequence) -> bool:
        if not self.enabled:
            return True
        # A sequence the gate has not observed yet drafts.
        allowed = self._last.get(seq, 1.0) >= self.min_target_prob
        self.num_gated += not allowed
        return allowed

    def observe(self, seq: Sequence, probability: float) -> None:
        self._last[seq] = probability
