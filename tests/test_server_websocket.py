"""The WebSocket protocol: chunks like SSE, a done message, cancel, concurrent requests."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_server):
    """A fresh server for this module (see conftest.tiny_server)."""
    return tiny_server


def ws_url(server) -> str:
    return server.url.replace("http://", "ws://") + "/v1/ws"


async def collect(ws, until_done: set[str]) -> dict[str, list[dict]]:
    """Messages per request_id until every id in ``until_done`` has its final message."""
    by_id: dict[str, list[dict]] = {}
    pending = set(until_done)
    while pending:
        message = json.loads(await asyncio.wait_for(ws.recv(), timeout=60))
        by_id.setdefault(message["request_id"], []).append(message)
        if message.get("type") in ("done", "error"):
            pending.discard(message["request_id"])
    return by_id


def test_chat_over_websocket_matches_sse(server):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "temperature": 0,
        "max_tokens": 8,
    }
    sse = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()

    async def main():
        async with websockets.connect(ws_url(server)) as ws:
            await ws.send(json.dumps({**body, "request_id": "r1"}))
            return (await collect(ws, {"r1"}))["r1"]

    messages = asyncio.run(main())
    assert messages[-1] == {"type": "done", "request_id": "r1"}
    chunks = messages[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == sse["choices"][0]["message"]["content"]


def test_two_concurrent_requests_and_a_cancel(server):
    long = {"model": MODEL, "prompt": "go", "max_tokens": 300, "ignore_eos": True}
    short = {"model": MODEL, "prompt": "hi", "max_tokens": 5, "ignore_eos": True}

    async def main():
        async with websockets.connect(ws_url(server)) as ws:
            await ws.send(json.dumps({**long, "request_id": "long"}))
            await ws.send(json.dumps({**short, "request_id": "short"}))
            first = json.loads(await ws.recv())
            await ws.send(json.dumps({"type": "cancel", "request_id": "long"}))
            rest = await collect(ws, {"long", "short"})
            rest.setdefault(first["request_id"], []).insert(0, first)
            return rest

    by_id = asyncio.run(main())
    assert by_id["short"][-1] == {"type": "done", "request_id": "short"}
    short_text = "".join(c["choices"][0]["text"] for c in by_id["short"][:-1])
    assert short_text
    assert by_id["long"][-1] == {"type": "done", "request_id": "long", "cancelled": True}
    long_tokens = len(by_id["long"]) - 1
    assert long_tokens < 300  # cancelled long before max_tokens


def test_bad_messages_get_error_messages_and_the_connection_survives(server):
    async def main():
        async with websockets.connect(ws_url(server)) as ws:
            await ws.send("not json")
            not_json = json.loads(await ws.recv())
            await ws.send(
                json.dumps({"request_id": "x", "model": MODEL, "prompt": "a", "temperature": -3})
            )
            bad_param = json.loads(await ws.recv())
            await ws.send(
                json.dumps({"request_id": "z", "model": MODEL, "prompt": "a", "stream": False})
            )
            not_streamed = json.loads(await ws.recv())
            await ws.send(
                json.dumps({"request_id": "y", "model": MODEL, "prompt": "a", "max_tokens": 2})
            )
            good = await collect(ws, {"y"})
            return not_json, bad_param, not_streamed, good

    not_json, bad_param, not_streamed, good = asyncio.run(main())
    assert not_streamed["type"] == "error" and not_streamed["error"]["param"] == "stream"
    assert not_json["type"] == "error" and not_json["error"]["type"] == "invalid_request_error"
    assert bad_param["type"] == "error" and bad_param["error"]["param"] == "temperature"
    assert good["y"][-1]["type"] == "done"
