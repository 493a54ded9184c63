"""Fuzzing the OpenAI routes of a real server (issue 11): bodies built from every parameter the
protocol knows, with values of every JSON type (and JSON's non-standard NaN/Infinity literals),
nested and out of range. Whatever arrives, the answer is never a 5xx, always comes (no hang),
and a 4xx is OpenAI-shaped; a streamed 200 ends with [DONE]. Bounded to run in CI in about a
minute; HYPOTHESIS_EXAMPLES raises the count for a longer hunt."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODEL = "tiny"
EXAMPLES = int(os.environ.get("HYPOTHESIS_EXAMPLES", "120"))

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.integers(-3, 300),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(-3, 3),
    st.text(max_size=12),
    st.sampled_from(["", "tiny", "user", "assistant", "tool", "developer", "text", "system"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=8,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), values)},
        optional={
            "content": st.one_of(
                st.text(max_size=20),
                st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text()})),
                values,
            )
        },
    ),
    max_size=4,
)
SAMPLING = [
    "temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty",
    "logit_bias", "user", "stream", "stream_options", "top_k", "min_p", "repetition_penalty",
    "min_tokens", "ignore_eos", "stop_token_ids", "speculative", "logprobs",
]  # fmt: skip


def bodies(kind: str):
    fields = {name: values for name in SAMPLING}
    fields["max_tokens"] = st.one_of(st.integers(-2, 6), values)
    if kind == "chat":
        fields |= {"top_logprobs": values, "max_completion_tokens": st.integers(-1, 6)}
        required = {"model": st.one_of(st.just(MODEL), values), "messages": messages}
    else:
        fields |= {"echo": values}
        required = {"model": st.one_of(st.just(MODEL), values), "prompt": st.one_of(
            st.text(max_size=30), st.lists(st.integers(-5, 400), max_size=6), values)}
    return st.fixed_dictionaries(required, optional=fields)


def check(server, path: str, body: dict) -> None:
    # allow_nan: send JSON's NaN/Infinity literals as a careless client would.
    data = json.dumps(body, allow_nan=True)
    headers = {"content-type": "application/json"}
    with httpx.stream("POST", server.url + path, content=data, headers=headers, timeout=60) as r:
        raw = r.read().decode()
    assert r.status_code < 500, (r.status_code, raw, data)
    if r.status_code >= 400:
        error = json.loads(raw)["error"]
        assert set(error) == {"message", "type", "param", "code"}, raw
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert raw.rstrip().endswith("data: [DONE]"), raw[-300:]
        assert '"error"' not in raw, raw  # a 200 stream that then failed
    else:
        assert "choices" in json.loads(raw), raw


@pytest.mark.parametrize(("kind", "path"), [("chat", "/v1/chat/completions"),
                                             ("completion", "/v1/completions")])  # fmt: skip
def test_no_body_makes_a_5xx_or_a_hang(tiny_server, kind, path):
    @settings(
        max_examples=EXAMPLES // 2, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )  # fmt: skip
    @given(body=bodies(kind))
    def run(body):
        check(tiny_server, path, body)

    run()
    assert httpx.get(tiny_server.url + "/health", timeout=10).status_code == 200
