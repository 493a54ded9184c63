"""EAGLE: the drafter's paged forward equals its training form at every depth it is trained
on (so training-time test trains what runs), greedy identity through the engine (batched,
preempted, aborted), the features each sequence's entries read, and `specserve train eagle` on
a tiny model (loss falls, a checkpoint resumes, the drafter loads). Sampled exactness is in
tests/test_decoders_sampling.py with the other decoders."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.decoder_checks import (
    check_greedy_identity_batched_preempted_aborted,
    first_draft_after_a_prefix_hit,
    first_draft_sharing_a_prefix,
)
from tests.tiny_models import save_eagle_drafter
from tooling.training.train_eagle import EagleTrainOptions, run_train_eagle, unrolled_outputs

pytestmark = pytest.mark.usefixtures("single_torch_thread")

PROMPTS = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 9 + [14], [3] * 12, [40 + i % 9 for i in range(30)]]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module", params=[True, False], ids=["input-norm", "eagle1-no-input-norm"])
def drafter_dir(tiny_model_dir, tmp_path_factory, request):
    path = tmp_path_factory.mktemp("eagle") / "drafter"
    return save_eagle_drafter(tiny_model_dir, path, input_norm=request.param)


def eagle_llm(model_dir, drafter, quantization="int8", **overrides) -> LLM:
    eagle = {"drafter": str(drafter), "quantization": quantization}
    decoder = {"method": "eagle", "eagle": eagle, "num_speculative_tokens": 4,
               "draft_policy": "fixed"}  # fmt: skip
    return LLM(model=str(model_dir), decoder=decoder, **overrides)


def test_paged_drafting_equals_the_unrolled_training_form(tiny_model_dir, drafter_dir):
    llm = eagle_llm(tiny_model_dir, drafter_dir, quantization="none")  # as trained
    engine = llm.engine
    drafter = engine.speculator.decoders["eagle"].drafter
    # 20 tokens: the drafts after the decode token still fit its second block.
    engine.add_request("r", PROMPTS[3][:20], SamplingParams(temperature=0, max_tokens=8))
    engine.step()  # the prefill: the target's features of every prompt position are in
    (seq,) = engine.scheduler.running
    log = drafter._logs[seq]
    n = seq.num_tokens - 1  # the decode token's position
    assert (log.start, len(log.features)) == (0, n)
    features = log.features.clone()
    drafter.begin_round(seq)
    outputs = []
    for chain in ([], [17], [17, 23]):
        drafter.forward([seq], {seq: chain}, {seq: 1})
        outputs.append(drafter._logs[seq].guess.clone())
    tokens = seq.token_ids + [17, 23]
    model = engine.model
    embeddings = model.embed(torch.tensor(tokens))[None]
    padded = torch.cat([features, torch.zeros(3, features.shape[1])])[None]
    rope = model.rope.lookup(torch.arange(len(tokens)))
    network = drafter_network(drafter_dir)
    reference = unrolled_outputs(network, rope, embeddings, padded, depth=3)
    for depth, got in enumerate(outputs, start=1):
        # Depth s's first draft entry sits at n + s - 1.
        expected = reference[depth - 1][0, n + depth - 1]
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


def test_the_layer_through_the_cpp_stack_equals_the_python_layer(tiny_model_dir, drafter_dir):
    """With int8 projections in the kernels' layout the drafter's layer runs as a one-layer
    C++ stack; its guesses must be the Python layer's, bit for bit."""
    from engine.kernels.build import load_kernels

    if not load_kernels():
        pytest.skip("no C++ kernels on this machine")
    if drafter_network(drafter_dir).input_norm is None:
        # The stack normalises before attention: a layer without that norm runs in Python.
        engine = eagle_llm(tiny_model_dir, drafter_dir).engine
        assert engine.speculator.decoders["eagle"].drafter.stack is None
        return
    guesses = []
    for use_stack in (True, False):
        engine = eagle_llm(tiny_model_dir, drafter_dir).engine
        drafter = engine.speculator.decoders["eagle"].drafter
        assert drafter.stack is not None
        if not use_stack:
            drafter.stack = None
        engine.add_request("r", PROMPTS[3][:20], SamplingParams(temperature=0, max_tokens=8))
        engine.step()
        (seq,) = engine.scheduler.running
        drafter.begin_round(seq)
        outputs = []
        for chain in ([], [17], [17, 23]):
            logits = drafter.forward([seq], {seq: chain}, {seq: 1}, compact=True)
            outputs.append((drafter._logs[seq].guess.clone(), logits))
        guesses.append(outputs)
    for (a, la), (b, lb) in zip(*guesses, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)


def drafter_network(drafter_dir):
    from engine.decoders.drafter_files import TrainedDrafter
    from engine.decoders.eagle import EagleNetwork

    return TrainedDrafter.load(drafter_dir, "eagle", EagleNetwork).network


def test_entries_read_the_target_features_once_verified(tiny_model_dir, drafter_dir):
    llm = eagle_llm(tiny_model_dir, drafter_dir)
    engine = llm.engine
    drafter = engine.speculator.decoders["eagle"].drafter
    engine.add_request("r", PROMPTS[0], SamplingParams(temperature=0, max_tokens=20))
    for _ in range(4):
        engine.step()
    (seq,) = engine.scheduler.running
    state, log = drafter._states[seq], drafter._logs[seq]
    # Entries stand up to the decode token of the last round; the features from one before
    # the first entry to recompute on are kept, up to the newest token's predecessor.
    assert log.start == state.num_cached - 1
    assert log.start + len(log.features) == seq.num_tokens - 1
    from tooling.training.self_distillation import sequence_features

    (reference,) = sequence_features(engine.model, [seq.token_ids[:-1]])
    torch.testing.assert_close(log.features, reference[log.start :], atol=1e-4, rtol=1e-4)


def test_greedy_equals_autoregressive_batched_preempted_and_aborted(tiny_model_dir, drafter_dir):
    check_greedy_identity_batched_preempted_aborted(
        tiny_model_dir,
        lambda **overrides: eagle_llm(tiny_model_dir, drafter_dir, **overrides),
        require_accepted=False,
    )


def test_train_learns_resumes_and_writes_a_drafter_the_decoder_loads(tiny_model_dir, tmp_path):
    llm = LLM(model=str(tiny_model_dir), kv_cache={"num_blocks": 256})
    train = [[(7 * i + j) % 300 + 10 for j in range(12)] for i in range(24)]
    held = [[(11 * i + 5 * j) % 300 + 10 for j in range(12)] for i in range(4)]
    options = EagleTrainOptions(
        output=tmp_path / "drafter",
        max_tokens=24,
        depth=2,
        draft_vocab_size=64,
        top_k=2,
        epochs=1,
        batch_size=8,
        learning_rate=3e-3,
        prompts=(train, held),
    )
    first = run_train_eagle(llm, options)
    options.epochs, options.resume = 4, True
    drafter = run_train_eagle(llm, options)
    assert first.info["resumed_after_epoch"] == 0
    assert drafter.info["resumed_after_epoch"] == 1
    losses = first.info["epoch_losses"] + drafter.info["epoch_losses"]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert len(drafter.accuracies) == 2 and len(drafter.accuracies[0]) == 2
    expected = llm.generate(PROMPTS[:2], GREEDY)
    got = eagle_llm(tiny_model_dir, options.output).generate(PROMPTS[:2], GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def test_steps_without_drafts_run_plain_and_still_hand_out_features(tiny_model_dir, drafter_dir):
    # A feature-reading decoder must see every step's features, but a step that drafts
    # nothing (the policy's usual choice under load) has nothing to verify: it samples as
    # plain decoding does, without the rejection sampler.
    llm = eagle_llm(tiny_model_dir, drafter_dir)
    engine = llm.engine
    spec = engine.speculator
    drafter = spec.decoders["eagle"].drafter
    plan, verify = spec.plan, spec.rejection_sampler
    steps, verified = [0], []
    spec.plan = lambda running: plan(running) if steps[0] % 3 == 0 else {}
    spec.rejection_sampler = lambda logits, runs: verified.append(steps[0]) or verify(logits, runs)
    engine.add_request("r", PROMPTS[0], SamplingParams(temperature=0, max_tokens=20))
    for steps[0] in range(1, 10):
        engine.step()
    assert verified and all(step % 3 == 0 for step in verified)
    (seq,) = engine.scheduler.running
    log = drafter._logs[seq]
    assert log.start + len(log.features) == seq.num_tokens - 1  # no step's features missed
    from tooling.training.self_distillation import sequence_features

    (reference,) = sequence_features(engine.model, [seq.token_ids[:-1]])
    torch.testing.assert_close(log.features, reference[log.start :], atol=1e-4, rtol=1e-4)
    while engine.has_unfinished_requests():
        engine.step()
    params = SamplingParams(temperature=0, max_tokens=20)
    expected = LLM(model=str(tiny_model_dir)).generate([PROMPTS[0]], params)[0].token_ids
    assert seq.output_token_ids == expected


def test_a_prefix_hit_reuses_only_the_entries_the_drafter_computed_for_those_blocks(
    tiny_model_dir, drafter_dir
):
    """The drafter's entries in shared blocks are reused on a prefix-cache hit when it
    computed them for that content (noise put there changes the drafts), and read again
    when the request that filled the blocks never drafted (noise there changes nothing)."""

    def first_draft(first_drafted: bool, seed: int) -> torch.Tensor:
        def make(**overrides):
            return eagle_llm(tiny_model_dir, drafter_dir, **overrides)

        return first_draft_after_a_prefix_hit(
            make, "eagle", lambda drafter: drafter.kv_cache, first_drafted, seed
        )

    assert torch.equal(first_draft(False, 1), first_draft(False, 2))
    assert not torch.allclose(first_draft(True, 1), first_draft(True, 2))


def test_requests_first_drafting_together_over_shared_blocks_read_the_fresh_entries(
    tiny_model_dir, drafter_dir
):
    """A request re-reading a prefix hit it has no entries for skips the blocks another
    request of the same pass writes from the target's features, and drafts as it would over
    entries recorded earlier (two writers of a slot in one pass leave either's)."""

    def first_draft(together: bool) -> torch.Tensor:
        def make(**overrides):
            return eagle_llm(tiny_model_dir, drafter_dir, quantization="none", **overrides)

        return first_draft_sharing_a_prefix(make, "eagle", together)

    torch.testing.assert_close(first_draft(True), first_draft(False), atol=1e-3, rtol=1e-3)
