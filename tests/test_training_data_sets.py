"""Several data sets learnt from together (`specserve train KIND --data A --data B`): a user's
conversations beside specserve's own set. The splits are the sets' in order, each set capped
by --data-tokens, and the layer outputs kept beside each set's shards are read from that set."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine import LLM
from tooling.training.data import training_splits
from tooling.training.layer_cache import split_layer_features
from tooling.training.self_distillation import sequence_features
from tooling.training.shards import Recipe, build, layer_directory, load_split


@pytest.fixture(scope="module")
def two_sets(tiny_chat_model_dir, tmp_path_factory):
    """Two `train data` directories of the tiny chat model, made with different seeds."""
    llm = LLM(
        model=str(tiny_chat_model_dir),
        decoder={"method": "autoregressive", "load_shipped_drafters": False},
    )
    roots = []
    for seed in (0, 1):
        root = tmp_path_factory.mktemp(f"set{seed}")
        recipe = Recipe(target={"model": "tiny"}, seed=seed, shard_requests=3,
                        answers_per_request=2, max_tokens=12, follow_up_max_tokens=6,
                        follow_up_share=0.5)  # fmt: skip
        build(llm, root, recipe, budget=1)
        roots.append(root)
    return llm, roots


def _options(roots, **more):
    return SimpleNamespace(**{"data": tuple(roots), "data_tokens": None, "data_from": None, **more})


def test_the_splits_are_each_sets_in_order(two_sets):
    llm, roots = two_sets
    a, b = (load_split(root / "train") for root in roots)
    assert a.sequences != b.sequences  # two different sets
    splits = training_splits(llm, _options(roots))
    train = splits["train"]
    assert train.sequences == a.sequences + b.sequences
    assert train.spans == a.spans + b.spans
    assert train.temperatures == a.temperatures + b.temperatures
    assert [(s.directory, s.first, s.count) for s in train.sources] == [
        (roots[0] / "train", 0, len(a.sequences)),
        (roots[1] / "train", 0, len(b.sequences)),
    ]
    held = [load_split(root / "held_out") for root in roots]
    assert splits["held_out"].sequences == held[0].sequences + held[1].sequences
    # One set: that set alone, as before sets could be joined.
    assert training_splits(llm, _options(roots[1:]))["train"].sequences == b.sequences


def test_data_tokens_caps_each_set_and_data_from_needs_one_set(two_sets):
    llm, roots = two_sets
    a, b = (load_split(root / "train") for root in roots)
    cap = a.answer_tokens(0) + 1  # the first conversation and the one that crosses the cap
    capped = training_splits(llm, _options(roots, data_tokens=cap))["train"]
    assert capped.sequences == a.sequences[:2] + b.sequences[: len(load_split(
        roots[1] / "train", cap).sequences)]  # fmt: skip
    assert [s.count for s in capped.sources] == [2, len(capped.sequences) - 2]
    with pytest.raises(ValueError, match="give one --data"):
        training_splits(llm, SimpleNamespace(data=tuple(roots), data_tokens=None, data_from=5))


def test_layer_outputs_are_read_from_each_sets_own_shards(two_sets):
    llm, roots = two_sets
    model, layers = llm.engine.model, (1, 0)
    train = training_splits(llm, _options(roots))["train"]
    rows = split_layer_features(model, train, layers)
    assert len(rows) == len(train.sequences)
    for root in roots:  # kept beside each set's own shards
        assert any(layer_directory(root / "train", layers).iterdir())
    for tokens, kept in zip(train.sequences, rows, strict=True):
        (expected,) = sequence_features(model, [tokens], layer=layers)
        torch.testing.assert_close(kept.float(), expected, atol=2e-3, rtol=2e-3)
    again = split_layer_features(model, train, layers)  # read back, the same rows
    assert all(torch.equal(x, y) for x, y in zip(rows, again, strict=True))


def test_a_drafters_record_names_every_set(two_sets, tmp_path):
    from tooling.training.epochs import _data_description, _option_text

    _, roots = two_sets
    conversations = tmp_path / "mine"
    conversations.mkdir()
    (conversations / "recipe.json").write_text('{"source": {"file": "support-chats.jsonl"}}')
    text = _data_description(_options([roots[0], conversations]))
    own, theirs = text.split("; ")
    assert f"own conversations in {roots[0].name}" in own
    assert "conversations of support-chats.jsonl" in theirs
    assert _option_text(tuple(roots)) == f"{roots[0]},{roots[1]}"
