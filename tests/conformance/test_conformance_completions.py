"""Legacy text completions: prompt forms, echo, logprobs, and the response fields."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conformance.conftest import MODEL, greedy


def test_response_object_fields(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", **greedy())
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL
    choice = r.choices[0]
    assert choice.index == 0 and isinstance(choice.text, str) and choice.logprobs is None
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_prompt_forms(server, client):
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": "Once upon"}).json()["tokens"]
    text = client.completions.create(model=MODEL, prompt="Once upon", **greedy())
    ids = client.completions.create(model=MODEL, prompt=tokens, **greedy())
    assert ids.choices[0].text == text.choices[0].text
    several = client.completions.create(model=MODEL, prompt=["Once upon", "Hi"], **greedy())
    assert [c.index for c in several.choices] == [0, 1]
    assert several.choices[0].text == text.choices[0].text
    arrays = client.completions.create(model=MODEL, prompt=[tokens, [1, 2]], **greedy())
    assert arrays.choices[0].text == text.choices[0].text


@pytest.mark.parametrize("k", [0, 1, 3])
def test_logprobs_list_the_sampled_token_and_up_to_k_others(client, k):
    r = client.completions.create(
        model=MODEL, prompt="Once upon", logprobs=k, temperature=1.0, seed=5, max_tokens=6
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert token in top and top[token] == pytest.approx(logprob)
        assert max(k, 1) <= len(top) <= k + 1
    assert "".join(lp.tokens) == r.choices[0].text


def test_echo_and_suffix(client):
    plain = client.completions.create(model=MODEL, prompt="Once", **greedy())
    echoed = client.completions.create(model=MODEL, prompt="Once", echo=True, **greedy())
    assert echoed.choices[0].text == "Once" + plain.choices[0].text
    assert client.completions.create(model=MODEL, prompt="Once", suffix="", **greedy()).choices
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="Once", suffix="The end.")
    assert caught.value.body["param"] == "suffix"


def test_add_special_tokens_and_truncation(client):
    r = client.completions.create(
        model=MODEL,
        prompt="one two three four five six seven eight",
        extra_body={"truncate_prompt_tokens": 3},
        **greedy(),
    )
    assert r.usage.prompt_tokens == 3
    r = client.completions.create(
        model=MODEL, prompt="Hi", extra_body={"add_special_tokens": False}, **greedy()
    )
    assert r.usage.prompt_tokens >= 1


def test_stream_options_rules(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="Hi", stream_options={"include_usage": True})
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Hi",
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            **greedy(max_tokens=4, extra_body={"ignore_eos": True}),
        )
    )
    assert all(c.usage is not None for c in chunks) and chunks[-1].usage.completion_tokens == 4
