"""``specserve train prompts``: the target writes user requests itself (Magpie-style)."""

from __future__ import annotations

import json

import pytest

from tooling.training.conversations_file import read_conversations
from tooling.training.prompt_mix import benchmark_prompts
from tooling.training.self_prompts import normalized, rejection, user_turn_opening


def test_only_finished_new_requests_of_a_sensible_length_are_kept():
    seen = {normalized("How do I bake bread at home?")}
    benchmark = frozenset({normalized("What is the capital of France, and what is it famous for?")})
    ok = "Can you suggest three books about sailing?"
    assert rejection(ok, "stop", seen, benchmark) is None
    assert rejection(ok, "length", seen, benchmark) == "cut off"
    assert rejection("Help me.", "stop", seen, benchmark) == "too short"
    assert rejection("word " * 81, "stop", seen, benchmark) == "too long"
    assert rejection("Tell me more <|im_start|> please now", "stop", seen) == "template tokens"
    assert rejection("how do I bake BREAD at home", "stop", seen, benchmark) == "repeated"
    assert rejection("What is the capital of France and what is it famous for",
                     "stop", seen, benchmark) == "a benchmark prompt"  # fmt: skip


def test_the_opening_is_the_template_up_to_the_user_s_message(smollm2_llm):
    tokenizer = smollm2_llm.tokenizer
    text = tokenizer.decode(user_turn_opening(tokenizer))
    assert text.endswith("<|im_start|>user\n")
    assert "You are a helpful AI assistant" in text  # the default system message, as users get
    full = tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=False)
    assert full.startswith(text)


def test_the_target_writes_requests_that_train_data_reads(smollm2_llm, tmp_path):
    from tooling.training.self_prompts import write_self_prompts

    path = tmp_path / "self.jsonl"
    report = write_self_prompts(smollm2_llm, 6, path, seed=3, batch=8)
    assert report.kept == 6 and report.written >= 6
    assert report.written == report.kept + sum(report.rejected.values())
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    texts = [line["messages"][0]["content"] for line in lines]
    assert len(texts) == 6 and len({normalized(t) for t in texts}) == 6
    banned = {normalized(t) for t in benchmark_prompts()}
    assert not banned & {normalized(t) for t in texts}
    assert all(4 <= len(t.split()) <= 80 for t in texts)
    assert len(read_conversations(path).requests) == 6  # what `train data --from` takes
    with pytest.raises(ValueError, match="--count"):
        write_self_prompts(smollm2_llm, 0, tmp_path / "none.jsonl")


def test_an_interrupted_run_goes_on_where_it_stopped(smollm2_llm, tmp_path):
    from tooling.training.self_prompts import write_self_prompts

    # One request at a time: each is computed alone, so the two ways meet the same numbers.
    whole = tmp_path / "whole.jsonl"
    write_self_prompts(smollm2_llm, 5, whole, seed=1, batch=1)
    resumed = tmp_path / "resumed.jsonl"
    write_self_prompts(smollm2_llm, 2, resumed, seed=1, batch=1)
    with resumed.open("a") as f:  # a line of a batch whose progress was never saved
        f.write('{"messages": [{"role": "user", "content": "half-written request"}]}\n')
    counted: list[int] = []
    report = write_self_prompts(smollm2_llm, 5, resumed, seed=1, batch=1, progress=counted.append)
    assert resumed.read_text() == whole.read_text()
    assert report.kept == 5 and counted == [2, 1, 1, 1]  # two found kept, three written now
    with pytest.raises(ValueError, match="name a new file"):
        write_self_prompts(smollm2_llm, 5, resumed, seed=2, batch=1)  # other settings
    other = tmp_path / "mine.jsonl"
    other.write_text("my own data\n")
    with pytest.raises(ValueError, match="name a new file"):
        write_self_prompts(smollm2_llm, 5, other, batch=1)
    assert other.read_text() == "my own data\n"


def test_openers_begin_the_requests_in_turn_and_the_model_writes_the_rest(smollm2_llm, tmp_path):
    from tooling.training.self_prompts import write_self_prompts

    openers = ("Why", "Describe", "How do I")
    path = tmp_path / "opened.jsonl"
    # One at a time, so request i is exactly the one seeded for opener i mod 3.
    report = write_self_prompts(smollm2_llm, 4, path, seed=5, batch=1, openers=openers)
    texts = [json.loads(line)["messages"][0]["content"] for line in path.read_text().splitlines()]
    assert report.kept == 4 and len(texts) == 4
    assert all(any(t.startswith(o + " ") for o in openers) for t in texts)
    assert all(len(t.split()) >= 4 for t in texts)  # the model wrote on past the opener
    assert len({t.split()[0] for t in texts}) >= 2  # the openers take turns
    plain = tmp_path / "plain.jsonl"
    write_self_prompts(smollm2_llm, 4, plain, seed=5, batch=1)
    assert plain.read_text() != path.read_text()
    # Resuming with other openers would mix two recipes in one file: refused.
    with pytest.raises(ValueError, match="name a new file"):
        write_self_prompts(smollm2_llm, 6, path, seed=5, batch=1, openers=("Write",))


def test_openers_come_builtin_or_from_a_file(tmp_path):
    from tooling.training.self_prompts import BUILTIN_OPENERS, load_openers

    assert load_openers(None) == ()
    assert load_openers("builtin") == BUILTIN_OPENERS and "Why" in BUILTIN_OPENERS
    mine = tmp_path / "openers.txt"
    mine.write_text("Why\n\n  Tell me  \n")
    assert load_openers(str(mine)) == ("Why", "Tell me")
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ValueError, match="names no opener"):
        load_openers(str(tmp_path / "empty.txt"))
    with pytest.raises(ValueError, match="neither 'builtin' nor a file"):
        load_openers(str(tmp_path / "missing.txt"))
