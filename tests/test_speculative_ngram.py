"""The ngram decoder through the engine: lossless under greedy and under sampling, proposing
chains (one match) and token trees (several matches merged)."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.decoders import Decoder
from engine.decoders.ngram import find_continuation, find_continuations, merge_into_tree
from tests.stats import chi_square_p_value

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "draft_policy": "fixed",  # k every step: these tests are about the drafts' distribution
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
# Repetitive prompts: lookup finds matches, so drafts are proposed and mostly verified.
PROMPTS = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 9 + [14], [20 + i % 7 for i in range(40)], [3] * 12]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def test_find_continuation_prefers_the_longest_latest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 2, 3]
    # "2 3" occurs at 1 and 5; the latest earlier one (5) is followed by 7, 8.
    assert find_continuation(tokens, 1, 2, 3) == [7, 8, 2]
    assert find_continuation(tokens, 3, 3, 2) == []  # "8 2 3" never occurred before
    assert find_continuation([4, 5, 6], 1, 2, 4) == []


def test_find_continuations_lists_every_match_in_order_of_preference():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 2, 3]
    # "2 3" at 5 then 1, then "3" at 6 and 2 (the same places, one token shorter).
    assert find_continuations(tokens, 1, 2, 2, 8) == [[7, 8], [9, 1], [7, 8], [9, 1]]
    assert find_continuations(tokens, 1, 2, 2, 1) == [[7, 8]]


def _continuations_by_scanning(tokens, min_n, max_n, k, matches):
    """The definition: compare the suffix n-gram at every earlier position, latest first."""
    length, found = len(tokens), []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[length - n :]:
                found.append(tokens[start + n : start + n + k])
                if len(found) == matches:
                    return found
    return found


def test_find_continuations_finds_what_scanning_every_position_finds():
    # Small vocabularies make many matches, of every length, at every place (the first
    # position and the one just before the suffix included).
    draws = random.Random(0)
    for case in range(400):
        vocab = draws.choice([1, 2, 3, 5, 20])
        tokens = [draws.randrange(vocab) for _ in range(draws.randrange(0, 60))]
        min_n = draws.randint(1, 3)
        max_n = draws.randint(min_n, 5)
        k, matches = draws.randint(1, 6), draws.randint(1, 5)
        expected = _continuations_by_scanning(tokens, min_n, max_n, k, matches)
        assert find_continuations(tokens, min_n, max_n, k, matches) == expected, case


def test_merge_into_tree_keeps_the_most_travelled_nodes_parents_first():
    found = [[1, 2, 3, 4], [1, 2, 5, 6], [7, 8], [1, 9]]
    # "1" thrice, "1 2" twice; then the first continuation's nodes, then the second's.
    assert merge_into_tree(found, 6) == ([1, 2, 3, 5, 4, 6], [-1, 0, 1, 1, 2, 3])
    assert merge_into_tree(found, 3) == ([1, 2, 3], [-1, 0, 1])  # a chain
    assert merge_into_tree([[4, 5], [6]], 3) == ([4, 6, 5], [-1, -1, 0])


# Chains (the latest match only) and trees (four matches merged).
@pytest.fixture(scope="module", params=[1, 4], ids=["chain", "tree"])
def ngram_config(request) -> dict:
    return {**NGRAM, "prompt_lookup_candidates": request.param}


@pytest.fixture(scope="module")
def engines(tiny_model_dir, ngram_config):
    return LLM(model=str(tiny_model_dir)), LLM(model=str(tiny_model_dir), decoder=ngram_config)


def assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished_requests()


def test_greedy_ngram_equals_autoregressive_alone_and_batched(engines):
    ar, ngram = engines
    expected = [o.token_ids for o in ar.generate(PROMPTS, GREEDY)]
    alone = [ngram.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    batched = [o.token_ids for o in ngram.generate(PROMPTS, GREEDY)]
    assert alone == expected and batched == expected
    stats = ngram.engine.speculator.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0  # drafts really ran
    assert_all_blocks_free(ngram)


def test_trees_are_proposed_and_their_accepted_paths_compacted(tiny_model_dir, monkeypatch):
    ar = LLM(model=str(tiny_model_dir))
    ngram = LLM(model=str(tiny_model_dir), decoder={**NGRAM, "prompt_lookup_candidates": 4})
    speculator = ngram.engine.speculator
    moved, compact = [], speculator._compact_path
    monkeypatch.setattr(
        speculator, "_compact_path", lambda s, path: (moved.append(path), compact(s, path))
    )
    # Logprobs too: the tiny model's argmax can survive a stale K/V, its probabilities cannot.
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    expected = ar.generate(PROMPTS, params)
    got = ngram.generate(PROMPTS, params)
    for a, b in zip(expected, got, strict=True):
        assert b.token_ids == a.token_ids
        logprobs = [t.logprob for t in b.outputs[0].logprobs]
        assert logprobs == pytest.approx([t.logprob for t in a.outputs[0].logprobs], abs=1e-4)
    # Some accepted path left the first branch, so its K/V really were copied down.
    assert any(node != depth for path in moved for depth, node in enumerate(path))
    assert_all_blocks_free(ngram)


def test_greedy_ngram_with_preemption_and_small_budget(tiny_model_dir, engines, ngram_config):
    ar, _ = engines
    expected = [o.token_ids for o in ar.generate(PROMPTS, GREEDY)]
    small = LLM(
        model=str(tiny_model_dir),
        decoder=ngram_config,
        kv_cache={"num_blocks": 12, "enable_prefix_caching": False},
        scheduler={"max_num_batched_tokens": 16, "max_model_len": 160},
    )
    assert [o.token_ids for o in small.generate(PROMPTS, GREEDY)] == expected
    assert small.engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(small)


def test_stop_token_inside_an_accepted_run_ends_at_that_token(engines):
    ar, ngram = engines
    free = ar.generate([PROMPTS[0]], GREEDY)[0].token_ids
    stop = free[7]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop])
    out = ngram.generate([PROMPTS[0]], params)[0]
    assert out.token_ids == free[: free.index(stop) + 1] and out.finish_reason == "stop"
    capped = ngram.generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    )[0]
    assert capped.token_ids == free[:9] and capped.finish_reason == "length"


def test_abort_mid_draft_frees_every_block(engines):
    _, ngram = engines
    engine = ngram.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"a{i}", p, SamplingParams(max_tokens=60, ignore_eos=True, n=2))
    for _ in range(4):
        engine.step()
    engine.abort("a1")
    engine.abort("a2")
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(ngram)


def exact_two_token_distribution(llm: LLM, prompt: list[int], params: SamplingParams):
    """p(first) and p(second) marginalised over first, from the target model directly."""
    from engine.sampling import probabilities, process_logits

    class Row:
        def __init__(self, output):
            self.sampling_params, self.prompt_token_ids = params, prompt
            self.output_token_ids = output

    def next_probs(prefixes: list[list[int]], outputs: list[list[int]]) -> torch.Tensor:
        logits = torch.stack([_last_logits(llm.engine, prefix) for prefix in prefixes])
        rows = [Row(o) for o in outputs]
        return probabilities(process_logits(logits, rows, llm.engine.eos_token_ids))

    first = next_probs([prompt], [[]])[0]
    vocab = first.shape[0]
    second_given = next_probs([prompt + [x] for x in range(vocab)], [[x] for x in range(vocab)])
    return first, first @ second_given


def _last_logits(engine, prefix: list[int]) -> torch.Tensor:
    from engine.attention import SequenceSlice, build_attention_metadata
    from engine.kv_cache import KVCache

    arch = engine.model.arch
    cache = KVCache(arch.num_layers, 16, 16, arch.num_kv_heads, arch.head_dim, torch.float32, "cpu")
    meta = build_attention_metadata(
        [SequenceSlice(0, len(prefix), list(range(16)))], 16, arch.head_dim, "cpu"
    )
    with torch.inference_mode():
        out = engine.model(
            torch.tensor(prefix),
            torch.arange(len(prefix)),
            cache.layers,
            meta,
            logits_indices=torch.tensor([len(prefix) - 1]),
        )
    return out.logits[0]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(temperature=1.0, top_p=0.8, min_p=0.02),
        SamplingParams(temperature=1.0, presence_penalty=1.5, logit_bias={7: 3.0}),
    ],
    ids=["plain", "top_k", "top_p-min_p", "penalty-bias"],
)
def test_sampled_ngram_matches_the_target_distribution(engines, params, monkeypatch):
    """A false alarm has probability 1e-4 per token position checked (two per case)."""
    _, ngram = engines
    speculator = ngram.engine.speculator
    # A random model's first token rarely has a prompt match: draft fixed, plausible tokens
    # for every sequence so that every second token really goes through verification.
    tree = speculator.decoders["ngram"].candidates > 1
    monkeypatch.setitem(speculator.decoders, "ngram", AlwaysDrafts(tree))
    runs_before = speculator.stats.num_drafts
    prompt = [5, 6, 7, 8, 9] * 4 + [5, 6]
    draws = 3000
    # max_tokens=4: the first token comes from the prefill, the second from verifying two
    # drafts (a chain 7, 7, or two siblings 7 and 9 in a tree): accepted, or drawn from the
    # rest of p.
    sampled = SamplingParams(
        **{**params.__dict__, "n": draws, "max_tokens": 4, "ignore_eos": True, "seed": 1}
    )
    out = ngram.generate([prompt], sampled)[0]
    first_p, second_p = exact_two_token_distribution(ngram, prompt, sampled)
    vocab = first_p.shape[0]
    firsts = torch.bincount(torch.tensor([o.token_ids[0] for o in out.outputs]), minlength=vocab)
    seconds = torch.bincount(torch.tensor([o.token_ids[1] for o in out.outputs]), minlength=vocab)
    assert chi_square_p_value(firsts, first_p) > 1e-4
    assert chi_square_p_value(seconds, second_p) > 1e-4
    assert speculator.stats.num_drafts - runs_before >= draws  # every sequence was verified


class AlwaysDrafts(Decoder):
    """Test drafter: proposes token 7 for every sequence (one-hot q, like ngram); as a tree,
    the siblings 7 and 9, each followed by 7s."""

    name = "ngram"

    def __init__(self, tree: bool = False):
        self.tree = tree

    def plan(self, seqs, max_drafts):
        return {s: k for s, k in max_drafts.items() if k > 0}

    def propose(self, seqs, num_drafts):
        from engine.decoders import Proposal

        proposals = {}
        for s in seqs:
            n = num_drafts[s]
            if not self.tree:
                proposals[s] = Proposal([7] * n)
                continue
            parents = [-1, -1, 0, 1][:n] + list(range(2, n - 2))
            proposals[s] = Proposal(([7, 9] + [7] * n)[:n], parents=parents)
        return proposals

    def on_verified(self, seq, proposal, num_accepted):
        pass


def test_seeded_sampling_is_token_identical_to_autoregressive_in_any_batch(engines):
    ar, ngram = engines
    seeded = SamplingParams(temperature=1.0, top_k=5, seed=42, max_tokens=30, ignore_eos=True)
    other = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)
    expected = ar.generate([PROMPTS[3]], seeded)[0].token_ids
    alone = ngram.generate([PROMPTS[3]], seeded)[0].token_ids
    mixed = ngram.generate([PROMPTS[0], PROMPTS[3], PROMPTS[1]], [other, seeded, other])[1]
    assert alone == expected and mixed.token_ids == expected


def test_a_request_can_opt_out_or_pick_its_own_k(engines):
    from engine.decoders import SpeculativeOptions

    ar, ngram = engines
    engine, stats = ngram.engine, ngram.engine.speculator.stats
    expected = ar.generate([PROMPTS[0]], GREEDY)[0].token_ids
    drafts_before = stats.num_draft_tokens
    engine.add_request("opt-out", PROMPTS[0], GREEDY, SpeculativeOptions("autoregressive"))
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[0].token_ids == expected and stats.num_draft_tokens == drafts_before
    engine.add_request("k1", PROMPTS[0], GREEDY, SpeculativeOptions("ngram", 1))
    runs_before = stats.num_drafts
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[0].token_ids == expected
    assert stats.num_draft_tokens - drafts_before == stats.num_drafts - runs_before  # k=1
    with pytest.raises(ValueError, match="not loaded; loaded: autoregressive, ngram"):
        engine.add_request("bad", PROMPTS[0], GREEDY, SpeculativeOptions("medusa"))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeOptions("ngram", 0)
