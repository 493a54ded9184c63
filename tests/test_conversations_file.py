"""Bring your own data: conversations as JSONL (OpenAI or ShareGPT), answered by the target."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tooling.training.conversations_file import read_conversations
from tooling.training.data import training_splits


def _write(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


OPENAI = {"messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi! (not trained on: the target answers again)"},
    {"role": "user", "content": [{"type": "text", "text": "Tell me "},
                                 {"type": "text", "text": "more."}]},
]}  # fmt: skip
SHAREGPT = {"conversations": [
    {"from": "human", "value": "What is rain?"},
    {"from": "human", "value": "Briefly."},
    {"from": "gpt", "value": "Water falling from clouds."},
]}  # fmt: skip


def test_both_shapes_become_the_users_turns(tmp_path):
    found = read_conversations(_write(tmp_path / "c.jsonl", [OPENAI, "", SHAREGPT]))
    first, second = found.requests
    assert first.user_turns == ("Hello", "Tell me more.") and first.system == "Be brief."
    assert second.user_turns == ("What is rain?\n\nBriefly.",) and second.system is None
    assert found.skipped == {"blank lines": 1}


def test_a_conversation_without_a_user_message_is_skipped_and_counted(tmp_path):
    lines = [OPENAI, {"messages": [{"role": "assistant", "content": "alone"}]},
             {"conversations": [{"from": "system", "value": "s"}]}]  # fmt: skip
    found = read_conversations(_write(tmp_path / "c.jsonl", lines))
    assert len(found.requests) == 1
    assert found.skipped == {"without a user message": 2}
    assert "1 conversations (skipped: 2 without a user message)" == found.summary()


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{not json", "c.jsonl:2: "),
        ({"text": "hi"}, "c.jsonl:2: expected a JSON object with 'messages'"),
        ({"messages": "hi"}, "c.jsonl:2: 'messages' must be a list"),
        ({"messages": [{"role": "robot", "content": "x"}]},
         "c.jsonl:2: messages\\[0\\]: role 'robot'"),
        ({"conversations": [{"from": "alien", "value": "x"}]},
         "c.jsonl:2: conversations\\[0\\]: 'from' 'alien'"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "c.jsonl:2: message 0: only text"),
        ([1, 2], "c.jsonl:2: expected a JSON object"),
    ],
)  # fmt: skip
def test_a_bad_line_is_an_error_naming_the_line(tmp_path, bad, message):
    with pytest.raises(ValueError, match=message):
        read_conversations(_write(tmp_path / "c.jsonl", [OPENAI, bad, SHAREGPT]))


def test_a_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        read_conversations(tmp_path / "absent.jsonl")


def test_training_reads_a_file_through_the_targets_own_answers(tiny_chat_model_dir, tmp_path,
                                                               monkeypatch):  # fmt: skip
    from engine import LLM

    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    llm = LLM(model=str(tiny_chat_model_dir),
              decoder={"method": "autoregressive", "load_shipped_drafters": False})  # fmt: skip
    path = _write(tmp_path / "mine.jsonl", [OPENAI, SHAREGPT, OPENAI])
    splits = training_splits(llm, SimpleNamespace(data=path, data_tokens=None))
    assert len(splits["train"].sequences) == 2 * 2  # two conversations, two answers each
    assert len(splits["held_out"].sequences) == 1 * 2  # the last one (5%, at least 1)
    system = llm.tokenizer.encode("Be brief.", add_special_tokens=False)
    first = splits["train"].sequences[0]
    assert any(first[i : i + len(system)] == system for i in range(len(first)))
    # The assistant turn in the file is not in the data: the target answered instead.
    ignored = llm.tokenizer.encode(" not trained on", add_special_tokens=False)
    assert not any(s[i : i + len(ignored)] == ignored for s in splits["train"].sequences
                   for i in range(len(s)))  # fmt: skip
    # A second read finds the shards in the cache, made from the same file.
    again = training_splits(llm, SimpleNamespace(data=path, data_tokens=None))
    assert again["train"].sequences == splits["train"].sequences
