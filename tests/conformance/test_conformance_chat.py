"""Chat completions: every request field we honour, and the response objects' fields."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conformance.conftest import CHAT, MODEL, greedy

LONG_CHAT = [{"role": "user", "content": "Tell me about the sea. " * 12}]


def test_response_object_fields(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, **greedy())
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL
    assert isinstance(r.created, int)
    choice = r.choices[0]
    assert choice.index == 0 and choice.finish_reason in ("stop", "length")
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.logprobs is None
    usage = r.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_cached_tokens_count_prefix_cache_hits(client):
    first = client.chat.completions.create(model=MODEL, messages=LONG_CHAT, **greedy())
    again = client.chat.completions.create(model=MODEL, messages=LONG_CHAT, **greedy())
    assert first.usage.prompt_tokens == again.usage.prompt_tokens > 32
    cached = again.usage.prompt_tokens_details.cached_tokens
    # Whole blocks of the prompt, never its last token (it must run to give logits).
    assert 16 <= cached < again.usage.prompt_tokens


def test_stream_chunk_fields_and_usage(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            stream=True,
            stream_options={"include_usage": True},
            **greedy(),
        )
    )
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.usage for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens >= 1
    assert last.usage.prompt_tokens_details.cached_tokens >= 0


def test_continuous_usage_stats_put_usage_so_far_in_every_chunk(client):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            stream=True,
            stream_options=options,
            **greedy(max_tokens=6, extra_body={"ignore_eos": True}),
        )
    )
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 6
    assert len(set(counts)) > 2  # it grows as tokens arrive, not only at the end
    # The prompt is counted from the first chunk on (the role chunk comes before any token).
    assert len({c.usage.prompt_tokens for c in chunks}) == 1 and chunks[0].usage.prompt_tokens > 0


def test_stream_options_without_stream_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=CHAT, stream_options={"include_usage": True}
        )
    assert caught.value.body["param"] == "stream_options"


def test_logprobs_and_top_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, logprobs=True, top_logprobs=3, **greedy(max_tokens=4)
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        # Greedy: the sampled token is the most likely one.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
        assert bytes(entry.bytes).decode("utf-8", "replace") or entry.token == ""


def test_seed_makes_sampling_reproducible_and_is_range_checked(client):
    sampled = {"temperature": 1.0, "max_tokens": 10, "seed": 2**63 - 1}
    a = client.chat.completions.create(model=MODEL, messages=CHAT, **sampled)
    b = client.chat.completions.create(model=MODEL, messages=CHAT, **sampled)
    assert a.choices[0].message.content == b.choices[0].message.content
    for seed in (2**63, -(2**63) - 1):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=CHAT, seed=seed)
        assert caught.value.body["param"] == "seed"


def test_logit_bias_error_names_every_bad_key(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=CHAT,
            logit_bias={"5": 1, "x": 1, "-3": 2, "99999999": 1, "7": 500},
        )
    message = caught.value.body["message"]
    assert "'x'" in message and "'-3'" in message and caught.value.body["param"] == "logit_bias"
    # Beyond the vocabulary and out of range, in the same message.
    assert "'99999999'" in message and "{'7': 500" in message


def test_logit_bias_forces_a_token(server, client):
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, logit_bias={"42": 100}, logprobs=True, **greedy(max_tokens=3)
    )
    text = httpx.post(server.url + "/detokenize", json={"tokens": [42]}, timeout=30).json()
    assert [e.token for e in r.choices[0].logprobs.content] == [text["prompt"]] * 3


def test_stop_n_and_max_completion_tokens(client):
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, n=3, max_completion_tokens=5, temperature=1.0, seed=3
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens <= 15
    free = client.chat.completions.create(model=MODEL, messages=CHAT, **greedy(max_tokens=20))
    text = free.choices[0].message.content
    # The first three non-blank characters after the start: a stop string the greedy text
    # is sure to contain (the assertion below must always run).
    start = next(i for i in range(3, len(text)) if not text[i].isspace())
    stop = text[start : start + 3]
    assert len(stop.strip()) == 3, text
    cut = client.chat.completions.create(
        model=MODEL, messages=CHAT, stop=[stop], **greedy(max_tokens=20)
    )
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_identifiers_and_storage_fields_are_accepted(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        user="u-1",
        safety_identifier="hash-1",
        prompt_cache_key="k-1",
        metadata={"team": "a"},
        store=False,
        service_tier="auto",
        parallel_tool_calls=False,
        tool_choice="none",
        response_format={"type": "text"},
        modalities=["text"],
        **greedy(max_tokens=2),
    )
    assert r.choices[0].message.content is not None


def test_message_roles_names_and_text_parts(client):
    messages = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "name": "ann",
            "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
        },
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, **greedy(max_tokens=2))
    assert r.choices[0].message.content is not None


def _tokenize(server, **body):
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_template_options_shape_the_prompt(server, client):
    turn = [*CHAT, {"role": "assistant", "content": "Once upon"}]
    answer = _tokenize(server, messages=turn)
    continued = _tokenize(
        server, messages=turn, add_generation_prompt=False, continue_final_message=True
    )
    closed = _tokenize(server, messages=turn, add_generation_prompt=False)
    # Continuing stops right after the assistant's text; answering opens a new turn after it.
    assert len(continued) < len(closed) < len(answer)
    r = client.chat.completions.create(
        model=MODEL,
        messages=turn,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
        **greedy(max_tokens=3),
    )
    assert r.usage.prompt_tokens == len(continued)
    with pytest.raises(openai.BadRequestError):  # both at once make no sense
        client.chat.completions.create(
            model=MODEL, messages=turn, extra_body={"continue_final_message": True}
        )


def test_chat_echo_prepends_the_last_assistant_message(client):
    turn = [*CHAT, {"role": "assistant", "content": "Once upon"}]
    extra = {"echo": True, "add_generation_prompt": False, "continue_final_message": True}
    plain = client.chat.completions.create(
        model=MODEL, messages=turn, extra_body=extra | {"echo": False}, **greedy(max_tokens=4)
    )
    echoed = client.chat.completions.create(
        model=MODEL, messages=turn, extra_body=extra, **greedy(max_tokens=4)
    )
    assert echoed.choices[0].message.content == "Once upon" + plain.choices[0].message.content
    chunks = client.chat.completions.create(
        model=MODEL, messages=turn, extra_body=extra, stream=True, **greedy(max_tokens=4)
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == echoed.choices[0].message.content


def test_truncate_prompt_tokens_keeps_the_last_tokens(client):
    r = client.chat.completions.create(
        model=MODEL, messages=LONG_CHAT, extra_body={"truncate_prompt_tokens": 20}, **greedy()
    )
    assert r.usage.prompt_tokens == 20


@pytest.mark.parametrize(
    "kwargs",
    [{"tokenize": True}, {"messages": []}, {"raise_exception": 1}, {"documents": None}],
)
def test_chat_template_kwargs_cannot_replace_the_templates_own_arguments(client, kwargs):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=CHAT, extra_body={"chat_template_kwargs": kwargs}
        )
    assert caught.value.body["param"] == "chat_template_kwargs"
    assert next(iter(kwargs)) in caught.value.body["message"]


def test_chat_template_kwargs_allowed_names_still_work(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        **greedy(max_tokens=2),
    )
    assert r.choices[0].message.content is not None


def test_best_of_is_honoured_only_as_n(client):
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, n=2, extra_body={"best_of": 2}, **greedy(max_tokens=2)
    )
    assert len(r.choices) == 2
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=CHAT, extra_body={"best_of": 3})
    assert caught.value.body["param"] == "best_of"


def test_vllm_sampling_extensions(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        temperature=0.8,
        top_p=0.9,
        seed=1,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        max_tokens=6,
        extra_body={
            "top_k": 5,
            "min_p": 0.05,
            "repetition_penalty": 1.2,
            "min_tokens": 6,
            "ignore_eos": True,
            "stop_token_ids": [0],
        },
    )
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
