"""Every error status the server answers, in OpenAI's shape, before any stream starts."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import websockets

from server.auth import key_subprotocol
from tests.server_process import ServerProcess

MODEL = "tiny"
CHAT = [{"role": "user", "content": "Hi"}]
KEY = "sk-test-secret"


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir, tmp_path_factory):
    """One running sequence at most and no queue: the second concurrent request gets 429."""
    tmp = tmp_path_factory.mktemp("restricted")
    config = tmp / "config.yaml"
    config.write_text(
        f"model: {tiny_chat_model_dir}\nscheduler:\n  max_num_seqs: 1\n  max_model_len: 1024\n"
    )
    proc = ServerProcess(
        "--config",
        str(config),
        "--served-model-name",
        MODEL,
        "--max-queued-requests",
        "0",
        env={"SPECSERVE_API_KEYS": KEY},
        log_path=tmp / "server.log",
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def post(server, path, body, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60, **kw)


def assert_openai_error(r: httpx.Response, status: int, param=None, contains=""):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert contains in err["message"]
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": "hot"}, "temperature"),  # pydantic's error, as a 400 not a 422
        ({"n": 0}, "n"),
        ({"logit_bias": {"999999": 5}}, "logit_bias"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_invalid_parameters_are_400_even_when_streaming(server, extra, param, stream):
    r = post(
        server,
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "stream": stream, **extra},
    )
    assert_openai_error(r, 400, param=param)


@pytest.mark.parametrize(
    "extra,param,needs",
    [
        ({"stop": 5}, "stop", ["valid string", "valid list"]),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", ["valid string"]),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}},
         "response_format.json_schema.schema", ["object"]),
    ],
)  # fmt: skip
def test_a_field_of_several_types_is_named_without_the_type_tried(server, extra, param, needs):
    body = {"model": MODEL, "messages": CHAT, **extra}
    err = assert_openai_error(post(server, "/v1/chat/completions", body), 400, param=param)
    assert all(words in err["message"] for words in needs), err["message"]


def test_missing_messages_is_400(server):
    assert_openai_error(post(server, "/v1/chat/completions", {"model": MODEL}), 400, "messages")


def test_context_length_error_states_both_numbers(server):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1030, "stream": True}
    r = post(server, "/v1/completions", body)
    err = assert_openai_error(r, 400, contains="maximum context length is 1024 tokens")
    assert "1030" in err["message"] and err["code"] == "context_length_exceeded"


def test_unknown_model_is_404(server):
    r = post(server, "/v1/chat/completions", {"model": "gpt-9", "messages": CHAT})
    assert_openai_error(r, 404, param="model", contains="gpt-9")


def test_the_bearer_scheme_is_case_insensitive_and_a_bare_key_is_refused(server):
    body = {"model": MODEL, "prompt": "a", "max_tokens": 1}
    for header, status in [(f"bearer {KEY}", 200), (f"BEARER {KEY}", 200), (KEY, 401)]:
        r = httpx.post(
            server.url + "/v1/completions", json=body, headers={"Authorization": header}, timeout=60
        )
        assert r.status_code == status, (header, r.text)


@pytest.mark.parametrize("key", [None, "wrong"])
def test_missing_or_wrong_api_key_is_401(server, key):
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT}, key=key)
    assert_openai_error(r, 401)
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
    # Health and metrics stay open for probes and scrapers.
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_full_queue_is_429_with_retry_after(server):
    # ~1000 decode steps: still running when the second request arrives right after.
    body = {"model": MODEL, "prompt": "a", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, headers=headers, timeout=60
    ) as long_running:
        assert long_running.status_code == 200
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": "b", "max_tokens": 2})
        assert_openai_error(r, 429)
        assert r.headers["retry-after"] == "1"
    # Once the first is gone (disconnected and aborted), requests are accepted again.
    for _ in range(50):
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": "b", "max_tokens": 2})
        if r.status_code == 200:
            break
        time.sleep(0.1)
    assert r.status_code == 200


def test_a_burst_beyond_the_limit_gets_429_for_all_but_one(server):
    body = {"model": MODEL, "prompt": "a", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}

    async def main():
        statuses: list[int] = []
        all_answered = asyncio.Event()
        async with httpx.AsyncClient(timeout=60, headers=headers) as client:

            async def one():
                async with client.stream("POST", server.url + "/v1/completions", json=body) as r:
                    statuses.append(r.status_code)
                    if len(statuses) == 8:
                        all_answered.set()
                    await all_answered.wait()  # keep the accepted stream open until then

            await asyncio.gather(*(one() for _ in range(8)))
        return statuses

    statuses = asyncio.run(main())
    assert sorted(statuses) == [200] + [429] * 7


def test_websocket_needs_the_api_key(server):
    url = server.url.replace("http", "ws") + "/v1/ws"
    request = {"request_id": "r", "model": MODEL, "prompt": "a", "max_tokens": 2}

    async def denied():
        async with websockets.connect(url) as ws:
            return json.loads(await ws.recv())  # refused at once, then closed

    async def allowed():
        headers = {"Authorization": f"Bearer {KEY}"}
        async with websockets.connect(url, additional_headers=headers) as ws:
            await ws.send(json.dumps(request))
            return json.loads(await ws.recv())

    async def allowed_by_subprotocol():
        # Browsers cannot set headers: the key rides as a subprotocol; the server picks
        # "specserve", never echoing the key.
        offered = ["specserve", key_subprotocol(KEY)]
        async with websockets.connect(url, subprotocols=offered) as ws:
            assert ws.subprotocol == "specserve"
            await ws.send(json.dumps(request))
            return json.loads(await ws.recv())

    refused = asyncio.run(denied())
    assert refused["type"] == "error" and refused["error"]["type"] == "authentication_error"
    answer = asyncio.run(allowed())
    assert answer["request_id"] == "r" and answer.get("type") != "error"
    answer = asyncio.run(allowed_by_subprotocol())
    assert answer["request_id"] == "r" and answer.get("type") != "error"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"model": "tiny",, "prompt": "a"}', "the body is not valid JSON: Expecting property "
         "name enclosed in double quotes at character 17"),
        (b'{"model": "tiny", "prompt": "a"', "the body is not valid JSON: Expecting ',' "
         "delimiter at character 31"),
        (b"", "the body is empty: a JSON object is expected"),
        (b'["model", "tiny"]', "the body must be a JSON object: Input should be a valid "
         "dictionary or object to extract fields from"),
    ],
)  # fmt: skip
def test_a_body_that_is_not_a_json_object_is_400_naming_no_parameter(server, body, message):
    r = httpx.post(
        server.url + "/v1/completions",
        content=body,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        timeout=60,
    )
    err = assert_openai_error(r, 400)
    assert err["message"] == message and err["param"] is None


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "top_p"])
def test_json_infinity_and_nan_are_400(server, field):
    for value in (float("inf"), float("nan")):
        body = {"model": MODEL, "prompt": "a", "max_tokens": 2, "min_tokens": 1, field: value}
        r = httpx.post(  # json.dumps writes the literals Infinity / NaN, as some clients do
            server.url + "/v1/completions",
            content=json.dumps(body),
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
            timeout=60,
        )
        assert_openai_error(r, 400, contains=field)
