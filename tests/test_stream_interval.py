"""``--stream-interval N``: a choice's first token is sent at once, then chunks of N tokens,
then the rest with its finish reason; the text, the logprobs and usage are those an interval of
one gives."""

from __future__ import annotations

import json

import httpx
import pytest

from server.generation import ChoiceEvent
from server.stream_interval import StreamInterval


def _event(index: int, tokens: list[int], finish: str | None = None, logprobs=True):
    text = "".join(f"<{t}>" for t in tokens)
    return ChoiceEvent(index, text, tokens, [f"lp{t}" for t in tokens] if logprobs else None,
                       finish)  # fmt: skip


def test_first_event_goes_at_once_then_events_gather_to_the_interval():
    interval = StreamInterval(3)
    assert [e.token_ids for e in interval.push(_event(0, [1]))] == [[1]]
    assert interval.push(_event(0, [2])) == []
    assert interval.push(_event(0, [3])) == []
    (sent,) = interval.push(_event(0, [4]))
    assert sent.token_ids == [2, 3, 4]
    assert sent.text == "<2><3><4>" and sent.logprobs == ["lp2", "lp3", "lp4"]
    assert sent.finish_reason is None


def test_a_finish_sends_what_is_held_with_the_finish_reason():
    interval = StreamInterval(4)
    interval.push(_event(0, [1]))
    interval.push(_event(0, [2]))
    (sent,) = interval.push(_event(0, [], "stop"))  # a stop string: no tokens, the end
    assert sent.token_ids == [2] and sent.finish_reason == "stop"
    assert interval.flush() == []


def test_choices_gather_apart_and_a_speculative_step_of_many_tokens_goes_at_once():
    interval = StreamInterval(2)
    interval.push(_event(0, [1]))
    interval.push(_event(1, [9]))
    assert interval.push(_event(0, [2])) == []
    (sent,) = interval.push(_event(1, [10, 11, 12]))  # three accepted tokens in one step
    assert sent.index == 1 and sent.token_ids == [10, 11, 12]
    assert [e.token_ids for e in interval.flush()] == [[2]]


def test_without_logprobs_the_merged_event_has_none():
    interval = StreamInterval(2)
    interval.push(_event(0, [1], logprobs=False))
    interval.push(_event(0, [2], logprobs=False))
    (sent,) = interval.push(_event(0, [3], logprobs=False))
    assert sent.logprobs is None and sent.sources is None


def test_an_interval_of_one_sends_every_event_and_below_one_is_refused():
    interval = StreamInterval(1)
    assert all(len(interval.push(_event(0, [t]))) == 1 for t in range(5))
    with pytest.raises(ValueError, match="at least 1"):
        StreamInterval(0)


@pytest.fixture(scope="module")
def gathering_server(tiny_chat_model_dir, tmp_path_factory):
    from tests.server_process import serving_tiny

    log = tmp_path_factory.mktemp("server") / "server.log"
    with serving_tiny(tiny_chat_model_dir, log, "--stream-interval", "4") as proc:
        yield proc


# Two prompts, two choices each: four choices gathering apart, merged into one stream.
BODY = {"model": "tiny", "prompt": ["Once upon", "The cat"], "max_tokens": 11, "n": 2,
        "temperature": 0, "logprobs": 1, "ignore_eos": True}  # fmt: skip


def test_served_stream_sends_one_token_then_chunks_of_the_interval(gathering_server):
    body = BODY | {"stream": True, "stream_options": {"continuous_usage_stats": True}}
    with httpx.stream("POST", gathering_server.url + "/v1/completions", json=body,
                      timeout=60) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    sizes: dict[int, list[int]] = {i: [] for i in range(4)}
    texts = dict.fromkeys(range(4), "")
    sent = 0
    for chunk in chunks:
        for choice in chunk["choices"]:
            sizes[choice["index"]].append(len(choice["logprobs"]["tokens"]))
            texts[choice["index"]] += choice["text"]
            sent += len(choice["logprobs"]["tokens"])
        if chunk["choices"]:
            # Usage so far counts the tokens sent, not those the server holds back.
            assert chunk["usage"]["completion_tokens"] == sent
    assert sizes == dict.fromkeys(range(4), [1, 4, 4, 2])

    whole = httpx.post(gathering_server.url + "/v1/completions", json=BODY, timeout=60).json()
    assert [c["text"] for c in whole["choices"]] == [texts[i] for i in range(4)]


def test_a_first_event_without_text_does_not_use_up_the_first_send():
    interval = StreamInterval(4)
    held_back = ChoiceEvent(0, "", [7], None)  # half a character: no text yet
    assert interval.push(held_back) == [held_back]
    (sent,) = interval.push(ChoiceEvent(0, "é", [8], None))  # the first text goes at once
    assert sent.text == "é"
    assert interval.push(ChoiceEvent(0, "x", [9], None)) == []


def test_text_held_when_the_request_times_out_is_sent_before_the_error(tiny_chat_model_dir,
                                                                       tmp_path):  # fmt: skip
    from tests.server_process import serving_tiny

    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 960,
            "ignore_eos": True, "stream": True,
            "stream_options": {"continuous_usage_stats": True}}  # fmt: skip
    args = ("--stream-interval", "100000", "--request-timeout", "0.5")
    with serving_tiny(tiny_chat_model_dir, tmp_path / "server.log", *args) as server:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                          timeout=60) as r:  # fmt: skip
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    assert json.loads(lines[-2])["error"]["code"] == "timeout"
    chunks = [json.loads(line) for line in lines[:-2]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    sent = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    # The first token, then everything generated until the deadline, held and then flushed.
    assert sent[-1] > 1 and text
