"""Verification of draft token trees (engine.tree_verification through the rejection sampler):
the greedy longest matching path, exactness under sampling for deterministic trees and for trees
drawn from q (chi-square against the exact joint distribution, as the chain tests), a drafter
that lies about q caught, chain-shaped trees verified exactly as chains, logprob rows.

The target is the toy Markov model of tests/test_rejection_sampler.py: each row of logits depends
on the token before it, so a tree's rows are TARGET at each node's own token.
"""

import pytest
import torch

from engine.rejection_sampler import DraftRun, RejectionSampler
from engine.sampling import SamplingParams, make_generator, probabilities, process_logits
from engine.token_tree import longest_path, path_to
from engine.tree_verification import children_of
from tests.stats import chi_square_p_value
from tests.test_rejection_sampler import (
    DRAFT,
    EOS,
    P_VALUE,
    PROMPT,
    RUNS,
    SAMPLED,
    SEED,
    TARGET,
    VOCAB,
    Row,
    emitted,
    exact_joint,
    peaked,
)


def tree_rows(history: list[int], tokens: list[int]) -> list[int]:
    """TARGET rows of a tree step: the root follows the history's last token, draft i its own."""
    return [(PROMPT + history)[-1], *tokens]


def test_tree_shape_helpers():
    parents = [-1, -1, 0, 0, 2]
    assert children_of(parents) == [[0, 1], [2, 3], [], [4], [], []]
    assert path_to(parents, 4) == [0, 2, 4] and path_to(parents, -1) == []
    assert longest_path(parents) == 3 and longest_path([]) == 0
    with pytest.raises(ValueError, match="parents must come first"):
        children_of([-1, 2, 0])


def test_greedy_takes_the_longest_path_that_matches_the_argmax():
    # Root children: 1 (node 0) and 2 (node 1); node 0 has children 3 and 4, node 1 has 0.
    tokens, parents = [1, 2, 3, 4, 0], [-1, -1, 0, 0, 1]
    sampler = RejectionSampler([EOS])
    # argmax: root -> 2 (node 1), then 0 (node 4), then at node 4 -> 3 (a leaf: bonus token).
    run = DraftRun(Row(SamplingParams(temperature=0)), tokens, parents=parents)
    [v] = sampler(peaked([2, 3, 0, 0, 1, 3]), [run])
    assert v.path == [1, 4] and emitted(v) == [2, 0, 3]
    # argmax: root -> 1 (node 0), then 2: no child holds it, so 2 is emitted and the walk stops.
    [v] = sampler(peaked([1, 2, 0, 0, 0, 0]), [run])
    assert v.path == [0] and emitted(v) == [1, 2]
    # Nothing matches at the root.
    [v] = sampler(peaked([4, 0, 0, 0, 0, 0]), [run])
    assert v.path == [] and emitted(v) == [4]


def test_tree_rows_are_processed_along_each_path():
    # A repetition penalty on the path's own tokens: without the draft history at node 0 the
    # argmax there would be token 1 again (and the walk would go on); with it, token 0 wins.
    params = SamplingParams(temperature=0, repetition_penalty=10.0)
    logits = torch.tensor([[0.0, 3.0, 0.0, 0.0, 0.0, 0.0], [2.0, 3.0, 0.0, 0.0, 0.0, 0.0]])
    run = DraftRun(Row(params, prompt_token_ids=[]), [1], parents=[-1])
    [v] = RejectionSampler([EOS])(logits, [run])
    assert emitted(v) == [1, 0]


# --- losslessness under sampling ----------------------------------------------------------------

# A fixed deterministic tree: root children 0 and 4 (likely and unlikely after token 0), then
# 2 and 1 after 0, and 3 after 4.
ONE_HOT_TREE = ([0, 4, 2, 1, 3], [-1, -1, 0, 0, 1])
# Drawn trees: how many children each node draws (by depth) from its q.
DRAWN_BRANCHING = [2, 2]


def draw_tree(params, history, generator, lie: bool = False):
    """Children drawn i.i.d. from the processed DRAFT q at their parent (DRAWN_BRANCHING per
    depth). With ``lie``, the verifier is handed the q of a different model."""
    tokens, parents, q_rows = [], [], []
    frontier = [(-1, [])]  # (node, path tokens)
    for branching in DRAWN_BRANCHING:
        next_frontier = []
        for node, path in frontier:
            row = Row(params, output_token_ids=history + path)
            last = (PROMPT + history + path)[-1]
            q = probabilities(process_logits(DRAFT[[last]], [row], [EOS]))[0]
            told = q
            if lie:
                told = probabilities(process_logits(TARGET[[(last + 2) % VOCAB]], [row], [EOS]))[0]
            for x in torch.multinomial(q, branching, replacement=True, generator=generator):
                tokens.append(int(x))
                parents.append(node)
                q_rows.append(told)
                next_frontier.append((len(tokens) - 1, path + [int(x)]))
        frontier = next_frontier
    return tokens, parents, torch.stack(q_rows)


def tree_step(params, histories, drafter, generator) -> list[list[int]]:
    runs, rows = [], []
    for history in histories:
        if drafter == "one_hot":
            tokens, parents = ONE_HOT_TREE
            q = None
        else:
            tokens, parents, q = draw_tree(params, history, generator, lie=drafter == "lying_q")
        runs.append(DraftRun(Row(params, output_token_ids=history), tokens, q, generator, parents))
        rows += tree_rows(history, tokens)
    return [emitted(v) for v in RejectionSampler([EOS])(TARGET[rows], runs)]


def first_two_tokens(params, drafter) -> torch.Tensor:
    generator = make_generator(SEED)
    tokens = tree_step(params, [[] for _ in range(RUNS)], drafter, generator)
    short = [i for i, t in enumerate(tokens) if len(t) == 1]
    more = tree_step(params, [tokens[i] for i in short], drafter, generator)
    for i, extra in zip(short, more, strict=True):
        tokens[i] = tokens[i] + extra
    return torch.tensor([t[:2] for t in tokens])


def p_value(params, drafter) -> float:
    pairs = first_two_tokens(params, drafter)
    counts = torch.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB * VOCAB)
    return chi_square_p_value(counts, exact_joint(params).flatten())


@pytest.mark.parametrize("drafter", ["one_hot", "drawn_q"])
@pytest.mark.parametrize("params", SAMPLED.values(), ids=SAMPLED.keys())
def test_tree_tokens_are_distributed_as_the_processed_target(params, drafter):
    assert p_value(params, drafter) > P_VALUE


def test_a_drafter_handing_in_the_wrong_q_is_caught():
    # The same drawn trees, verified against another model's q: the output must drift, and
    # the test above must be able to tell.
    assert p_value(SamplingParams(), "lying_q") < P_VALUE


# --- chains as trees, logprobs ------------------------------------------------------------------


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=0.8)])
@pytest.mark.parametrize("with_q", [False, True])
def test_a_chain_shaped_tree_is_verified_exactly_as_the_chain(params, with_q):
    drafts = [0, 2, 1]
    logits = TARGET[[0, 0, 2, 1]]
    q = DRAFT[[0, 0, 2]].softmax(dim=-1) if with_q else None
    sampler = RejectionSampler([EOS])
    for seed in range(40):
        chain = DraftRun(Row(params), drafts, q, make_generator(seed))
        tree = DraftRun(Row(params), drafts, q, make_generator(seed), parents=[-1, 0, 1])
        [a, b] = sampler(torch.cat([logits, logits]), [chain, tree])
        assert (a.path, emitted(a)) == (b.path, emitted(b))
        assert chain.generator.get_state().equal(tree.generator.get_state())


def test_tree_logprobs_are_read_at_each_emitted_tokens_own_row():
    # Root -> node 1 (token 2) -> node 2 (token 3), then the bonus token at node 2's row (row 3).
    tokens, parents = [1, 2, 3], [-1, -1, 1]
    logits = peaked([2, 0, 3, 4]) + torch.arange(4.0)[:, None] * 0.1 * torch.arange(VOCAB)
    run = DraftRun(Row(SamplingParams(temperature=0, logprobs=1)), tokens, parents=parents)
    [v] = RejectionSampler([EOS])(logits, [run])
    assert v.path == [1, 2] and emitted(v) == [2, 3, 4]
    expected = torch.log_softmax(logits[[0, 2, 3]], dim=-1)[[0, 1, 2], [2, 3, 4]]
    assert [t.logprob for t in v.tokens] == pytest.approx(expected.tolist())
