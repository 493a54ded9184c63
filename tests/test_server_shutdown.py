"""A bounded shutdown (`--shutdown-timeout`): after SIGTERM new requests are refused, a stream
still open at the deadline gets an error event and [DONE] (the official openai client sees
the error, not a hang), the engine process is stopped, and the server exits with status 0."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import httpx
import pytest

from tests.server_process import serving_tiny

LONG = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 990,
        "ignore_eos": True, "stream": True}  # fmt: skip


@pytest.fixture
def server(tiny_chat_model_dir, tmp_path):
    log = tmp_path / "server.log"
    with serving_tiny(tiny_chat_model_dir, log, "--shutdown-timeout", "0.3") as proc:
        yield proc


def test_sigterm_ends_open_streams_at_the_deadline_and_exits_cleanly(server):
    engine_pids = server.engine_pids()
    events: list[str] = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=LONG, timeout=60) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        events.append(first[6:])
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        # A new connection now is refused (no listener) or answered 503.
        refused = threading.Event()

        def try_new():
            try:
                body = {**LONG, "stream": False, "max_tokens": 2}
                r2 = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=10)
                refused.set() if r2.status_code == 503 else None
            except httpx.TransportError:
                refused.set()

        probe = threading.Thread(target=try_new)
        probe.start()
        events += [line[6:] for line in lines if line.startswith("data: ")]
        probe.join()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "server_shutdown" and "shutting down" in error["message"]
    assert refused.is_set()
    assert server.proc.wait(timeout=30) == 0
    assert time.monotonic() - started < 25
    for pid in engine_pids:  # the engine process went with it
        assert subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0
    assert "status=503 finished_reason=abort" in server.log_tail(20000)


def test_the_openai_client_sees_the_end_of_a_stream_not_a_hang(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(
        model="tiny", messages=LONG["messages"], max_tokens=990, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    next(iter(stream))
    server.proc.send_signal(signal.SIGTERM)
    with pytest.raises(openai.APIError, match="shutting down"):
        for _ in stream:
            pass
    assert server.proc.wait(timeout=30) == 0
