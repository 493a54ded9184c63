"""EAGLE-3: the target hands over several layers' outputs in one pass, the drafter's paged
forward equals its training form at every depth it is trained on, greedy identity through the
engine (chains and trees, batched, preempted, aborted), and `specserve train eagle3` on a tiny
model. The public layout's round trip and refusals are in tests/test_public_drafters.py."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.decoder_checks import check_greedy_identity_batched_preempted_aborted
from tests.tiny_models import save_eagle3_drafter
from tooling.training.train_eagle import unrolled_outputs

pytestmark = pytest.mark.usefixtures("single_torch_thread")

PROMPTS = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 9 + [14], [3] * 12, [40 + i % 9 for i in range(30)]]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def drafter_dir(tiny_model_dir, tmp_path_factory):
    return save_eagle3_drafter(tiny_model_dir, tmp_path_factory.mktemp("eagle3") / "drafter")


def eagle3_llm(model_dir, drafter, quantization="int8", tree_top_k=0, **overrides) -> LLM:
    section = {"drafter": str(drafter), "quantization": quantization, "tree_top_k": tree_top_k}
    decoder = {"method": "eagle3", "eagle3": section, "num_speculative_tokens": 4,
               "draft_policy": "fixed"}  # fmt: skip
    return LLM(model=str(model_dir), decoder=decoder, **overrides)


def _network(drafter_dir):
    from engine.decoders.drafter_files import TrainedDrafter
    from engine.decoders.eagle3 import Eagle3Network

    return TrainedDrafter.load(drafter_dir, "eagle3", Eagle3Network).network


def _layer_outputs(model, tokens: list[int], layers) -> torch.Tensor:
    """[len, len(layers) * d]: the outputs of ``layers``, one pass each, side by side."""
    from tooling.training.self_distillation import sequence_features

    return torch.cat([sequence_features(model, [tokens], layer=i)[0] for i in layers], dim=1)


def test_one_pass_captures_several_layers_side_by_side(tiny_model_dir):
    from tooling.training.self_distillation import sequence_features

    model = LLM(model=str(tiny_model_dir)).engine.model
    tokens = PROMPTS[3]
    (together,) = sequence_features(model, [tokens], layer=(2, 0))
    torch.testing.assert_close(together, _layer_outputs(model, tokens, (2, 0)))
    assert together.shape[1] == 2 * model.arch.hidden_size


def test_paged_drafting_equals_the_unrolled_training_form(tiny_model_dir, drafter_dir):
    llm = eagle3_llm(tiny_model_dir, drafter_dir, quantization="none")  # as trained
    engine = llm.engine
    drafter = engine.speculator.decoders["eagle3"].drafter
    network = _network(drafter_dir)
    engine.add_request("r", PROMPTS[3][:20], SamplingParams(temperature=0, max_tokens=8))
    engine.step()  # the prefill: the target's layers at every prompt position are in
    (seq,) = engine.scheduler.running
    n = seq.num_tokens - 1  # the decode token's position
    layers = network.shape["feature_layers"]
    with torch.no_grad():
        fused = network.fuse(_layer_outputs(engine.model, seq.token_ids[:-1], layers))
    torch.testing.assert_close(drafter._logs[seq].features, fused, atol=1e-4, rtol=1e-4)
    drafter.begin_round(seq)
    outputs, logits = [], []
    for chain in ([], [17], [17, 23]):
        logits.append(drafter.forward([seq], {seq: chain}, {seq: 1}, compact=True)[0])
        outputs.append(drafter._logs[seq].guess.clone())
    tokens = seq.token_ids + [17, 23]
    model = engine.model
    embeddings = model.embed(torch.tensor(tokens))[None]
    padded = torch.cat([fused, torch.zeros(3, fused.shape[1])])[None]
    rope = model.rope.lookup(torch.arange(len(tokens)))
    with torch.no_grad():
        reference = unrolled_outputs(network, rope, embeddings, padded, depth=3)
    for depth, (got, scores) in enumerate(zip(outputs, logits, strict=True), start=1):
        expected = reference[depth - 1][0, n + depth - 1]  # depth s's entry sits at n + s - 1
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
        with torch.no_grad():
            head = network.logits(expected[None])[0]
        torch.testing.assert_close(scores, head, atol=2e-3, rtol=1e-3)


def test_the_drafter_layer_runs_in_the_cpp_stack_as_in_python(tiny_model_dir, drafter_dir):
    # int8 projections in the kernels' layout: the layer runs in one C++ call whose q/k/v
    # read the entry ([norm(embedding); norm(feature)]) and whose residual is the feature.
    llm = eagle3_llm(tiny_model_dir, drafter_dir)
    engine = llm.engine
    drafter = engine.speculator.decoders["eagle3"].drafter
    assert drafter.stack is not None
    engine.add_request("r", PROMPTS[3][:20], SamplingParams(temperature=0, max_tokens=8))
    engine.step()
    (seq,) = engine.scheduler.running
    drafter.begin_round(seq)
    drafter.forward([seq], {seq: []}, {seq: 1})  # the prompt's entries (a long run: Python)
    log = drafter._logs[seq]
    start, guess, guess_position = drafter._states[seq].num_cached, log.guess, log.guess_position
    calls = []
    run = drafter.stack.run

    def spy(*args, **kwargs):
        calls.append(run(*args, **kwargs)[0])
        return calls[-1], None

    drafter.stack.run = spy
    outputs = {}
    for use_stack in (True, False):
        # the same entries again, on the same cache, from the same guess
        drafter._states[seq].num_cached = start
        log.guess, log.guess_position = guess, guess_position
        stack = drafter.stack
        drafter.stack = stack if use_stack else None
        try:
            outputs[use_stack] = drafter.forward([seq], {seq: [17, 23]}, {seq: 3}, compact=True)
        finally:
            drafter.stack = stack
    assert calls == [True]
    torch.testing.assert_close(outputs[True], outputs[False], atol=1e-4, rtol=1e-4)


def test_the_decoder_asks_for_its_layers_and_eagle_for_the_last(tiny_model_dir, drafter_dir):
    llm = eagle3_llm(tiny_model_dir, drafter_dir)
    spec = llm.engine.speculator
    assert spec.decoders["eagle3"].feature_layers(3) == (0, 1, 2)
    assert spec.loaded_feature_layers() == (0, 1, 2)


def test_a_drafter_reading_layers_the_target_lacks_is_refused(tiny_model_dir, tmp_path):
    path = save_eagle3_drafter(tiny_model_dir, tmp_path / "deep", feature_layers=(1, 5, 9))
    with pytest.raises(ValueError, match=r"reads layers \[1, 5, 9\]; the target has 3"):
        eagle3_llm(tiny_model_dir, path)


@pytest.mark.parametrize("tree_top_k", [0, 2], ids=["chains", "trees"])
def test_greedy_equals_autoregressive_batched_preempted_and_aborted(
    tiny_model_dir, drafter_dir, tree_top_k
):
    check_greedy_identity_batched_preempted_aborted(
        tiny_model_dir,
        lambda **overrides: eagle3_llm(
            tiny_model_dir, drafter_dir, tree_top_k=tree_top_k, **overrides
        ),  # fmt: skip
        require_accepted=False,
    )


def test_a_draft_vocabulary_maps_back_to_target_tokens(tiny_model_dir, tmp_path):
    vocab = torch.tensor([40, 3, 17, 5, 6, 7, 8, 9, 23, 11, 12, 13, 14, 41, 42])  # by frequency
    path = save_eagle3_drafter(tiny_model_dir, tmp_path / "small", draft_vocab=vocab)
    llm = eagle3_llm(tiny_model_dir, path, quantization="none")  # its head as trained
    engine = llm.engine
    drafter = engine.speculator.decoders["eagle3"].drafter
    engine.add_request("r", PROMPTS[0], SamplingParams(temperature=0, max_tokens=8))
    engine.step()
    (seq,) = engine.scheduler.running
    drafter.begin_round(seq)
    logits = drafter.forward([seq], {seq: []}, {seq: 1})
    finite = logits[0].isfinite().nonzero().flatten()
    assert finite.tolist() == sorted(vocab.tolist())  # every other token is -inf: never drafted
    # Head row i scores the i-th token of the vocabulary as trained, whatever order the
    # drafting loop keeps it in (the bug this pins: rows read against the sorted vocabulary).
    network = _network(path)
    with torch.no_grad():
        rows = network.logits(drafter._logs[seq].guess[None])[0]
    torch.testing.assert_close(logits[0][vocab], rows, atol=2e-4, rtol=1e-4)
    expected = LLM(model=str(tiny_model_dir)).generate(PROMPTS[:2], GREEDY)
    got = llm.generate(PROMPTS[:2], GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def test_train_learns_and_writes_a_drafter_the_decoder_loads(tiny_model_dir, tmp_path):
    from tooling.training.train_eagle3 import Eagle3TrainOptions, run_train_eagle3

    llm = LLM(model=str(tiny_model_dir), kv_cache={"num_blocks": 256})
    train = [[(7 * i + j) % 300 + 10 for j in range(12)] for i in range(24)]
    held = [[(11 * i + 5 * j) % 300 + 10 for j in range(12)] for i in range(4)]
    options = Eagle3TrainOptions(
        output=tmp_path / "drafter", max_tokens=24, depth=2, draft_vocab_size=64, top_k=2,
        epochs=4, batch_size=8, learning_rate=3e-3, prompts=(train, held),
        feature_layers=(0, 1, 2),
    )  # fmt: skip
    drafter = run_train_eagle3(llm, options)
    losses = drafter.info["epoch_losses"]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert drafter.network.shape["feature_layers"] == [0, 1, 2]
    assert len(drafter.draft_vocab) == drafter.network.shape["draft_vocab_size"] <= 64
    assert len(drafter.accuracies) == 2 and len(drafter.accuracies[0]) == 2
    expected = llm.generate(PROMPTS[:2], GREEDY)
    got = eagle3_llm(tiny_model_dir, options.output).generate(PROMPTS[:2], GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def test_int4_projections_run_in_the_stack_and_leave_greedy_output_unchanged(
    tiny_model_dir, drafter_dir
):
    # int4: the target's own 4-bit kernels for the drafter's projections and its LM-head rows,
    # about half int8's bytes a draft; drafts may differ a little, output may not.
    from engine.models.quantized_linear import QuantizedLinear

    llm = eagle3_llm(tiny_model_dir, drafter_dir, quantization="int4")
    drafter = llm.engine.speculator.decoders["eagle3"].drafter
    assert drafter.stack is not None
    int8 = eagle3_llm(tiny_model_dir, drafter_dir).engine.speculator.decoders["eagle3"].drafter
    for name in ("qkv", "o", "gate_up", "down"):
        four, eight = getattr(drafter.layer, name), getattr(int8.layer, name)
        assert isinstance(four, QuantizedLinear) and isinstance(eight, QuantizedLinear)
        assert four.nbytes < 0.75 * eight.nbytes
    check_greedy_identity_batched_preempted_aborted(
        tiny_model_dir,
        lambda **overrides: eagle3_llm(tiny_model_dir, drafter_dir, "int4", **overrides),
        require_accepted=False,
    )
