"""The trained-head drafters (medusa, hydra): the tree ranking, the drafter directory, the
target hidden state each sequence's drafts start from, greedy identity through the engine
(batched, preempted, aborted), and `specserve train`'s pipeline on a tiny model (loss falls, a
checkpoint resumes, the drafter loads). Sampled exactness is in tests/test_decoders_sampling.py
with the other decoders."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.decoders.drafter_files import TrainedDrafter
from engine.decoders.trained_heads import rank_tree
from engine.models.llama import rms_norm
from tests.decoder_checks import check_greedy_identity_batched_preempted_aborted
from tests.tiny_models import save_heads_drafter
from tooling.training.self_distillation import sequence_features
from tooling.training.train_heads import HEADS, HeadsTrainOptions, run_train_heads

pytestmark = pytest.mark.usefixtures("single_torch_thread")

KINDS = ["medusa", "hydra"]
PROMPTS = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 9 + [14], [3] * 12, [40 + i % 9 for i in range(30)]]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def test_rank_tree_orders_paths_by_their_product_with_prefixes_first():
    accuracies = [[0.6, 0.2], [0.5, 0.4], [0.9, 0.05]]
    tree = rank_tree(accuracies, 8)
    # 0.6, then 0.6*0.5=0.30, 0.30*0.9=0.27, 0.6*0.4=0.24, 0.24*0.9=0.216, 0.2, ...
    assert tree[:6] == [(0,), (0, 0), (0, 0, 0), (0, 1), (0, 1, 0), (1,)]
    for n in range(1, len(tree) + 1):  # every prefix is a tree
        assert all(path[:-1] in tree[: tree.index(path)] for path in tree[:n] if len(path) > 1)


@pytest.fixture(scope="module", params=KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def drafter_dir(kind, tiny_model_dir, tmp_path_factory):
    # Heads as initialised: each guesses the target's own next token again, which on repetitive
    # prompts is often right, so paths are accepted and compacted.
    return save_heads_drafter(tiny_model_dir, tmp_path_factory.mktemp(kind) / "drafter", kind)


def trained_llm(kind, model_dir, drafter, **overrides) -> LLM:
    decoder = {"method": kind, kind: {"drafter": str(drafter)}, "num_speculative_tokens": 6,
               "draft_policy": "fixed"}  # fmt: skip
    return LLM(model=str(model_dir), decoder=decoder, **overrides)


def test_drafter_directory_round_trips_and_refuses_another_model(
    kind, drafter_dir, tiny_model_dir, tmp_path
):
    drafter = TrainedDrafter.load(drafter_dir, kind, HEADS[kind])
    assert drafter.network.num_heads == 3 and len(drafter.draft_vocab) == 320
    other = tmp_path / "other"
    drafter.target = {**drafter.target, "hidden_size": 1}
    drafter.save(other)
    with pytest.raises(ValueError, match="was trained for"):
        trained_llm(kind, tiny_model_dir, other)
    with pytest.raises(ValueError, match="not a drafter directory"):
        trained_llm(kind, tiny_model_dir, tmp_path)
    wrong = "hydra" if kind == "medusa" else "medusa"
    with pytest.raises(ValueError, match=f"not {wrong}"):
        trained_llm(wrong, tiny_model_dir, drafter_dir)


def test_the_decoder_reads_the_hidden_state_of_each_sequences_newest_token(
    kind, tiny_model_dir, drafter_dir
):
    llm = trained_llm(kind, tiny_model_dir, drafter_dir)
    engine, decoder = llm.engine, llm.engine.speculator.decoders[kind]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(4):  # a prefill and some verified steps
        engine.step()
    for seq in engine.scheduler.running:
        tokens = list(seq.token_ids)
        # Teacher forcing: the row of the position before the newest token gave that token.
        features = sequence_features(engine.model, [tokens])[0][len(tokens) - 2][None]
        arch = engine.model.arch
        stored = rms_norm(decoder._hidden[seq], engine.model.final_norm, arch.rms_norm_eps)
        torch.testing.assert_close(stored, features, atol=1e-4, rtol=1e-4)


def test_greedy_equals_autoregressive_batched_preempted_and_aborted(
    kind, tiny_model_dir, drafter_dir
):
    def make(**overrides):
        return trained_llm(kind, tiny_model_dir, drafter_dir, **overrides)

    check_greedy_identity_batched_preempted_aborted(tiny_model_dir, make)


@pytest.mark.parametrize("quantization, tolerance", [("none", 1e-5), ("int8", 0.03)])
def test_the_engine_runs_each_head_as_trained(
    kind, tiny_model_dir, tmp_path, quantization, tolerance
):
    """The decoder's projections (int8 by default, the model's float32 with ``none``) compute
    each head's trained function: head j's own weights, its own inputs."""
    drafter = save_heads_drafter(tiny_model_dir, tmp_path / "d", kind, scale=0.2)
    decoder_config = {"method": kind, kind: {"drafter": str(drafter), "quantization": quantization}}
    decoder = LLM(model=str(tiny_model_dir), decoder=decoder_config).engine.speculator.decoders[
        kind
    ]
    torch.manual_seed(0)
    heads = decoder.heads
    features = torch.randn(3, heads.hidden_size)
    trained = heads(features) if kind == "medusa" else None
    for j, block in enumerate(decoder.blocks):
        if kind == "medusa":
            want, got = trained[j], heads.block(j, features, block)
        else:
            embeddings = torch.randn(3, j + 1, heads.hidden_size)
            want = heads.head(j, features, embeddings)
            got = heads.head(j, features, embeddings, (decoder.inputs[j], block))
        assert ((got - want).norm() / want.norm()).item() < tolerance


def test_hydra_heads_read_the_path_they_extend(tiny_model_dir, tmp_path):
    # Two paths with the same first candidate rank but different tokens get different
    # children: the depth-2 candidates depend on the depth-1 token.
    drafter = TrainedDrafter.load(
        save_heads_drafter(tiny_model_dir, tmp_path / "d", "hydra", scale=0.2),
        "hydra",
        HEADS["hydra"],
    )
    heads, d = drafter.network, drafter.network.hidden_size
    features = torch.randn(1, d)
    embeddings = torch.randn(2, 2, d)
    embeddings[1, 0] = embeddings[0, 0]  # same decode token, different first draft
    out = heads.head(1, features.repeat(2, 1), embeddings)
    assert not torch.allclose(out[0], out[1])


def test_train_learns_resumes_and_writes_a_drafter_the_decoder_loads(
    kind, tiny_model_dir, tmp_path
):
    llm = LLM(model=str(tiny_model_dir), kv_cache={"num_blocks": 256})
    train = [[(7 * i + j) % 300 + 10 for j in range(12)] for i in range(24)]
    held = [[(11 * i + 5 * j) % 300 + 10 for j in range(12)] for i in range(4)]
    options = HeadsTrainOptions(
        kind=kind,
        output=tmp_path / "drafter",
        max_tokens=24,
        num_heads=2,
        draft_vocab_size=64,
        top_k=2,
        epochs=1,
        batch_size=32,
        learning_rate=3e-3,
        prompts=(train, held),
    )
    first = run_train_heads(llm, options)
    options.epochs, options.resume = 4, True
    drafter = run_train_heads(llm, options)
    assert first.info["resumed_after_epoch"] == 0
    assert drafter.info["resumed_after_epoch"] == 1
    losses = first.info["epoch_losses"] + drafter.info["epoch_losses"]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert len(drafter.accuracies) == 2 and len(drafter.accuracies[0]) == 2
    expected = llm.generate(PROMPTS[:2], GREEDY)
    got = trained_llm(kind, tiny_model_dir, options.output).generate(PROMPTS[:2], GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def test_hydra_s_embedding_norm_is_pytorch_s_in_drafts_and_in_training():
    from torch.nn import functional as F

    from engine.decoders.hydra import unit_rms

    x = torch.randn(3, 2, 576) * 5
    # In a draft (no autograd): the C++ norm where the kernels load, equal up to rounding.
    torch.testing.assert_close(unit_rms(x), F.rms_norm(x, (576,)), rtol=1e-5, atol=1e-6)
    # In training the gradient flows through it as through PyTorch's op.
    leaf = x.clone().requires_grad_()
    unit_rms(leaf)[:, :, 0].sum().backward()
    expected = x.clone().requires_grad_()
    F.rms_norm(expected, (576,))[:, :, 0].sum().backward()
    torch.testing.assert_close(leaf.grad, expected.grad)


def test_proposals_carry_each_node_s_probability_under_its_head(kind, drafter_dir, tiny_model_dir):
    # The policy's chance floor reads them: a node's confidence is its head's softmax
    # probability of the node's token, the first node's the largest of head 1's.
    llm = trained_llm(kind, tiny_model_dir, drafter_dir)
    decoder = llm.engine.speculator.decoders[kind]
    seen = []
    propose = decoder.propose

    def recording(seqs, num_drafts):
        proposals = propose(seqs, num_drafts)
        seen.extend(proposals.values())
        return proposals

    decoder.propose = recording
    llm.generate(PROMPTS[:2], GREEDY)
    assert seen
    for proposal in seen:
        assert len(proposal.confidences) == len(proposal.token_ids)
        assert all(0 < c <= 1 for c in proposal.confidences)
        assert any(c < 1 for c in proposal.confidences)  # probabilities, not placeholders
        children = [i for i, p in enumerate(proposal.parents) if p == -1]
        # The first-level candidates in rank order: the top one's probability the largest.
        firsts = [proposal.confidences[i] for i in children]
        assert firsts == sorted(firsts, reverse=True)
    guesses = torch.randn(3, decoder.model.arch.hidden_size)
    tokens, chances = decoder.ranked_candidates(guesses, 2)
    logits = decoder.readout(guesses).float()
    expected = torch.softmax(logits, dim=-1).topk(2, dim=-1)
    assert tokens == decoder.draft_vocab[expected.indices].tolist()
    assert torch.allclose(torch.tensor(chances), expected.values, atol=1e-6)
    top1, one = decoder.ranked_candidates(guesses, 1)
    assert [t[0] for t in top1] == [t[0] for t in tokens]
    assert torch.allclose(torch.tensor(one)[:, 0], expected.values[:, 0], atol=1e-6)
