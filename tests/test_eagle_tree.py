"""EAGLE-2's dynamic trees: every drafted node's probability is what the drafter gives after
that node's own path (so a tree entry sees its ancestors and nothing else of the tree), the
tree is the most valuable nodes with parents first, a one-wide tree is the chain, and greedy
output equals plain decoding batched, preempted and aborted. Sampled exactness is in
tests/test_decoders_sampling.py (the "eagle-tree" case)."""

from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, SamplingParams
from engine.decoders.eagle_tree import draft_tree
from tests.decoder_checks import check_greedy_identity_batched_preempted_aborted
from tests.tiny_models import save_eagle_drafter, save_tiny_model

pytestmark = pytest.mark.usefixtures("single_torch_thread")

# 20 tokens: the reference chains of the tests stay inside the second 16-slot block.
PROMPT = [40 + i % 9 for i in range(20)]


@pytest.fixture(scope="module")
def drafter_dir(tiny_model_dir, tmp_path_factory):
    # A sharper drafter than the default random one: its values differ enough between nodes
    # that the tree's shape is not a tie-break.
    return save_eagle_drafter(tiny_model_dir, tmp_path_factory.mktemp("eagle-tree") / "d")


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A Mistral-style target whose sliding window (8) is shorter than the prompt, and a
    drafter over it: tree entries must see the window their positions give."""
    root = tmp_path_factory.mktemp("eagle-tree-window")
    model = save_tiny_model(root / "mistral", "mistral", sliding_window=8)
    return model, save_eagle_drafter(model, root / "d")


def tree_llm(model_dir, drafter, top_k=2, depth=3, **overrides) -> LLM:
    eagle = {"drafter": str(drafter), "quantization": "none", "tree_top_k": top_k,
             "tree_depth": depth}  # fmt: skip
    decoder = {"method": "eagle", "eagle": eagle, "num_speculative_tokens": 6,
               "draft_policy": "fixed"}  # fmt: skip
    return LLM(model=str(model_dir), decoder=decoder, **overrides)


def decoding_sequence(llm: LLM, params: SamplingParams):
    """A sequence after its prefill, ready to draft at its decode token."""
    engine = llm.engine
    engine.add_request("r", PROMPT, params)
    engine.step()
    (seq,) = engine.scheduler.running
    return engine, seq


def chain_probabilities(drafter, seq, path: list[int]) -> torch.Tensor:
    """The drafter's raw distribution after ``path`` (tokens after the decode token), one entry
    at a time from the decode token on, as chain drafting computes it."""
    decode = seq.num_tokens - 1
    drafter.rewind(seq, decode)
    drafter.begin_round(seq)
    for depth in range(len(path) + 1):
        logits = drafter.forward([seq], {seq: path[:depth]}, {seq: 1})
    return torch.softmax(logits[0], dim=-1)


def paths(proposal) -> list[list[int]]:
    out = []
    for i, p in enumerate(proposal.parents):
        out.append((out[p] if p >= 0 else []) + [proposal.token_ids[i]])
    return out


@pytest.mark.parametrize("target", ["llama", "sliding-window"])
def test_every_node_has_the_probability_its_own_path_gives(target, tiny_model_dir, drafter_dir,
                                                          request):  # fmt: skip
    model_dir, drafter_path = (
        (tiny_model_dir, drafter_dir) if target == "llama" else request.getfixturevalue("windowed")
    )
    llm = tree_llm(model_dir, drafter_path)
    engine, seq = decoding_sequence(llm, SamplingParams(temperature=0, max_tokens=16))
    drafter = engine.speculator.decoders["eagle"].drafter
    # Every node drafted: 3 children of the decode token, then at depths 2 and 3 three
    # expanded nodes with three children each.
    proposal = draft_tree(drafter, [seq], {seq: 64}, top_k=3, depth=3)[seq]
    depths = [len(p) for p in paths(proposal)]
    assert (depths.count(1), depths.count(2), depths.count(3)) == (3, 9, 9)
    for path, prob in zip(paths(proposal), proposal.confidences, strict=True):
        reference = chain_probabilities(drafter, seq, path[:-1])
        assert math.isclose(prob, reference[path[-1]].item(), rel_tol=1e-4, abs_tol=1e-6)
        # ... and a node is one of its parent's three likeliest continuations.
        assert path[-1] in reference.topk(3).indices.tolist()


def test_the_tree_is_the_most_valuable_nodes_parents_first(tiny_model_dir, drafter_dir):
    llm = tree_llm(tiny_model_dir, drafter_dir)
    engine, seq = decoding_sequence(llm, SamplingParams(temperature=0, max_tokens=16))
    drafter = engine.speculator.decoders["eagle"].drafter
    full = draft_tree(drafter, [seq], {seq: 64}, top_k=2, depth=3)[seq]
    # top_k 2: 2 children of the root, then 2 expanded nodes per depth with 2 children each.
    assert len(full.token_ids) == 2 + 4 + 4
    values = []
    for i, p in enumerate(full.parents):
        assert p < i
        values.append(full.confidences[i] * (values[p] if p >= 0 else 1.0))
    assert values == sorted(values, reverse=True)
    # A grant of n slots keeps the n most valuable: the full tree's first n nodes.
    engine2, seq2 = decoding_sequence(tree_llm(tiny_model_dir, drafter_dir), SamplingParams(
        temperature=0, max_tokens=16))  # fmt: skip
    drafter2 = engine2.speculator.decoders["eagle"].drafter
    small = draft_tree(drafter2, [seq2], {seq2: 5}, top_k=2, depth=3)[seq2]
    assert small.token_ids == full.token_ids[:5] and small.parents == full.parents[:5]


def test_a_tree_writes_its_entries_only_into_the_slots_it_was_granted(tiny_model_dir,
                                                                     drafter_dir):  # fmt: skip
    llm = tree_llm(tiny_model_dir, drafter_dir)
    engine, seq = decoding_sequence(llm, SamplingParams(temperature=0, max_tokens=16))
    drafter = engine.speculator.decoders["eagle"].drafter
    k_cache, v_cache = drafter.kv_cache.layers[0]
    table, size = seq.cache_state().block_table, drafter.kv_cache.block_size
    after_decode = [table[p // size] * size + p % size
                    for p in range(seq.num_tokens, len(table) * size)]  # fmt: skip
    k_cache[after_decode] = float("nan")
    v_cache[after_decode] = float("nan")
    # Three first drafts expanded, then one more node: the four slots of a grant of four,
    # one entry each, in order; nothing past them.
    proposal = draft_tree(drafter, [seq], {seq: 4}, top_k=3, depth=3)[seq]
    assert len(proposal.token_ids) == 4
    written = [not bool(k_cache[s].isnan().any()) for s in after_decode]
    assert written == [True] * 4 + [False] * (len(after_decode) - 4)
    assert not bool(v_cache[after_decode[:4]].isnan().any())


def test_sequences_drafting_together_get_the_trees_they_get_alone(tiny_model_dir, drafter_dir):
    prompts = [PROMPT, [3 + i % 5 for i in range(18)], [60 - i for i in range(17)]]
    grants = [8, 3, 6]

    def trees(together: bool):
        engine = tree_llm(tiny_model_dir, drafter_dir).engine
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=16))
        engine.step()  # the prefills
        seqs = sorted(engine.scheduler.running, key=lambda s: s.request_id)
        drafter = engine.speculator.decoders["eagle"].drafter
        grant = dict(zip(seqs, grants, strict=True))
        if together:
            out = draft_tree(drafter, seqs, grant, top_k=3, depth=4)
        else:
            out = {}
            for s in seqs:
                out |= draft_tree(drafter, [s], {s: grant[s]}, top_k=3, depth=4)
        return [(out[s].token_ids, out[s].parents) for s in seqs]

    assert trees(together=True) == trees(together=False)


def test_a_one_wide_tree_is_the_greedy_chain(tiny_model_dir, drafter_dir):
    llm = tree_llm(tiny_model_dir, drafter_dir)
    engine, seq = decoding_sequence(llm, SamplingParams(temperature=0, max_tokens=16))
    drafter = engine.speculator.decoders["eagle"].drafter
    tree = draft_tree(drafter, [seq], {seq: 4}, top_k=1, depth=4)[seq]
    drafter.rewind(seq, seq.num_tokens - 1)
    chain = drafter.draft([seq], {seq: 4})[seq]
    assert tree.parents == [-1, 0, 1, 2]
    assert tree.token_ids == chain.token_ids
    torch.testing.assert_close(tree.confidences, chain.confidences, rtol=1e-4, atol=1e-6)


def test_banned_tokens_are_never_drafted(tiny_model_dir, drafter_dir):
    llm = tree_llm(tiny_model_dir, drafter_dir)
    engine, seq = decoding_sequence(llm, SamplingParams(temperature=0, max_tokens=16))
    drafter = engine.speculator.decoders["eagle"].drafter
    first = draft_tree(drafter, [seq], {seq: 8}, top_k=2, depth=3)[seq].token_ids
    banned = {t: -100.0 for t in first}
    engine2, seq2 = decoding_sequence(
        tree_llm(tiny_model_dir, drafter_dir),
        SamplingParams(temperature=0, max_tokens=16, logit_bias=banned),
    )
    drafter2 = engine2.speculator.decoders["eagle"].drafter
    again = draft_tree(drafter2, [seq2], {seq2: 8}, top_k=2, depth=3)[seq2].token_ids
    assert again and not set(again) & set(first)


def test_greedy_equals_autoregressive_batched_preempted_and_aborted(tiny_model_dir, drafter_dir):
    check_greedy_identity_batched_preempted_aborted(
        tiny_model_dir,
        lambda **overrides: tree_llm(tiny_model_dir, drafter_dir, **overrides),
        require_accepted=False,
    )


def test_the_config_turns_trees_on(tiny_model_dir, drafter_dir):
    llm = tree_llm(tiny_model_dir, drafter_dir, top_k=2)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert out[0].token_ids
    stats = llm.engine.speculator.stats
    # Six-node trees: more drafts verified per run than any depth-3 chain could hold.
    assert stats.num_drafts > 0 and stats.num_draft_tokens / stats.num_drafts > 3
