"""Input errors that used to escape as 5xx (issue 11 item 3): a chat template that refuses the
conversation is a 400 over HTTP and an error for that request alone over a WebSocket (the
connection and its other requests go on); an unexpected failure inside a stream still ends it
with an error event and [DONE], logged as a 500."""

from __future__ import annotations

import asyncio
import json
import shutil
import types

import httpx
import pytest
import websockets

from tests.server_process import ServerProcess

MODEL = "tiny"
# A real template's role rule (many models' templates raise like this for roles they lack).
STRICT_TEMPLATE = """{%- for message in messages -%}
{%- if message['role'] not in ['system', 'user', 'assistant'] -%}
{{ raise_exception('Roles must be system, user or assistant, not ' + message['role']) }}
{%- endif -%}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
"""
REFUSED = [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "42"}]


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("strict-template")
    model = tmp / "model"
    shutil.copytree(tiny_chat_model_dir, model)
    (model / "chat_template.jinja").write_text(STRICT_TEMPLATE)
    proc = ServerProcess(
        "--model", str(model), "--served-model-name", MODEL, log_path=tmp / "server.log"
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_a_template_that_refuses_the_messages_is_a_400(server):
    for stream in (False, True):
        body = {"model": MODEL, "messages": REFUSED, "max_tokens": 2, "stream": stream}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages" and "not tool" in err["message"]
    ok = {"model": MODEL, "messages": REFUSED[:1], "max_tokens": 2}
    assert httpx.post(server.url + "/v1/chat/completions", json=ok, timeout=60).status_code == 200


def test_on_a_websocket_the_refused_request_fails_alone(server):
    url = server.url.replace("http", "ws") + "/v1/ws"

    async def main():
        async with websockets.connect(url) as ws:
            good = {"model": MODEL, "messages": REFUSED[:1], "max_tokens": 8, "ignore_eos": True}
            await ws.send(json.dumps({"request_id": "good", **good}))
            await ws.send(json.dumps({"request_id": "bad", "model": MODEL, "messages": REFUSED}))
            await ws.send(json.dumps({"request_id": "after", **good}))
            seen: dict[str, list[dict]] = {}
            while not all(
                any(m.get("type") in ("done", "error") for m in seen.get(r, []))
                for r in ("good", "bad", "after")
            ):
                message = json.loads(await ws.recv())
                seen.setdefault(message["request_id"], []).append(message)
            return seen

    seen = asyncio.run(main())
    (bad,) = seen["bad"]
    assert bad["type"] == "error" and bad["error"]["param"] == "messages"
    for rid in ("good", "after"):
        assert seen[rid][-1]["type"] == "done"
        assert any(m.get("choices") for m in seen[rid])


def test_an_unexpected_error_in_a_stream_ends_it_with_an_error_event_and_done(
    monkeypatch, caplog
):
    # Fault injection: the stream's source fails the way a bug would.
    from server import app as app_module

    async def failing_chunks(_):
        yield {"id": "x", "choices": []}
        raise RuntimeError("a bug")

    monkeypatch.setattr(app_module, "stream_chunks", failing_chunks)
    usage = types.SimpleNamespace(prompt_tokens=1, completion_tokens=1)
    run = types.SimpleNamespace(usage=usage, endings=lambda: "none")
    prepared = types.SimpleNamespace(response_id="cmpl-test", run=run)

    async def collect():
        return [event async for event in app_module._sse(prepared, 0.0)]

    with caplog.at_level("INFO", logger="specserve.requests"):
        events = asyncio.run(collect())
    assert [e["data"] for e in events][-1] == "[DONE]"
    error = json.loads(events[-2]["data"])["error"]
    assert error["type"] == "internal_server_error"
    assert any("status=500" in r.getMessage() for r in caplog.records)
    assert not any("status=200" in r.getMessage() for r in caplog.records)
