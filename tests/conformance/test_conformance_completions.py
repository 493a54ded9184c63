"""Legacy text completions: prompt forms, echo, logprobs, and the response fields."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conformance.conftest import BOS, MODEL, greedy, tokenize


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


def test_add_special_tokens_adds_the_tokenizers_bos(bos_server, bos_client):
    """On by default for a text prompt (vLLM); off, the prompt is the text's tokens alone."""
    bare = tokenize(bos_server, prompt="Once upon", add_special_tokens=False)
    assert tokenize(bos_server, prompt="Once upon") == [BOS, *bare]

    def prompt_tokens(**extra) -> int:
        r = bos_client.completions.create(
            model=MODEL, prompt="Once upon", extra_body=extra, **greedy(max_tokens=1)
        )
        return r.usage.prompt_tokens

    assert prompt_tokens() == len(bare) + 1
    assert prompt_tokens(add_special_tokens=False) == len(bare)


REPETITIVE = "a a a a a a a a"  # the tiny model's greedy text repeats its second token


@pytest.mark.parametrize(
    "penalty",
    [{"presence_penalty": 2}, {"frequency_penalty": 2}, {"extra_body": {"repetition_penalty": 2}}],
    ids=["presence", "frequency", "repetition"],
)
def test_penalties_break_a_repetition(client, penalty):
    def tokens(**kw) -> list[str]:
        r = client.completions.create(model=MODEL, prompt=REPETITIVE, logprobs=0, **kw)
        return r.choices[0].logprobs.tokens

    plain = tokens(**greedy(max_tokens=4))
    assert plain[1] == plain[2] == plain[3], plain
    penalized = tokens(**greedy(max_tokens=4), **penalty)
    assert penalized[:2] == plain[:2] and penalized[2] != penalized[1], penalized


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
    alone = list(  # as in vLLM, include_usage defaults to true inside stream_options
        client.completions.create(
            model=MODEL,
            prompt="Hi",
            stream=True,
            stream_options={"continuous_usage_stats": True},
            **greedy(max_tokens=2, extra_body={"ignore_eos": True}),
        )
    )
    assert all(c.usage is not None for c in alone) and alone[-1].choices == []
    # include_usage false wins: no usage at all, continuous or not (vLLM's own tests pin it).
    quiet = list(
        client.completions.create(
            model=MODEL,
            prompt="Hi",
            stream=True,
            stream_options={"include_usage": False, "continuous_usage_stats": True},
            **greedy(max_tokens=2, extra_body={"ignore_eos": True}),
        )
    )
    assert quiet and all(c.usage is None for c in quiet)


def test_prompt_logprobs_agree_with_the_logprobs_of_generated_tokens(server, client):
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": "Once upon a"}).json()["tokens"]
    first = client.completions.create(
        model=MODEL, prompt=tokens, logprobs=1, **greedy(max_tokens=1)
    )
    # Any next token will do: the prompt logprobs at that position rank the model's choices,
    # and rank 1 is the token greedy generation emitted (no re-tokenizing of its text).
    extended = [*tokens, tokens[1]]
    r = client.completions.create(
        model=MODEL, prompt=[tokens, extended], extra_body={"prompt_logprobs": 2}, **greedy()
    )
    short, long = (c.model_extra["prompt_logprobs"] for c in r.choices)
    assert short[0] is None and len(short) == len(tokens)
    for token, entry in zip(tokens[1:], short[1:], strict=True):
        assert str(token) in entry and 2 <= len(entry) <= 3
        assert entry[str(token)]["rank"] >= 1
        assert sorted(e["rank"] for e in entry.values())[:2] == [1, 2]
    for a, b in zip(long[1 : len(short)], short[1:], strict=True):  # batching moves floats
        assert a.keys() == b.keys()
        assert all(a[t]["logprob"] == pytest.approx(b[t]["logprob"], abs=1e-4) for t in a)
    last = next(entry for entry in long[-1].values() if entry["rank"] == 1)
    assert last["logprob"] == pytest.approx(first.choices[0].logprobs.token_logprobs[0], abs=1e-4)
    assert last["decoded_token"] == first.choices[0].text


def test_prompt_logprobs_in_chat_and_not_when_streaming(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}],
        extra_body={"prompt_logprobs": 0}, **greedy(max_tokens=2),
    )  # fmt: skip
    entries = r.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == r.usage.prompt_tokens
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in entries[1:])
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model=MODEL, prompt="Hi", stream=True, extra_body={"prompt_logprobs": 1}
        )
    assert caught.value.body["param"] == "prompt_logprobs"


def test_echo_with_logprobs_covers_the_prompt_tokens(server, client):
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": "Once upon a"}).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt=tokens, echo=True, logprobs=2, **greedy())
    lp = r.choices[0].logprobs
    generated = r.usage.completion_tokens
    assert len(lp.tokens) == len(tokens) + generated
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) for v in lp.token_logprobs[1:])
    pairs = zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True)
    assert all(t in top and len(top) <= 3 for t, top in pairs)
    assert r.choices[0].model_extra["prompt_logprobs"] is None  # not asked for (vLLM: null)
    streamed = list(
        client.completions.create(
            model=MODEL, prompt=tokens, echo=True, logprobs=2, stream=True, **greedy()
        )
    )
    first = streamed[0].choices[0]
    assert first.text == r.choices[0].text[: len(first.text)] and first.logprobs.tokens
    assert first.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1 : len(tokens)])


def test_provenance_is_opt_in_and_covers_every_token(client):
    plain = client.completions.create(model=MODEL, prompt="Hi", **greedy())
    assert "provenance" not in (plain.choices[0].model_extra or {})
    r = client.completions.create(
        model=MODEL, prompt="Hi", extra_body={"return_provenance": True}, **greedy()
    )
    entries = r.choices[0].model_extra["provenance"]
    assert len(entries) == r.usage.completion_tokens
    assert {e["source"] for e in entries} == {"plain"}  # no decoder drafts on this server
    assert "".join(e["token"] for e in entries) == r.choices[0].text
    chunks = client.completions.create(
        model=MODEL, prompt="Hi", stream=True, extra_body={"return_provenance": True}, **greedy()
    )
    streamed = [e for c in chunks for ch in c.choices for e in ch.model_extra.get("provenance", [])]
    assert streamed == entries


def test_a_prompt_of_no_known_form_says_which_forms_exist(server):
    for prompt in (["a", [1, 2]], 5, [[1, "x"]], [1.5]):
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": prompt})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "prompt"
        assert error["message"] == (
            "prompt: prompt must be a string, a list of strings, a list of token ids or a list "
            "of token-id lists"
        )
