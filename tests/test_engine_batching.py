"""Continuous batching, chunked prefill and preemption do not change what is generated."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.tiny_models import TINY_VOCAB


def prompts(*lengths: int) -> list[list[int]]:
    return [[(7 * i + 13 * n) % (TINY_VOCAB - 3) + 3 for i in range(n)] for n in lengths]


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


def test_greedy_alone_equals_greedy_in_mixed_batch(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir))
    batch = prompts(5, 37, 1, 90, 16, 64)
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in batch]
    together = [o.token_ids for o in llm.generate(batch, GREEDY)]
    assert together == alone
    assert_all_blocks_free(llm)


def test_chunked_prefill_and_preemption_give_identical_tokens(tiny_model_dir):
    reference = LLM(model=str(tiny_model_dir))
    batch = prompts(50, 33, 70, 12)
    expected = [o.token_ids for o in reference.generate(batch, GREEDY)]
    # 10 blocks of 16 tokens cannot hold four growing sequences (up to 110 tokens each):
    # the newest must be preempted and recomputed; an 8-token budget chunks every prefill.
    small = LLM(
        model=str(tiny_model_dir),
        kv_cache={"num_blocks": 10, "enable_prefix_caching": False},
        scheduler={"max_num_batched_tokens": 8, "max_model_len": 160},
    )
    got = [o.token_ids for o in small.generate(batch, GREEDY)]
    assert got == expected
    assert small.engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(small)


def test_seeded_sampling_is_reproducible_across_batch_compositions(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir))
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=30, ignore_eos=True)
    other = SamplingParams(temperature=0.8, max_tokens=25, ignore_eos=True)
    target = prompts(20)[0]
    alone = llm.generate([target], seeded)[0].token_ids
    mixed = llm.generate(prompts(9, 44) + [target], [other, other, seeded])[2].token_ids
    first = llm.generate([target] + prompts(3), [seeded, other])[0].token_ids
    assert alone == mixed == first
    different_seed = SamplingParams(
        temperature=1.0, top_p=0.9, seed=99, max_tokens=30, ignore_eos=True
    )
    assert llm.generate([target], different_seed)[0].token_ids != alone


def test_n_continuations_share_the_prompt_and_differ(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir))
    stats = llm.engine.block_manager.stats
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=20)
    out = llm.generate(prompts(40), params)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) <= 20 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    # Continuations 1 and 2 reuse the two full prompt blocks the first one computed.
    assert (stats.queries, stats.hits) == (3 * 40, 2 * 32)
    assert out.num_cached_prompt_tokens == 0
    assert_all_blocks_free(llm)
    # Each continuation is its own seeded stream: the same request gives the same three.
    again = llm.generate(prompts(40), params)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]


def test_finish_reasons(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), scheduler={"max_model_len": 64})
    p = prompts(10)[0]
    free_run = llm.generate([p], GREEDY)[0].token_ids
    stop_at = free_run[5]
    out = llm.generate(
        [p], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_at])
    )[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free_run[: free_run.index(stop_at) + 1]
    assert (
        llm.generate([p], SamplingParams(temperature=0, max_tokens=7))[0].finish_reason == "length"
    )
    # max_tokens=None runs to the context length.
    ctx = llm.generate([p], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert ctx.finish_reason == "length" and len(p) + len(ctx.token_ids) == 64


def test_eos_ends_a_sequence_unless_ignored(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir))
    p = prompts(10)[0]
    eos = next(iter(llm.engine.eos_token_ids))
    forced = SamplingParams(temperature=0, max_tokens=20, logit_bias={eos: 100.0})
    out = llm.generate([p], forced)[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    ignored = SamplingParams(temperature=0, max_tokens=5, logit_bias={eos: 100.0}, ignore_eos=True)
    out = llm.generate([p], ignored)[0]
    assert out.token_ids == [eos] * 5 and out.finish_reason == "length"


@pytest.mark.parametrize("abort_after_steps", [0, 1, 6])
def test_abort_at_any_time_frees_every_block(tiny_model_dir, abort_after_steps):
    llm = LLM(model=str(tiny_model_dir), scheduler={"max_num_batched_tokens": 16})
    engine = llm.engine
    for i, p in enumerate(prompts(40, 8, 25)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=30, n=2, ignore_eos=True))
    for _ in range(abort_after_steps):
        engine.step()
    final = engine.abort("r1")
    assert final is not None and all(o.finish_reason == "abort" for o in final.outputs)
    assert engine.abort("r1") is None
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(llm)


def test_changed_sampling_params_are_validated_again(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir))
    params = SamplingParams()
    params.top_p = 0.0
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(prompts(5), params)


def test_prefix_cache_hits_are_reused_and_counted(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir))
    bm = llm.engine.block_manager
    shared = prompts(70)[0]
    first = llm.generate([shared + [5, 6]], GREEDY)[0]
    assert first.num_cached_prompt_tokens == 0
    hits_before = bm.stats.hits
    second = llm.generate([shared + [9]], GREEDY)[0]
    # 70 shared tokens = 4 full blocks of 16 reused.
    assert second.num_cached_prompt_tokens == 64
    assert bm.stats.hits - hits_before == 64
    cold = LLM(model=str(tiny_model_dir), kv_cache={"enable_prefix_caching": False})
    assert cold.generate([shared + [9]], GREEDY)[0].token_ids == second.token_ids
    # Freed blocks stay cached with ref count 0 until they are handed out again.
    assert bm.num_free_blocks == bm.num_blocks
    assert any(b.hash is not None and b.ref_count == 0 for b in bm.blocks)


def test_blocks_all_free_after_mixed_finish_abort_and_preemption(tiny_model_dir):
    llm = LLM(
        model=str(tiny_model_dir),
        kv_cache={"num_blocks": 12},
        scheduler={"max_num_batched_tokens": 32, "max_model_len": 190},
    )
    engine = llm.engine
    lengths = (30, 50, 20, 45, 33)
    for i, p in enumerate(prompts(*lengths)):
        max_tokens = 5 if i == 2 else 60  # one finishes early by length
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    finished, aborted = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason
        sched = engine.scheduler
        preempted = [s for s in sched.waiting if s.num_preemptions > 0]
        if preempted and not aborted:
            # Abort one request sent back to the waiting queue and one that is running.
            aborted = [preempted[0].request_id, sched.running[0].request_id]
            for request_id in aborted:
                assert engine.abort(request_id).finish_reason == "abort"
    assert len(aborted) == 2 and engine.scheduler.num_preemptions > 0
    assert set(finished) == {"r0", "r1", "r2", "r3", "r4"} - set(aborted)
    assert set(finished.values()) == {"length"}
    assert_all_blocks_free(llm)


def test_logprobs_reach_the_request_output(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir))
    out = llm.generate(prompts(12), SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0]
    steps = out.outputs[0].logprobs
    assert [s.token_id for s in steps] == out.token_ids
    for s in steps:
        top_ids = [t for t, _ in s.top_logprobs]
        # Greedy picks the most likely raw token, so it heads the top-3 list.
        assert top_ids[0] == s.token_id and len(top_ids) == 3
        assert s.logprob == pytest.approx(s.top_logprobs[0][1])
    plain = llm.generate(prompts(12), SamplingParams(temperature=0, max_tokens=4))[0]
    assert plain.outputs[0].logprobs is None


# ---- aborting one of a request's n continuations -------------------------------------------
def run_to_end(engine, max_steps: int = 1000) -> list:
    outputs = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outputs
        outputs.extend(engine.step())
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def where(request, seq) -> str:
    if seq in request.held_back:
        return "held-back"
    if seq.num_computed_tokens == 0:
        return "queued"
    return "mid-prefill" if seq.num_computed_tokens < seq.num_prompt_tokens else "decoding"


@pytest.mark.parametrize(
    "index,steps,state",
    [(1, 0, "held-back"), (0, 0, "queued"), (0, 1, "mid-prefill"), (2, 6, "decoding")],
)
def test_aborting_one_continuation_frees_it_and_leaves_the_others_unchanged(
    tiny_model_dir, index, steps, state
):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=20, ignore_eos=True)
    prompt = prompts(40)[0]
    reference = LLM(model=str(tiny_model_dir)).generate([prompt], params)[0].outputs
    # A 16-token budget prefills the 40-token prompt in three steps, while the other two
    # continuations are held back behind the first.
    llm = LLM(model=str(tiny_model_dir), scheduler={"max_num_batched_tokens": 16})
    engine = llm.engine
    engine.add_request("r", prompt, params)
    for _ in range(steps):
        engine.step()
    seq = engine.requests["r"].seqs[index]
    assert where(engine.requests["r"], seq) == state
    assert engine.abort_sequence("r", index)
    assert seq.block_table == [] and seq not in engine.scheduler.running
    assert not engine.abort_sequence("r", index)  # already finished: nothing changes
    (reported,) = engine.step()  # the abort is reported by the very next step
    assert reported.outputs[index].finish_reason == "abort"
    assert reported.outputs[index].num_new_tokens == 0

    final = run_to_end(engine)[-1]
    assert final.finished
    for i, (got, want) in enumerate(zip(final.outputs, reference, strict=True)):
        if i == index:
            assert got.finish_reason == "abort"
            assert got.token_ids == want.token_ids[: len(got.token_ids)]
            assert len(got.token_ids) < len(want.token_ids)
        else:  # each continuation samples from its own seeded generator
            assert (got.token_ids, got.finish_reason) == (want.token_ids, "length")
    assert_all_blocks_free(llm)


def test_aborting_every_continuation_finishes_the_request(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir))
    engine = llm.engine
    params = SamplingParams(n=2, max_tokens=30, ignore_eos=True)
    engine.add_request("r", prompts(20)[0], params)
    engine.add_request("s", prompts(24)[0], params)
    engine.step()
    engine.step()
    assert not engine.abort_sequence("r", 2) and not engine.abort_sequence("nope", 0)
    for request_id in ("r", "s"):
        assert engine.abort_sequence(request_id, 1) and engine.abort_sequence(request_id, 0)
    assert_all_blocks_free(llm)  # freed at once, before any step
    # "s" is aborted as a whole before the step: its final output comes from abort, once.
    assert [o.finish_reason for o in engine.abort("s").outputs] == ["abort", "abort"]
    assert engine.has_unfinished_requests()  # the final output of "r" is still to be sent
    (final,) = engine.step()
    assert final.request_id == "r" and final.finished
    assert [o.finish_reason for o in final.outputs] == ["abort", "abort"]
    assert not engine.has_unfinished_requests()
    assert engine.step() == [] and engine.abort("r") is None
    assert not engine.abort_sequence("r", 0)
