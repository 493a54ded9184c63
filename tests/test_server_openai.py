"""The OpenAI-compatible server as a real process, driven by the official openai client."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

MODEL = "tiny"
CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server(tiny_server):
    """A fresh server for this module (see conftest.tiny_server)."""
    return tiny_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def greedy(**kw):
    return {"temperature": 0, "max_tokens": 12, **kw}


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_completion_non_streaming(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, **greedy())
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_equals_non_streaming(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, **greedy())
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **greedy())
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]


def test_completions_streaming_and_not(client):
    full = client.completions.create(model=MODEL, prompt="Once upon a time", **greedy())
    assert full.object == "text_completion" and full.choices[0].text
    chunks = list(
        client.completions.create(model=MODEL, prompt="Once upon a time", stream=True, **greedy())
    )
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert sum(1 for c in chunks if c.choices[0].finish_reason) == 1


def test_completions_take_token_ids_and_several_prompts(client):
    r = client.completions.create(model=MODEL, prompt=[[1, 2, 3], [4, 5, 6, 7]], n=2, **greedy())
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 3 + 4


def test_n_choices_stream_with_their_index(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, n=2, stream=True, temperature=1.0, seed=3, max_tokens=10
    )
    texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
    for c in stream:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert all(len(f) == 1 for f in finishes.values())
    assert texts[0] and texts[1]


def test_stop_string_is_not_emitted(client):
    free = client.completions.create(model=MODEL, prompt="abc", **greedy(max_tokens=20))
    text = free.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "need a non-blank stop string from the middle of the text"
    cut = client.completions.create(model=MODEL, prompt="abc", stop=[stop], **greedy(max_tokens=20))
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt="abc", stop=stop, stream=True, **greedy(max_tokens=20)
    )
    assert "".join(c.choices[0].text for c in streamed) == text[: text.index(stop)]


def test_stop_strings_wait_for_min_tokens(client):
    free = client.completions.create(model=MODEL, prompt="abc", **greedy(max_tokens=20))
    text = free.choices[0].text
    stop = text[:3]
    assert stop.strip(), "need a non-blank stop string at the start of the text"
    # min_tokens = max_tokens: the stop string (in the first tokens) is text, as in vLLM.
    body = {"min_tokens": 20, "ignore_eos": True}
    late = client.completions.create(
        model=MODEL, prompt="abc", stop=[stop], extra_body=body, **greedy(max_tokens=20)
    )
    assert late.choices[0].finish_reason == "length" and late.choices[0].text.startswith(stop)
    assert late.usage.completion_tokens == 20


def test_include_usage_adds_a_final_usage_chunk(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            stream=True,
            stream_options={"include_usage": True},
            **greedy(),
        )
    )
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_logprobs_chat_and_completions(client):
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, logprobs=True, top_logprobs=3, **greedy(max_tokens=5)
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    # Greedy: the chosen token is the most likely one.
    assert all(t.top_logprobs[0].token == t.token for t in content)
    c = client.completions.create(model=MODEL, prompt="abc", logprobs=2, **greedy(max_tokens=5))
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == c.choices[0].text or c.choices[0].finish_reason == "stop"


def test_seed_reproducibility(client):
    def sample(seed):
        return (
            client.completions.create(
                model=MODEL, prompt="xyz", temperature=1.0, seed=seed, max_tokens=15
            )
            .choices[0]
            .text
        )

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_async_client_concurrent_requests(server):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        calls = [
            aclient.chat.completions.create(model=MODEL, messages=CHAT, **greedy())
            for _ in range(4)
        ]
        results = await asyncio.gather(*calls)
        await aclient.close()
        return [r.choices[0].message.content for r in results]

    texts = asyncio.run(main())
    assert len(set(texts)) == 1  # greedy and batched: all identical


def test_raw_sse_framing(server):
    body = {"model": MODEL, "messages": CHAT, "stream": True, **greedy(max_tokens=4)}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e.strip() and not e.startswith(":")]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert sum(1 for p in payloads if p["choices"][0]["finish_reason"]) == 1


def test_several_prompts_with_n_stream_every_choice_once(client):
    stream = client.completions.create(
        model=MODEL, prompt=["one", "two"], n=2, stream=True, **greedy(max_tokens=6)
    )
    finishes: dict[int, int] = {}
    for c in stream:
        for choice in c.choices:
            if choice.finish_reason:
                finishes[choice.index] = finishes.get(choice.index, 0) + 1
    assert finishes == {0: 1, 1: 1, 2: 1, 3: 1}


def test_max_completion_tokens_and_nulls(server):
    body = {
        "model": MODEL,
        "messages": CHAT,
        "temperature": 0,
        "max_completion_tokens": 3,
        "ignore_eos": True,
        "n": None,
        "stream": None,
        "logprobs": None,
        "tools": None,  # explicit nulls count as absent, even for refused fields
        "user": "u1",
    }
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def test_echo_prepends_the_prompt(client):
    plain = client.completions.create(model=MODEL, prompt="Once", **greedy(max_tokens=4))
    echoed = client.completions.create(
        model=MODEL, prompt="Once", echo=True, **greedy(max_tokens=4)
    )
    assert echoed.choices[0].text == "Once" + plain.choices[0].text
    chunks = client.completions.create(
        model=MODEL, prompt="Once", echo=True, stream=True, **greedy(max_tokens=4)
    )
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text


def test_stop_string_ends_one_choice_while_the_other_goes_on(client):
    sampled = {"temperature": 1.0, "seed": 11, "max_tokens": 40, "n": 2}
    free = client.completions.create(model=MODEL, prompt="q", **sampled)
    first, second = (c.text for c in sorted(free.choices, key=lambda c: c.index))
    stop = next(
        first[i : i + 4]
        for i in range(2, len(first) - 4)
        if first[i : i + 4].strip() and first[i : i + 4] not in second
    )
    cut = client.completions.create(model=MODEL, prompt="q", stop=[stop], **sampled)
    by_index = {c.index: c for c in cut.choices}
    assert by_index[0].text == first[: first.index(stop)] and by_index[0].finish_reason == "stop"
    assert by_index[1].text == second
