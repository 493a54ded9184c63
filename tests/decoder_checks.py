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
    an earlier request's (a prefix-cache hit: the target computes nothing there), after noise
    from ``poison_seed`` went into the drafter's own cache (``own_cache(drafter)``: a KVCache):
    all of it when the earlier request never drafted, the last shared block's slots only when
    it drafted through its prompt (``first_drafted``: then all six blocks must be reused). The
    later request's output must equal plain decoding's."""
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
    hits_before = engine.block_manager.stats.hits
    prompt = shared + [3, 4, 5]
    engine.add_request("b", prompt, params)
    outputs = [o for o in engine.step() if o.finished]  # B's prompt: no drafting before it
    (seq,) = engine.scheduler.running
    storage = own_cache(drafter).storage
    noise = 10 * torch.randn(storage.shape, generator=torch.Generator().manual_seed(poison_seed))
    if first_drafted:
        block = seq.cache_state().block_table[5]
        slots = slice(4 * block, 4 * block + 4)
        storage[:, :, slots] = noise[:, :, slots]
    else:
        storage.copy_(noise)
    # The Python forward's logits are recorded: the C++ chain, which drafts the same tokens
    # (tests/test_draft_chain.py), is set aside.
    drafter.chain = None
    logits, forward = [], drafter.forward

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        logits.append(out.clone())
        return out

    drafter.forward = recording
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert engine.block_manager.stats.hits - hits_before == 24  # six blocks of four
    expected = LLM(model=str(engine.config.model)).generate([prompt], params)[0].token_ids
    assert outputs[0].outputs[0].token_ids == expected
    return logits[0]


def first_draft_sharing_a_prefix(make_llm: Callable[..., LLM], name: str, together: bool):
    """The first drafting logits of a request B whose prompt shares six blocks with a request
    A's (a prefix-cache hit). ``together``: A and B draft for the first time in the same step,
    so nothing of A's is recorded yet and A writes the shared blocks' entries in the very pass
    where B reads them; otherwise A drafted (and recorded them) before B was added."""
    llm = make_llm(kv_cache={"block_size": 4})
    engine = llm.engine
    decoder = engine.speculator.decoders[name]
    drafter = decoder.drafter
    allowed: set[str] = set()
    plan = decoder.plan

    def gated(seqs, max_drafts):
        return plan([s for s in seqs if s.request_id in allowed],
                    {s: k for s, k in max_drafts.items() if s.request_id in allowed})  # fmt: skip

    decoder.plan = gated
    shared = [40 + i % 9 for i in range(25)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("a", shared, params)
    engine.step()  # A's prompt: its blocks committed
    if not together:
        allowed.add("a")
        engine.step()
        engine.step()
    engine.add_request("b", shared + [3, 4, 5], params)
    engine.step()  # B's prompt after the hit
    drafter.chain = None  # the Python forward's rows are recorded (as above)
    b_rows, forward = [], drafter.forward

    def recording(seqs, chains, num_logits, *args, **kwargs):
        out = forward(seqs, chains, num_logits, *args, **kwargs)
        row = 0
        for s in seqs:
            if s.request_id == "b" and not b_rows:
                b_rows.append(out[row : row + num_logits[s]].clone())
            row += num_logits[s]
        return out

    drafter.forward = recording
    allowed |= {"a", "b"}
    engine.step()
    assert engine.block_manager.stats.hits == 24  # six blocks of four
    return b_rows[0]
