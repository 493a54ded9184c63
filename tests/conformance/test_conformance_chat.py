"""Chat completions: every request field we honour, and the response objects' fields."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conformance.conftest import BOS, CHAT, MODEL, greedy, tokenize

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


def _stream(client, **kw) -> list:
    return list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            stream=True,
            **greedy(max_tokens=3, extra_body={"ignore_eos": True}, **kw),
        )
    )


def test_continuous_usage_stats_alone_turns_usage_on_as_in_vllm(client):
    """vLLM's include_usage defaults to true inside stream_options: usage so far in every
    chunk, then the final usage chunk, as with include_usage given."""
    chunks = _stream(client, stream_options={"continuous_usage_stats": True})
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks[:-1]]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 3  # role chunk first
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def test_continuous_usage_stats_with_include_usage_false_sends_no_usage(client):
    # As vLLM (its entrypoint tests pin it): include_usage false wins over continuous stats.
    options = {"include_usage": False, "continuous_usage_stats": True}
    chunks = _stream(client, stream_options=options)
    assert chunks and all(c.usage is None for c in chunks)


@pytest.mark.parametrize("options", [None, {}, {"include_usage": False}])
def test_a_stream_has_no_usage_unless_asked(client, options):
    """OpenAI's rule: usage only with include_usage true (or continuous stats, above)."""
    chunks = _stream(client, **({} if options is None else {"stream_options": options}))
    assert [c.usage for c in chunks] == [None] * len(chunks) and chunks[-1].choices


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
        prompt_cache_retention="in_memory",  # the SDK's spelling (the API reference: in-memory)
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


def test_template_options_shape_the_prompt(server, client):
    turn = [*CHAT, {"role": "assistant", "content": "Once upon"}]
    answer = tokenize(server, messages=turn)
    continued = tokenize(
        server, messages=turn, add_generation_prompt=False, continue_final_message=True
    )
    closed = tokenize(server, messages=turn, add_generation_prompt=False)
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


def test_chat_template_kwargs_reach_the_template(server, client):
    """SmolLM2's template reads add_generation_prompt; as in vLLM, chat_template_kwargs of
    that name (or continue_final_message) win over the request fields."""
    turn = [*CHAT, {"role": "assistant", "content": "Once upon"}]
    closed = tokenize(server, messages=turn, add_generation_prompt=False)
    continued = tokenize(
        server, messages=turn, add_generation_prompt=False, continue_final_message=True
    )
    assert len(continued) < len(closed) < len(tokenize(server, messages=turn))
    for kwargs, expected in [
        ({"add_generation_prompt": False}, closed),
        ({"add_generation_prompt": False, "continue_final_message": True}, continued),
    ]:
        r = client.chat.completions.create(
            model=MODEL,
            messages=turn,
            extra_body={"chat_template_kwargs": kwargs},
            **greedy(max_tokens=1),
        )
        assert r.usage.prompt_tokens == len(expected), kwargs


def test_chat_add_special_tokens_adds_the_tokenizers_bos(bos_server, bos_client):
    """Off by default for chat (the template writes the special tokens); on, the tokenizer's
    own are added too, here a BOS before the rendered conversation."""
    rendered = tokenize(bos_server, messages=CHAT)
    assert tokenize(bos_server, messages=CHAT, add_special_tokens=True) == [BOS, *rendered]
    plain = bos_client.chat.completions.create(model=MODEL, messages=CHAT, **greedy(max_tokens=1))
    with_bos = bos_client.chat.completions.create(
        model=MODEL, messages=CHAT, extra_body={"add_special_tokens": True}, **greedy(max_tokens=1)
    )
    assert plain.usage.prompt_tokens == len(rendered)
    assert with_bos.usage.prompt_tokens == len(rendered) + 1


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


# ---- each sampling field changes the output (a server that ignored it fails these) ---------
def _chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=CHAT, **kw)


@pytest.mark.parametrize(
    "limit",
    [{"extra_body": {"top_k": 1}}, {"top_p": 1e-6}, {"extra_body": {"min_p": 1.0}}],
    ids=["top_k", "top_p", "min_p"],
)
def test_keeping_only_the_top_token_samples_greedily(client, limit):
    """top_k 1, a tiny top_p, min_p 1: only the most likely token is left, so sampling at
    temperature 1 (seeded or not) gives the greedy text, which it otherwise leaves."""
    greedy_text = _chat(client, **greedy()).choices[0].message.content
    sampled = {"temperature": 1.0, "max_tokens": 8}
    assert _chat(client, seed=11, **sampled).choices[0].message.content != greedy_text
    assert _chat(client, seed=11, **sampled, **limit).choices[0].message.content == greedy_text
    assert _chat(client, **sampled, **limit).choices[0].message.content == greedy_text


def test_stop_token_ids_end_the_output_at_that_token(server, client):
    free = _chat(client, logprobs=True, **greedy())
    tokens = [e.token for e in free.choices[0].logprobs.content]
    third = tokenize(server, prompt=tokens[2], add_special_tokens=False)
    assert len(third) == 1 and tokens[2] not in tokens[:2], tokens  # one token, new here
    cut = _chat(client, extra_body={"stop_token_ids": third}, **greedy())
    assert cut.choices[0].message.content == "".join(tokens[:2])  # the stop token's text left out
    assert cut.choices[0].finish_reason == "stop"


def _end_of_turn_bias(server) -> dict:
    """A random model all but never ends a turn; this bias makes <|im_end|>, the model's EOS,
    its first choice at every step, so greedy output ends with EOS at once."""
    (eos,) = tokenize(server, prompt="<|im_end|>")
    return {"logit_bias": {str(eos): 100}}


def test_ignore_eos_runs_to_max_tokens(server, client):
    ends = _end_of_turn_bias(server)
    early = _chat(client, **greedy(max_tokens=6, **ends))
    assert early.usage.completion_tokens == 1 and early.choices[0].finish_reason == "stop"
    full = _chat(client, extra_body={"ignore_eos": True}, **greedy(max_tokens=6, **ends))
    assert full.usage.completion_tokens == 6 and full.choices[0].finish_reason == "length"


def test_min_tokens_keep_going_past_eos(server, client):
    ends = _end_of_turn_bias(server)
    r = _chat(client, extra_body={"min_tokens": 4}, **greedy(max_tokens=8, **ends))
    # EOS is held back for 4 tokens, then (biased to the top) comes at once.
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content


def test_message_name_and_tool_call_id_reach_the_template(smollm2_path):
    """SmolLM2's template reads neither; a template that reads them gets both."""
    from transformers import AutoTokenizer

    from server.handlers import render_chat
    from server.protocol import ChatCompletionRequest

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    tokenizer.chat_template = (
        "{% for m in messages %}[{{ m.role }}|{{ m.name }}|{{ m.tool_call_id }}]"
        "{{ m.content }}{% endfor %}"
    )
    messages = [
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "tool", "content": "4", "tool_call_id": "c1"},
    ]
    body = ChatCompletionRequest(model=MODEL, messages=messages)
    assert tokenizer.decode(render_chat(tokenizer, body)) == "[user|ann|]Hi[tool||c1]4"
