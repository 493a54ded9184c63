"""The goodput policy (engine/draft_policy.py): with a synthetic cost model it drafts nothing
when verification and drafting cost more than acceptance returns, and the most it may when they
pay; it measures every length it may choose before it trusts its model; through the engine it
leaves greedy output unchanged while its choices change from step to step. Sampled exactness
with changing lengths is in tests/test_decoders_sampling.py."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.draft_policy import DecoderRecord, GoodputPolicy

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def trained_policy(step_seconds, draft_seconds_per_depth, acceptance, cap=4, batch=1):
    """A policy that has seen steps costing ``step_seconds(n)`` for n tokens, drafting costing
    ``draft_seconds_per_depth`` per depth, and drafts accepted with probability
    ``acceptance`` at every position."""
    policy = GoodputPolicy(explore_every=10**9)
    for n in range(1, batch * (cap + 1) + 1):
        policy.observe_step(n, step_seconds(n))
    for k in range(1, cap + 1):
        policy.observe_draft("d", k, k * draft_seconds_per_depth)
    draws = random.Random(0)
    for _ in range(400):  # runs of cap drafts, each accepted with probability ``acceptance``
        accepted = 0
        while accepted < cap and draws.random() < acceptance:
            accepted += 1
        policy.observe_run("d", cap, accepted)
    return policy


def test_drafting_that_costs_more_than_it_returns_is_dropped():
    # Each verified token costs half a step, drafts are seldom right: plain decoding wins.
    policy = trained_policy(lambda n: 0.01 * (1 + 0.5 * (n - 1)), 0.002, acceptance=0.2)
    assert policy.choose("d", num_seqs=1, cap=4) == 0


def test_drafting_that_pays_drafts_as_much_as_allowed():
    # Verification nearly free (spare compute), drafts usually right: draft the whole cap.
    policy = trained_policy(lambda n: 0.01 * (1 + 0.01 * (n - 1)), 0.0002, acceptance=0.9)
    assert policy.choose("d", num_seqs=1, cap=4) == 4


def test_a_full_batch_drafts_less_than_a_single_stream():
    # Past 8 tokens every token costs as much as a step's fixed part: at batch 8 the rows that
    # were spare at batch 1 are gone, so the policy stops drafting.
    def cost(n):
        return 0.01 + 0.001 * min(n, 8) + 0.01 * max(0, n - 8)

    policy = trained_policy(cost, 0.0005, acceptance=0.6, batch=8)
    assert policy.choose("d", num_seqs=1, cap=4) > 0
    assert policy.choose("d", num_seqs=8, cap=4) == 0


def test_unmeasured_lengths_are_tried_before_the_model_is_trusted():
    policy = GoodputPolicy(explore_every=10**9)
    assert policy.choose("d", 1, cap=2) == 0  # no step measured yet
    policy.observe_step(1, 0.01)
    assert policy.choose("d", 1, cap=2) == 1  # no 2-token step, no depth-1 drafting yet
    policy.observe_step(2, 0.011)
    policy.observe_draft("d", 1, 0.001)
    assert policy.choose("d", 1, cap=2) == 2


def test_acceptance_by_position_gives_the_expected_accepted_drafts():
    record = DecoderRecord()
    for accepted in (0, 1, 2, 2):  # runs of 2 drafts
        record.observe_run(2, accepted)
    # Position 0 accepted in 3 of 4 runs (decayed weights nearly equal), position 1 in 2 of 3.
    assert record.acceptance(0) == pytest.approx(0.75, abs=0.01)
    assert record.acceptance(1) == pytest.approx(2 / 3, abs=0.01)
    assert record.expected_accepted(2) == pytest.approx(0.75 + 0.75 * 2 / 3, abs=0.02)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_output_is_unchanged_with_the_policy(tiny_model_dir, method):
    prompts = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 9 + [14], [3] * 12]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model=str(tiny_model_dir)).generate(prompts, greedy)]
    decoder = {"method": method, "draft_policy": "goodput", "num_speculative_tokens": 3}
    llm = LLM(model=str(tiny_model_dir), decoder=decoder)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == expected
    chosen = llm.engine.speculator.policy.chosen[method]
    assert sum(1 for count in chosen.values() if count) >= 2  # its choice changed


def test_its_choices_reach_prometheus_and_survive_an_engine_restart(tiny_model_dir):
    from engine.core_process import _sum_counters
    from engine.core_protocol import EngineStats, engine_stats
    from server.metrics import ServerMetrics

    decoder = {"method": "ngram", "draft_policy": "goodput", "num_speculative_tokens": 3}
    llm = LLM(model=str(tiny_model_dir), decoder=decoder)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm.generate([[5, 6, 7, 8, 9] * 6], greedy)
    stats = engine_stats(llm.engine)
    (name, counts), = stats.spec_draft_lengths
    assert name == "ngram" and sum(counts) > 0 and len(counts) >= 2
    text = ServerMetrics("m", lambda: stats).render().decode()
    for length, count in enumerate(counts):
        line = (f'specserve:spec_decode_draft_length_chosen_total{{decoder="ngram",'
                f'length="{length}",model_name="m"}} {float(count)}')  # fmt: skip
        assert line in text, text
    assert "specserve:spec_policy_predicted_step_seconds{" in text
    assert stats.spec_policy_measured_seconds > 0
    # Counters carried over a restart add up length by length.
    restarted = EngineStats(spec_draft_lengths=(("ngram", (1,)),))
    summed = _sum_counters(stats, restarted)["spec_draft_lengths"]
    assert summed == (("ngram", (counts[0] + 1, *counts[1:])),)


def test_plain_and_verified_steps_mix_without_changing_seeded_output(tiny_model_dir):
    # The policy's length-0 steps run as plain autoregressive steps (no drafts, no
    # verification); seeded sampling must come out the same as without any decoder, whichever
    # path each step took (prompt lookup's deterministic drafts follow the autoregressive
    # draws; with 1-token n-grams it finds a match nearly every step).
    prompts = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 9 + [14]]
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=48, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model=str(tiny_model_dir)).generate(prompts, params)]
    decoder = {"method": "ngram", "prompt_lookup_min": 1, "draft_policy": "goodput",
               "num_speculative_tokens": 3}  # fmt: skip
    llm = LLM(model=str(tiny_model_dir), decoder=decoder)
    spec = llm.engine.speculator
    plain_steps = []
    original = spec.plain_step

    def counting(scheduled, proposals):
        plain = original(scheduled, proposals)
        plain_steps.append(plain)
        return plain

    spec.plain_step = counting
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert any(plain_steps) and not all(plain_steps)  # both kinds of step ran
