"""/health stays responsive while abusive requests run (issue 37 item 7): the API process's
event loop never blocks on a request's work, so a load balancer's probe is answered within
100 ms (the bound the issue sets) while requests at the limits are served or refused. The
default model's version of this, with its latencies printed, is tests/health_under_abuse.py."""

from __future__ import annotations

import gc
import threading
import time

import httpx
import pytest

ABUSES = [
    ("/v1/chat/completions",
     {"n": 16, "max_tokens": 64, "messages": [{"role": "user", "content": "Tell me a story."}]}),
    ("/v1/completions", {"max_tokens": 4, "prompt": ["lorem ipsum dolor sit amet " * 74] * 64}),
    ("/v1/completions", {"max_tokens": 4, "prompt": "word " * 400_000}),  # refused: too long
]  # fmt: skip


@pytest.mark.parametrize("path, body", ABUSES, ids=["n16", "64-prompts", "2MB-prompt"])
def test_health_answers_within_100_ms_while_abusive_requests_run(tiny_server, path, body):
    latencies: list[float] = []
    done = threading.Event()

    def poll():
        with httpx.Client(base_url=tiny_server.url, timeout=30) as client:
            while not done.is_set():
                start = time.perf_counter()
                assert client.get("/health").status_code == 200
                latencies.append(time.perf_counter() - start)
                time.sleep(0.02)

    # The probes' latency is measured in this process, which after a thousand tests holds a
    # large heap: a full collection here, or the request's client being built (certificates
    # loaded under the GIL), would be counted against the server. A CI run saw its first probe
    # take 0.47 s where runs here take under 15 ms; both now happen before the probes start.
    gc.collect()
    gc.disable()
    poller = threading.Thread(target=poll)
    try:
        with httpx.Client(base_url=tiny_server.url, timeout=300) as client:
            poller.start()
            r = client.post(path, json={"model": "tiny", **body})
    finally:
        done.set()
        if poller.is_alive():
            poller.join()
        gc.enable()
    assert r.status_code in (200, 400), r.text
    assert latencies, "no probe ran"
    assert max(latencies) < 0.1, sorted(latencies)[-5:]
