"""Training on from a drafter that exists (`specserve train KIND --init-from DIR --data-from N`):
the data a drafter has already learnt from is left out by whole shards and conversations, and
a run starts from the drafter's own weights and draft vocabulary."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engine import LLM
from tooling.training.shards import (
    Recipe,
    build,
    layer_directory,
    load_shard,
    load_split,
    shard_paths,
)

TRAIN = [[(7 * i + j) % 300 + 10 for j in range(12)] for i in range(24)]
HELD = [[(11 * i + 5 * j) % 300 + 10 for j in range(12)] for i in range(4)]


@pytest.fixture(scope="module")
def two_shards(tiny_chat_model_dir, tmp_path_factory):
    """A `train data` directory of two training shards (the tiny chat model's answers)."""
    llm = LLM(
        model=str(tiny_chat_model_dir),
        decoder={"method": "autoregressive", "load_shipped_drafters": False},
    )
    root = tmp_path_factory.mktemp("data")
    recipe = Recipe(target={"model": "tiny"}, shard_requests=3, answers_per_request=2,
                    max_tokens=12, follow_up_max_tokens=6, follow_up_share=1.0)  # fmt: skip
    build(llm, root, recipe, budget=1)
    one = load_split(root / "train")
    build(llm, root, recipe, budget=sum(map(one.answer_tokens, range(len(one.sequences)))) + 1)
    assert len(shard_paths(root / "train")) == 2
    return llm, root


def test_data_from_leaves_out_the_conversations_that_start_before_it(two_shards):
    _, root = two_shards
    everything = load_split(root / "train")
    in_first_shard = len(load_shard(shard_paths(root / "train")[0]))
    seen = sum(everything.answer_tokens(i) for i in range(in_first_shard))
    rest = load_split(root / "train", skip_answer_tokens=seen)
    assert rest.sources[0].first == in_first_shard
    assert rest.sequences == everything.sequences[in_first_shard:]
    assert rest.spans == everything.spans[in_first_shard:]
    # A conversation that starts before the cut is left out whole.
    assert load_split(root / "train", skip_answer_tokens=1).sources[0].first == 1
    # Both counts run from the first shard: the range [seen, seen + 1) is one conversation.
    assert len(load_split(root / "train", seen + 1, seen).sequences) == 1


def test_layer_outputs_of_left_out_shards_are_never_computed(two_shards, monkeypatch):
    from tooling.training import layer_cache
    from tooling.training.layer_cache import cached_layer_features
    from tooling.training.self_distillation import sequence_features

    llm, root = two_shards
    model, layers = llm.engine.model, (1, 0)
    everything = load_split(root / "train")
    first = len(load_shard(shard_paths(root / "train")[0])) + 1  # into the second shard
    computed = []

    def counted(model, sequences, **kwargs):
        computed.append(len(sequences))
        return sequence_features(model, sequences, **kwargs)

    monkeypatch.setattr(layer_cache, "sequence_features", counted)
    rows = cached_layer_features(model, root / "train", layers, 2, first=first)
    assert computed == [len(load_shard(shard_paths(root / "train")[1]))]
    assert [p.name for p in layer_directory(root / "train", layers).iterdir()] == [
        shard_paths(root / "train")[1].name
    ]
    assert len(rows) == 2
    for tokens, kept in zip(everything.sequences[first : first + 2], rows, strict=True):
        (expected,) = sequence_features(model, [tokens], layer=layers)
        torch.testing.assert_close(kept.float(), expected, atol=2e-3, rtol=2e-3)


def _tensors(directory) -> dict:
    return load_file(str(directory / "drafter.safetensors"))


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), kv_cache={"num_blocks": 256})


def test_an_eagle3_run_starts_from_the_drafter_it_is_given(target, tmp_path):
    from tooling.training.train_eagle3 import Eagle3TrainOptions, run_train_eagle3

    common = dict(max_tokens=24, depth=2, top_k=2, epochs=1, batch_size=8,
                  prompts=(TRAIN, HELD))  # fmt: skip
    first = run_train_eagle3(target, Eagle3TrainOptions(
        output=tmp_path / "first", draft_vocab_size=64, learning_rate=3e-3,
        feature_layers=(0, 1, 2), **common,
    ))  # fmt: skip
    # Learning rate 0: the run keeps exactly what it started from (not a fresh network), with
    # the first drafter's vocabulary although it asks for another size.
    again = run_train_eagle3(target, Eagle3TrainOptions(
        output=tmp_path / "again", draft_vocab_size=32, learning_rate=0.0,
        init_from=str(tmp_path / "first"), **common,
    ))  # fmt: skip
    assert torch.equal(again.draft_vocab, first.draft_vocab)
    assert again.network.shape["feature_layers"] == [0, 1, 2]
    before, after = _tensors(tmp_path / "first"), _tensors(tmp_path / "again")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)
    started = again.info["started_from"]
    assert started["drafter"] == str(tmp_path / "first")
    assert started["training_answer_tokens"] == first.info["training_answer_tokens"]
    # A third run in the chain counts what both before it learnt from.
    third = run_train_eagle3(target, Eagle3TrainOptions(
        output=tmp_path / "third", learning_rate=0.0, init_from=str(tmp_path / "again"),
        **common,
    ))  # fmt: skip
    assert third.info["started_from"]["training_answer_tokens"] == (
        first.info["training_answer_tokens"] + again.info["training_answer_tokens"]
    )
    # Options that shape the network must agree with the drafter's.
    refused = r"feature_layers \[0, 1, 2\], this run asks for \[0, 1, 1\]"
    with pytest.raises(ValueError, match=refused):
        run_train_eagle3(target, Eagle3TrainOptions(
            output=tmp_path / "other", init_from=str(tmp_path / "first"),
            feature_layers=(0, 1, 1), **common,
        ))  # fmt: skip


def test_heads_train_on_from_their_drafter(target, tmp_path):
    from tooling.training.train_heads import HeadsTrainOptions, run_train_heads

    common = dict(kind="medusa", max_tokens=24, num_heads=2, top_k=2, epochs=1, batch_size=32,
                  prompts=(TRAIN, HELD))  # fmt: skip
    first = run_train_heads(target, HeadsTrainOptions(
        output=tmp_path / "first", draft_vocab_size=64, learning_rate=3e-3, **common
    ))  # fmt: skip
    # A few steps on from the first drafter: they move its weights, not a fresh network's.
    again = run_train_heads(target, HeadsTrainOptions(
        output=tmp_path / "again", learning_rate=1e-4, init_from=str(tmp_path / "first"),
        **common,
    ))  # fmt: skip
    assert torch.equal(again.draft_vocab, first.draft_vocab)
    before, after = _tensors(tmp_path / "first"), _tensors(tmp_path / "again")
    moved = [(after[n].float() - before[n].float()).abs().max().item() for n in before if
             n.startswith("network.")]  # fmt: skip
    assert 0 < max(moved) < 0.05
    with pytest.raises(ValueError, match="num_heads 2, this run asks for 3"):
        run_train_heads(target, HeadsTrainOptions(
            output=tmp_path / "other", init_from=str(tmp_path / "first"),
            **{**common, "num_heads": 3},
        ))  # fmt: skip


def test_the_command_line_checks_the_data_range(tiny_chat_model_dir, tmp_path, capsys):
    from tooling.cli import main

    base = ["train", "eagle3", "--model", str(tiny_chat_model_dir), "--output", str(tmp_path)]
    assert main([*base, "--data-from", "1M"]) == 2
    assert "--data-from leaves out part of --data: give --data" in capsys.readouterr().err
    with_data = [*base, "--data", str(tmp_path), "--data-tokens", "1M"]
    assert main([*with_data, "--data-from", "2M"]) == 2
    assert "--data-from must be below --data-tokens" in capsys.readouterr().err
    two_sets = [*base, "--data", str(tmp_path), "--data", str(tmp_path), "--data-from", "1M"]
    assert main(two_sets) == 2
    assert "--data-from leaves out the start of one set: give one --data" in capsys.readouterr().err


def test_a_grown_vocabulary_keeps_the_start_and_adds_the_most_frequent_labels():
    from tooling.training.warm_start import grown_vocabulary

    start = torch.tensor([5, 3])
    labels = torch.tensor([1, 1, 1, 2, 2, 3, 5, 5, 7, -1, -100])
    assert grown_vocabulary(start, labels, 4).tolist() == [5, 3, 1, 2]
    assert grown_vocabulary(start, labels, 1).tolist() == [5, 3]  # never cut
    assert grown_vocabulary(start, labels, 10).tolist() == [5, 3, 1, 2, 7]  # labels that occur


def test_an_eagle3_warm_start_grows_its_head_with_the_targets_rows(target, tmp_path):
    from engine.toolkit import SamplingParams, dense_weight
    from tooling.training.train_eagle3 import Eagle3TrainOptions, run_train_eagle3

    common = dict(max_tokens=24, depth=2, top_k=2, epochs=1, batch_size=8,
                  prompts=(TRAIN, HELD), feature_layers=(0, 1, 2))  # fmt: skip
    first = run_train_eagle3(target, Eagle3TrainOptions(
        output=tmp_path / "first", draft_vocab_size=24, learning_rate=3e-3, **common,
    ))  # fmt: skip
    grown = run_train_eagle3(target, Eagle3TrainOptions(
        output=tmp_path / "grown", draft_vocab_size=48, learning_rate=0.0,
        init_from=str(tmp_path / "first"), **common,
    ))  # fmt: skip
    vocab = grown.draft_vocab
    assert torch.equal(vocab[:24], first.draft_vocab)
    assert 24 < len(vocab) <= 48 and len(set(vocab.tolist())) == len(vocab)
    assert grown.network.shape["draft_vocab_size"] == len(vocab)
    before, after = _tensors(tmp_path / "first"), _tensors(tmp_path / "grown")
    (head,) = [name for name in after if name.endswith("lm_head.weight")]
    assert after[head].shape[0] == len(vocab)
    torch.testing.assert_close(after[head][:24].float(), before[head].float())  # as trained
    new_rows = dense_weight(target.engine.model.lm_head)[vocab[24:]].float()
    torch.testing.assert_close(after[head][24:].float(), new_rows, atol=1e-2, rtol=1e-2)
    # The engine drafts with it, and the output stays the target's.
    llm = LLM(model=str(target.model_dir), kv_cache={"num_blocks": 256},
              decoder={"method": "eagle3", "eagle3": {"drafter": str(tmp_path / "grown")},
                       "draft_policy": "fixed", "num_speculative_tokens": 2})  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [TRAIN[0][:6], HELD[1][:6]]
    drafted = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    plain = [o.outputs[0].token_ids for o in target.generate(prompts, params)]
    assert drafted == plain
    assert llm.engine.speculator.stats.num_draft_tokens > 0
