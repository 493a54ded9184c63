"""The goodput policy (engine/draft_policy.py): with a synthetic cost model it drafts nothing
when verification and drafting cost more than acceptance returns, and the most it may when they
pay; it has one sequence try each length before trusting its model, and explores a length that
is a clear loss only rarely; the engine times step sizes for it once, before its first choice;
through the engine it leaves greedy output unchanged while its choices change from step to
step. Sampled exactness with changing lengths is in tests/test_decoders_sampling.py."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.draft_policy import DecoderRecord, GoodputPolicy, StepTimings

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def trained_policy(step_seconds, draft_seconds_per_depth, acceptance, cap=4, batch=1):
    """A policy that has seen steps costing ``step_seconds(n)`` for n tokens, drafting costing
    ``draft_seconds_per_depth`` per depth, and drafts accepted with probability
    ``acceptance`` at every position."""
    policy = GoodputPolicy(explore_every=10**9)
    for n in range(1, batch * (cap + 1) + 1):
        policy.observe_step(n, step_seconds(n))
    for k in range(1, cap + 1):
        policy.observe_draft("d", k, 1, k * draft_seconds_per_depth)
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


def test_a_step_stretch_bound_drafts_only_what_keeps_chunks_close(tiny_model_dir):
    # Each verified token costs 0.3 of a step and drafts are usually right: unbounded, the
    # policy drafts the whole cap (1.9x the tokens a second, in a step 2.2x as long).
    def cost(n):
        return 0.01 * (1 + 0.3 * (n - 1))

    assert trained_policy(cost, 0.00001, acceptance=0.9).choose("d", num_seqs=1, cap=4) == 4
    # A drafting step may take 1.35x a plain one: one draft (1.3x), and the next length is
    # never explored, however often the policy would otherwise re-check it.
    bounded = trained_policy(cost, 0.00001, acceptance=0.9)
    bounded.max_step_stretch, bounded.explore_every = 1.35, 1
    for _ in range(40):
        assert bounded.choose("d", num_seqs=1, cap=4) == 1 and not bounded.explore
    # 1.1x: no draft fits, the stream runs plain.
    bounded.max_step_stretch = 1.1
    assert bounded.choose("d", num_seqs=1, cap=4) == 0 and not bounded.explore
    # The config reaches the engine's policy.
    decoder = {"method": "ngram", "max_step_stretch": 1.25}
    policy = LLM(model=str(tiny_model_dir), decoder=decoder).engine.speculator.policy
    assert policy.max_step_stretch == 1.25


def test_a_full_batch_drafts_less_than_a_single_stream():
    # Past 8 tokens every token costs as much as a step's fixed part: at batch 8 the rows that
    # were spare at batch 1 are gone, so the policy stops drafting.
    def cost(n):
        return 0.01 + 0.001 * min(n, 8) + 0.01 * max(0, n - 8)

    policy = trained_policy(cost, 0.0005, acceptance=0.6, batch=8)
    assert policy.choose("d", num_seqs=1, cap=4) > 0
    assert policy.choose("d", num_seqs=8, cap=4) == 0
    # One sequence that could draft among 7 that cannot (prompt lookup found no match for
    # them): its drafts would take the step past 8 rows, where the whole step pays for them.
    assert policy.choose("d", num_seqs=1, cap=4, other_tokens=7) == 0


def test_unmeasured_lengths_are_tried_by_one_sequence_first():
    policy = GoodputPolicy(explore_every=10**9)
    # Nothing measured: no drafts for the group, one sequence tries a draft.
    assert policy.choose("d", 8, cap=2) == 0 and policy.explore
    policy.observe_step(8, 0.02)
    policy.observe_step(9, 0.021)
    policy.observe_draft("d", 1, 1, 0.0005)
    for _ in range(20):
        policy.observe_run("d", 1, 1)  # that draft was accepted
    # Depth 1 pays for everyone; depth 2 was never drafted, so one sequence tries it.
    assert policy.choose("d", 8, cap=2) == 1 and policy.explore


def test_a_clear_loss_is_explored_only_rarely():
    from engine.draft_policy import RARELY

    policy = trained_policy(lambda n: 0.01 * n, 0.002, acceptance=0.1)  # drafting never pays
    policy.explore_every = 1
    explored = [policy.choose("d", num_seqs=1, cap=4) == 0 and policy.explore
                for _ in range(4 * RARELY)]  # fmt: skip
    assert sum(explored) == 4
    close = trained_policy(lambda n: 0.01 * (1 + 0.5 * (n - 1)), 0.0001, acceptance=0.5)
    record = close.decoders["d"]
    record.reached, record.accepted = [1.0] * 4, [0.43] * 4  # k = 1: 95% of k = 0's rate
    close.explore_every = 1
    rates = [close.choose("d", num_seqs=1, cap=4) for _ in range(8)]
    assert rates == [0] * 8 and close.explore  # close enough to keep checking every time


def test_step_costs_extend_past_what_was_measured():
    timings = StepTimings({1: 0.01, 2: 0.012, 4: 0.016}, context=0)
    policy = GoodputPolicy(calibrate=lambda: timings)
    assert policy.cost.predict(4) is None  # nothing until the first choice calibrates
    policy.choose("d", 1, cap=1)
    assert policy.cost.predict(3) == pytest.approx(0.014)  # between measured sizes
    assert policy.cost.predict(8) == pytest.approx(0.024)  # along the last two
    assert policy.cost.predict(1) == 0.01
    # Real steps run at twice the calibrated time (longer contexts, a busy neighbour): every
    # size's estimate follows, not only the size that ran.
    for _ in range(100):
        policy.observe_step(2, 0.024)
    assert policy.cost.predict(2) == pytest.approx(0.024, rel=1e-3)
    assert policy.cost.predict(8) == pytest.approx(0.048, rel=1e-3)


def test_a_step_of_more_tokens_is_never_priced_below_a_smaller_one():
    # Size 3 timed in a fast spell of the machine: read as it is, a 3-token step would look
    # cheaper than one token, and two drafts cheaper than none.
    timings = StepTimings({1: 0.010, 2: 0.011, 3: 0.009, 4: 0.013}, context=0)
    policy = GoodputPolicy(calibrate=lambda: timings)
    policy.ensure_calibrated()
    assert policy.cost.predict(3) == pytest.approx(0.011)
    assert policy.cost.predict(4) == pytest.approx(0.013)
    assert policy.cost.predict(1) == pytest.approx(0.010)


def test_the_sizes_are_timed_in_rounds_and_the_small_ones_more_often(tiny_model_dir, monkeypatch):
    # Fault injection: the runner's steps slow down 5x for a stretch. Timed back to back, the
    # sizes inside that stretch would read 5x dearer than the ones outside it; in rounds every
    # size also runs outside it.
    from engine import step_costs

    engine = LLM(model=str(tiny_model_dir)).engine
    runner = engine.runner
    sizes: list[int] = []

    def run(items, **options):
        sizes.append(len(items))
        slow = 20 <= len(sizes) < 60
        time.sleep(0.005 if slow else 0.001)
        return torch.zeros(len(items), 8)

    monkeypatch.setattr(runner, "run", run)
    monkeypatch.setattr(step_costs, "WARM_UP_SECONDS", 0.0)
    timings = step_costs.time_forward_steps(runner, engine.block_manager, 16, engine.max_model_len)
    assert max(timings.short.values()) < 0.004, timings.short
    timed = [n for n in sizes if n in (1, 16)]
    # one untimed run each, then 6 rounds of the small sizes and 2 of the large ones, and the
    # long-context sizes (1 and 16 again) after them
    assert timed.count(16) < timed.count(1)


def test_drafts_over_long_contexts_cost_their_attention():
    # 1 ms per token at 10 keys each, 1 ms more per 100 keys a token attends to: a draft
    # costs 10% of a step at a short context and much more at a long one.
    short = {n: 0.001 * n + 0.010 + 0.00001 * 10 * n for n in range(1, 9)}
    long = {n: short[n] + 0.00001 * 990 * n for n in (1, 4)}
    policy = GoodputPolicy(calibrate=lambda: StepTimings(short, 10, long, 1000))
    policy.ensure_calibrated()
    assert policy.cost.key_seconds == pytest.approx(0.00001)
    assert policy.cost.predict(2, keys=2 * 500) == pytest.approx(short[2] + 0.00001 * 980)
    policy.observe_draft("d", 1, 1, 0.0001)
    record = policy.decoders["d"]
    record.reached, record.accepted = [1.0], [0.3]  # 30% of first drafts accepted
    assert policy.choose("d", num_seqs=1, cap=1, context=20) == 1
    assert policy.choose("d", num_seqs=1, cap=1, context=2000) == 0


def test_drafting_time_of_an_unseen_group_size_errs_high():
    record = DecoderRecord()
    record.observe_draft(2, 1, 0.001)
    record.observe_draft(2, 4, 0.002)
    assert record.predict_draft(2, 4) == 0.002
    assert record.predict_draft(2, 3) == 0.002  # the next larger group's time
    assert record.predict_draft(2, 8) == pytest.approx(0.004)  # scaled up from 4
    assert record.predict_draft(3, 1) is None


def test_the_engine_times_its_steps_once_before_the_first_choice(tiny_model_dir):
    decoder = {"method": "ngram", "num_speculative_tokens": 3}  # the policy is the default
    llm = LLM(model=str(tiny_model_dir), decoder=decoder, scheduler={"max_num_seqs": 4})
    policy = llm.engine.speculator.policy
    # Timed when the engine was built (it drafts by default): decode-shaped steps up to 4
    # sequences x (1 + 3 drafts), their blocks given back.
    assert policy is not None and policy.calibrated
    assert sorted(policy.cost.products) == [1, 2, 3, 4, 5, 6, 8, 12, 16]
    assert policy.cost.predict(16, keys=16 * 200) > 0 and policy.cost.key_seconds >= 0
    blocks = llm.engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks
    timed = dict(policy.cost.products)
    llm.engine.calibrate_step_costs()  # once only
    assert policy.cost.products == timed
    llm.generate([[5, 6, 7, 8, 9] * 6], SamplingParams(temperature=0, max_tokens=8))
    assert policy.cost.products == timed and policy.cost.scale != 1.0  # rescaled, not re-timed


def test_the_timings_skip_a_freshly_loaded_process_s_slow_start(tiny_model_dir, monkeypatch):
    # Fault injection: the runner's steps take 20 ms during their first 0.1 s of running and
    # 1 ms after, whatever their size (a process just loaded runs slow for a while). Timed
    # inside that while, one token would look many times dearer than two, and drafting free.
    from engine import step_costs

    engine = LLM(model=str(tiny_model_dir)).engine
    runner = engine.runner
    started = []

    def run(items, **options):
        started.append(started[0] if started else time.perf_counter())
        slow = time.perf_counter() - started[0] < 0.1
        time.sleep(0.02 if slow else 0.001)
        return torch.zeros(len(items), 8)

    monkeypatch.setattr(runner, "run", run)
    timings = step_costs.time_forward_steps(runner, engine.block_manager, 4, engine.max_model_len)
    assert timings.short[1] < 0.01 and timings.short[2] < 0.01


def test_acceptance_by_position_gives_the_expected_accepted_drafts():
    record = DecoderRecord()
    for _ in range(100):
        for accepted in (0, 1, 2, 2):  # runs of 2 drafts
            record.observe_run(2, accepted)
    # Position 0 accepted in 3 of 4 runs, position 1 in 2 of the 3 that reached it.
    assert record.acceptance(0) == pytest.approx(0.75, abs=0.01)
    assert record.acceptance(1) == pytest.approx(2 / 3, abs=0.02)
    assert record.expected_accepted(2) == pytest.approx(0.75 + 0.75 * 2 / 3, abs=0.03)
    # A position never reached reads like the one before it.
    assert record.acceptance(2) == pytest.approx(record.acceptance(1))


def _reference_expected(record: DecoderRecord, k: int, optimism: float) -> float:
    """The expectations as the policy defines them, position by position from scratch."""

    def acceptance(position: int) -> float:
        prior = 0.5 if position == 0 else acceptance(position - 1)
        if position >= len(record.reached):
            return prior
        runs = record.reached[position] + 2.0
        rate = (record.accepted[position] + 2.0 * prior) / runs
        return min(1.0, rate + optimism * (rate * (1 - rate) / runs) ** 0.5)

    chain, total = 1.0, 0.0
    for j in range(k):
        chain *= acceptance(j)
        total += chain
    if k not in record.tree_runs:
        return total
    runs = record.tree_runs[k] + 2.0
    mean = (record.tree_accepted[k] + 2.0 * total) / runs
    square = (record.tree_squares[k] + 2.0 * total**2) / runs
    spread = max(0.0, square - mean**2) ** 0.5
    return min(float(k), mean + optimism * spread / runs**0.5)


@pytest.mark.parametrize("trees", [False, True])
def test_every_length_s_expectation_in_one_pass_matches_reading_each_anew(trees):
    # choose() weighs every length from one pass along the positions: the same numbers as
    # reading each length's positions from scratch, optimistic or not, chains and trees.
    draws = random.Random(3)
    record = DecoderRecord()
    for _ in range(80):
        size = draws.randint(1, 5)
        record.observe_run(size, draws.randint(0, size), tree=trees and draws.random() < 0.5)
    for optimism in (0.0, 1.5):
        together = record.expected_by_length(7, optimism)
        assert len(together) == 8 and together[0] == 0.0
        for k in range(8):
            reference = _reference_expected(record, k, optimism)
            assert together[k] == pytest.approx(reference, rel=1e-12, abs=1e-12)
            assert record.expected_accepted(k, optimism) == pytest.approx(reference, rel=1e-12)
    assert record.expected_by_length(7, 1.5)[5] > record.expected_by_length(7)[5]


def test_a_position_reached_a_few_times_is_not_taken_as_certain():
    record = DecoderRecord()
    for _ in range(50):
        record.observe_run(1, 0)  # first drafts seldom accepted
    record.observe_run(3, 3)  # one lucky long run
    assert record.acceptance(0) < 0.1
    # 1 of 1 at positions 1 and 2, pulled towards the rates before them (1.0 unsmoothed).
    assert record.acceptance(1) < 0.4 and record.acceptance(2) < 0.6


def observe_trees(record, runs: dict[int, list[int]], rounds: int = 60) -> None:
    """``rounds`` times, one run of each tree size in turn for every accepted length listed."""
    for _ in range(rounds):
        for lengths in zip(*runs.values(), strict=True):
            for size, accepted in zip(runs, lengths, strict=True):
                record.observe_run(size, accepted, tree=True)


def test_a_tree_size_is_judged_by_its_own_runs():
    # Bushy 8-node trees: the path is accepted 3 deep on average. 2-node trees seldom get one.
    # Read as positions, the 8-node runs' depths (accepted nearly always) would make the
    # 2-node tree look as good as the top of a bushy one.
    record = DecoderRecord()
    observe_trees(record, {8: [4, 4, 3, 2, 2], 2: [0, 0, 0, 1, 1]})
    assert record.expected_accepted(2) == pytest.approx(0.4, abs=0.15)
    assert record.expected_accepted(8) == pytest.approx(3.0, abs=0.3)
    # A size that never ran reads along the positions, as a chain does.
    assert record.expected_accepted(3) > record.expected_accepted(2) + 0.5
    # Optimism widens a size's estimate by its own spread, never past its node count.
    assert record.expected_accepted(2) < record.expected_accepted(2, optimism=1.5) <= 2


def test_a_tree_decoder_s_chains_count_for_their_size_too():
    # ngram sends a chain when its candidates agree (its good runs), a tree when they do not.
    record = DecoderRecord()
    record.observe_run(2, 0, tree=True)
    for _ in range(50):
        record.observe_run(2, 2)  # agreeing candidates: a chain, all accepted
    assert record.expected_accepted(2) > 1.7


def test_small_trees_that_lose_are_not_drafted_because_big_ones_did_well():
    # Verifying costs half a step per token (a CPU): 8-node trees (3.0 accepted) lose, and
    # so do this request's 1- and 2-node trees (0.3 and 0.4 accepted) however bushy trees
    # fared earlier.
    policy = GoodputPolicy(explore_every=10**9)
    for n in range(1, 10):
        policy.observe_step(n, 0.01 * (1 + 0.5 * (n - 1)))
    for k in range(1, 9):
        policy.observe_draft("d", k, 1, 0.0001 * k)
    observe_trees(
        policy.decoders["d"],
        {8: [4, 4, 3, 2, 2] * 2, 1: [0, 0, 0, 1, 0, 0, 1, 0, 0, 1], 2: [0, 0, 0, 1, 1] * 2},
    )
    assert policy.choose("d", num_seqs=1, cap=2) == 0


@pytest.mark.parametrize(
    "method, options",
    [
        ("ngram", {}),
        ("draft", {}),
        ("ngram", {"prompt_lookup_candidates": 4, "prompt_lookup_min": 1}),
    ],
    ids=["ngram", "draft", "ngram-tree"],
)
def test_greedy_output_is_unchanged_with_the_policy(tiny_model_dir, method, options):
    prompts = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 9 + [14], [3] * 12]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model=str(tiny_model_dir)).generate(prompts, greedy)]
    decoder = {"method": method, "draft_policy": "goodput", "num_speculative_tokens": 3, **options}
    llm = LLM(model=str(tiny_model_dir), decoder=decoder)
    # Drafts start out right every time and verified rows cost nothing: the policy drafts
    # all it may, whatever the machine's load makes of the tiny model's costs (on a busy
    # machine it otherwise ran plain steps and one-draft tries, and never drafted a tree).
    policy = llm.engine.speculator.policy
    policy.ensure_calibrated()
    policy.cost.calibrate(StepTimings(short=dict.fromkeys(range(1, 17), 0.01), context=16))
    for _ in range(100):
        policy.observe_run(method, 3, 3)
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == expected
    assert llm.engine.speculator.stats_by_decoder[method].num_drafts > 0  # drafts were verified
    # A tree decoder's runs are kept by tree size for the policy; a chain's are not.
    tree_runs = llm.engine.speculator.policy.decoders[method].tree_runs
    assert bool(tree_runs) == bool(options)


def test_its_choices_reach_prometheus_and_survive_an_engine_restart(tiny_model_dir):
    from engine.core_process import _sum_counters
    from engine.core_protocol import EngineStats, engine_stats
    from server.metrics import ServerMetrics

    decoder = {"method": "ngram", "prompt_lookup_min": 1, "num_speculative_tokens": 3}
    llm = LLM(model=str(tiny_model_dir), decoder=decoder)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm.generate([[5, 6, 7, 8, 9] * 6], greedy)
    stats = engine_stats(llm.engine)
    ((name, counts),) = stats.spec_draft_lengths
    assert name == "ngram" and sum(counts) > 1
    text = ServerMetrics("m", lambda: stats).render().decode()
    for length, count in enumerate(counts):
        line = (f'specserve:spec_decode_draft_length_chosen_total{{decoder="ngram",'
                f'length="{length}",model_name="m"}} {float(count)}')  # fmt: skip
        assert line in text, text
    assert "specserve:spec_policy_predicted_step_seconds{" in text
    # What the serving bench reads back from /metrics, and its summary column.
    from tooling.bench.bench_serve import parse_draft_lengths, policy_summary

    assert parse_draft_lengths(text, "ngram") == dict(enumerate(map(float, counts)))
    assert parse_draft_lengths(text, "eagle") == {}
    by_source = dataclasses.replace(
        stats, spec_draft_lengths=(("hybrid:lookup", (0, 2)), ("hybrid:hydra", (0, 3)))
    )
    sources = ServerMetrics("m", lambda: by_source).render().decode()
    assert parse_draft_lengths(sources, "hybrid") == {0: 0.0, 1: 5.0}  # its sources, summed
    assert policy_summary({0: 3.0, 2: 1.0}) == "75% | 0.50" and policy_summary({}) == "- | -"
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


def test_an_unlucky_start_is_explored_until_the_runs_say_so():
    # Drafting one token pays once 35% of drafts are right. None of the first five runs was
    # accepted (one chance in 20 for a drafter right 46% of the time): the estimate says a
    # clear loss, but five runs cannot tell, so the length keeps being tried at the regular
    # pace, not rarely.
    def step(n):
        return 0.010 * (1 + 0.1 * (n - 1))

    policy = GoodputPolicy(explore_every=1)
    for n in range(1, 4):
        policy.observe_step(n, step(n))
    policy.observe_draft("d", 1, 1, 0.0025)
    for _ in range(5):
        policy.observe_run("d", 1, 0)
    record = policy.decoders["d"]
    assert record.expected_accepted(1) < 0.2  # a clear loss by the point estimate
    explored = [policy.choose("d", num_seqs=1, cap=1) == 0 and policy.explore for _ in range(8)]
    assert all(explored)
    draws = random.Random(1)
    for _ in range(60):  # the exploration runs come in at the drafter's real rate
        policy.observe_run("d", 1, int(draws.random() < 0.46))
    assert policy.choose("d", num_seqs=1, cap=1) == 1


def test_early_drafting_times_are_averaged_not_smoothed():
    record = DecoderRecord()
    for seconds in (0.004, 0.001, 0.001, 0.001):
        record.observe_draft(1, 1, seconds)
    assert record.predict_draft(1, 1) == pytest.approx(0.00175)  # the mean of four


def test_a_decoder_s_first_drafts_in_the_process_are_not_timed(tiny_model_dir, monkeypatch):
    # Fault injection: the first propose call takes 0.5 s more (a cold first call), later
    # ones their own time. Its time must not become the price of the length it explored (no
    # recorded time holds the injected delay, whatever else shares the machine).
    decoder = {"method": "draft", "num_speculative_tokens": 2}  # an int8 copy: always drafts
    engine = LLM(model=str(tiny_model_dir), decoder=decoder).engine
    draft = engine.speculator.decoders["draft"]
    propose, calls = draft.propose, []

    def slow_first(seqs, grants):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.5)
        return propose(seqs, grants)

    monkeypatch.setattr(draft, "propose", slow_first)
    policy, timed = engine.speculator.policy, []
    observe_draft = policy.observe_draft

    def spied(decoder, depth, num_seqs, seconds):
        timed.append(seconds)
        observe_draft(decoder, depth, num_seqs, seconds)

    monkeypatch.setattr(policy, "observe_draft", spied)
    engine.add_request("r", [5, 6, 7, 8, 9] * 6, SamplingParams(temperature=0, max_tokens=24))
    while engine.has_unfinished_requests():
        engine.step()
    record = engine.speculator.policy.decoders["draft"]
    assert len(calls) >= 2 and sum(record.draft_counts.values()) == len(calls) - 1
    assert len(timed) == len(calls) - 1 and max(timed) < 0.5


def test_an_engine_that_drafts_by_default_calibrates_before_its_first_request(tiny_model_dir):
    """The step timings the policy needs are taken when the engine is built, not inside the
    first drafting step (that wait had made a fresh engine's ngram run 0.58x plain decoding);
    decoders loaded only for requests that pick them stay lazy."""
    drafting = LLM(model=str(tiny_model_dir), decoder={"method": "ngram"})
    assert drafting.engine.speculator.policy.calibrated
    on_request = LLM(model=str(tiny_model_dir), decoder={"extra_methods": ["ngram"]})
    assert not on_request.engine.speculator.policy.calibrated


@pytest.fixture(scope="module")
def eagle_dir(tiny_model_dir, tmp_path_factory):
    from tests.tiny_models import save_eagle_drafter

    return save_eagle_drafter(tiny_model_dir, tmp_path_factory.mktemp("eagle") / "drafter")


def test_the_policy_prices_drafting_without_a_drafter_s_catch_up(tiny_model_dir, eagle_dir):
    """A drafter's first draft of a sequence reads its whole prompt (and one after a stretch
    without drafts, every token of it): that catch-up is not what drafting k costs a step, so
    the goodput policy does not learn from those calls (it had priced EAGLE's drafts 10x too
    dear and stopped drafting)."""
    from engine.speculation import CATCH_UP_SLACK

    decoder = {"method": "eagle", "eagle": {"drafter": str(eagle_dir)}, "num_speculative_tokens": 2}
    llm = LLM(model=str(tiny_model_dir), decoder=decoder, kv_cache={"num_blocks": 256})
    spec = llm.engine.speculator
    eagle = spec.decoders["eagle"]
    calls, observed = [], []
    behind, observe = eagle.tokens_behind, spec.policy.observe_draft

    def recording_behind(seq):
        calls.append(behind(seq))
        return calls[-1]

    eagle.tokens_behind = recording_behind
    spec.policy.observe_draft = lambda *args: (observed.append(calls[-1]), observe(*args))
    llm.generate([list(range(20, 80))], SamplingParams(temperature=0, max_tokens=24))
    assert max(calls) >= 60  # the first draft read the prompt
    assert observed and all(b <= 2 + CATCH_UP_SLACK for b in observed)


def test_a_step_s_overhead_outside_the_forward_counts_for_drafting():
    """The loop around each step costs the same whether it drafts or not, so it favours the
    step that emits more tokens: with a forward of 3 ms plain and 4.4 ms verifying one draft,
    0.4 ms drafting it and drafts right half the time, drafting loses (1.5 / 4.8 ms against
    1 / 3 ms) until the 1.5 ms the loop adds to each step counts (1.5 / 6.3 ms against
    1 / 4.5 ms)."""
    policy = trained_policy(lambda n: 0.003 + 0.0014 * (n - 1), 0.0004, acceptance=0.5, cap=1)
    assert 0.42 < policy.decoders["d"].expected_accepted(1) < 0.58
    assert policy.choose("d", num_seqs=1, cap=1) == 0
    for _ in range(100):
        policy.observe_overhead(0.0015)
    assert policy.cost.overhead == pytest.approx(0.0015, rel=1e-3)
    assert policy.choose("d", num_seqs=1, cap=1) == 1


def test_a_drafting_step_s_rest_is_priced_apart_from_a_plain_one_s():
    # Plain steps' rest 0.2 ms, drafting ones' 0.5 ms (their bookkeeping). With one average of
    # both, a stream that drafts every step prices plain steps at 0.5 ms too.
    policy = trained_policy(lambda n: 0.005 + 0.0005 * (n - 1), 0.0005, acceptance=0.2, cap=1)
    for _ in range(100):
        policy.observe_overhead(0.0002)
        policy.observe_overhead(0.0005, drafted=True)
    assert policy.cost.overhead_of(False) == pytest.approx(0.0002, rel=1e-3)
    assert policy.cost.overhead_of(True) == pytest.approx(0.0005, rel=1e-3)
    # 1.2 tokens in 6.5 ms against 1 in 5.2: plain wins; priced alike (0.5 ms each), 1.2 /
    # 6.5 against 1 / 5.5 ms: drafting would have looked a win.
    assert policy.choose("d", num_seqs=1, cap=1) == 0
    policy.cost.overhead = 0.0005
    assert policy.choose("d", num_seqs=1, cap=1) == 1


def test_the_engine_measures_the_loop_between_its_steps(tiny_model_dir):
    """From one step's start to the next, less the step's forward and drafting; the gap of an
    engine waiting for work is not counted."""
    from engine.speculation import IDLE_GAP_RATIO

    llm = LLM(model=str(tiny_model_dir), decoder={"method": "ngram", "draft_policy": "goodput"})
    spec = llm.engine.speculator
    seen = []
    observe = spec.policy.observe_overhead
    spec.policy.observe_overhead = lambda s, drafted=False: (seen.append(s), observe(s, drafted))
    llm.generate([list(range(20, 60))], SamplingParams(temperature=0, max_tokens=16))
    assert seen and all(0 <= s for s in seen)
    before = len(seen)
    time.sleep(0.3)  # idle: far longer than a tiny model's step
    spec.measured_step_seconds = 0.001
    spec.observe_step_interval(0.3)
    assert len(seen) == before
    spec.observe_step_interval(0.001 * (1 + IDLE_GAP_RATIO / 2))
    assert len(seen) == before + 1


def test_a_hybrid_s_two_sources_get_lengths_of_their_own(tiny_model_dir, eagle_dir):
    """The hybrid decoder drafts by prompt lookup where the text repeats and by its trained
    drafter elsewhere: the policy keeps each source's acceptance and cost apart (a lookup
    match accepted whole must not make the drafter's guesses look as good), and greedy
    output stays the target's."""
    prompts = [[5, 6, 7, 8, 9] * 6, list(range(20, 80))]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model=str(tiny_model_dir)).generate(prompts, greedy)]
    decoder = {
        "method": "hybrid",
        "hybrid": {"drafter": "eagle", "lookup_min": 3},
        "eagle": {"drafter": str(eagle_dir)},
        "num_speculative_tokens": 3,
    }
    llm = LLM(model=str(tiny_model_dir), decoder=decoder, kv_cache={"num_blocks": 256})
    assert [o.token_ids for o in llm.generate(prompts, greedy)] == expected
    spec = llm.engine.speculator
    records = spec.policy.decoders
    assert {"hybrid:lookup", "hybrid:eagle"} <= set(records)
    for source in ("hybrid:lookup", "hybrid:eagle"):
        assert records[source].reached, f"no verified runs of {source}"
        assert sum(spec.policy.chosen[source].values()) > 0
    assert spec.stats_by_decoder["hybrid"].num_drafts > 0


def test_two_sources_choosing_every_step_each_get_their_re_checks():
    """A hybrid's lookup and drafter choose in every step of a batch that holds both: a
    re-check every 16th choice counted over both would fall on the same source each time
    (their calls alternate), and the other would never re-try a length it left."""
    import copy

    # One draft pays a little less than none by the estimates, and could pay: re-checked.
    policy = trained_policy(lambda n: 0.01 * (1 + 0.4 * (n - 1)), 0.0005, 0.33, cap=2)
    assert policy.choose("d", num_seqs=1, cap=2) == 0 and not policy.explore
    policy.decoders["e"] = copy.deepcopy(policy.decoders["d"])
    policy.explore_every = 16
    explored = {"d": 0, "e": 0}
    for _ in range(64):
        for source in ("d", "e"):
            policy.choose(source, num_seqs=1, cap=2)
            explored[source] += policy.explore
    assert explored["d"] > 0 and explored["e"] > 0, explored


def test_verification_cost_follows_its_average_not_one_noisy_step():
    from engine.draft_policy import VERIFY_SMOOTHING, StepCostModel

    model = StepCostModel()
    model.calibrate(StepTimings(short={1: 0.010, 2: 0.012}, context=16))
    model.observe(2, 0.024, drafted=True)  # the first two are averaged: 2.0, then 1.0
    model.observe(2, 0.012, drafted=True)
    assert model.verify_ratio == pytest.approx(1.5)
    for _ in range(200):
        model.observe(2, 0.012, drafted=True)
    settled = model.verify_ratio
    model.observe(2, 0.036, drafted=True)  # one step at 3x (a noisy neighbour)
    assert model.verify_ratio - settled == pytest.approx(VERIFY_SMOOTHING * (3.0 - settled))
    assert model.verify_ratio < 1.1


def test_a_decoder_drafting_nothing_is_retried_more_often():
    from engine.draft_policy import PLAIN_EXPLORE_FACTOR

    def explorations(acceptance: float) -> list[int]:
        policy = trained_policy(lambda n: 0.010 * n**0.5, 0.001, acceptance, cap=1)
        policy.explore_every = 16
        steps = []
        for step in range(64):
            policy.choose("d", num_seqs=1, cap=1)
            if policy.explore:
                steps.append(step)
        return steps

    # Drafting one pays (each draft right 90% of the time): the next length, 2, is beyond
    # the cap, nothing is explored; a loss by the estimates at 40%, but within reach of
    # them: plain steps, and one try every 16 / PLAIN_EXPLORE_FACTOR choices.
    assert explorations(0.9) == []
    tried = explorations(0.4)
    assert tried == list(range(3, 64, 16 // PLAIN_EXPLORE_FACTOR))


def test_a_drafter_that_keeps_losing_is_retried_at_the_usual_pace_again():
    from engine.draft_policy import PLAIN_EXPLORE_FACTOR, PLAIN_RETRIES

    # Drafting one loses (each draft right 40% of the time, a second row costs 41% of a
    # step), and the tries do not change that (nothing is observed between choices): the
    # first PLAIN_RETRIES tries after drafting stopped come every 16 / PLAIN_EXPLORE_FACTOR
    # choices, the later ones every 16 (each is a step that loses).
    policy = trained_policy(lambda n: 0.010 * n**0.5, 0.001, 0.4, cap=1)
    policy.explore_every = 16
    fast = 16 // PLAIN_EXPLORE_FACTOR
    choices = PLAIN_RETRIES * fast + 8 * 16
    tried = []
    for step in range(choices):
        assert policy.choose("d", num_seqs=1, cap=1) == 0
        if policy.explore:
            tried.append(step)
    gaps = [b - a for a, b in zip(tried, tried[1:], strict=False)]
    assert len(tried) == PLAIN_RETRIES + 8
    assert gaps[: PLAIN_RETRIES - 1] == [fast] * (PLAIN_RETRIES - 1)
    assert gaps[PLAIN_RETRIES:] == [16] * (len(gaps) - PLAIN_RETRIES)


def test_drafting_again_resets_the_fast_retries():
    # A stretch where drafting wins ends the plain streak: the next time drafting stops, its
    # first tries come at the fast pace again.
    from engine.draft_policy import PLAIN_EXPLORE_FACTOR, PLAIN_RETRIES

    fast = 16 // PLAIN_EXPLORE_FACTOR
    policy = trained_policy(lambda n: 0.010 * n**0.5, 0.001, 0.4, cap=1)
    policy.explore_every = 16
    for _ in range(PLAIN_RETRIES * fast + 64):
        policy.choose("d", num_seqs=1, cap=1)
    record = policy.decoders["d"]
    assert record.plain_streak > PLAIN_RETRIES * fast
    for _ in range(60):  # drafts right every time now: drafting wins
        policy.observe_run("d", 1, 1)
    assert policy.choose("d", num_seqs=1, cap=1) == 1
    assert record.plain_streak == 0
    for _ in range(200):  # and wrong every time again
        policy.observe_run("d", 1, 0)
    assert policy.choose("d", num_seqs=1, cap=1) == 0
    assert policy._explore_interval(record.plain_streak) == fast


def _choices(policy: GoodputPolicy, steps: int, repeat: bool) -> tuple[list, int]:
    """Each step's (length, explore) for one sequence with cap 1; with ``repeat``, a choice
    the policy says is sure to be 0 is counted unevaluated. Also: how many were evaluated."""
    made, evaluated = [], 0
    for _ in range(steps):
        if repeat and policy.repeat_plain("d"):
            made.append((0, policy.explore))
        else:
            evaluated += 1
            made.append((policy.choose("d", num_seqs=1, cap=1), policy.explore))
    return made, evaluated


def test_a_clear_loss_s_plain_choices_stand_unevaluated_until_the_next_try():
    # Drafting one loses by about 8% (right 40% of the time, a second row 41% of a step):
    # repeating the choice of 0 without evaluating it, until a try falls due, makes the same
    # choices and tries at the same steps as evaluating every one, for a fraction of the work.
    def policy():
        trained = trained_policy(lambda n: 0.010 * n**0.5, 0.001, 0.4, cap=1)
        trained.explore_every = 16
        return trained

    every, _ = _choices(policy(), 400, repeat=False)
    repeated, evaluated = _choices(policy(), 400, repeat=True)
    assert repeated == every
    assert any(explore for _, explore in every)
    assert evaluated < 400 // 3
    counted = policy()
    _choices(counted, 400, repeat=True)
    assert dict(counted.chosen["d"]) == {0: 400}


def test_a_near_break_even_is_evaluated_every_step():
    # Right about half the time, drafting one comes within a few percent of plain decoding: a
    # drift of the step costs could turn it, so every choice is evaluated.
    policy = trained_policy(lambda n: 0.010 * n**0.5, 0.001, 0.52, cap=1)
    assert policy.choose("d", num_seqs=1, cap=1) == 0
    assert not policy.repeat_plain("d")
    drafting = trained_policy(lambda n: 0.010 * n**0.5, 0.001, 0.9, cap=1)
    assert drafting.choose("d", num_seqs=1, cap=1) == 1
    assert not drafting.repeat_plain("d")
    # Without tries due for long, a clear loss still re-evaluates every MAX_PLAIN_REPEATS.
    from engine.draft_policy import MAX_PLAIN_REPEATS

    losing = trained_policy(lambda n: 0.010 * n**0.5, 0.001, 0.2, cap=1)
    assert losing.choose("d", num_seqs=1, cap=1, shape=(1, 1, 0)) == 0
    assert not losing.repeat_plain("d", (2, 1, 0))  # another step's shape: evaluated
    assert [losing.repeat_plain("d", (1, 1, 0)) for _ in range(MAX_PLAIN_REPEATS + 1)] == [
        True
    ] * MAX_PLAIN_REPEATS + [False]


def test_the_engine_repeats_sure_plain_choices_until_its_sequences_change(tiny_model_dir):
    # Drafting is known to cost a second a token: every choice is a clear 0. The engine
    # counts the sure repeats without asking the policy, until a second sequence joins the
    # step, which is evaluated anew; the output stays greedy.
    prompt, other = [5, 6, 7, 8, 9] * 6, [11, 12, 13] * 9 + [14]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(model=str(tiny_model_dir))
    expected = [o.token_ids for o in plain.generate([prompt, other], greedy)]
    decoder = {"method": "ngram", "prompt_lookup_min": 1, "draft_policy": "goodput",
               "num_speculative_tokens": 3}  # fmt: skip
    llm = LLM(model=str(tiny_model_dir), decoder=decoder)
    policy = llm.engine.speculator.policy
    policy.explore_every = 64  # tries every 16th choice at first: long runs of repeats
    for k in range(1, 4):
        for seqs in (1, 2):
            policy.observe_draft("ngram", k, seqs, 1.0)
    evaluated = []  # (step, decode rows) of each evaluated choice
    choose = policy.choose

    def counted(decoder, num_seqs, cap, **rest):
        evaluated.append((steps, num_seqs + rest.get("other_tokens", 0)))
        return choose(decoder, num_seqs, cap, **rest)

    policy.choose = counted
    engine = llm.engine
    engine.add_request("a", prompt, greedy)
    outputs: dict[str, list[int]] = {}
    steps, first_of_b, repeats_left = 0, None, None
    while engine.has_unfinished_requests():
        # "b" arrives while several of "a"'s repeats are still to come.
        arrives = "b" not in outputs and "b" not in engine.requests
        if arrives and policy.decoders["ngram"].plain_ahead >= 6:
            engine.add_request("b", other, greedy)
            repeats_left = steps + policy.decoders["ngram"].plain_ahead
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
            if out.request_id == "b" and first_of_b is None:
                first_of_b = steps  # its prefill's step
        steps += 1
    assert [outputs["a"], outputs["b"]] == expected
    assert policy.chosen["ngram"][0] > 2 * len(evaluated)  # most were repeats
    # From the step after its prefill "b" decodes beside "a": the first choice for the two
    # is evaluated, before the repeats "a"'s last choice allowed would have run out.
    step, rows = next((step, rows) for step, rows in evaluated if step > first_of_b)
    assert rows == 2 and step < repeats_left
