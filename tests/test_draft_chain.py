"""EAGLE chains in one C++ call (engine/decoders/draft_chain.py): from the same drafter state
the C++ chain and the Python drafting loop give the same drafts, confidences, entropies, the
same guess and the same cache position, for EAGLE and EAGLE-3, exact and with 8-bit
activations; it stops at a token that ends the sequence; and it leaves every case it does not
cover (sampled or processed requests, several sequences drafting) to the Python loop, with the
drafter's state untouched."""

from __future__ import annotations

import collections

import pytest
import torch

from engine import LLM, SamplingParams
from engine.decoders.drafting import ModelDrafter
from tests.tiny_models import save_eagle3_drafter, save_eagle_drafter

pytestmark = pytest.mark.usefixtures("single_torch_thread")

PROMPTS = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 9 + [14], [40 + i % 9 for i in range(30)]]


@pytest.fixture(scope="module")
def drafters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("chain")
    return {
        "eagle": save_eagle_drafter(tiny_model_dir, root / "eagle", scale=2.0),
        "eagle3": save_eagle3_drafter(tiny_model_dir, root / "eagle3"),
    }


def _llm(model_dir, kind, drafter, k=3, **overrides) -> LLM:
    decoder = {"method": kind, kind: {"drafter": str(drafter)}, "num_speculative_tokens": k,
               "draft_policy": "fixed"}  # fmt: skip
    return LLM(model=str(model_dir), decoder=decoder, **overrides)


def _snapshot(drafter, seqs):
    states = {s: drafter._states[s].num_cached for s in seqs}
    logs = {s: (drafter._logs[s].guess, drafter._logs[s].guess_position) for s in seqs}
    return states, logs


def _restore(drafter, snapshot):
    states, logs = snapshot
    for s, n in states.items():
        drafter._states[s].num_cached = n
    for s, (guess, position) in logs.items():
        drafter._logs[s].guess, drafter._logs[s].guess_position = guess, position


def _compare_both_paths(llm, drafter, prompts, params) -> collections.Counter:
    """Every round drafted twice from the same state, by the chain and by the Python loop
    (whose result the engine goes on with); counts the rounds and any difference."""
    counts = collections.Counter()

    def draft(seqs, num_drafts, prefixes=None):
        active = [s for s in seqs if num_drafts.get(s, 0) > 0]
        for s in active:
            drafter._state(s)  # created as the first call of either path would
        before = _snapshot(drafter, active)
        fast = drafter.chain.draft(seqs, num_drafts)
        after_fast = _snapshot(drafter, active)
        _restore(drafter, before)
        slow = ModelDrafter.draft(drafter, seqs, num_drafts, prefixes)
        if fast is None:
            counts["python"] += 1
            return slow
        counts["chain"] += 1
        for s, proposal in fast.items():
            same = (proposal.token_ids, proposal.confidences, proposal.entropies) == (
                slow[s].token_ids, slow[s].confidences, slow[s].entropies
            )  # fmt: skip
            states, logs = after_fast
            same &= states[s] == drafter._states[s].num_cached
            same &= logs[s][1] == drafter._logs[s].guess_position
            same &= torch.equal(logs[s][0], drafter._logs[s].guess)
            counts["different"] += not same
            counts["early stops"] += len(proposal.token_ids) < num_drafts[s]
        return slow

    drafter.draft = draft
    llm.generate(prompts, params)
    return counts


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("int8", [False, True], ids=["exact", "int8-activations"])
def test_the_chain_drafts_what_the_python_loop_drafts(tiny_model_dir, drafters, kind, int8):
    llm = _llm(tiny_model_dir, kind, drafters[kind], int8_activations=int8)
    drafter = llm.engine.speculator.decoders[kind].drafter
    assert drafter.chain is not None
    for prompt in PROMPTS:  # one at a time: a batch of one drafting is what the chain covers
        counts = _compare_both_paths(
            llm, drafter, [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        )
        assert counts["chain"] >= 5, counts
        assert counts["different"] == 0, counts


def test_the_chain_stops_after_a_token_that_ends_the_sequence(tiny_model_dir, drafters):
    llm = _llm(tiny_model_dir, "eagle3", drafters["eagle3"], k=4)
    engine = llm.engine
    drafter = engine.speculator.decoders["eagle3"].drafter
    engine.add_request("r", PROMPTS[2][:20], SamplingParams(temperature=0, max_tokens=8))
    engine.step()  # the prefill
    engine.step()  # a round drafted: the drafter's entries now stand for the prompt
    (seq,) = engine.scheduler.running
    chain = drafter.chain
    state, log = drafter._state(seq), drafter._logs[seq]
    first = state.num_cached
    n = seq.num_tokens - first
    assert chain._supported(n)
    features = log.before(first, n, engine.model.arch.hidden_size).contiguous()
    ids = torch.tensor(seq.token_ids[first:])
    kv = [t for pair in drafter.kv_cache.layers for t in pair]
    table = list(seq.cache_state().block_table)
    tokens, *_ = chain._chain.draft(ids, first, features, table, kv, 4, [])
    assert len(tokens) == 4
    drafted = tokens.tolist()
    # the last draft whose token came no earlier (the first one if all are alike)
    last = max(j for j in range(len(drafted)) if drafted[j] not in drafted[:j])
    ended, *_ = chain._chain.draft(ids, first, features, table, kv, 4, [drafted[last]])
    assert ended.tolist() == drafted[: last + 1]  # the same drafts, up to the ending one


def test_requests_the_chain_does_not_cover_go_to_the_python_loop(tiny_model_dir, drafters):
    llm = _llm(tiny_model_dir, "eagle3", drafters["eagle3"])
    drafter = llm.engine.speculator.decoders["eagle3"].drafter
    cases = {
        "sampled": SamplingParams(temperature=0.8, seed=1, max_tokens=16, ignore_eos=True),
        "penalized": SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=16,
                                    ignore_eos=True),  # fmt: skip
    }
    for name, params in cases.items():
        counts = _compare_both_paths(llm, drafter, [PROMPTS[0]], params)
        assert counts["chain"] == 0 and counts["python"] >= 3, (name, counts)
    # two sequences drafting in one step
    counts = _compare_both_paths(
        llm, drafter, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    )
    assert counts["python"] >= 3, counts
    assert counts["different"] == 0, counts


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_greedy_output_with_the_chain_equals_autoregressive(tiny_model_dir, drafters, kind):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    expected = LLM(model=str(tiny_model_dir)).generate(PROMPTS, params)
    llm = _llm(tiny_model_dir, kind, drafters[kind])
    drafter = llm.engine.speculator.decoders[kind].drafter
    calls = []
    draft = drafter.chain.draft

    def counted(*args):
        calls.append(draft(*args))
        return calls[-1]

    drafter.chain.draft = counted
    got = [llm.generate([p], params)[0] for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert sum(c is not None for c in calls) >= 10


def test_after_a_prefix_hit_the_chain_drafts_what_the_python_loop_drafts(
    tiny_model_dir, drafters
):
    # B's prompt shares A's blocks: the drafter reuses the entries it computed there for A
    # (or reads them again from zeros, in the Python loop), then drafts as usual.
    llm = _llm(tiny_model_dir, "eagle3", drafters["eagle3"], kv_cache={"block_size": 4,
               "enable_prefix_caching": True})  # fmt: skip
    drafter = llm.engine.speculator.decoders["eagle3"].drafter
    shared = [40 + i % 9 for i in range(25)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    total = collections.Counter()
    for prompt in (shared, shared + [3, 4, 5], shared[:17] + [6]):
        total += _compare_both_paths(llm, drafter, [prompt], params)
    assert llm.engine.block_manager.stats.hits > 0
    assert total["chain"] >= 10 and total["different"] == 0, total
