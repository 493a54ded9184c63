"""Window policies: how many of its k allowed tokens a drafter drafts this step.

A model drafter asks after each draft token whether to draft another; the token just drafted
is always proposed (verifying one more token costs the target next to nothing). After each
verification the policy hears how the run went and may adapt its threshold. One policy object
serves every sequence of a decoder, so it adapts on the traffic as a whole.

Stopping early never changes what is emitted: the target verifies whatever chain it gets.
"""

from __future__ import annotations

from engine.config import WindowConfig
from engine.decoders.base import Proposal


class FixedWindow:
    """Always draft the k tokens allowed."""

    name = "fixed"

    def keep_drafting(self, confidence: float, entropy: float) -> bool:
        return True

    def on_verified(self, proposal: Proposal, num_accepted: int) -> None:
        pass


class AdaptiveDraftExit:
    """Draft & Verify's adaptive draft-exiting (Zhang et al. 2023): stop once the draft's top-1
    probability falls below gamma; after each verification, smooth the acceptance rate and move
    gamma up a step when it is at or below the target rate (drafts too bold), down otherwise."""

    name = "adaptive_exit"

    def __init__(self, config: WindowConfig):
        self.gamma = config.gamma
        self.target_acceptance = config.target_acceptance
        self.step = config.step
        self.beta1 = config.acceptance_smoothing
        self.beta2 = config.gamma_smoothing
        self.acceptance = config.target_acceptance  # smoothed; starts neutral

    def keep_drafting(self, confidence: float, entropy: float) -> bool:
        return confidence >= self.gamma

    def on_verified(self, proposal: Proposal, num_accepted: int) -> None:
        drafted = len(proposal.token_ids)
        if not drafted:
            return
        rate = num_accepted / drafted
        self.acceptance = self.beta1 * self.acceptance + (1 - self.beta1) * rate
        moved = self.gamma + (
            self.step if self.acceptance <= self.target_acceptance else -self.step
        )
        self.gamma = min(1.0, max(0.0, self.beta2 * self.gamma + (1 - self.beta2) * moved))


class EntropyWindow:
    """HSDDW's entropy-driven window (Jiang et al.): stop once the draft's entropy exceeds tau;
    tau is the running mean entropy of the drafts the target rejected (the initial tau counts
    as one observation)."""

    name = "entropy"

    def __init__(self, config: WindowConfig):
        self.tau = config.tau
        self._sum, self._count = config.tau, 1

    def keep_drafting(self, confidence: float, entropy: float) -> bool:
        return entropy <= self.tau

    def on_verified(self, proposal: Proposal, num_accepted: int) -> None:
        if num_accepted < len(proposal.entropies):
            self._sum += proposal.entropies[num_accepted]
            self._count += 1
            self.tau = self._sum / self._count


def build_window(config: WindowConfig):
    if config.policy == "adaptive_exit":
        return AdaptiveDraftExit(config)
    if config.policy == "entropy":
        return EntropyWindow(config)
    return FixedWindow()
