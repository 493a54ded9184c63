"""Structured output through the API: response_format and vLLM's guided fields hold the
output to its constraint (streaming too), and a constraint that cannot be used is a 400.

The tiny model's text is random, which is what makes these checks sharp: nothing but the
constraint makes its output parse.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.conformance.conftest import CHAT, MODEL

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["ok", "size", "colour", "tags"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "thing", "description": "A thing.", "schema": SCHEMA, "strict": True},
}


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _sampled(**kw):
    return {"temperature": 1.0, "max_tokens": 120, **kw}


def test_json_schema_output_validates(client):
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, response_format=JSON_SCHEMA_FORMAT, n=4, **_sampled(seed=1)
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_streamed_json_validates(client):
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        response_format=JSON_SCHEMA_FORMAT,
        stream=True,
        **_sampled(seed=2),
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_composes_with_logit_bias(server, client):
    """Any JSON object: with random keys it would run long, so a bias pushes "}": the
    constraint and the bias both apply, and the object still parses."""
    ids = [httpx.post(server.url + "/tokenize", json={"prompt": p}).json()["tokens"][-1]
           for p in ("{}", "}")]  # fmt: skip
    r = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        response_format={"type": "json_object"},
        logit_bias={str(i): 40 for i in ids},
        **_sampled(seed=2),
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
        ({"guided_choice": ["left", "right", "up"]}, lambda t: t in ("left", "right", "up")),
        (
            {"guided_grammar": 'start: "(" num ")"\nnum: /[0-9]+/'},
            lambda t: re.fullmatch(r"\(\d+\)", t),
        ),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) or True),
        ({"guided_json": json.dumps(SCHEMA)}, lambda t: json.loads(t)),
        ({"structured_outputs": {"choice": ["x", "y"]}}, lambda t: t in ("x", "y")),
        (
            # Random keys would run long: SmolLM2's "{}" and "}" tokens pushed up.
            {"structured_outputs": {"json_object": True}, "logit_bias": {"6150": 40, "109": 40}},
            lambda t: isinstance(json.loads(t), dict),
        ),
    ],
    ids=[
        "regex",
        "choice",
        "grammar",
        "json",
        "json-text",
        "structured-choice",
        "structured-object",
    ],
)
def test_vllm_guided_fields(client, extra, check):
    r = client.completions.create(
        model=MODEL, prompt="Answer:", extra_body=extra, **_sampled(seed=3, max_tokens=300)
    )
    assert r.choices[0].finish_reason == "stop"
    assert check(r.choices[0].text), r.choices[0].text


def test_whitespace_pattern_is_honoured(client):
    r = client.completions.create(
        model=MODEL,
        prompt="Answer:",
        extra_body={"guided_json": SCHEMA, "guided_whitespace_pattern": ""},
        **_sampled(seed=4),
    )
    assert not re.search(r"\s", r.choices[0].text.replace('"', ""))  # no whitespace at all


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"response_format": _schema_format({"type": "array", "uniqueItems": True})},
         "response_format", "uniqueItems"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema", "required"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
         "response_format.json_schema.name", "required"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        # Keys response_format does not define: refused, not ignored (a schema here would be).
        ({"response_format": {"type": "json_object", "schema": SCHEMA}},
         "response_format.schema", "not a field"),
        ({"response_format": {"type": "text", "foo": 1}}, "response_format.foo", "not a field"),
        ({"response_format": {**JSON_SCHEMA_FORMAT, "schema": SCHEMA}},
         "response_format.schema", "not a field"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": SCHEMA, "mode": "lax"}}},
         "response_format.json_schema.mode", "not a field"),
        ({"guided_regex": "[a-"}, "guided_regex", "regex"),
        ({"guided_grammar": "start: ("}, "guided_grammar", "guided_grammar"),
        # Only the model's vocabulary says this one is wrong: still before the stream starts.
        ({"guided_grammar": 'start: <|nonexistent|> "x"'}, "guided_grammar", "special token"),
        ({"guided_choice": []}, "guided_choice", "choices"),
        ({"guided_json": "{not json"}, "guided_json", "JSON"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "at most one"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}},
         "structured_outputs", "exactly one"),
        ({"guided_regex": "a", "guided_whitespace_pattern": " "},
         "guided_whitespace_pattern", "JSON"),
        # With no JSON output it would shape nothing.
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "JSON"),
        ({"guided_whitespace_pattern": "", "response_format": {"type": "text"}},
         "guided_whitespace_pattern", "JSON"),
    ],
)  # fmt: skip
def test_unusable_constraints_are_a_400_naming_the_field(server, body, param, words):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": CHAT, "stream": True, **body},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_constraints_over_the_websocket(server):
    from websockets.sync.client import connect

    with connect(server.url.replace("http", "ws") + "/v1/ws") as ws:
        ws.send(json.dumps({"request_id": "c", "model": MODEL, "messages": CHAT,
                            "guided_choice": ["yes", "no"], "temperature": 1.0}))  # fmt: skip
        text = ""
        while (message := json.loads(ws.recv())).get("type") != "done":
            text += "".join(c["delta"].get("content") or "" for c in message["choices"])
    assert text in ("yes", "no")


def test_openai_client_parse_helper(client):
    """The SDK's own structured-output helper reads our JSON back into its model."""
    from pydantic import BaseModel

    class Thing(BaseModel):
        ok: bool
        size: int

    r = client.chat.completions.parse(
        model=MODEL, messages=CHAT, response_format=Thing, **_sampled(seed=5)
    )
    assert isinstance(r.choices[0].message.parsed, Thing)


def test_openai_client_refuses_nothing_we_accept(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL, messages=CHAT, response_format={"type": "json_schema"}
        )


def test_banned_words_hold_back_and_never_stream_the_phrase(server, client):
    cat = httpx.post(server.url + "/tokenize", json={"prompt": " cat"}).json()["tokens"][-1]
    tempt = {"logit_bias": {str(cat): 9}, "temperature": 1.0, "max_tokens": 30, "n": 4}
    free = client.completions.create(model=MODEL, prompt="Once", seed=1, **tempt)
    assert any(re.search(r"(?<!\w)cat(?!\w)", c.text) for c in free.choices)  # tempted
    body = {"banned_words": ["Cat"]}
    full = client.completions.create(model=MODEL, prompt="Once", seed=1, extra_body=body, **tempt)
    chunks = client.completions.create(
        model=MODEL, prompt="Once", seed=1, stream=True, extra_body=body, **tempt
    )
    streamed = ["", "", "", ""]
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] += c.text
    texts = [c.text for c in sorted(full.choices, key=lambda c: c.index)]
    assert streamed == texts
    assert not any(re.search(r"(?<!\w)cat(?!\w)", t, re.IGNORECASE) for t in texts)


def test_banned_words_are_checked(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="x", extra_body={"banned_words": ["..."]})
    assert caught.value.body["param"] == "banned_words"


def test_nulls_inside_response_format_count_as_absent(server):
    wrapper = {**JSON_SCHEMA_FORMAT["json_schema"], "description": None, "strict": None}
    text = {"type": "text", "json_schema": None}
    for fmt in (text, {"type": "json_schema", "json_schema": wrapper}):
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "response_format": fmt}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
