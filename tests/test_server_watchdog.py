"""The watchdog over HTTP: an engine that stops stepping (SIGSTOP, fault injection) while a
stream is open is noticed after --engine-stall-timeout; the stream ends with an error event
and [DONE], /health answers 503 while the engine restarts, then 200, and the server serves
again."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from tests.server_process import serving_tiny

LONG = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 990,
        "ignore_eos": True, "stream": True}  # fmt: skip


@pytest.fixture
def server(tiny_chat_model_dir, tmp_path):
    log = tmp_path / "server.log"
    with serving_tiny(tiny_chat_model_dir, log, "--engine-stall-timeout", "2") as proc:
        yield proc


def test_a_stalled_engine_ends_the_stream_turns_health_503_and_comes_back(server):
    (engine,) = server.engine_pids()
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=LONG, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        os.kill(engine, signal.SIGSTOP)  # alive, never stepping again
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] and "no progress" in error["message"], error
    seen, deadline = set(), time.monotonic() + 120
    while 200 not in seen or 503 not in seen:
        code = server.health()
        seen.add(code)
        if 503 in seen and code == 200:
            break
        assert time.monotonic() < deadline, seen
        time.sleep(0.02)
    assert 503 in seen  # restarting: not ready
    body = {**LONG, "stream": False, "max_tokens": 2}
    assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    assert engine not in server.engine_pids()  # a new engine process
