"""The per-request time limit (issue 11 item 4, `--request-timeout`): a request still generating
past it is aborted in the engine; a streaming one ends with an error event (code "timeout")
and [DONE], a non-streaming one gets a 408; the server then serves on with nothing left
running."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.server_process import ServerProcess

MODEL = "tiny"
# ~960 tokens of the tiny model take well over half a second on any machine we know.
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 960,
        "ignore_eos": True}  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir, tmp_path_factory):
    proc = ServerProcess(
        "--model", str(tiny_chat_model_dir), "--served-model-name", MODEL,
        "--request-timeout", "0.5",
        log_path=tmp_path_factory.mktemp("timeouts") / "server.log",
    )  # fmt: skip
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_a_request_past_the_limit_is_aborted(server):
    r = httpx.post(server.url + "/v1/chat/completions", json=LONG, timeout=60)
    assert r.status_code == 408, r.text
    assert r.json()["error"]["code"] == "timeout"
    body = {**LONG, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "timeout"
    deadline = time.monotonic() + 10  # the engine's next stats report shows the abort
    while True:
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        running = [line for line in metrics.splitlines() if "num_requests_running{" in line]
        if running and all(line.endswith(" 0.0") for line in running):
            break
        assert time.monotonic() < deadline, running
        time.sleep(0.1)
    # Both endings are counted, by how they ended, and named in the requests' log lines.
    assert f'request_success_total{{finished_reason="timeout",model_name="{MODEL}"}} 2.0' in metrics
    assert server.log_tail(20000).count("finished_reason=timeout") == 2


def test_the_deadline_holds_while_the_engine_stalls(server):
    """No output arrives at all (the engine process is stopped: what a long queue or a hung
    step looks like from here): the request still ends at its deadline."""
    import os
    import signal

    (engine,) = server.engine_pids()
    os.kill(engine, signal.SIGSTOP)
    try:
        started = time.monotonic()
        short = {**LONG, "max_tokens": 4}
        r = httpx.post(server.url + "/v1/chat/completions", json=short, timeout=60)
        waited = time.monotonic() - started
    finally:
        os.kill(engine, signal.SIGCONT)
    assert r.status_code == 408 and r.json()["error"]["code"] == "timeout", r.text
    assert waited < 30  # ended by its own deadline, not by the client's or a watchdog's
    ok = httpx.post(server.url + "/v1/chat/completions", json={**LONG, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text  # the engine steps again
