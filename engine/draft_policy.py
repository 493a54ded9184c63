"""How many tokens to draft this step: the goodput policy (issue 12, first part).

Speculation buys latency with spare compute; when drafting and verifying cost more than the
accepted tokens save, it makes the server slower. Each step the policy picks, per decoder, the
draft length k (0 included) that maximises expected emitted tokens per second of step time:

    B * (1 + E(k)) / (T(tokens of the step with k drafts each) + D(k) + O)

for the B sequences that want to draft, with

- T(n, K): the target's forward time for a step of n tokens attending to K keys: the engine
  times decode-shaped steps of 1 to 128 tokens, and a few at a longer context, when the policy
  is first needed (``calibrate``), and every decode step that runs rescales that model
  (``StepCostModel``; a step with a prompt's pass in it does not: other kernels, see
  ``engine.speculation.decode_shaped``);
- D(k, B): the decoder's drafting time when B sequences are granted k, learnt per decoder from
  its propose calls (a window that stops early is part of what k costs); for a B not seen, the
  time of the nearest larger B seen, or the largest smaller one scaled up by B (an estimate
  that errs towards drafting less);
- O: the rest of a step (scheduling, bookkeeping, outputs), a moving average of each step's
  time outside its forward pass and drafting;
- E(k): expected accepted drafts of a k-draft run, from the decoder's acceptance per draft
  position (decaying counts: position j counts the runs that reached it). For a token tree, k
  is its node count, and the tree's own runs of that size decide: their mean accepted path
  length, backed by ``PRIOR_RUNS`` pseudo-runs at the per-depth reading (which, with k nodes
  read as k positions deep, overrates a big tree when small ones were measured and a small
  tree when big ones were, a bushy tree's depths being accepted more often than a chain's).

Exploration costs one sequence, never the batch: a length never drafted yet is tried by one
sequence of the group (``explore``: it drafts one more than the choice), and so is the next
length every ``explore_every`` of the decoder's choices (``PLAIN_EXPLORE_FACTOR`` times as
often for the first ``PLAIN_RETRIES`` tries after it stopped drafting) while it could be
within ``PLAUSIBLE`` of the best rate (its acceptance and cost estimates keep up with the
load), and only every ``RARELY`` times that otherwise (a loss by the estimates is seldom
worth re-checking, and each check slows a step). "Could be" reads each acceptance
``OPTIMISM`` standard errors high: a few unlucky first runs (one accepted of five, for a
drafter right 46% of the time) must not file a length under "clear loss" before enough runs
say so.
Each choice also sets the decoder's ``chance_floor``: what a verified row must be worth. A
draft whose chance of standing is below it costs its row more than it is expected to bring:

    floor = (T(step) - T(step less one row per sequence)) / B * tokens per second

(``Speculator.propose`` trims greedy chains at the first draft under it). A draft's chance is
its drafter's top-1 probability as calibrated by that decoder's verified drafts
(``DecoderRecord.calibrated``: accepted over judged per tenth of probability, with
``CALIBRATION_PRIOR`` pseudo-drafts at the probability itself), multiplied along the chain.
Drafters differ: a shipped EAGLE-3's drafts given 0.3-0.4 were accepted 46% of the time,
Hydra's 25%. Exploring steps verify untrimmed, so the tenths under the floor keep being
judged. On a GPU a row is nearly free and the floor is near 0; on a 2-core CPU one verified row
costs a fifth to a quarter of a step and the floor is about 0.25.
With ``max_step_stretch`` s it only considers lengths whose predicted step (drafting,
forward and verification) takes at most s times the plain step's, and explores none beyond: a
bound on how much further apart drafting spaces a stream's chunks (inter-token latency).
The windows, the gate and the request's k still cap what it may choose: it only ever drafts
less. Choosing 0 for every sequence leaves the step without drafts. Output never depends on it:
the verifier is exact whatever is drafted.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

SMOOTHING = 0.1  # weight of a new observation in the moving averages
# ... in the average of what verification adds to a step: a structural ratio (the rejection
# sampler, per-sequence bookkeeping), not a level that follows the load. At SMOOTHING a noisy
# machine (steps scattered by a quarter or more) swung it by about as much as drafting one
# token gains, and each high swing switched drafting off where nothing corrects it.
VERIFY_SMOOTHING = 0.03
DECAY = 0.98  # acceptance counts: about the last 50 runs matter
PRIOR_ACCEPTANCE = 0.5  # the first position, before any run reached it
PRIOR_RUNS = 2.0  # pseudo-runs behind each position's estimate
PLAUSIBLE = 0.9  # explore the next length while its rate is within this of the best
RARELY = 16  # ... and every RARELY-th exploring step otherwise
# While a decoder is not drafting at all, nothing but exploring updates what it would accept
# and cost, so a plausible length is re-tried this many times as often: an estimate that
# dipped by chance would otherwise hold drafting off for long stretches. Together with
# VERIFY_SMOOTHING, in `python -m tooling.bench.policy_simulation` (a drafter right 46% of the
# time, steps scattered by a log-normal spread of 0.5): plain steps 47% -> 13%, and the policy
# at 0.96x -> 0.99x of fixed k = 1.
PLAIN_EXPLORE_FACTOR = 4
# ... for this many tries after drafting stopped; then at the usual pace again. A drafter
# that is wrong too often (kangaroo at 36% on grounded prompts, 0.92x on the Zen 4 VM) was
# otherwise tried every fourth step for good, each try a step that loses. In the simulation
# (40 seeds, `--acceptance 0.15,0.3,0.46 --noise 0.25,0.5`): a drafter right 15% of the time
# 0.977x / 0.979x -> 0.993x / 0.989x of plain, one right 46% 1.135x / 1.119x -> 1.131x / 1.114x.
PLAIN_RETRIES = 32
OPTIMISM = 1.5  # standard errors added to an acceptance when judging what to explore
# A choice of 0 that no drafting length came within this share of (by the central estimates)
# stands until the next exploring choice is due: without verified runs only the cost model's
# level moves, which scales every length alike, so the step-by-step re-evaluation would find
# the same. Each evaluation read cold code after the forward pass (a step streams the weights
# past every cache): about 40 us of a plain step on a 2-core CPU, 1% of a 4 ms step.
PLAIN_MARGIN = 0.95
MAX_PLAIN_REPEATS = 16  # ... and at most this many (the level's drift stays small)
CHANCE_BINS = 10  # a drafter's top-1 probabilities are calibrated per tenth
CALIBRATION_PRIOR = 8.0  # pseudo-drafts per tenth, accepted at the probability itself


def _tenth(confidence: float) -> int:
    """The calibration bin of a drafter's top-1 probability."""
    return min(CHANCE_BINS - 1, max(0, int(confidence * CHANCE_BINS)))


def _ema(old: float | None, new: float, weight: float = SMOOTHING) -> float:
    return new if old is None else (1 - weight) * old + weight * new


def _along(points: dict[int, float], n: int) -> float | None:
    """A curve through ``points`` at n: linear between them, along the last two beyond the
    largest (never falling), the smallest's value below it; None without points."""
    if n in points:
        return points[n]
    seen = sorted(points)
    if not seen:
        return None
    below = [m for m in seen if m < n]
    above = [m for m in seen if m > n]
    if not below:
        return points[above[0]]
    if not above:
        if len(below) == 1:  # proportional to the tokens: errs towards drafting less
            return points[below[-1]] * n / below[-1]
        lo, hi = below[-2], below[-1]
    else:
        lo, hi = below[-1], above[0]
    slope = max(0.0, (points[hi] - points[lo]) / (hi - lo))
    return points[lo] + slope * (n - lo)


def _chain_sums(rates: list[float]) -> list[float]:
    """Expected accepted drafts of a chain of 0 .. len(rates) drafts with these per-position
    acceptances (a draft is judged only when every one before it stood)."""
    sums, total, chain = [0.0], 0.0, 1.0
    for rate in rates:
        chain *= rate
        total += chain
        sums.append(total)
    return sums


@dataclass
class StepTimings:
    """What the engine measured for the cost model: forward seconds by step size with every
    row attending to ``context`` keys, and at some sizes with ``long_context`` keys."""

    short: dict[int, float]
    context: int
    long: dict[int, float] = field(default_factory=dict)
    long_context: int = 0


@dataclass
class StepCostModel:
    """The target's forward time for a step of n tokens attending to K keys in all (each
    token counts the keys of its sequence up to itself).

    With a calibration: T = (P(n) + a K) s. P(n), the step at a short context, and a, seconds
    per attended key, come from the engine's timings (the curve gives the shape); s, the ratio
    of observed to predicted time over the steps that really run, gives the level (a busy
    neighbour slows every size, not only the sizes that ran lately). Keys matter because a
    draft attends to its whole sequence: at 130 tokens of context a 2-token step cost 1.3x a
    1-token one on a 2-core CPU, at 15 tokens 1.07x. Without a calibration: each size's own
    moving average, joined by ``_along``.
    """

    seconds: dict[int, float] = field(default_factory=dict)  # observed, by step size
    products: dict[int, float] = field(default_factory=dict)  # P(n)
    key_seconds: float = 0.0  # a
    scale: float = 1.0  # s over plain steps, a moving average
    # How much more a step that verifies drafts costs than the plain step the model predicts
    # at the current s (the rejection sampler, per-sequence bookkeeping, the hidden states
    # some decoders read): a policy that priced verification as sampling drafted at 8 streams
    # where it lost. A ratio on top of s, not a scale of its own: drafted steps are rare
    # under load, and a scale last updated at a lighter load made drafting look cheap.
    verify_ratio: float = 1.0
    verified_steps: int = 0  # drafted steps observed (the ratio's plain mean until then)
    # The rest of a step, outside its forward pass and drafting (scheduling, appending tokens,
    # the outputs, this policy): the same whether or not it drafts, so it weighs on the plain
    # step's one token more than on a drafting step's several. Left out, a drafter that wins
    # by 8% (eagle3-k1 against plain decoding, 2 cores) looked like a loss of 5%, and the
    # policy mostly chose plain steps.
    overhead: float = 0.0
    # ... and of a step that drafted, apart (None: none seen yet, the plain one stands in):
    # verifying adds its bookkeeping (the drafters' updates, the runs' statistics): the
    # bench's rest of a step 0.4-0.5 ms against a plain step's 0.2 with 8-bit activations on
    # a 2-core CPU. One average of both
    # was a drafting step's while a stream drafted: plain steps were priced 0.1-0.3 ms dear,
    # and medusa (a draft right 20% of the time) drafted at 0.90x where plain made 1.0x.
    drafted_overhead: float | None = None

    def calibrate(self, timings: StepTimings) -> None:
        per_key = [
            (timings.long[n] - timings.short[n]) / (n * (timings.long_context - timings.context))
            for n in timings.long
            if n in timings.short and timings.long_context > timings.context
        ]
        self.key_seconds = max(0.0, sum(per_key) / len(per_key)) if per_key else 0.0
        self.products = {}
        floor = 0.0
        # A step of more tokens never costs less: a size timed in a fast spell must not make
        # the sizes above it look cheaper (a drafted row free, or cheaper than none).
        for n in sorted(timings.short):
            floor = max(floor, timings.short[n] - self.key_seconds * n * timings.context, 0.0)
            self.products[n] = floor
        self.scale = 1.0

    def _model(self, num_tokens: int, keys: int) -> float | None:
        products = _along(self.products, num_tokens)
        return None if products is None else products + self.key_seconds * keys

    def observe(self, num_tokens: int, seconds: float, keys: int = 0, drafted: bool = False):
        if not drafted:
            self.seconds[num_tokens] = _ema(self.seconds.get(num_tokens), seconds)
        expected = self._model(num_tokens, keys)
        if expected and drafted:
            self.verified_steps += 1
            weight = max(VERIFY_SMOOTHING, 1 / self.verified_steps)
            self.verify_ratio = _ema(self.verify_ratio, seconds / (expected * self.scale), weight)
        elif expected:
            self.scale = _ema(self.scale, seconds / expected)

    def observe_overhead(self, seconds: float, drafted: bool = False) -> None:
        if drafted:
            self.drafted_overhead = _ema(self.drafted_overhead, max(0.0, seconds))
        else:
            self.overhead = _ema(self.overhead, max(0.0, seconds))

    def overhead_of(self, drafted: bool) -> float:
        """The rest of a step that drafts (``drafted``) or not."""
        if drafted and self.drafted_overhead is not None:
            return self.drafted_overhead
        return self.overhead

    def predict(self, num_tokens: int, keys: int = 0, drafted: bool = False) -> float | None:
        """None before any step is known. ``drafted``: a step that verifies drafts."""
        if self.products:
            ratio = self.verify_ratio if drafted else 1.0
            return self._model(num_tokens, keys) * self.scale * ratio
        return _along(self.seconds, num_tokens)


@dataclass
class DecoderRecord:
    """One decoder's drafting time per depth and acceptance per draft position."""

    # by (depth k, sequences drafting)
    draft_seconds: dict[tuple[int, int], float] = field(default_factory=dict)
    draft_counts: dict[tuple[int, int], int] = field(default_factory=dict)
    reached: list[float] = field(default_factory=list)  # runs that drafted position j
    accepted: list[float] = field(default_factory=list)  # ... and had it accepted
    # Token trees, by node count: runs, and the sum and sum of squares of the accepted path
    # lengths (decaying like the positions' counts).
    tree_runs: dict[int, float] = field(default_factory=dict)
    tree_accepted: dict[int, float] = field(default_factory=dict)
    tree_squares: dict[int, float] = field(default_factory=dict)
    # Choices made for it, and of those the ones that considered exploring: counted per
    # decoder (draft source), so that two sources choosing in every step (hybrid's lookup and
    # drafter) each get their turn at the periodic re-check, not always the same one.
    choices: int = 0
    exploring_choices: int = 0
    plain_streak: int = 0  # choices of 0 in a row
    # Choices of 0 that may follow the last one unevaluated, for steps of the shape it was
    # made for (``GoodputPolicy.repeat_plain``).
    plain_ahead: int = 0
    plain_shape: tuple = ()
    # Per tenth of the drafter's top-1 probability: verified drafts judged, and accepted
    # (decaying like the positions' counts).
    judged: list[float] = field(default_factory=lambda: [0.0] * CHANCE_BINS)
    right: list[float] = field(default_factory=lambda: [0.0] * CHANCE_BINS)

    def observe_chances(self, confidences: list[float], num_accepted: int) -> None:
        """A verified chain's drafts with their top-1 probabilities: each judged one (every
        draft up to the first rejected) counts in its tenth."""
        judged = confidences[: num_accepted + 1]
        if not judged:
            return
        self.judged = [n * DECAY for n in self.judged]
        self.right = [n * DECAY for n in self.right]
        for j, confidence in enumerate(judged):
            b = _tenth(confidence)
            self.judged[b] += 1
            self.right[b] += j < num_accepted

    def calibrated(self, confidence: float) -> float:
        """How often a draft given ``confidence`` by its drafter was accepted."""
        b = _tenth(confidence)
        return (self.right[b] + CALIBRATION_PRIOR * confidence) / (
            self.judged[b] + CALIBRATION_PRIOR
        )

    def observe_draft(self, depth: int, num_seqs: int, seconds: float) -> None:
        key = (depth, num_seqs)
        count = self.draft_counts[key] = self.draft_counts.get(key, 0) + 1
        # The plain mean until SMOOTHING's weight takes over: a length drafted only while
        # exploring is seen a few times, and its first times must not linger.
        weight = max(SMOOTHING, 1 / count)
        self.draft_seconds[key] = _ema(self.draft_seconds.get(key), seconds, weight)

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

    def observe_run(self, num_drafts: int, num_accepted: int, tree: bool = False) -> None:
        """A verified run of ``num_drafts`` drafts (a chain, or with ``tree`` a tree of that
        many nodes) of which ``num_accepted`` stood (a tree's: the accepted path's length)."""
        # Once a decoder has drafted a tree, its chains count by size too: a decoder that
        # sends a chain when its candidates agree (ngram) would otherwise file only its
        # weaker, disagreeing runs under a size. Sizes decay on these runs only; positions
        # decay on every run.
        if tree or self.tree_runs:
            for size in self.tree_runs:
                self.tree_runs[size] *= DECAY
                self.tree_accepted[size] *= DECAY
                self.tree_squares[size] *= DECAY
            self.tree_runs[num_drafts] = self.tree_runs.get(num_drafts, 0.0) + 1
            self.tree_accepted[num_drafts] = self.tree_accepted.get(num_drafts, 0.0) + num_accepted
            self.tree_squares[num_drafts] = self.tree_squares.get(num_drafts, 0.0) + num_accepted**2
        while len(self.reached) < num_drafts:
            self.reached.append(0.0)
            self.accepted.append(0.0)
        self.reached = [r * DECAY for r in self.reached]
        self.accepted = [a * DECAY for a in self.accepted]
        # Position j was judged when every position before it was accepted.
        for j in range(min(num_drafts, num_accepted + 1)):
            self.reached[j] += 1
            self.accepted[j] += j < num_accepted

    def acceptance(self, position: int, optimism: float = 0.0) -> float:
        """Accepted over reached at ``position``, with PRIOR_RUNS pseudo-runs at the previous
        position's rate (PRIOR_ACCEPTANCE for the first): a deep position reached a few times
        must not read 100% and make long drafts look free. ``optimism``: that many standard
        errors higher (at most 1)."""
        return self._acceptances(position + 1, optimism)[position]

    def _acceptances(self, count: int, optimism: float) -> list[float]:
        """``acceptance`` of positions 0 .. count - 1, in one pass along them (each reads the
        one before it as its prior)."""
        rates, prior = [], PRIOR_ACCEPTANCE
        for position in range(count):
            if position < len(self.reached):
                runs = self.reached[position] + PRIOR_RUNS
                rate = (self.accepted[position] + PRIOR_RUNS * prior) / runs
                prior = min(1.0, rate + optimism * (rate * (1 - rate) / runs) ** 0.5)
            rates.append(prior)
        return rates

    def expected_accepted(self, k: int, optimism: float = 0.0) -> float:
        """Expected accepted drafts of a k-draft run: along the positions, or for a tree size
        that has run, that size's mean (``optimism``: that many standard errors higher)."""
        return self.expected_by_length(k, optimism)[k]

    def expected_by_length(self, cap: int, optimism: float = 0.0) -> list[float]:
        """``expected_accepted`` of k = 0 .. cap, from one pass along the positions: the
        policy weighs every length each step, and reading each one's positions anew (each
        position reading the ones before it) was most of a choice's time."""
        chains = _chain_sums(self._acceptances(cap, optimism))
        if not self.tree_runs:
            return chains
        return [
            self._tree_expected(k, optimism, chains[k]) if k in self.tree_runs else chains[k]
            for k in range(cap + 1)
        ]

    def _tree_expected(self, k: int, optimism: float, prior: float | None = None) -> float:
        # The pseudo-runs read with the same optimism, so that a few unlucky first runs pull
        # an optimistic estimate no lower than the positions' reading would have been.
        if prior is None:
            prior = _chain_sums(self._acceptances(k, optimism))[k]
        runs = self.tree_runs[k] + PRIOR_RUNS
        mean = (self.tree_accepted[k] + PRIOR_RUNS * prior) / runs
        square = (self.tree_squares[k] + PRIOR_RUNS * prior**2) / runs
        spread = max(0.0, square - mean**2) ** 0.5
        return min(float(k), mean + optimism * spread / runs**0.5)


class GoodputPolicy:
    def __init__(
        self,
        explore_every: int = 16,
        calibrate: Callable[[], StepTimings] | None = None,
        max_step_stretch: float | None = None,
    ):
        """``calibrate``: returns the target's forward timings (``StepTimings``), measured on
        the machine; called once, before the first choice. ``max_step_stretch``: see the
        module docstring (None: no bound)."""
        self.cost = StepCostModel()
        self.max_step_stretch = max_step_stretch
        self.decoders: dict[str, DecoderRecord] = defaultdict(DecoderRecord)
        self.explore_every = explore_every
        self._calibrate = calibrate
        self.chosen: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.predicted_seconds: float | None = None  # the last choice's predicted step time
        self.explore = False  # whether one sequence should draft one more than the choice
        # Per decoder, the chance a draft must have to be verified in the step just chosen
        # (None: verify whatever is drafted; see the module docstring).
        self.chance_floors: dict[str, float | None] = {}
        self.chosen_rates: dict[str, float] = {}  # and the tokens a second it predicted

    @property
    def calibrated(self) -> bool:
        """Whether the step timings are in (or there was nothing to time)."""
        return self._calibrate is None

    def ensure_calibrated(self) -> None:
        if self._calibrate is not None:
            measure, self._calibrate = self._calibrate, None
            self.cost.calibrate(measure())

    def choose(
        self,
        decoder: str,
        num_seqs: int,
        cap: int,
        context: int = 0,
        other_tokens: int = 0,
        other_keys: int = 0,
        shape: tuple = (),
    ) -> int:
        """The draft length for ``num_seqs`` sequences of ``decoder`` (at most ``cap``) holding
        ``context`` tokens in all, in a step with ``other_tokens`` more decode tokens (one
        token out each) attending to ``other_keys`` keys; sets ``explore`` when one of the
        sequences should draft one more. The others count: two drafts added to a step of 8
        sequences cost what 8 -> 10 rows cost, not 1 -> 3, and the step's output is theirs
        too. ``shape``: the caller's key of this step for ``repeat_plain``."""
        self.ensure_calibrated()
        record = self.decoders[decoder]
        record.choices += 1
        rates: dict[int, tuple[float, float]] = {}  # k -> (tokens per second, step seconds)
        forwards: dict[int, float] = {}  # k -> the forward pass's predicted seconds
        hopes: dict[int, float] = {}  # k -> tokens per second at optimistic acceptance
        too_long = False  # the next length's step is known to break max_step_stretch
        expected_accepted = record.expected_by_length(cap)
        hoped_accepted = record.expected_by_length(cap, OPTIMISM)
        for k in range(cap + 1):
            # Each of the 1 + k tokens attends to its sequence, drafts to their predecessors.
            keys = other_keys + (1 + k) * context + num_seqs * k * (k + 1) // 2
            forward = self.cost.predict(other_tokens + num_seqs * (1 + k), keys, drafted=k > 0)
            drafting = 0.0 if k == 0 else record.predict_draft(k, num_seqs)
            if forward is None or drafting is None:
                break  # not measured: deeper lengths are not either
            if k > 0 and self.max_step_stretch is not None:
                if forward + drafting > self.max_step_stretch * rates[0][1]:
                    too_long = True  # and deeper lengths take longer still
                    break
            expected = other_tokens + num_seqs * (1 + expected_accepted[k])
            whole = forward + drafting + self.cost.overhead_of(k > 0)  # start to end
            rates[k] = (expected / whole, forward + drafting)
            forwards[k] = forward
            hoped = other_tokens + num_seqs * (1 + hoped_accepted[k])
            hopes[k] = hoped / whole
        best = max(rates, key=lambda k: rates[k][0]) if rates else 0
        record.plain_streak = 0 if best else record.plain_streak + 1
        nxt = best + 1
        if nxt > cap or (too_long and nxt not in rates):
            self.explore = False
        elif nxt not in rates:
            self.explore = True  # never measured: one sequence tries it now
        elif record.choices % self._explore_interval(record.plain_streak) == 0:
            record.exploring_choices += 1
            plausible = hopes[nxt] >= PLAUSIBLE * rates[best][0]
            self.explore = plausible or record.exploring_choices % RARELY == 0
        else:
            self.explore = False
        self.predicted_seconds = None if self.explore or not rates else rates[best][1]
        self.chance_floors[decoder] = None
        self.chosen_rates[decoder] = rates[best][0] if rates else 0.0
        if best > 0 and not self.explore:  # an explored length is tried untrimmed
            row = (forwards[best] - forwards[best - 1]) / num_seqs
            self.chance_floors[decoder] = max(0.0, row) * rates[best][0]
        self.chosen[decoder][best] += 1
        clear_loss = best == 0 and not self.explore and self._clearly_plain(rates)
        record.plain_ahead = self._choices_before_exploring(record) if clear_loss else 0
        record.plain_shape = shape
        return best

    def repeat_plain(self, decoder: str, shape: tuple = ()) -> bool:
        """Count a choice of 0 for ``decoder`` without evaluating it, if one is sure to come
        out: the last choice, for a step of the same ``shape`` (the caller's key of what
        ``choose`` weighs: sequences, cap, other tokens), drafted nothing, no length came
        within PLAIN_MARGIN of it, and no exploring choice falls due before this one. False:
        evaluate it (``choose``)."""
        record = self.decoders[decoder]
        if record.plain_ahead <= 0 or record.plain_shape != shape:
            return False
        record.plain_ahead -= 1
        record.choices += 1
        record.plain_streak += 1
        self.explore = False
        self.chance_floors[decoder] = None
        self.chosen[decoder][0] += 1
        return True

    @staticmethod
    def _clearly_plain(rates: dict[int, tuple[float, float]]) -> bool:
        drafting = [rate for k, (rate, _) in rates.items() if k > 0]
        return bool(drafting) and max(drafting) < PLAIN_MARGIN * rates[0][0]

    def _choices_before_exploring(self, record: DecoderRecord) -> int:
        """Choices after this one and before the next that may explore. While the streak
        lasts the interval only lengthens (fast retries end), so the next multiple of today's
        interval comes no later than the real one."""
        interval = self._explore_interval(record.plain_streak)
        return min(MAX_PLAIN_REPEATS, interval - record.choices % interval - 1)

    def observe_chances(self, decoder: str, confidences: list[float], num_accepted: int) -> None:
        self.decoders[decoder].observe_chances(confidences, num_accepted)

    def chance(self, decoder: str, confidence: float) -> float:
        """A draft's chance of standing from its drafter's top-1 probability, as calibrated by
        ``decoder``'s verified drafts."""
        return self.decoders[decoder].calibrated(confidence)

    def chosen_rate(self, decoder: str) -> float:
        """The tokens a second predicted for the length last chosen for ``decoder``."""
        return self.chosen_rates.get(decoder, 0.0)

    def chance_floor(self, decoder: str) -> float | None:
        """The least chance of standing worth a verified row in the step last chosen for
        ``decoder`` (None: no floor)."""
        return self.chance_floors.get(decoder)

    def _explore_interval(self, plain_streak: int) -> int:
        """Choices between tries of the next length: PLAIN_EXPLORE_FACTOR times as often for
        the first PLAIN_RETRIES tries after drafting stopped (an estimate that dipped by chance
        is corrected by them), then at the usual pace (those tries said drafting loses; each
        further try is a step that loses)."""
        fast = max(1, self.explore_every // PLAIN_EXPLORE_FACTOR)
        if 0 < plain_streak <= PLAIN_RETRIES * fast:
            return fast
        return self.explore_every

    def observe_step(
        self, num_tokens: int, seconds: float, keys: int = 0, drafted: bool = False
    ) -> None:
        self.cost.observe(num_tokens, seconds, keys, drafted)

    def observe_overhead(self, seconds: float, drafted: bool = False) -> None:
        """A step's time outside its forward pass and drafting (``drafted``: a step that
        drafted)."""
        self.cost.observe_overhead(seconds, drafted)

    def observe_draft(self, decoder: str, depth: int, num_seqs: int, seconds: float) -> None:
        self.decoders[decoder].observe_draft(depth, num_seqs, seconds)

    def observe_run(
        self, decoder: str, num_drafts: int, num_accepted: int, tree: bool = False
    ) -> None:
        self.decoders[decoder].observe_run(num_drafts, num_accepted, tree)
