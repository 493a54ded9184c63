"""How many tokens to draft this step: the goodput policy (issue 12, first part).

Speculation buys latency with spare compute; when drafting and verifying cost more than the
accepted tokens save, it makes the server slower. Each step the policy picks, per decoder, the
draft length k (0 included) that maximises expected emitted tokens per second of step time:

    B * (1 + E(k)) / (T(tokens of the step with k drafts each) + D(k))

for the B sequences that want to draft, with

- T(n): the target's forward time for a step of n tokens: measured for a range of step sizes
  when the policy is first needed (``calibrate``; the engine times decode-shaped steps), then
  refined by every step (a moving average per n, linear between the n known, extended along
  the last two beyond them);
- D(k, B): the decoder's drafting time when B sequences are granted k, learnt per decoder from
  its propose calls (a window that stops early is part of what k costs); for a B not seen, the
  time of the nearest larger B seen, or the largest smaller one scaled up by B (an estimate
  that errs towards drafting less);
- E(k): expected accepted drafts of a k-draft run, from the decoder's acceptance per draft
  position (decaying counts: position j counts the runs that reached it). For a token tree, k
  is its node count and the positions are the accepted path's depths, an approximation.

Exploration costs one sequence, never the batch: a length never drafted yet is tried by one
sequence of the group (``explore``: it drafts one more than the choice), and so is the next
length every ``explore_every`` steps while it is within ``PLAUSIBLE`` of the best rate (its
acceptance and cost estimates keep up with the load), and only every ``RARELY`` times that
otherwise (a loss by the estimates is seldom worth re-checking, and each check slows a step).
The windows, the gate and the request's k still cap what it may choose: it only ever drafts
less. Choosing 0 for every sequence leaves the step without drafts. Output never depends on it:
the verifier is exact whatever is drafted.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

SMOOTHING = 0.1  # weight of a new observation in the moving averages
DECAY = 0.98  # acceptance counts: about the last 50 runs matter
PRIOR_ACCEPTANCE = 0.5  # a position never reached yet
PLAUSIBLE = 0.9  # explore the next length while its rate is within this of the best
RARELY = 16  # ... and every RARELY-th exploring step otherwise


def _ema(old: float | None, new: float, weight: float = SMOOTHING) -> float:
    return new if old is None else (1 - weight) * old + weight * new


@dataclass
class StepCostModel:
    """The target's forward time by number of tokens in the step."""

    seconds: dict[int, float] = field(default_factory=dict)

    def observe(self, num_tokens: int, seconds: float) -> None:
        self.seconds[num_tokens] = _ema(self.seconds.get(num_tokens), seconds)

    def predict(self, num_tokens: int) -> float | None:
        """Linear between the step sizes known, along the last two beyond the largest (never
        below it), the smallest's time below it; None before any step is known."""
        if num_tokens in self.seconds:
            return self.seconds[num_tokens]
        seen = sorted(self.seconds)
        if not seen:
            return None
        below = [n for n in seen if n < num_tokens]
        above = [n for n in seen if n > num_tokens]
        if not below:
            return self.seconds[above[0]]
        if not above:
            if len(below) == 1:  # proportional to the tokens: errs towards drafting less
                return self.seconds[below[-1]] * num_tokens / below[-1]
            lo, hi = below[-2], below[-1]
        else:
            lo, hi = below[-1], above[0]
        slope = max(0.0, (self.seconds[hi] - self.seconds[lo]) / (hi - lo))
        return self.seconds[lo] + slope * (num_tokens - lo)


@dataclass
class DecoderRecord:
    """One decoder's drafting time per depth and acceptance per draft position."""

    # by (depth k, sequences drafting)
    draft_seconds: dict[tuple[int, int], float] = field(default_factory=dict)
    reached: list[float] = field(default_factory=list)  # runs that drafted position j
    accepted: list[float] = field(default_factory=list)  # ... and had it accepted

    def observe_draft(self, depth: int, num_seqs: int, seconds: float) -> None:
        key = (depth, num_seqs)
        self.draft_seconds[key] = _ema(self.draft_seconds.get(key), seconds)

    def predict_draft(self, depth: int, num_seqs: int) -> float | None:
        """Drafting time of ``num_seqs`` sequences to ``depth``: as measured, else the nearest
        larger group's time, else the largest smaller group's scaled up; None if never
        drafted to that depth."""
        if (depth, num_seqs) in self.draft_seconds:
            return self.draft_seconds[depth, num_seqs]
        sizes = sorted(b for k, b in self.draft_seconds if k == depth)
        if not sizes:
            return None
        larger = [b for b in sizes if b > num_seqs]
        if larger:
            return self.draft_seconds[depth, larger[0]]
        return self.draft_seconds[depth, sizes[-1]] * num_seqs / sizes[-1]

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
    def __init__(
        self,
        explore_every: int = 16,
        calibrate: Callable[[], dict[int, float]] | None = None,
    ):
        """``calibrate``: returns the target's forward seconds by step size, measured on the
        machine; called once, before the first choice."""
        self.cost = StepCostModel()
        self.decoders: dict[str, DecoderRecord] = defaultdict(DecoderRecord)
        self.explore_every = explore_every
        self._calibrate = calibrate
        self._steps = 0
        self._exploring_steps = 0
        self.chosen: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.predicted_seconds: float | None = None  # the last choice's predicted step time
        self.explore = False  # whether one sequence should draft one more than the choice

    def ensure_calibrated(self) -> None:
        if self._calibrate is not None:
            measure, self._calibrate = self._calibrate, None
            for num_tokens, seconds in measure().items():
                self.cost.observe(num_tokens, seconds)

    def choose(self, decoder: str, num_seqs: int, cap: int, other_tokens: int = 0) -> int:
        """The draft length for ``num_seqs`` sequences of ``decoder`` (at most ``cap``), with
        ``other_tokens`` more tokens in the step; sets ``explore`` when one of them should draft
        one more."""
        self.ensure_calibrated()
        self._steps += 1
        record = self.decoders[decoder]
        rates: dict[int, tuple[float, float]] = {}  # k -> (tokens per second, step seconds)
        for k in range(cap + 1):
            forward = self.cost.predict(other_tokens + num_seqs * (1 + k))
            drafting = 0.0 if k == 0 else record.predict_draft(k, num_seqs)
            if forward is None or drafting is None:
                break  # not measured: deeper lengths are not either
            expected = num_seqs * (1 + record.expected_accepted(k))
            rates[k] = (expected / (forward + drafting), forward + drafting)
        best = max(rates, key=lambda k: rates[k][0]) if rates else 0
        nxt = best + 1
        if nxt > cap:
            self.explore = False
        elif nxt not in rates:
            self.explore = True  # never measured: one sequence tries it now
        elif self._steps % self.explore_every == 0:
            self._exploring_steps += 1
            plausible = rates[nxt][0] >= PLAUSIBLE * rates[best][0]
            self.explore = plausible or self._exploring_steps % RARELY == 0
        else:
            self.explore = False
        self.predicted_seconds = None if self.explore or not rates else rates[best][1]
        self.chosen[decoder][best] += 1
        return best

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.cost.observe(num_tokens, seconds)

    def observe_draft(self, decoder: str, depth: int, num_seqs: int, seconds: float) -> None:
        self.decoders[decoder].observe_draft(depth, num_seqs, seconds)

    def observe_run(self, decoder: str, num_drafts: int, num_accepted: int) -> None:
        self.decoders[decoder].observe_run(num_drafts, num_accepted)
