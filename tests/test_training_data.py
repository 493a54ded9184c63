"""The self-distillation set at scale (`specserve train data`): its requests, its shards, and a
build that continues after an interruption with the same data."""

from __future__ import annotations

import argparse
import random

import pytest
import torch

from tooling.cli_train import parse_token_count
from tooling.training import prompt_mix
from tooling.training.self_distillation import answer_mask
from tooling.training.shards import (
    Recipe,
    _continued,
    _user_turn,
    build,
    load_shard,
    load_split,
    shard_paths,
)

SMALL = dict(shard_requests=3, answers_per_request=2, max_tokens=12, follow_up_max_tokens=6,
             follow_up_share=1.0)  # fmt: skip


@pytest.fixture(scope="module")
def chat_llm(tiny_chat_model_dir):
    from engine import LLM

    return LLM(
        model=str(tiny_chat_model_dir),
        decoder={"method": "autoregressive", "load_shipped_drafters": False},
    )


def test_held_out_subjects_are_never_training_subjects():
    train, held = set(prompt_mix.subjects("train")), set(prompt_mix.subjects("held_out"))
    assert train and held and not train & held
    assert train | held == set(prompt_mix.SUBJECTS)
    rng = random.Random(0)
    drawn = {prompt_mix.request(rng, "held_out").subject for _ in range(200)}
    assert drawn <= held and len(drawn) > 10


def test_requests_are_reproducible_and_never_a_benchmark_prompt(monkeypatch):
    a = [prompt_mix.request(random.Random(7), "train") for _ in range(3)]
    b = [prompt_mix.request(random.Random(7), "train") for _ in range(3)]
    assert a == b
    # A benchmark prompt the generator would produce is skipped, not returned.
    first = prompt_mix.request(random.Random(1), "train", follow_up_share=0).message
    monkeypatch.setattr(prompt_mix, "benchmark_prompts", lambda: {first})
    assert prompt_mix.request(random.Random(1), "train", follow_up_share=0).message != first


def test_the_real_benchmark_prompts_are_read():
    assert "Write a short poem about the sea." in prompt_mix.benchmark_prompts()


def test_token_counts_parse_with_suffixes():
    assert parse_token_count("10M") == 10_000_000
    assert parse_token_count("2.5m") == 2_500_000
    assert parse_token_count("400k") == 400_000
    assert parse_token_count("123") == 123
    for bad in ("ten", "0", "-1k"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_token_count(bad)


def _recipe(**overrides) -> Recipe:
    return Recipe(target={"model": "tiny"}, **{**SMALL, **overrides})


def _contents(directory):
    return [
        [(c.tokens, c.spans, c.temperature, c.features) for c in load_shard(p)]
        for p in shard_paths(directory)
    ]


def _same(a, b) -> bool:
    if len(a) != len(b):
        return False
    for shard_a, shard_b in zip(a, b, strict=True):
        for (ta, sa, pa, fa), (tb, sb, pb, fb) in zip(shard_a, shard_b, strict=True):
            if ta != tb or sa != sb or pa != pb or not torch.equal(fa, fb):
                return False
    return len(a) > 0


def test_an_interrupted_build_continues_with_the_same_data(chat_llm, tmp_path):
    recipe = _recipe()
    whole = build(chat_llm, tmp_path / "whole", recipe, budget=150)
    # Interrupted: one shard done, a second one half-written (a temporary file) when it stopped.
    build(chat_llm, tmp_path / "resumed", recipe, budget=1)
    assert len(shard_paths(tmp_path / "resumed" / "train")) == 1
    (tmp_path / "resumed" / "train" / "shard-00001.tmp").write_bytes(b"half a shard")
    resumed = build(chat_llm, tmp_path / "resumed", recipe, budget=150)
    assert resumed == whole >= 150
    for split in ("train", "held_out"):
        assert _same(_contents(tmp_path / "whole" / split), _contents(tmp_path / "resumed" / split))


def test_a_build_from_a_later_shard_makes_the_shards_a_whole_build_makes_there(
    chat_llm, tmp_path, capsys
):
    """``--first-shard``: a set goes on past shards made before (a drafter learned from them)
    with exactly the shards a build from the start makes at those indices."""
    recipe = _recipe()
    build(chat_llm, tmp_path / "whole", recipe, budget=150)
    made = shard_paths(tmp_path / "whole" / "train")
    assert len(made) >= 3
    later = build(chat_llm, tmp_path / "later", recipe, budget=1, first_shard=2)
    assert [p.name for p in shard_paths(tmp_path / "later" / "train")] == [made[2].name]
    assert later == sum(c.answer_tokens for c in load_shard(made[2]))
    third = _contents(tmp_path / "whole" / "train")[2]
    assert _same(_contents(tmp_path / "later" / "train"), [third])
    from tooling.cli import main

    assert main(["train", "data", "--from", "x.jsonl", "--first-shard", "3"]) == 2
    assert "--first-shard: an index >= 0" in capsys.readouterr().err


def test_conversations_hold_both_turns_with_features_everywhere(chat_llm, tmp_path):
    build(chat_llm, tmp_path, _recipe(), budget=1)
    conversations = load_shard(shard_paths(tmp_path / "train")[0])
    assert {c.temperature for c in conversations} == {0.0, 0.7}  # greedy, then sampled
    two_turns = [c for c in conversations if len(c.spans) == 2]
    for c in conversations:
        hidden = chat_llm.engine.model.arch.hidden_size
        assert c.features.shape == (len(c.tokens), hidden) and c.features.dtype == torch.float16
        assert c.spans[-1][1] == len(c.tokens)
    for c in two_turns:  # the follow-up turn: the user's message between the two answers
        (a0, a1), (b0, b1) = c.spans
        between = chat_llm.tokenizer.decode(c.tokens[a1:b0])
        assert a1 < b0 and "user" in between and any(f in between for f in prompt_mix.FOLLOW_UPS)


def test_a_follow_up_extends_the_conversation_as_the_chat_template_writes_it(chat_llm):
    first = chat_llm.render_chat([{"role": "user", "content": "Hello"}])
    answer = chat_llm.tokenizer.encode("Hi there.", add_special_tokens=False)
    turn = _user_turn(chat_llm, "Can you make that shorter?")
    expected = chat_llm.render_chat([
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there."},
        {"role": "user", "content": "Can you make that shorter?"},
    ])  # fmt: skip
    assert _continued(first + answer, turn) == expected
    end = turn[0]  # an answer that stopped on the end-of-turn token keeps one of them
    assert _continued(first + answer + [end], turn) == expected


def test_a_split_masks_exactly_the_answer_turns(chat_llm, tmp_path):
    build(chat_llm, tmp_path, _recipe(), budget=1)
    split = load_split(tmp_path / "train")
    width = max(len(s) for s in split.sequences)
    mask = answer_mask(split, list(range(len(split.sequences))), width)
    for i, spans in enumerate(split.spans):
        expected = torch.zeros(width, dtype=torch.bool)
        for start, end in spans:
            expected[start - 1 : end - 1] = True  # positions whose next token is an answer's
        assert torch.equal(mask[i], expected)
    assert len(split.answer_labels()) == sum(
        split.answer_tokens(i) for i in range(len(split.sequences))
    )
    capped = load_split(tmp_path / "train", max_answer_tokens=1)
    assert len(capped.sequences) == 1


def test_another_recipe_in_the_same_directory_is_refused(chat_llm, tmp_path):
    build(chat_llm, tmp_path, _recipe(), budget=1)
    with pytest.raises(ValueError, match="another recipe .*max_tokens"):
        build(chat_llm, tmp_path, _recipe(max_tokens=13), budget=1)


def test_a_drafter_is_scored_on_a_data_sets_held_out_split(chat_llm, tiny_chat_model_dir,
                                                           tmp_path):  # fmt: skip
    from tests.tiny_models import save_eagle_drafter
    from tooling.training.train_eagle import evaluate_eagle

    build(chat_llm, tmp_path / "data", _recipe(), budget=1)
    drafter = save_eagle_drafter(tiny_chat_model_dir, tmp_path / "eagle")
    scores = evaluate_eagle(chat_llm, str(drafter), tmp_path / "data", depth=2, top_k=3)
    # the recipe answers each request greedily and sampled: scored over all and by kind
    assert set(scores) == {"all answers", "greedy answers", "sampled answers"}
    for accuracies in scores.values():
        assert len(accuracies) == 2 and all(len(row) == 3 for row in accuracies)
        assert all(0 <= a <= 1 for row in accuracies for a in row)
        assert sum(accuracies[0]) <= 1  # the top-3 candidates are distinct tokens


def test_eagle3s_layer_outputs_are_kept_beside_the_shards_and_read_back(chat_llm, tmp_path,
                                                                        monkeypatch):  # fmt: skip
    from tooling.training import layer_cache
    from tooling.training.layer_cache import cached_layer_features, layer_directory
    from tooling.training.self_distillation import sequence_features

    build(chat_llm, tmp_path, _recipe(), budget=1)
    split = load_split(tmp_path / "train")
    model, layers = chat_llm.engine.model, (1, 0)
    first = cached_layer_features(model, tmp_path / "train", layers, len(split.sequences))
    assert sorted(p.name for p in layer_directory(tmp_path / "train", layers).iterdir()) == [
        p.name for p in shard_paths(tmp_path / "train")
    ]
    for tokens, rows in zip(split.sequences, first, strict=True):
        (expected,) = sequence_features(model, [tokens], layer=layers)
        assert rows.dtype == torch.float16
        torch.testing.assert_close(rows.float(), expected, atol=2e-3, rtol=2e-3)

    def no_second_pass(*args, **kwargs):
        raise AssertionError("the kept layer outputs were computed again")

    monkeypatch.setattr(layer_cache, "sequence_features", no_second_pass)
    again = cached_layer_features(model, tmp_path / "train", layers, 2)
    assert len(again) == 2 and all(torch.equal(a, b) for a, b in zip(again, first, strict=False))


def test_kept_layers_are_what_a_second_pass_would_compute(chat_llm, tmp_path, monkeypatch):
    # `train data --keep-layers`: each new shard's layer outputs are written beside it from
    # the generating passes, and the layer cache reads them instead of running the model.
    from engine.sampling_params import SamplingParams
    from tooling.training import layer_cache, shards
    from tooling.training.layer_cache import cached_layer_features
    from tooling.training.self_distillation import sequence_features
    from tooling.training.shards import layer_directory

    def stopping(recipe, answer, max_tokens, *where):
        # every answer stops after 3 tokens, so every conversation gets its follow-up turn
        # (the random model would otherwise run to max_tokens and end after one)
        vocab = chat_llm.engine.model.arch.vocab_size
        p = shards_params(recipe, answer, max_tokens, *where)
        every_token = list(range(vocab))
        return SamplingParams(temperature=p.temperature, max_tokens=p.max_tokens, seed=p.seed,
                              min_tokens=2, stop_token_ids=every_token)  # fmt: skip

    shards_params = shards._params
    monkeypatch.setattr(shards, "_params", stopping)
    layers = (1, 0)
    build(chat_llm, tmp_path, _recipe(), budget=1, keep_layers=layers)
    monkeypatch.setattr(shards, "_params", shards_params)
    for split in ("train", "held_out"):
        kept = sorted(p.name for p in layer_directory(tmp_path / split, layers).iterdir())
        assert kept == [p.name for p in shard_paths(tmp_path / split)]
    split = load_split(tmp_path / "train")
    model = chat_llm.engine.model

    def no_second_pass(*args, **kwargs):
        raise AssertionError("the layer outputs were computed in a second pass")

    monkeypatch.setattr(layer_cache, "sequence_features", no_second_pass)
    rows = cached_layer_features(model, tmp_path / "train", layers, len(split.sequences))
    assert len(rows) == len(split.sequences) and any(len(s) > 1 for s in split.spans)
    for tokens, kept in zip(split.sequences, rows, strict=True):
        (expected,) = sequence_features(model, [tokens], layer=layers)
        assert kept.dtype == torch.float16 and kept.shape == expected.shape
        # every position but the last, which never ran (zero, as the features' last row)
        torch.testing.assert_close(kept[:-1].float(), expected[:-1], atol=2e-3, rtol=2e-3)
        assert not kept[-1].any()
    # the shard's own features are the last layer's, as without --keep-layers
    for tokens, features in zip(split.sequences, split.features, strict=True):
        (expected,) = sequence_features(model, [tokens])
        torch.testing.assert_close(features[:-1].float(), expected[:-1], atol=2e-3, rtol=2e-3)


def test_an_eagle3_drafter_is_scored_on_a_data_sets_held_out_split(chat_llm, tiny_chat_model_dir,
                                                                   tmp_path):  # fmt: skip
    from tests.tiny_models import save_eagle3_drafter
    from tooling.training.train_eagle3 import evaluate_eagle3

    build(chat_llm, tmp_path / "data", _recipe(), budget=1)
    layers = (0, 1, 1)  # the chat model has two layers
    drafter = save_eagle3_drafter(tiny_chat_model_dir, tmp_path / "eagle3", feature_layers=layers)
    scores = evaluate_eagle3(chat_llm, str(drafter), tmp_path / "data", depth=2, top_k=3)
    assert set(scores) == {"all answers", "greedy answers", "sampled answers"}
    for accuracies in scores.values():
        assert len(accuracies) == 2 and all(len(row) == 3 for row in accuracies)
        assert all(0 <= a <= 1 for row in accuracies for a in row)
        assert sum(accuracies[0]) <= 1


def test_held_out_answers_are_told_apart_by_how_they_were_made(chat_llm, tmp_path):
    from tooling.training.train_eagle import by_answer_kind

    build(chat_llm, tmp_path, _recipe(), budget=1)
    split = load_split(tmp_path / "held_out")
    # two answers a request, the first greedy and the second sampled, in that order
    assert split.temperatures == [0.0, 0.7] * (len(split.sequences) // 2)
    kinds = split.answer_kinds()
    assert kinds == {
        "greedy answers": list(range(0, len(split.sequences), 2)),
        "sampled answers": list(range(1, len(split.sequences), 2)),
    }
    # Each sequence scored once: a kind's counts are its sequences', all answers' their sum.
    asked = []

    def count(only):  # sequence i: i hits at depth 1 over 10 positions
        asked.append(only)
        index = range(len(split.sequences)) if only is None else only
        return torch.tensor([[float(sum(index))]]), torch.tensor([10.0 * len(index)])

    result = by_answer_kind(count, split)
    assert asked == list(kinds.values())
    n = len(split.sequences)
    by_kind = {kind: [[pytest.approx(sum(i) / (10 * len(i)))]] for kind, i in kinds.items()}
    assert result == {"all answers": [[pytest.approx(sum(range(n)) / (10 * n))]], **by_kind}
    # one kind alone is scored once, as all answers
    greedy = load_split(tmp_path / "held_out")
    greedy.temperatures = [0.0] * len(greedy.sequences)
    asked.clear()
    assert by_answer_kind(count, greedy) == {"all answers": [[pytest.approx((n - 1) / 20)]]}
    assert asked == [None]


def test_held_out_accuracy_over_some_sequences_is_theirs_alone(chat_llm, tiny_chat_model_dir,
                                                               tmp_path):  # fmt: skip
    from engine.toolkit import EagleNetwork, dense_weight, load_drafter
    from tests.tiny_models import save_eagle_drafter
    from tooling.training.self_distillation import FeatureSplit
    from tooling.training.train_eagle import held_out_accuracies, padded_rope

    build(chat_llm, tmp_path / "data", _recipe(), budget=1)
    split = load_split(tmp_path / "data" / "held_out")
    model = chat_llm.engine.model
    # Every even token drafted, each as a candidate: a sequence scores the share of its
    # answer tokens that are even, which differs from sequence to sequence.
    even = torch.arange(0, model.arch.vocab_size, 2)
    saved = save_eagle_drafter(tiny_chat_model_dir, tmp_path / "eagle", draft_vocab=even)
    drafter = load_drafter(str(saved), "eagle", EagleNetwork, model)
    readout = dense_weight(model.lm_head)[even].float()

    def score(s, only=None) -> list[float]:
        network, rope_of = drafter.network.float(), padded_rope(model)
        rows = held_out_accuracies(network, rope_of, s, model.embed, readout, even,
                                   model.arch.vocab_size, 2, len(even), only=only)  # fmt: skip
        return [round(sum(row), 6) for row in rows]

    whole = score(split)
    alone = [
        score(FeatureSplit([split.sequences[i]], [split.starts[i]], [split.features[i]],
                           [split.spans[i]]))  # fmt: skip
        for i in range(len(split.sequences))
    ]
    assert len(set(map(tuple, alone))) > 1  # the sequences do score differently
    for i, expected in enumerate(alone):
        assert score(split, only=[i]) == expected
    assert score(split, only=list(range(len(split.sequences)))) == whole


def test_train_data_keeps_layers_from_the_command_line(tiny_chat_model_dir, tmp_path, capsys):
    from tooling.cli import main
    from tooling.training.shards import layer_directory

    args = ["train", "data", "--model", str(tiny_chat_model_dir), "--tokens", "1",
            "--output", str(tmp_path), "--shard-requests", "2", "--max-tokens", "4",
            "--follow-up-max-tokens", "2", "--batch", "4"]  # fmt: skip
    assert main([*args, "--keep-layers", "0,9"]) == 2  # the tiny model has 2 layers
    assert "--keep-layers 0,9: the model's layers are 0 to 1" in capsys.readouterr().err
    assert main([*args, "--keep-layers", "low"]) == 2
    assert main([*args, "--keep-layers", "1,0"]) == 0
    for split in ("train", "held_out"):
        kept = layer_directory(tmp_path / split, (1, 0))
        assert [p.name for p in kept.iterdir()] == [p.name for p in shard_paths(tmp_path / split)]


def test_a_set_does_not_go_on_in_other_numerics(tiny_chat_model_dir, tmp_path, capsys):
    # 8-bit activations answer as another model: shards of both in one set would mix them.
    import json

    from tooling.cli import main

    args = ["train", "data", "--model", str(tiny_chat_model_dir), "--tokens", "1",
            "--output", str(tmp_path), "--shard-requests", "2", "--max-tokens", "4",
            "--follow-up-max-tokens", "2", "--batch", "4"]  # fmt: skip
    assert main(args) == 0
    assert "numerics" not in json.loads((tmp_path / "recipe.json").read_text())  # float32
    capsys.readouterr()
    assert main([*args, "--int8-activations"]) == 2
    assert "another recipe (differs in numerics)" in capsys.readouterr().err
    assert main([*args, "--output", str(tmp_path / "int8"), "--int8-activations"]) == 0
    recipe = json.loads((tmp_path / "int8" / "recipe.json").read_text())
    assert recipe["numerics"] == {"int8_activations": True}
    assert main(args) == 0  # the float32 set goes on as before


def test_a_resumed_builds_rate_counts_only_its_own_tokens():
    import io
    import time

    from tqdm import tqdm

    from tooling.cli_train import _resumed

    bar = tqdm(total=2_000_000, file=io.StringIO(), mininterval=0, miniters=1)
    update = _resumed(bar)
    update(1_000_000)  # made by earlier runs
    time.sleep(0.05)
    update(10)  # this run's first shard
    assert bar.n == 1_000_010
    # 10 tokens in >= 0.05 s is <= 200 tok/s; counting the earlier million would read far more
    assert bar.format_dict["rate"] < 1000


def test_kangaroo_reads_its_exit_layer_from_the_kept_layers(chat_llm, tmp_path, monkeypatch):
    # Kangaroo's shallow features are one of the layers `--keep-layers` kept: read, not
    # computed (the pass over a 10M-token set would hold its rows in memory).
    from tooling.training import train_kangaroo
    from tooling.training.self_distillation import sequence_features
    from tooling.training.shards import kept_layers_with, layer_directory
    from tooling.training.train_kangaroo import shallow_features

    layers = (1, 0)
    build(chat_llm, tmp_path, _recipe(), budget=1, keep_layers=layers)
    train = tmp_path / "train"
    assert kept_layers_with(train, 0) == layers and kept_layers_with(train, 1) == layers
    assert kept_layers_with(train, 5) is None
    split = load_split(train)
    model = chat_llm.engine.model

    def no_pass(*args, **kwargs):
        raise AssertionError("the kept layer was computed again")

    monkeypatch.setattr(train_kangaroo, "sequence_features", no_pass)
    rows = shallow_features(model, split, 0, "train")
    assert len(rows) == len(split.sequences)
    for tokens, row in zip(split.sequences, rows, strict=True):
        (expected,) = sequence_features(model, [tokens], layer=0)
        assert row.dtype == torch.float16 and row.shape == expected.shape
        torch.testing.assert_close(row[:-1].float(), expected[:-1], atol=2e-3, rtol=2e-3)

    # A shard without its kept file: the set no longer holds the layer for every shard.
    next(layer_directory(train, layers).iterdir()).unlink()
    assert kept_layers_with(train, 0) is None
    monkeypatch.setattr(train_kangaroo, "sequence_features", sequence_features)
    computed = shallow_features(model, split, 0, "train")
    assert computed[0].dtype == torch.float16
    torch.testing.assert_close(computed[0][:-1], rows[0][:-1], atol=2e-3, rtol=2e-3)
