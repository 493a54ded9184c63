"""How many tokens to draft this step: the goodput policy (issue 12, first part).

Speculation buys latency with spare compute; when drafting and verifying cost more than the
accepted tokens save, it makes the server slower. Each step the policy picks, per decoder, the
draft length k (0 included) that maximises expected emitted tokens per second of step time:

    B * (1 + E(k)) / (T(tokens of the step with k drafts each) + D(k))

for the B sequences that want to draft, with

- T(n): the target's forward time for a step of n tokens, learnt online from every step (a
  moving average per n, linear between the n seen);
- D(k): the decoder's drafting time when granted k, learnt per decoder from its propose calls
  (a window that stops early is part of what k costs);
- E(k): expected accepted drafts of a k-draft run, from the decoder's acceptance per draft
  position (decaying counts: position j counts the runs that reached it). For a token tree, k
  is its node count and the positions are the accepted path's depths, an approximation.

Until a length has been measured the policy tries it, so every length it may choose gets
measured; every ``explore_every`` steps one sequence of the group drafts one more than the
choice (``explore``), so the estimates keep up with the load at the price of one sequence's
extra draft, not the whole batch's. The windows, the gate and the request's k still cap what it
may choose: it only ever drafts less. Choosing 0 for every sequence leaves the step without
drafts. Output never depends on it: the verifier is exact whatever is drafted.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

SMOOTHING = 0.1  # weight of a new observation in the moving averages
DECAY = 0.98  # acceptance counts: about the last 50 runs matter
PRIOR_ACCEPTANCE = 0.5  # a position never reached yet


def _ema(old: float | None, new: float, weight: float = SMOOTHING) -> float:
    return new if old is None else (1 - weight) * old + weight * new


@dataclass
class StepCostModel:
    """The target's forward time by number of tokens in the step, learnt online."""

    seconds: dict[int, float] = field(default_factory=dict)

    def observe(self, num_tokens: int, seconds: float) -> None:
        self.seconds[num_tokens] = _ema(self.seconds.get(num_tokens), seconds)

    def predict(self, num_tokens: int) -> float | None:
        """None outside the range of step sizes seen (the policy then explores)."""
        if num_tokens in self.seconds:
            return self.seconds[num_tokens]
        seen = sorted(self.seconds)
        below = [n for n in seen if n < num_tokens]
        above = [n for n in seen if n > num_tokens]
        if below and above:
            lo, hi = below[-1], above[0]
            w = (num_tokens - lo) / (hi - lo)
            return (1 - w) * self.seconds[lo] + w * self.seconds[hi]
        return None


@dataclass
class DecoderRecord:
    """One decoder's drafting time per depth and acceptance per draft position."""

    draft_seconds: dict[int, float] = field(default_factory=dict)  # by depth k
    reached: list[float] = field(default_factory=list)  # runs that drafted position j
    accepted: list[float] = field(default_factory=list)  # ... and had it accepted

    def observe_draft(self, depth: int, seconds: float) -> None:
        self.draft_seconds[depth] = _ema(self.draft_seconds.get(depth), seconds)

    def observe_run(self, num_drafts: int, num_accepted: int) -> None:
        while len(self.reached) < num_drafts:
            self.reached.append(0.0)
            self.accepted.append(0.0)
        self.reached = [r * DECAY for r in self.reached]
        self.accepted = [a * DECAY for a in self.accepted]
        # Position j was judged when every position before it was accepted.
        for j in range(min(num_drafts, num_accepted + 1)):
            self.reached[j] += 1
            self.accepted[j] += j < num_accepted

    def acceptance(self, position: int) -> float:
        if position >= len(self.reached) or self.reached[position] == 0:
            return PRIOR_ACCEPTANCE
        return self.accepted[position] / self.reached[position]

    def expected_accepted(self, k: int) -> float:
        total, chain = 0.0, 1.0
        for j in range(k):
            chain *= self.acceptance(j)
            total += chain
        return total


class GoodputPolicy:
    def __init__(self, explore_every: int = 16):
        self.cost = StepCostModel()
        self.decoders: dict[str, DecoderRecord] = defaultdict(DecoderRecord)
        self.explore_every = explore_every
        self._steps = 0
        self.chosen: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.predicted_seconds: float | None = None  # the last choice's predicted step time
        self.explore = False  # whether one sequence should draft one more than the choice

    def choose(self, decoder: str, num_seqs: int, cap: int, other_tokens: int = 0) -> int:
        """The draft length for ``num_seqs`` sequences of ``decoder`` (at most ``cap``), with
        ``other_tokens`` more tokens in the step."""
        self._steps += 1
        record = self.decoders[decoder]
        best, best_rate, best_time = 0, -1.0, None
        for k in range(cap + 1):
            forward = self.cost.predict(other_tokens + num_seqs * (1 + k))
            drafting = 0.0 if k == 0 else record.draft_seconds.get(k)
            if forward is None or drafting is None:
                best = k  # not measured yet: try it, so that it is
                break
            rate = num_seqs * (1 + record.expected_accepted(k)) / (forward + drafting)
            if rate > best_rate:
                best, best_rate, best_time = k, rate, forward + drafting
        # Keep the next length's estimates fresh as the load changes (``explore``).
        self.explore = self._steps % self.explore_every == 0 and best < cap
        self.predicted_seconds = None if self.explore else best_time
        self.chosen[decoder][best] += 1
        return best

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.cost.observe(num_tokens, seconds)

    def observe_draft(self, decoder: str, depth: int, seconds: float) -> None:
        self.decoders[decoder].observe_draft(depth, seconds)

    def observe_run(self, decoder: str, num_drafts: int, num_accepted: int) -> None:
        self.decoders[decoder].observe_run(num_drafts, num_accepted)
