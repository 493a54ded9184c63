"""The goodput policy's chance floor: a greedy chain's drafts are verified only while the
drafter's chance of being right (its top-1 probabilities multiplied along the chain) pays
for their verification row at the measured step costs (engine/draft_policy.py,
engine/speculation.py ``drafts_worth_verifying``). Trimming never changes greedy output."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from engine import LLM, SamplingParams
from engine.decoders.base import Proposal
from engine.draft_policy import DecoderRecord
from engine.speculation import drafts_worth_verifying
from tests.test_draft_policy import trained_policy

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _seq(greedy: bool = True):
    return SimpleNamespace(sampling_params=SimpleNamespace(greedy=greedy))


def test_a_greedy_chain_is_cut_at_the_first_draft_whose_chance_is_under_the_floor():
    chain = Proposal([7, 8, 9], None, [0.9, 0.5, 0.9], [0.0] * 3)
    # chances 0.9, 0.45, 0.405: all above 0.25; under 0.42 the third goes, under 0.5 two go.
    assert drafts_worth_verifying(_seq(), chain, 0.25) == 3
    assert drafts_worth_verifying(_seq(), chain, 0.42) == 2
    assert drafts_worth_verifying(_seq(), chain, 0.5) == 1
    assert drafts_worth_verifying(_seq(), chain, 0.95) == 0
    # A one-node tree is a chain (hydra-k1's proposals).
    one = Proposal([7], None, [0.1], [0.0], parents=[-1])
    assert drafts_worth_verifying(_seq(), one, 0.25) == 0


def test_trees_sampled_requests_and_drafts_without_probabilities_are_not_trimmed():
    tree = Proposal([7, 8, 9], None, [0.1, 0.1, 0.1], [0.0] * 3, parents=[-1, -1, 0])
    assert drafts_worth_verifying(_seq(), tree, 0.5) == 3
    chain = Proposal([7, 8], None, [0.1, 0.1], [0.0] * 2)
    assert drafts_worth_verifying(_seq(greedy=False), chain, 0.5) == 2
    assert drafts_worth_verifying(_seq(), Proposal([7, 8]), 0.5) == 2  # no probabilities


def test_the_floor_is_what_a_row_costs_in_the_tokens_a_second_it_would_buy():
    # A verified row costs a quarter of a step: the floor is that quarter of a step's time in
    # tokens at the chosen rate, about 0.2-0.3.
    policy = trained_policy(lambda n: 0.01 * (1 + 0.25 * (n - 1)), 0.001, acceptance=0.6)
    k = policy.choose("d", num_seqs=1, cap=4)
    assert k >= 1 and not policy.explore
    floor = policy.chance_floor("d")
    forward_k = policy.cost.predict(1 + k, drafted=True)
    forward_less = policy.cost.predict(k, drafted=k > 1)
    assert floor == pytest.approx((forward_k - forward_less) * policy.chosen_rate("d"))
    assert 0.15 < floor < 0.4
    # Nearly free rows (spare compute, a GPU): nearly every draft is worth verifying.
    cheap = trained_policy(lambda n: 0.01 * (1 + 0.01 * (n - 1)), 0.0002, acceptance=0.6)
    assert cheap.choose("d", num_seqs=1, cap=4) == 4
    assert 0 < cheap.chance_floor("d") < 0.02
    # No floor for a step that drafts nothing, or one that explores a length untrimmed.
    dear = trained_policy(lambda n: 0.01 * (1 + 0.5 * (n - 1)), 0.002, acceptance=0.2)
    assert dear.choose("d", num_seqs=1, cap=4) == 0 and dear.chance_floor("d") is None
    assert policy.chance_floor("never chosen") is None


def test_a_drafter_s_probabilities_are_calibrated_by_its_verified_drafts():
    record = DecoderRecord()
    assert record.calibrated(0.35) == pytest.approx(0.35)  # unjudged: the probability itself
    draws = random.Random(1)
    for _ in range(300):
        # An overconfident drafter: given 0.35, right a quarter of the time; given 0.95, 90%.
        first = draws.random() < 0.25
        second = draws.random() < 0.9
        record.observe_chances([0.35, 0.95], int(first) + int(first and second))
    assert record.calibrated(0.35) == pytest.approx(0.25, abs=0.06)
    assert record.calibrated(0.95) == pytest.approx(0.9, abs=0.06)
    assert record.calibrated(0.62) == pytest.approx(0.62)  # a tenth never judged
    # A draft after a rejected one was never judged: only the first counted there.
    judged = sum(record.judged)
    record.observe_chances([0.35, 0.95, 0.95], 0)
    assert sum(record.judged) == pytest.approx(judged * 0.98 + 1)


def _forced(llm, floor):
    """The policy's choice and floor forced (a fault injection of costs): three drafts every
    step, cut at ``floor`` (None: not cut)."""
    policy = llm.engine.speculator.policy
    policy.choose = lambda *args, **kwargs: 3
    policy.chance_floor = lambda source: floor
    return policy


@pytest.mark.parametrize("cut", ["some", "all"])
def test_trimmed_drafts_leave_greedy_output_unchanged(tiny_model_dir, cut):
    prompts = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 9 + [14], [3] * 12]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model=str(tiny_model_dir)).generate(prompts, greedy)]
    decoder = {"method": "draft", "draft_policy": "goodput", "num_speculative_tokens": 3}
    # Untrimmed, the drafts' first probabilities; their median cuts some chains, 1.01 all.
    untrimmed = LLM(model=str(tiny_model_dir), decoder={**decoder, "trim_unlikely_drafts": False})
    _forced(untrimmed, 1.01)
    firsts = []
    propose = untrimmed.engine.speculator.decoders["draft"].propose

    def recording(seqs, num_drafts):
        proposals = propose(seqs, num_drafts)
        firsts.extend(p.confidences[0] for p in proposals.values())
        return proposals

    untrimmed.engine.speculator.decoders["draft"].propose = recording
    assert [o.token_ids for o in untrimmed.generate(prompts, greedy)] == expected
    assert untrimmed.engine.speculator.num_trimmed_drafts == 0  # off: every draft verified
    floor = sorted(firsts)[len(firsts) // 2] if cut == "some" else 1.01

    llm = LLM(model=str(tiny_model_dir), decoder=decoder)
    speculator = llm.engine.speculator
    policy = _forced(llm, floor)
    runs: list[tuple[int, int]] = []
    observe = policy.observe_run
    policy.observe_run = lambda source, n, accepted, tree=False: (
        runs.append((n, accepted)), observe(source, n, accepted, tree)
    )
    steps: list[tuple[int, bool]] = []
    observe_step = policy.observe_step
    policy.observe_step = lambda n, seconds, keys=0, drafted=False: (
        steps.append((n, drafted)), observe_step(n, seconds, keys, drafted)
    )
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == expected
    assert speculator.num_trimmed_drafts > 0
    stats = speculator.stats_by_decoder["draft"]
    # The policy hears of every drafted run, trimmed drafts counted as not accepted; the
    # verified ones are only those that kept drafts.
    assert len(runs) >= stats.num_drafts and sum(n for n, _ in runs) > stats.num_draft_tokens
    assert speculator._drafted == {}  # nothing held past the steps
    # Counted for Prometheus, with the engine's other speculation counters.
    from engine.core_protocol import engine_stats
    from server.metrics import ServerMetrics

    snapshot = engine_stats(llm.engine)
    assert snapshot.spec_num_trimmed_drafts == speculator.num_trimmed_drafts
    text = ServerMetrics("m", lambda: snapshot).render().decode()
    line = 'specserve:spec_decode_num_trimmed_draft_tokens_total{model_name="m"} '
    assert line + f"{float(speculator.num_trimmed_drafts)}" in text, text
    if cut == "all":
        # Every step drafted, so every decode step is priced as a drafting one, though none
        # verified a draft: the drafter's pass came before its forward pass all the same.
        # Only the last (each sequence's last token: no room for a draft) ran plain.
        assert [drafted for _, drafted in steps] == [True] * (len(steps) - 1) + [False]
    if cut == "some":
        assert stats.num_drafts > 0
        assert sum(policy.decoders["draft"].judged) > 0  # verified drafts calibrate chances
    else:
        assert stats.num_drafts == 0 and len(runs) > 0
