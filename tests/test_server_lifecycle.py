"""Disconnects free the engine's KV blocks; an engine crash is noticed and recovered from."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest
import websockets

MODEL = "tiny"
LONG = {"model": MODEL, "prompt": "count", "max_tokens": 400, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def server(tiny_server):
    """A fresh server for this module (see conftest.tiny_server)."""
    return tiny_server


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(f"specserve:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not exported:\n{text}")


def wait_until_idle(server, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (
            metric(server, "kv_cache_usage_perc") == 0
            and metric(server, "num_requests_running") == 0
        ):
            return
        time.sleep(0.05)
    raise AssertionError("KV blocks still allocated after the client went away")


def test_metric_series_exist_before_any_request(server):
    # The first test of the module: nothing has been generated on this server yet.
    assert metric(server, "generation_tokens_total") == 0
    assert metric(server, "prompt_tokens_total") == 0
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'specserve:time_to_first_token_seconds_count{model_name="tiny"} 0.0' in text


def aborted(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    series = f'specserve:request_success_total{{finished_reason="abort",model_name="{MODEL}"}} '
    lines = [line for line in text.splitlines() if line.startswith(series)]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def test_sse_disconnect_aborts_and_frees_blocks(server):
    before = aborted(server)
    # 1000 tokens: seconds of work, so the request can only end by the client leaving.
    body = {**LONG, "max_tokens": 1000}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert metric(server, "kv_cache_usage_perc") > 0
    wait_until_idle(server)
    # Counted by how it ended, and named so in the request's log line.
    assert aborted(server) == before + 1
    assert "finished_reason=abort" in server.log_tail(20000)


def test_websocket_disconnect_aborts_and_frees_blocks(server):
    async def main():
        async with websockets.connect(server.url.replace("http", "ws") + "/v1/ws") as ws:
            await ws.send(json.dumps({**LONG, "request_id": "a"}))
            for _ in range(4):
                json.loads(await ws.recv())
            assert metric(server, "kv_cache_usage_perc") > 0

    asyncio.run(main())
    wait_until_idle(server)


def test_non_streaming_disconnect_aborts_and_frees_blocks(server):
    # 8 x 1000 tokens: seconds of work, far more than the client waits for.
    body = {**LONG, "stream": False, "n": 8, "max_tokens": 1000}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.3)
    wait_until_idle(server)


def test_websocket_cancel_frees_blocks_while_the_connection_stays(server):
    async def main():
        async with websockets.connect(server.url.replace("http", "ws") + "/v1/ws") as ws:
            await ws.send(json.dumps({**LONG, "request_id": "c"}))
            for _ in range(3):
                await ws.recv()
            await ws.send(json.dumps({"type": "cancel", "request_id": "c"}))
            while (message := json.loads(await ws.recv())).get("type") != "done":
                pass
            assert message["cancelled"] is True
            await asyncio.to_thread(wait_until_idle, server)

    asyncio.run(main())


def test_metrics_count_requests_and_tokens(server):
    before = metric(server, "generation_tokens_total")
    httpx.post(
        server.url + "/v1/completions",
        timeout=60,
        json={"model": MODEL, "prompt": "x", "max_tokens": 5, "ignore_eos": True},
    )
    assert metric(server, "generation_tokens_total") == before + 5
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert f"specserve:{name}_bucket{{" in text, name
    assert 'specserve:request_success_total{finished_reason="length",model_name="tiny"}' in text
    for name in (
        "num_preemptions_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "prompt_tokens_total",
        "num_requests_waiting",
    ):
        assert f"specserve:{name}{{" in text, name


def test_engine_crash_is_noticed_and_recovered(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    stream = client.completions.create(
        model=MODEL, prompt="count", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    (pid,) = server.engine_pids()
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises(openai.APIError):
        for _ in stream:  # the in-flight stream ends with an error event
            pass
    assert time.monotonic() - killed_at < 2  # noticed within about a second
    # /health goes to 503 while the engine restarts; requests meanwhile are refused with 503.
    deadline = time.monotonic() + 3
    while server.health() != 503:
        assert time.monotonic() < deadline, "health never reported the dead engine"
        time.sleep(0.05)
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
    server.wait_ready(timeout=60)
    assert server.engine_pids() != [pid]
    ok = client.completions.create(model=MODEL, prompt="again", max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")
