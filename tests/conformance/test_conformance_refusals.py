"""No request field is accepted and ignored: each one we do not implement is a 400 naming it
(when given a value that asks for something), unknown fields are refused as OpenAI refuses
them, and the neutral value of a refused field is accepted."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai
import pytest

from tests.conformance.conftest import CHAT, MODEL

# (field, a value that asks for something, its neutral value or None), from the OpenAI API
# reference (chat and legacy completions) and vLLM's documented extra parameters.
REFUSED_FIELDS = [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}], []),
    ("tool_choice", "required", "none"),
    ("functions", [{"name": "f", "parameters": {}}], []),
    ("function_call", "auto", "none"),
    ("audio", {"voice": "alloy", "format": "wav"}, None),
    ("modalities", ["text", "audio"], ["text"]),
    ("prediction", {"type": "content", "content": "x"}, None),
    ("web_search_options", {}, None),
    ("reasoning_effort", "low", None),
    ("verbosity", "low", None),
    ("store", True, False),
    ("service_tier", "flex", "auto"),
    ("use_beam_search", True, False),
    ("length_penalty", 2.0, 1.0),
    ("guided_decoding_backend", "xgrammar", "auto"),
    ("structural_tag", "{}", None),
    ("bad_words", ["hello"], []),
    ("allowed_token_ids", [1, 2, 3], None),
    ("include_stop_str_in_output", True, False),
    ("skip_special_tokens", False, True),
    ("spaces_between_special_tokens", False, True),
    ("logits_processors", ["x"], None),
    ("return_tokens_as_token_ids", True, False),
    ("return_token_ids", True, False),
    ("prompt_cache_retention", "24h", "in-memory"),
    ("priority", 1, 0),
    ("request_id", "mine", None),
    ("chat_template", "{{ messages }}", None),
    ("documents", [{"text": "d"}], None),
    ("mm_processor_kwargs", {}, None),
    ("cache_salt", "s", None),
    ("kv_transfer_params", {}, None),
    ("vllm_xargs", {}, None),
]
COMPLETION_ONLY = [("suffix", "the end", ""), ("prompt_embeds", "AAAA", None)]
# Fields OpenAI (its SDK) or vLLM define that we do not implement and that have no neutral
# value worth a row of REFUSED: refused at any value as unknown fields are (the README's
# "not implemented" rows).
UNRECOGNIZED = [
    "include_reasoning",
    "thinking_token_budget",
    "media_io_kwargs",
    "watermarking",
    "truncation_side",
    "logprob_token_ids",
    "session_id",
    "return_prompt_text",
    "moderation",
    "prompt_cache_options",
]


def _post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


def _chat(**fields):
    return {"model": MODEL, "messages": CHAT, "max_tokens": 2, **fields}


def _completion(**fields):
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **fields}


def _assert_refused(response, field):
    assert response.status_code == 400, (field, response.text)
    error = response.json()["error"]
    assert error["param"] == field and f"`{field}`" in error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("field", "value", "neutral"), REFUSED_FIELDS, ids=lambda v: str(v)[:20])
def test_refused_chat_field_is_a_400_naming_it(server, field, value, neutral):
    _assert_refused(_post(server, "/v1/chat/completions", _chat(**{field: value})), field)
    if neutral is not None:
        r = _post(server, "/v1/chat/completions", _chat(**{field: neutral}))
        assert r.status_code == 200, (field, r.text)


@pytest.mark.parametrize(
    ("field", "value", "neutral"), REFUSED_FIELDS + COMPLETION_ONLY, ids=lambda v: str(v)[:20]
)
def test_refused_completion_field_is_a_400_naming_it(server, field, value, neutral):
    _assert_refused(_post(server, "/v1/completions", _completion(**{field: value})), field)
    if neutral is not None:
        r = _post(server, "/v1/completions", _completion(**{field: neutral}))
        assert r.status_code == 200, (field, r.text)


def test_refused_fields_reach_openai_clients_as_bad_request(client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=CHAT, tools=tools)
    assert caught.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError):  # also before a stream would start
        client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, tools=tools)


def test_unknown_fields_are_refused_as_openai_does_naming_every_one(server):
    r = _post(server, "/v1/chat/completions", _chat(colour="blue", flavour=1))
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["message"] == "Unrecognized request argument supplied: colour, flavour"
    assert error["param"] == "colour"


@pytest.mark.parametrize("field", UNRECOGNIZED)
def test_defined_fields_we_do_not_implement_are_refused_at_any_value(server, field):
    for value in (True, False, 0, "x", {}):
        r = _post(server, "/v1/chat/completions", _chat(**{field: value}))
        assert r.status_code == 400, (field, value, r.text)
        error = r.json()["error"]
        assert error["message"] == f"Unrecognized request argument supplied: {field}"
        assert error["param"] == field


def test_explicit_nulls_count_as_absent(server):
    nulls = {name: None for name, _, _ in REFUSED_FIELDS + [(f, 0, 0) for f in UNRECOGNIZED]}
    r = _post(server, "/v1/chat/completions", _chat(**nulls, seed=None, stop=None, n=None))
    assert r.status_code == 200, r.text


def test_nulls_inside_request_objects_count_as_absent(server):
    options = {"include_usage": None, "continuous_usage_stats": None, "include_obfuscation": None}
    speculative = {"method": "autoregressive", "num_speculative_tokens": None}
    message = {"role": "user", "content": [{"type": "text", "text": "Hi"}], "name": None}
    body = _chat(messages=[message], stream=True, stream_options=options, speculative=speculative)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and '"usage"' not in "".join(lines[:-1])


def test_obfuscation_padding_is_refused(server):
    body = _chat(stream=True, stream_options={"include_obfuscation": True})
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "stream_options.include_obfuscation"
    body = _chat(stream=True, stream_options={"include_obfuscation": False})
    assert _post(server, "/v1/chat/completions", body).status_code == 200


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "type"),
        ({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}, "type"),
        ({"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}, "tool_calls"),
        ({"role": "assistant", "content": "x", "function_call": {"name": "f"}}, "function_call"),
        ({"role": "assistant", "audio": {"id": "a"}}, "audio"),
        ({"role": "user", "content": "x", "colour": "blue"}, "colour"),
        (
            {"role": "assistant", "content": "x", "annotations": [{"type": "url_citation"}]},
            "annotations",
        ),
    ],
)
def test_message_fields_we_cannot_honour_are_refused(server, message, field):
    r = _post(server, "/v1/chat/completions", _chat(messages=[*CHAT, message]))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith("messages.1") and field in error["message"]


def test_a_response_message_echoed_back_is_accepted(client):
    """What clients append to the conversation: the response's own message object."""
    first = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3)
    message = first.choices[0].message.model_dump()  # refusal, tool_calls etc. as null
    second = client.chat.completions.create(
        model=MODEL, messages=[*CHAT, message, {"role": "user", "content": "More."}], max_tokens=3
    )
    assert second.choices[0].message.content is not None


def test_readme_compatibility_table_lists_every_refused_field():
    from server.field_policy import REFUSED

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    table = readme[readme.index("### Compatibility") :]
    first_cells = re.findall(r"^\| (`[^|]+) \|[^|]*\| refused", table, flags=re.M)
    refused_rows = {name for cell in first_cells for name in re.findall(r"`([a-z_]+)`", cell)}
    assert refused_rows == set(REFUSED), refused_rows ^ set(REFUSED)
    listed_here = {name for name, _, _ in REFUSED_FIELDS + COMPLETION_ONLY}
    assert listed_here == set(REFUSED), listed_here ^ set(REFUSED)
    cells = re.findall(r"^\| (`[^|]+) \|[^|]*\| not implemented: 400", table, flags=re.M)
    unrecognized_rows = {name for cell in cells for name in re.findall(r"`([a-z_]+)`", cell)}
    assert unrecognized_rows == set(UNRECOGNIZED), unrecognized_rows ^ set(UNRECOGNIZED)
