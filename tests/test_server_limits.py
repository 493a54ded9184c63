"""Request limits (issue 11): a request beyond one gets an OpenAI-shaped 400 naming the
parameter before any work; a body beyond the size limit a 413 before it is parsed, with or
without Content-Length; an oversized WebSocket message closes that socket (1009). The server
here runs with small limits so that each is cheap to cross."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets

from tests.server_process import ServerProcess
from tests.test_server_errors import assert_openai_error

MODEL = "tiny"
CHAT = [{"role": "user", "content": "Hi"}]
LIMITS = {
    "--max-n": 4,
    "--max-prompts": 3,
    "--max-stop": 2,
    "--max-stop-length": 8,
    "--max-stop-token-ids": 2,
    "--max-logit-bias": 2,
    "--max-top-logprobs": 5,
    "--max-messages": 3,
    "--max-content-parts": 2,
    "--max-body-bytes": 20000,
}


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir, tmp_path_factory):
    args = [str(a) for pair in LIMITS.items() for a in pair]
    proc = ServerProcess(
        "--model", str(tiny_chat_model_dir), "--served-model-name", MODEL, *args,
        log_path=tmp_path_factory.mktemp("limits") / "server.log",
    )  # fmt: skip
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def chat(server, **fields):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, **fields}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def complete(server, **fields):
    body = {"model": MODEL, "prompt": "a", "max_tokens": 2, **fields}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 5}, "n"),
        ({"stop": ["a", "b", "c"]}, "stop"),
        ({"stop": "123456789"}, "stop"),
        ({"stop_token_ids": [1, 2, 3]}, "stop_token_ids"),
        ({"logit_bias": {"1": 1, "2": 1, "3": 1}}, "logit_bias"),
        ({"logprobs": True, "top_logprobs": 6}, "top_logprobs"),
        ({"messages": CHAT * 4}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 3}]},
         "messages[0].content"),
    ],
)  # fmt: skip
def test_chat_beyond_a_limit_is_a_400_naming_it(server, fields, param):
    err = assert_openai_error(chat(server, **fields), 400, param=param)
    assert err["code"] == "invalid_value"
    assert "at most" in err["message"] or "[0, 5]" in err["message"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": ["a", "b", "c", "d"]}, "prompt"),
        ({"prompt": ["a"], "n": 5}, "n"),
        ({"logprobs": 6}, "logprobs"),
    ],
)
def test_completion_beyond_a_limit_is_a_400_naming_it(server, fields, param):
    r = complete(server, **fields)
    assert_openai_error(r, 400, param=param)


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (CHAT * 4, "messages"),
        ([{"role": "user", "content": [{"type": "text", "text": "a"}] * 3}], "messages[0].content"),
    ],
)
def test_tokenize_holds_chat_messages_to_the_same_limits(server, messages, param):
    body = {"model": MODEL, "messages": messages}
    r = httpx.post(server.url + "/tokenize", json=body, timeout=60)
    assert_openai_error(r, 400, param=param)
    at_limit = {"model": MODEL, "messages": CHAT * 3}
    assert httpx.post(server.url + "/tokenize", json=at_limit, timeout=60).status_code == 200


def test_requests_at_the_limits_are_served(server):
    r = chat(
        server, n=4, stop=["ab", "12345678"], logit_bias={"1": 1, "2": -1},
        logprobs=True, top_logprobs=5, stop_token_ids=[1, 2], messages=CHAT * 3,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 4
    r = complete(server, prompt=["a", "b", "c"], logprobs=5)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3


def test_a_body_over_the_size_limit_is_a_413_before_parsing(server):
    big = {"model": MODEL, "prompt": "a" * 30000, "max_tokens": 2}
    r = httpx.post(server.url + "/v1/completions", json=big, timeout=60)
    err = assert_openai_error(r, 413, contains="20000 bytes")
    assert err["code"] == "too_large"

    def chunked():  # no Content-Length: the size is only known while reading
        data = json.dumps(big).encode()
        for i in range(0, len(data), 4096):
            yield data[i : i + 4096]

    r = httpx.post(
        server.url + "/v1/completions", content=chunked(), timeout=60,
        headers={"content-type": "application/json"},
    )  # fmt: skip
    assert_openai_error(r, 413)
    assert complete(server).status_code == 200  # and the server goes on serving


def test_an_oversized_websocket_message_closes_that_socket_only(server):
    url = server.url.replace("http", "ws") + "/v1/ws"
    request = {"request_id": "r", "model": MODEL, "prompt": "a", "max_tokens": 2}

    async def main():
        async with websockets.connect(url) as fine, websockets.connect(url) as big:
            await big.send(json.dumps({**request, "prompt": "a" * 30000}))
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await big.recv()
            await fine.send(json.dumps(request))
            return closed.value.rcvd.code, json.loads(await fine.recv())

    code, answer = asyncio.run(main())
    assert code == 1009  # message too big
    assert answer["request_id"] == "r" and answer.get("type") != "error"
