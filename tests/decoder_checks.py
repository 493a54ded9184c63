"""Checks every drafting decoder's tests run the same way."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 9 + [14], [3] * 12, [40 + i % 9 for i in range(30)]]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def check_greedy_identity_batched_preempted_aborted(
    model_dir, make_llm: Callable[..., LLM], require_accepted: bool = True
) -> None:
    """``make_llm(**overrides)``'s greedy output equals plain decoding one prompt at a time,
    batched, and with a cache small enough to preempt; aborted requests (with n = 2) leave
    every block free."""
    expected = [o.token_ids for o in LLM(model=str(model_dir)).generate(PROMPTS, GREEDY)]
    roomy = make_llm()
    assert [roomy.generate([p], GREEDY)[0].token_ids for p in PROMPTS] == expected
    assert [o.token_ids for o in roomy.generate(PROMPTS, GREEDY)] == expected
    stats = roomy.engine.speculator.stats
    assert stats.num_drafts > 0
    if require_accepted:
        assert stats.num_accepted_tokens > 0
    small = make_llm(
        kv_cache={"num_blocks": 10},
        scheduler={"max_num_batched_tokens": 16, "max_model_len": 160},
    )
    assert [o.token_ids for o in small.generate(PROMPTS, GREEDY)] == expected
    assert small.engine.scheduler.num_preemptions > 0
    engine = small.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"a{i}", p, SamplingParams(max_tokens=40, ignore_eos=True, n=2))
    for _ in range(5):
        engine.step()
    engine.abort("a1")
    engine.abort("a2")
    while engine.has_unfinished_requests():
        engine.step()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def first_draft_after_a_prefix_hit(
    make_llm: Callable[..., LLM], name: str, own_cache, first_drafted: bool, poison_seed: int
):
    """The first drafting forward's logits of a request whose prompt shares six blocks with
    an earlier request's (a prefix-cache hit: the target computes nothing there), after the
    drafter's own cache (``own_cache(drafter)``: a KVCache) was filled with noise from
    ``poison_seed``. The earlier request drafted through its prompt or never drafted
    (``first_drafted``). The later request's output must equal plain decoding's."""
    llm = make_llm(kv_cache={"block_size": 4})
    engine = llm.engine
    decoder = engine.speculator.decoders[name]
    drafter = decoder.drafter
    shared = [40 + i % 9 for i in range(25)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plan = decoder.plan
    if not first_drafted:
        decoder.plan = lambda seqs, max_drafts: {}
    engine.add_request("a", shared, params)
    while engine.has_unfinished_requests():
        engine.step()
    decoder.plan = plan
    storage = own_cache(drafter).storage
    noise = torch.randn(storage.shape, generator=torch.Generator().manual_seed(poison_seed))
    storage.copy_(noise * 10)
    logits, forward = [], drafter.forward

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        logits.append(out.clone())
        return out

    drafter.forward = recording
    hits_before = engine.block_manager.stats.hits
    prompt = shared + [3, 4, 5]
    engine.add_request("b", prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert engine.block_manager.stats.hits - hits_before == 24  # six blocks of four
    expected = LLM(model=str(engine.config.model)).generate([prompt], params)[0].token_ids
    assert outputs[0].outputs[0].token_ids == expected
    return logits[0]
